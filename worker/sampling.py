"""Logits processing and logprobs shared by the HF engine and the teacher-forcing verifier (DESIGN D7).

The distribution a token is sampled from is built exactly like transformers' ``generate`` builds it:
fp32 logits -> repetition penalty -> temperature -> top-k -> top-p -> min-p -> typical-p -> log_softmax, with
filtered tokens at ``-inf``. Greedy decoding (``temperature == 0``) takes the argmax and reports the
log_softmax of the penalised logits at temperature 1, without filtering.

Every function works on ``[n, vocab]`` tensors whose rows are independent positions, so the engine can
process one row per running request and a verifier can process all completion positions at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engines.contract import GenerationParams

__all__ = [
    "gather_logprobs",
    "is_greedy",
    "param_error",
    "presence_mask",
    "process_logits",
    "teacher_forced_logprobs",
    "top_logprobs",
]

_NEG_INF = float("-inf")


def is_greedy(params: GenerationParams) -> bool:
    return params.temperature == 0.0


def param_error(params: GenerationParams) -> str | None:
    """The first problem with ``params``, or None if they are valid."""
    checks = [
        (params.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
        (params.temperature >= 0, "temperature must be >= 0"),
        (params.top_k is None or params.top_k >= 0, "top_k must be >= 0"),
        (params.top_p is None or 0 < params.top_p <= 1, "top_p must be in (0, 1]"),
        (params.typical_p is None or 0 < params.typical_p <= 1, "typical_p must be in (0, 1]"),
        (params.min_p is None or 0 <= params.min_p <= 1, "min_p must be in [0, 1]"),
        (
            params.repetition_penalty is None or params.repetition_penalty > 0,
            "repetition_penalty must be > 0",
        ),
        (params.top_logprobs >= 0, "top_logprobs must be >= 0"),
    ]
    return next((message for ok, message in checks if not ok), None)


def presence_mask(prev_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[n, vocab]`` bool: which ids occur in each row's previous tokens (for the repetition penalty)."""
    mask = torch.zeros((len(prev_ids), vocab_size), dtype=torch.bool, device=device)
    for row, ids in enumerate(prev_ids):
        if ids:
            mask[row, torch.tensor(list(ids), dtype=torch.long, device=device)] = True
    return mask


def process_logits(
    logits: torch.Tensor, params: GenerationParams, presence: torch.Tensor | None = None
) -> torch.Tensor:
    """Raw ``[n, vocab]`` logits -> fp32 log-probs of the distribution sampled from (-inf = filtered).

    ``presence`` (``[n, vocab]`` bool, see ``presence_mask``) marks prompt + generated-so-far tokens and
    is required when ``params.repetition_penalty`` is active.
    """
    scores = logits.float()
    penalty = params.repetition_penalty
    if penalty is not None and penalty != 1.0:
        if presence is None:
            raise ValueError("repetition_penalty needs a presence mask")
        penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores = torch.where(presence, penalised, scores)
    if is_greedy(params):
        return torch.log_softmax(scores, dim=-1)
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k is not None and params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, _NEG_INF)
    if params.top_p is not None and params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    if params.min_p is not None and params.min_p > 0.0:
        scores = _min_p(scores, params.min_p)
    if params.typical_p is not None and params.typical_p < 1.0:
        scores = _typical_p(scores, params.typical_p)
    return torch.log_softmax(scores, dim=-1)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    # transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep >= 1 token.
    sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return scores.masked_fill(remove, _NEG_INF)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    # transformers' MinPLogitsWarper: drop tokens less likely than min_p x the most likely one.
    probs = torch.softmax(scores, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(probs < threshold, _NEG_INF)


def _typical_p(scores: torch.Tensor, mass: float) -> torch.Tensor:
    # transformers' TypicalLogitsWarper: keep the tokens whose surprisal is closest to the entropy.
    logp = torch.log_softmax(scores, dim=-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    shifted = torch.abs(-logp - entropy)
    sorted_shifted, sorted_idx = torch.sort(shifted, descending=False, dim=-1)
    cum = scores.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=-1).clamp(max=scores.shape[-1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(-1, last.view(-1, 1))
    remove_sorted[..., :1] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return scores.masked_fill(remove, _NEG_INF)


def gather_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``[n]`` logprob of each row's token, looked up by id."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logprobs.device).view(-1, 1)
    return logprobs.gather(-1, ids).squeeze(-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely ``(id, logprob)`` per row, best first; filtered (-inf) tokens are left out."""
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [
        [(i, v) for i, v in zip(row_ids, row_vals, strict=True) if v != _NEG_INF]
        for row_ids, row_vals in zip(ids.tolist(), values.tolist(), strict=True)
    ]


def teacher_forced_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], prompt_len: int, params: GenerationParams
) -> torch.Tensor:
    """Processed ``[n, vocab]`` log-probs for the ``n = len(token_ids) - prompt_len`` completion positions.

    ``logits`` are the ``[len(token_ids), vocab]`` (or longer-by-nothing) outputs of one forward pass
    over the full sequence ``token_ids`` = prompt + completion; row ``j`` of the result is the
    distribution completion token ``j`` was sampled from, penalised by the ids before it.
    """
    n = len(token_ids) - prompt_len
    if n <= 0 or prompt_len <= 0:
        raise ValueError("need a non-empty prompt and completion")
    rows = logits[prompt_len - 1 : prompt_len - 1 + n].float()
    presence = None
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        # id v is present at completion position j iff its first occurrence is before prompt_len + j
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=rows.device)
        first = torch.full((rows.shape[-1],), len(token_ids), dtype=torch.long, device=rows.device)
        first.scatter_reduce_(0, ids, torch.arange(len(ids), device=rows.device), reduce="amin")
        limits = torch.arange(prompt_len, prompt_len + n, device=rows.device)
        presence = first.unsqueeze(0) < limits.unsqueeze(1)
    return process_logits(rows, params, presence)
