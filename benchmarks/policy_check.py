"""Checkpoints for weight pushes and teacher forcing by policy version, shared by the weights benchmark,
the tests and the RL example: ``perturbed_checkpoint`` writes a model whose every weight is moved by a
fixed seed (a stand-in for a training step), ``Scorer`` re-scores stored completions under the
checkpoint of each version their ``policy_versions`` spans name (float32, transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from worker.engines.contract import GenerationParams
from worker.sampling import gather_logprobs, teacher_forced_logprobs

TOLERANCE = 1e-4  # float32 logprobs against teacher forcing


def perturbed_checkpoint(base: str | Path, out: str | Path, seed: int, scale: float = 0.5) -> Path:
    """``base`` with every weight moved by ``scale`` times its spread in seeded noise, as safetensors."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))
    model.save_pretrained(str(out), safe_serialization=True)
    return Path(out)


class Scorer:
    """Teacher forcing of stored messages (``?include=tokens`` reads) under each version's checkpoint."""

    def __init__(self, paths: dict[int, str | Path]) -> None:
        self.paths = dict(paths)
        self._models: dict[int, Any] = {}

    def model(self, version: int) -> Any:
        if version not in self._models:
            from transformers import AutoModelForCausalLM

            hf: Any = AutoModelForCausalLM
            self._models[version] = hf.from_pretrained(str(self.paths[version]), dtype=torch.float32).eval()
        return self._models[version]

    def max_delta(self, msg: dict[str, Any], temperature: float = 1.0) -> float:
        """The largest |stored - teacher-forced| logprob over the message's completion, each span under
        the weights of its version."""
        prompt, completion = msg["prompt_token_ids"], msg["completion_token_ids"]
        ids = prompt + completion
        spans = msg["policy_versions"]
        ends = [s for s, _ in spans[1:]] + [len(completion)]
        params = GenerationParams(max_new_tokens=1, temperature=temperature)
        worst = 0.0
        for (start, version), end in zip(spans, ends, strict=True):
            with torch.no_grad():
                logits = self.model(version)(input_ids=torch.tensor([ids])).logits[0].float()
            rows = teacher_forced_logprobs(logits, ids[: len(prompt) + end], len(prompt) + start, params)
            fresh = gather_logprobs(rows, ids[len(prompt) + start : len(prompt) + end]).tolist()
            for stored, got in zip(msg["logprobs"][start:end], fresh, strict=True):
                worst = max(worst, abs(stored - got))
        return worst
