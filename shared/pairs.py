"""Preference pairs (native ``tokentrail.pair``, versioned; and TRL's DPO field names).

A pair is two sibling assistant drafts (same chat, same parent message) of which one was preferred:
by the user's choice between drafts (OA's ``message_evals``: source ``message_eval``), or by a higher
environment reward (``reward``) or vote (``vote``). Both drafts were generated from one prompt, so a
pair holds that prompt's token ids once and each side's completion ids with the logprobs the sampler
stored for them (position-aligned with ``completion_ids``; None where one was -inf).

Each side carries its message's policy-version spans (``[start, version]`` over ``completion_ids``,
as a rollout turn's ``policy_versions``) and the pair its ``policy_paths`` (version -> checkpoint
directory), so ``tokentrail verify`` re-scores each token under the weights that produced it.

``to_trl`` writes the TRL form: the text fields ``prompt``/``chosen``/``rejected``, the token ids under
both of TRL's names (``prompt_ids``/``chosen_ids``/``rejected_ids``, read by TRL 1.x's
``DataCollatorForPreference``; ``prompt_input_ids``/``chosen_input_ids``/``rejected_input_ids``, read by
the 0.x collator), the stored per-token ``chosen_logps``/``rejected_logps``, and the provenance under
``tokentrail``. No prompt text is stored (only tokens), so ``prompt`` is "": the ids are authoritative.
No ``ref_chosen_logps``: TRL would take them as the reference model's sequence logprobs, and the stored
ones are the sampler's (temperature, top-k/p applied; perhaps of several policy versions).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from pydantic import BaseModel, Field

PAIR_SCHEMA_NAME = "tokentrail.pair"
PAIR_SCHEMA_VERSION = 1
PAIR_SCHEMAS: tuple[str, ...] = ("tokentrail", "trl")  # ``--schema`` values with ``--pairs``
PairSource = Literal["message_eval", "reward", "vote"]
TRL_ID_FIELDS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")  # TRL 0.x; 1.x: *_ids


class PairSide(BaseModel):
    message_id: str
    completion_ids: list[int]
    logprobs: list[float | None]  # of the sampled tokens; None where a logprob was -inf or missing
    finish_reason: str
    stop_reason: int | str | None = None
    engine: str
    sampling: dict[str, Any] = Field(default_factory=dict)  # the draft's SamplingParameters, with its seed
    # message_eval: the turn's reward as rollouts give it (environment's, else vote); reward/vote: the
    # value the pair was decided on
    reward: float | None = None
    policy_versions: list[tuple[int, int]]  # [start, version] spans over completion_ids
    # the parsed view, for readers; training uses the token fields
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    created_at: str | None = None


class PairRecord(BaseModel):
    schema_name: str = Field(PAIR_SCHEMA_NAME, alias="schema")
    schema_version: int = PAIR_SCHEMA_VERSION
    pair_id: str  # "<source>:<chosen id>:<rejected id>": stable across exports
    source: PairSource
    chat_id: str
    user_id: str
    parent_message_id: str | None
    model_name: str
    tokenizer_hash: str
    template_hash: str
    prompt_ids: list[int]  # the prompt both drafts were generated from
    chosen: PairSide
    rejected: PairSide
    policy_paths: dict[str, str | None] = Field(default_factory=dict)

    model_config = {"populate_by_name": True}


_META_SIDE = ("message_id", "reward", "policy_versions", "sampling", "finish_reason")


def to_trl(pair: Mapping[str, Any]) -> dict[str, Any]:
    """A native pair as a TRL DPO row (module docstring)."""
    chosen, rejected = pair["chosen"], pair["rejected"]
    prompt = pair["prompt_ids"]
    meta = {k: pair[k] for k in ("pair_id", "source", "chat_id", "user_id", "parent_message_id", "model_name")}
    meta |= {k: pair[k] for k in ("tokenizer_hash", "template_hash", "policy_paths")}
    return {
        "prompt": "",
        "chosen": chosen.get("content") or "",
        "rejected": rejected.get("content") or "",
        "prompt_ids": prompt,
        "chosen_ids": chosen["completion_ids"],
        "rejected_ids": rejected["completion_ids"],
        "prompt_input_ids": prompt,
        "chosen_input_ids": chosen["completion_ids"],
        "rejected_input_ids": rejected["completion_ids"],
        "chosen_logps": chosen["logprobs"],
        "rejected_logps": rejected["logprobs"],
        "tokentrail": {
            **meta,
            "chosen": {k: chosen[k] for k in _META_SIDE},
            "rejected": {k: rejected[k] for k in _META_SIDE},
        },
    }


def adapt_pair(pair: dict[str, Any], schema: str) -> dict[str, Any]:
    if schema == "tokentrail":
        return pair
    if schema == "trl":
        return to_trl(pair)
    raise ValueError(f"unknown pair schema {schema!r}; choose from {', '.join(PAIR_SCHEMAS)}")


def is_pair_record(record: Mapping[str, Any]) -> bool:
    """A native pair, or a TRL row under either TRL generation's id names."""
    if record.get("schema") == PAIR_SCHEMA_NAME:
        return True
    names = ("prompt", "chosen", "rejected")
    return all(f"{n}_input_ids" in record for n in names) or all(f"{n}_ids" in record for n in names)


class SideView(TypedDict):
    """One side of a pair as ``tokentrail verify`` re-scores it: prompt + completion."""

    where: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float | None]
    sampling: dict[str, Any] | str | None  # Parquet stores it as JSON text
    policy_versions: list[list[int]] | None  # None: every token version 0
    policy_paths: dict[str, str | None]


def _object(value: Any) -> dict[str, Any]:
    return dict((json.loads(value) if isinstance(value, str) else value) or {})


def _trl_ids(record: Mapping[str, Any], name: str, where: str, problems: list[str]) -> list[int]:
    """A TRL row's ids of ``name`` under either name; both present must agree."""
    new, old = record.get(f"{name}_ids"), record.get(f"{name}_input_ids")
    ids = new if new is not None else old
    if ids is None:
        raise ValueError(f"{where}: a TRL pair row without {name}_ids")
    if new is not None and old is not None and list(new) != list(old):
        problems.append(f"{where}: {name}_ids and {name}_input_ids differ")
    return list(ids)


def pair_sides(record: Mapping[str, Any]) -> tuple[list[SideView], list[str]]:
    """The two sides (chosen, rejected) of a pair record of either schema, and the structural problems
    found in it."""
    problems: list[str] = []
    native = record.get("schema") == PAIR_SCHEMA_NAME
    meta = record if native else _object(record.get("tokentrail"))
    where = f"pair {meta.get('pair_id', '?')}"
    prompt = list(record["prompt_ids"]) if native else _trl_ids(record, "prompt", where, problems)
    views = []
    for name in ("chosen", "rejected"):
        side = _object(meta.get(name))
        if native:
            ids, lps = list(side["completion_ids"]), list(side["logprobs"])
        else:
            ids, lps = _trl_ids(record, name, where, problems), list(record.get(f"{name}_logps") or [])
        if len(lps) != len(ids):
            problems.append(f"{where} {name}: {len(lps)} logprobs for {len(ids)} tokens")
        spans = side.get("policy_versions")
        views.append(
            SideView(
                where=f"{where} {name}",
                prompt_ids=prompt,
                completion_ids=ids,
                logprobs=lps,
                sampling=side.get("sampling"),
                policy_versions=None if spans is None else [[int(a), int(b)] for a, b in spans],
                policy_paths=_object(meta.get("policy_paths")),
            )
        )
    return views, problems
