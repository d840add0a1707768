"""The native rollout schema (``tokentrail``, versioned): one record per conversation path.

A rollout is the path root -> leaf of a chat tree that ends in an assistant message. It carries
each assistant turn exactly as the model consumed and produced it, and the flattened training
samples: a path without forks is one sample; each fork starts a new one.

Within a sample, ``token_ids`` is the last turn's prompt + completion; ``loss_mask`` is 1 exactly
on generated tokens (every turn's completion), 0 on prompt, bridge and synthetic closer tokens;
``logprobs`` is position-aligned (``logprobs[t]`` is the sampled logprob of ``token_ids[t]``, not
shifted) and 0.0 where the mask is 0; ``turn_spans`` are the ``[start, end)`` of each completion.
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
    reward: float | None = None  # the turn's vote (-1, 0, 1) when rated
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

    model_config = {"populate_by_name": True}


def sample_record(
    token_ids: list[int],
    mask: list[int],
    lps: list[float],
    spans: list[tuple[int, int]],
    group: list[int],
    turns: list[dict[str, Any]],
) -> dict[str, Any]:
    temps = [turns[i]["sampling"].get("temperature") for i in group]
    return {
        "token_ids": token_ids,
        "loss_mask": mask,
        "logprobs": lps,
        "prompt_length": spans[0][0],
        "turn_spans": spans,
        "turn_indices": group,
        "temperatures": [1.0 if t is None else float(t) for t in temps],
    }


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
