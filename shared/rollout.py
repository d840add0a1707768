"""The native rollout schema (``tokentrail``, versioned): one record per conversation path.

A rollout is the path root -> leaf of a chat tree that ends in an assistant message. It carries
each assistant turn exactly as the model consumed and produced it, and the flattened training
samples: a path without forks is one sample; each fork starts a new one.

Within a sample, ``token_ids`` is the last turn's prompt + completion; ``loss_mask`` is 1 exactly
on generated tokens (every turn's completion), 0 on prompt, bridge and synthetic closer tokens;
``logprobs`` is position-aligned (``logprobs[t]`` is the sampled logprob of ``token_ids[t]``, not
shifted) and 0.0 where the mask is 0; ``turn_spans`` are the ``[start, end)`` of each completion.

Policy versions (the weights version that generated each token, see docs/weights.md): a turn's
``policy_versions`` is a list of ``[start, version]`` spans over its ``completion_ids`` (version
``version`` from ``completion_ids[start]`` to the next span's start); a sample's ``policy_versions``
is per position, aligned with ``token_ids`` and ``loss_mask``: the version of each generated token,
-1 where the mask is 0 (like ``logprobs``' 0.0 there). The rollout's ``policy_paths`` maps each
version its generated tokens use (as a string: a JSON key) to that version's checkpoint directory
in the server's registry; ``None`` for version 0 (the worker's own model) or a version the registry
does not know. All three are ``None`` / empty where versions were not recorded (records built
client-side, exports made before versions existed): read every token as version 0 then.

These fields were added without raising ``SCHEMA_VERSION``: they are optional, no existing field
changed shape or meaning, and a reader that ignores them reads what it read before (the record of
a model whose weights never changed: every token version 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from shared.stitching import merge_turns

SCHEMA_NAME = "tokentrail"
SCHEMA_VERSION = 1

RewardRule = Literal["last", "mean", "min", "leaf"]


class TurnRecord(BaseModel):
    message_id: str
    prompt_delta_ids: list[int]  # prompt tokens added since the previous turn's end (whole prompt after a fork)
    completion_ids: list[int]
    logprobs: list[float | None]  # of the sampled tokens; None where a logprob was -inf or missing
    finish_reason: str
    stop_reason: int | str | None = None
    synthetic_closer_ids: list[int] = Field(default_factory=list)  # closer tokens the model did not generate
    reused_prefix_len: int = 0
    fork: bool = False
    prompt_method: str | None = None  # how the worker built the prompt (worker.prompt_builder)
    prompt_length: int  # len(prompt_ids) of this turn
    sampling: dict[str, Any] = Field(default_factory=dict)  # the SamplingParameters of the turn, with its seed
    # the environment's reward (POST /v1/rewards) when one was posted, else the turn's vote (-1, 0, 1)
    reward: float | None = None
    done: bool = False  # the environment ended the episode at this turn
    # [start, version] spans over completion_ids: the weights version of each generated token
    policy_versions: list[tuple[int, int]] | None = None
    # the parsed view, for readers; training uses the token fields
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    created_at: str | None = None


class Sample(BaseModel):
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int  # tokens before the first generated token of the sample
    turn_spans: list[tuple[int, int]]  # [start, end) of each turn's completion in token_ids
    turn_indices: list[int]  # which turns of the rollout this sample holds
    temperatures: list[float]  # per turn, for re-scoring
    policy_versions: list[int] | None = None  # per position: the version of a generated token, -1 elsewhere


class Rollout(BaseModel):
    schema_name: str = Field(SCHEMA_NAME, alias="schema")
    schema_version: int = SCHEMA_VERSION
    rollout_id: str  # the leaf message id: stable across exports
    chat_id: str
    leaf_message_id: str
    user_id: str
    model_name: str
    tokenizer_hash: str
    template_hash: str
    engine: str
    system_prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    turns: list[TurnRecord]
    samples: list[Sample]
    reward: float | None = None  # per the export's reward rule
    reward_rule: RewardRule = "last"
    complete: bool = True  # every assistant turn on the path finished
    # version (as a string) -> its checkpoint directory; None: version 0 or not in the registry
    policy_paths: dict[str, str | None] = Field(default_factory=dict)

    model_config = {"populate_by_name": True}


NO_VERSION = -1  # a sample's per-position version where the loss mask is 0


def token_versions(spans: Sequence[Sequence[int]], n: int) -> list[int]:
    """A turn's ``[start, version]`` spans as the version of each of its ``n`` completion tokens."""
    if len(spans) == 1 and not spans[0][0]:  # one version for the whole completion: the usual case
        return [int(spans[0][1])] * n
    out = [NO_VERSION] * n
    for k, (start, version) in enumerate(spans):
        first = max(0, int(start))
        end = min(n, int(spans[k + 1][0]) if k + 1 < len(spans) else n)
        if end > first:
            out[first:end] = [int(version)] * (end - first)
    return out


def sample_versions(
    spans: list[tuple[int, int]], group: list[int], turns: list[dict[str, Any]], n: int
) -> list[int] | None:
    """The per-position versions of a sample of ``n`` tokens, or None when its turns carry none."""
    if any(turns[i].get("policy_versions") is None for i in group):
        return None
    out = [NO_VERSION] * n
    for (start, end), i in zip(spans, group, strict=True):
        out[start:end] = token_versions(turns[i]["policy_versions"], end - start)
    return out


def sample_record(
    token_ids: list[int],
    mask: list[int],
    lps: list[float],
    spans: list[tuple[int, int]],
    group: list[int],
    turns: list[dict[str, Any]],
    versions: list[int] | None = None,
) -> dict[str, Any]:
    """One sample; ``versions``: its per-position policy versions (None: computed from the turns')."""
    temps = [turns[i]["sampling"].get("temperature") for i in group]
    record = {
        "token_ids": token_ids,
        "loss_mask": mask,
        "logprobs": lps,
        "prompt_length": spans[0][0],
        "turn_spans": spans,
        "turn_indices": group,
        "temperatures": [1.0 if t is None else float(t) for t in temps],
    }
    if versions is None:
        versions = sample_versions(spans, group, turns, len(token_ids))
    if versions is not None:
        record["policy_versions"] = versions
    return record


def build_samples(
    seqs: Sequence[tuple[Sequence[int], Sequence[int]]], turns: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Merge turns whose prompts extend the previous turns into samples with masks and logprobs."""
    samples = []
    for group in merge_turns(seqs):
        prompt, completion = seqs[group[-1]]
        token_ids = [*prompt, *completion]
        mask = [0] * len(token_ids)
        lps = [0.0] * len(token_ids)
        spans = []
        for i in group:
            start = len(seqs[i][0])
            end = start + len(seqs[i][1])
            spans.append((start, end))
            mask[start:end] = [1] * (end - start)
            lps[start:end] = [0.0 if lp is None else lp for lp in turns[i]["logprobs"]]
        samples.append(sample_record(token_ids, mask, lps, spans, group, turns))
    return samples
