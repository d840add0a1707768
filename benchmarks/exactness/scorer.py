"""Teacher-forced re-scoring: the model's logprobs of stored tokens, processed as the worker processed them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from benchmarks.exactness.metrics import top_k_cut_tied
from worker.engines.contract import GenerationParams


def _params(sampling: dict[str, Any]) -> GenerationParams:
    """The processing the worker applied (worker/generation.py builds GenerationParams the same way)."""
    temperature = sampling.get("temperature")
    return GenerationParams(
        max_new_tokens=int(sampling.get("max_new_tokens", 1024)),
        temperature=1.0 if temperature is None else float(temperature),
        top_k=sampling.get("top_k"),
        top_p=sampling.get("top_p"),
        typical_p=sampling.get("typical_p"),
        repetition_penalty=sampling.get("repetition_penalty"),
    )


class Scorer:
    """Re-scores token sequences with the model in one fp32 forward pass on CPU."""

    def __init__(self, model_dir: str) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        hf: Any = transformers
        hf.utils.logging.disable_progress_bar()
        # one thread: for a model this small, more threads only wait on each other (badly so on a busy machine)
        torch.set_num_threads(1)
        self.torch = torch
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.eval()

    def logits(self, ids: Sequence[int]) -> Any:
        with self.torch.inference_mode():
            return self.model(input_ids=self.torch.tensor([list(ids)], dtype=self.torch.long)).logits[0].float()

    def rescored(
        self, logits: Any, seq: Sequence[int], prompt_len: int, n: int, sampling: dict[str, Any]
    ) -> list[float]:
        """Re-scored logprobs of ``seq[prompt_len : prompt_len + n]`` given everything before them."""
        from worker.sampling import gather_logprobs, teacher_forced_logprobs

        if n == 0:
            return []
        end = prompt_len + n
        rows = teacher_forced_logprobs(logits[:end], list(seq[:end]), prompt_len, _params(sampling))
        values: list[float] = gather_logprobs(rows, list(seq[prompt_len:end])).tolist()
        return values

    def cut_tied(
        self, logits: Any, seq: Sequence[int], prompt_len: int, n: int, sampling: dict[str, Any]
    ) -> list[bool]:
        """Per completion position: does the turn's top-k cut fall on a near-tie of the scores
        (repetition penalty and temperature applied, no filter)?"""
        from worker.sampling import is_greedy, teacher_forced_logprobs

        params = _params(sampling)
        top_k = params.top_k
        if n == 0 or not top_k or is_greedy(params):
            return [False] * n
        unfiltered = dataclasses.replace(params, top_k=None, top_p=None, typical_p=None, min_p=None)
        end = prompt_len + n
        rows = teacher_forced_logprobs(logits[:end], list(seq[:end]), prompt_len, unfiltered)
        k = min(top_k + 1, rows.shape[-1])
        best = self.torch.topk(rows, k, dim=-1).values.tolist()
        return [top_k_cut_tied(row, top_k) for row in best]
