"""Native ``tokentrail`` rollouts (shared/rollout.py) as the rollout records of RL trainers, and back.

``adapt(rollout, schema)`` turns one native rollout into that trainer's records: one per native
*sample* (a rollout with forks yields several), except ``marin`` (one per assistant turn: marin is
single-turn) and ``tokentrail`` (the rollout itself). ``to_native_samples(record, schema)`` maps a
record back to the fields ``tokentrail verify`` checks. Records hold only plain lists, ints, floats,
strings, bools and None, so they serialize to JSON and Parquet; trainers convert them to tensors.

Every format stores logprobs *unshifted* (``logprob[t]`` is that of ``token[t]``); trainers shift
internally. With the running example P=[10,11,12], C1=[20,21], U=[30,31,32], C2=[40,41]:

============  ====================================================  =============================================
schema        layout (trainer source)                               mask / logprobs / reward
============  ====================================================  =============================================
verl          ``prompt_ids`` = P; ``response_ids`` = C1+U+C2         ``response_mask``/``response_logprobs`` over
              (verl/experimental/agent_loop/agent_loop.py            the response, 0.0 on U; ``reward_score``
              ``AgentLoopOutput``)                                   (None kept: verl's reward loop scores it)
openrlhf      ``observation_tokens`` = all; ``action_ranges``        ``rollout_log_probs`` full length, 0.0
              [start, end) (openrlhf/utils/agent.py)                 outside actions; ``reward``/``scores`` (None
                                                                     kept: OpenRLHF None-checks both)
slime         ``tokens`` = all; ``response_length`` = len - len(P)   ``loss_mask``/``rollout_log_probs`` over the
              (slime/utils/types.py ``Sample.to_dict()``)            response; ``reward`` (None kept: Optional in
                                                                     ``Sample``, left for slime's reward function)
skyrl         batched ``GeneratorOutput`` with singleton lists       ``loss_masks``/``rollout_logprobs`` over the
              (skyrl/train/generators/base.py)                       response; ``rewards`` [float] (None -> 0.0:
                                                                     validate_generator_output needs floats)
prime-rl      ``TrainingSample``: full-length ``token_ids``,         ``logprobs`` 0.0 at context; per-token
              ``mask`` (bools) (src/prime_rl/transports/rollouts/    ``temperatures``; ``advantages`` None (the
              types.py)                                              orchestrator computes them) + extra ``reward``
nemo-rl       ``DatumSpec.message_log``: user P, assistant C1,       ``generation_logprobs`` on assistant messages
              environment/user U, assistant C2                       only; reward in ``extra_env_info`` (None kept;
              (nemo_rl/data/interfaces.py)                           the batch's ``total_reward`` is the env's)
marin         one ``Rollout`` per turn: (P, C1), (P+C1+U, C2)        ``response_logprobs``; ``episode_reward`` and
              (lib/marin/src/marin/rl/types.py)                      broadcast ``token_rewards`` (None -> 0.0)
tokentrail    the native rollout                                     as exported
============  ====================================================  =============================================

Semantic choices where the native data and a trainer's record do not line up one to one:

- No prompt text is stored (only tokens), so text fields (openrlhf ``prompt``, slime ``prompt`` and
  ``response``, nemo-rl's non-assistant ``content``) are ""; the token fields are authoritative.
- verl ``num_turns`` follows ToolAgentLoop: ``user_turns + assistant_turns + 1``, where assistant turns
  are the sample's completions and user turns are the non-empty token runs between two completions
  (each is one observation round: tool results or a user message, with any synthetic closer).
- "truncated": slime ``status`` and skyrl ``stop_reasons`` follow the sample's *last* turn (earlier
  cut turns were closed and continued); openrlhf ``truncated`` is True when any turn of the sample was
  cut by length; marin's ``is_truncated`` is per turn.
- prime-rl ``temperatures`` is per token: a completion's tokens get their turn's temperature, and the
  context tokens before a completion get that completion's temperature too (so the logits position that
  predicts a completion's first token is scaled right under either alignment); tokens after the last
  completion (none in native samples) get 1.0.
- nemo-rl: tokens between two completions form one message, role ``environment`` when the previous
  turn made tool calls, else ``user``; ``idx`` is the sample's index within the rollout.
- marin ``decoding`` takes the turn's sampling parameters (None where unset), except ``temperature``:
  the sample's per-turn temperature (unset means 1.0, as in native samples).

Policy versions (the weights version of each generated token, shared/rollout.py) go where a record has
room for one per token, aligned with that record's own token list and -1 where its mask is 0: verl
``extra_fields.policy_versions`` (over ``response_ids``), slime ``metadata.policy_versions`` (over the
response) plus slime's own ``weight_versions`` (one string per run of one version in each turn, in
order: one per turn unless a turn was switched to new weights in flight), nemo-rl
``extra_env_info.policy_versions`` (over the whole ``message_log``), and, as extra fields like
prime-rl's ``reward``, prime-rl ``policy_versions`` (full length, like ``temperatures``), openrlhf
``policy_versions`` (over ``observation_tokens``) and skyrl ``policy_versions`` (a batch entry over the
response, like ``loss_masks``). marin has no per-token slot: ``metadata.weight_step`` is the version of
the turn's first token (-1 where unknown). The free-form slots (verl ``extra_fields``, slime
``metadata``, nemo-rl ``extra_env_info``) also carry ``policy_paths``, the checkpoint directory of each
version the sample uses. A native rollout without versions gives records without these fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

SCHEMAS: tuple[str, ...] = ("tokentrail", "verl", "openrlhf", "slime", "skyrl", "prime-rl", "nemo-rl", "marin")
ENV_NAME = "tokentrail"  # env/task name in prime-rl, nemo-rl and marin records

Record = dict[str, Any]


class NativeSampleView(TypedDict):
    """What ``tokentrail verify`` needs from a sample (a subset of the native ``Sample`` fields)."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 exactly on generated tokens
    logprobs: list[float]  # position-aligned, unshifted, full length, 0.0 where the mask is 0
    prompt_length: int  # tokens before the first generated token
    turn_spans: list[tuple[int, int]]  # [start, end) of each completion
    temperatures: list[float] | None  # per turn (aligned with turn_spans); None when the record has none
    policy_versions: list[int] | None  # per position: version of a generated token, -1 elsewhere; None: unknown
    policy_paths: dict[str, str | None] | None  # version -> checkpoint directory, where the record carries them


@dataclass(frozen=True)
class _Sample:
    index: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    spans: list[tuple[int, int]]
    turn_indices: list[int]
    temperatures: list[float]
    versions: list[int] | None  # per position; None: the rollout records no versions


def _parse_sample(index: int, raw: Mapping[str, Any]) -> _Sample:
    token_ids = [int(t) for t in raw["token_ids"]]
    mask = [int(m) for m in raw["loss_mask"]]
    lps = [0.0 if lp is None else float(lp) for lp in raw["logprobs"]]
    spans = [(int(s), int(e)) for s, e in raw["turn_spans"]]
    turn_indices = [int(i) for i in raw["turn_indices"]]
    temps = [float(t) for t in raw["temperatures"]]
    n = len(token_ids)
    if len(mask) != n or len(lps) != n:
        raise ValueError(f"sample {index}: token_ids, loss_mask and logprobs differ in length")
    if not spans or len(turn_indices) != len(spans) or len(temps) != len(spans):
        raise ValueError(f"sample {index}: turn_spans, turn_indices and temperatures must be non-empty and aligned")
    if any(not 0 <= s <= e <= n for s, e in spans):
        raise ValueError(f"sample {index}: a turn span lies outside token_ids")
    raw_versions = raw.get("policy_versions")
    versions = None if raw_versions is None else [int(v) for v in raw_versions]
    if versions is not None and len(versions) != n:
        raise ValueError(f"sample {index}: policy_versions and token_ids differ in length")
    return _Sample(index, token_ids, mask, lps, int(raw["prompt_length"]), spans, turn_indices, temps, versions)


def _ids(rollout: Mapping[str, Any], s: _Sample) -> Record:
    """Where a record has a free-form slot: enough to find the rollout and the turns again, and the
    checkpoint directory of each version the sample uses."""
    ids: Record = {
        "rollout_id": rollout["rollout_id"],
        "chat_id": rollout["chat_id"],
        "sample_index": s.index,
        "turn_indices": list(s.turn_indices),
        "temperatures": list(s.temperatures),
    }
    if s.versions is not None:
        paths = _json_object(rollout.get("policy_paths"))
        used = {str(v) for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
        ids["policy_paths"] = {k: paths.get(k) for k in sorted(used, key=int)}
    return ids


def _json_object(value: Any) -> dict[str, Any]:
    """A free-form object, also as the JSON text a Parquet file stores it as (None: empty)."""
    if isinstance(value, str):
        value = json.loads(value)
    return dict(value or {})


def _with_versions(record: Record, key: str, versions: list[int] | list[list[int]] | None) -> Record:
    """``record`` with ``key`` set to ``versions`` when the sample has them."""
    if versions is not None:
        record[key] = versions
    return record


def _response_versions(s: _Sample) -> list[int] | None:
    return None if s.versions is None else s.versions[s.prompt_length :]


def _weight_versions(s: _Sample) -> list[str]:
    """slime ``weight_versions``: each turn's runs of one version, in order, as strings."""
    if s.versions is None:
        return []
    out = []
    for start, end in s.spans:
        prev = None
        for v in s.versions[start:end]:
            if v != prev:
                out.append(str(v))
                prev = v
    return out


def _reward(rollout: Mapping[str, Any]) -> float | None:
    r = rollout.get("reward")
    return None if r is None else float(r)


def _reward_or_zero(rollout: Mapping[str, Any]) -> float:
    r = _reward(rollout)
    return 0.0 if r is None else r


def _turns(rollout: Mapping[str, Any], s: _Sample) -> list[Mapping[str, Any]]:
    turns: Sequence[Mapping[str, Any]] = rollout["turns"]
    return [turns[i] for i in s.turn_indices]


def _gaps(s: _Sample) -> list[tuple[int, int]]:
    """[start, end) of the tokens between consecutive completions (observations, bridges, closers)."""
    return [(a[1], b[0]) for a, b in zip(s.spans, s.spans[1:], strict=False)]


# --- adapters: native sample -> records ------------------------------------------------------------


def _verl(rollout: Mapping[str, Any], s: _Sample) -> list[Record]:
    p = s.prompt_length
    user_turns = sum(1 for a, b in _gaps(s) if b > a)
    return [
        {
            "prompt_ids": s.token_ids[:p],
            "response_ids": s.token_ids[p:],
            "response_mask": s.loss_mask[p:],
            "response_logprobs": s.logprobs[p:],
            "reward_score": _reward(rollout),
            "num_turns": user_turns + len(s.spans) + 1,
            "multi_modal_data": {},
            "extra_fields": _with_versions(
                {
                    "turn_scores": [t.get("reward") for t in _turns(rollout, s)],  # votes; None where unrated
                    "tool_rewards": [],
                    **_ids(rollout, s),
                },
                "policy_versions",
                _response_versions(s),
            ),
            "metrics": {},
        }
    ]


def _openrlhf(rollout: Mapping[str, Any], s: _Sample) -> list[Record]:
    reward = _reward(rollout)
    record: Record = {
        "prompt": "",
        "label": None,
        "images": None,
        "mm_train_inputs": None,
        "observation_tokens": list(s.token_ids),
        "action_ranges": [[a, b] for a, b in s.spans],
        "rollout_log_probs": list(s.logprobs),
        "reward": reward,
        "scores": reward,
        "extra_logs": {},  # OpenRLHF turns every value into a tensor: numbers only
        "truncated": any(t.get("finish_reason") == "length" for t in _turns(rollout, s)),
    }
    return [_with_versions(record, "policy_versions", None if s.versions is None else list(s.versions))]


def _slime_status(finish_reason: Any) -> str:
    return {"length": "truncated", "abort": "aborted"}.get(str(finish_reason), "completed")


def _slime(rollout: Mapping[str, Any], s: _Sample) -> list[Record]:
    p = s.prompt_length
    return [
        {
            "group_index": None,
            "index": s.index,
            "prompt": "",
            "tokens": list(s.token_ids),
            "response": "",
            "response_length": len(s.token_ids) - p,
            "label": None,
            "reward": _reward(rollout),
            "loss_mask": s.loss_mask[p:],
            "weight_versions": _weight_versions(s),
            "rollout_log_probs": s.logprobs[p:],
            "remove_sample": False,
            "status": _slime_status(_turns(rollout, s)[-1].get("finish_reason")),
            "metadata": _with_versions(_ids(rollout, s), "policy_versions", _response_versions(s)),
        }
    ]


def _skyrl(rollout: Mapping[str, Any], s: _Sample) -> list[Record]:
    p = s.prompt_length
    record: Record = {
        "prompt_token_ids": [s.token_ids[:p]],
        "response_ids": [s.token_ids[p:]],
        "loss_masks": [s.loss_mask[p:]],
        "rollout_logprobs": [s.logprobs[p:]],
        "rewards": [_reward_or_zero(rollout)],
        "stop_reasons": [str(_turns(rollout, s)[-1].get("finish_reason"))],
        "trajectory_ids": [{"instance_id": rollout["rollout_id"], "repetition_id": s.index}],
        "rollout_metrics": {},
    }
    versions = _response_versions(s)
    return [_with_versions(record, "policy_versions", None if versions is None else [versions])]


def _token_temperatures(s: _Sample) -> list[float]:
    out = [1.0] * len(s.token_ids)
    prev_end = 0
    for (_, end), temp in zip(s.spans, s.temperatures, strict=True):
        out[prev_end:end] = [temp] * (end - prev_end)  # the context before a completion, and the completion
        prev_end = max(prev_end, end)
    return out


def _prime_rl(rollout: Mapping[str, Any], s: _Sample) -> list[Record]:
    record: Record = {
        "token_ids": list(s.token_ids),
        "mask": [m == 1 for m in s.loss_mask],
        "logprobs": list(s.logprobs),
        "temperatures": _token_temperatures(s),
        "env_name": ENV_NAME,
        "advantages": None,  # computed by prime-rl's orchestrator from the reward
        "reward": _reward(rollout),  # not a TrainingSample field
    }
    # not a TrainingSample field either
    return [_with_versions(record, "policy_versions", None if s.versions is None else list(s.versions))]


def _nemo_rl(rollout: Mapping[str, Any], s: _Sample) -> list[Record]:
    turns = _turns(rollout, s)
    log: list[Record] = [{"role": "user", "content": "", "token_ids": s.token_ids[: s.prompt_length]}]
    for k, ((start, end), turn) in enumerate(zip(s.spans, turns, strict=True)):
        if k:
            gap_start = s.spans[k - 1][1]
            role = "environment" if turns[k - 1].get("tool_calls") else "user"
            log.append({"role": role, "content": "", "token_ids": s.token_ids[gap_start:start]})
        log.append(
            {
                "role": "assistant",
                "content": turn.get("content") or "",
                "token_ids": s.token_ids[start:end],
                "generation_logprobs": s.logprobs[start:end],
            }
        )
    return [
        {
            "message_log": log,
            "length": len(s.token_ids),
            "extra_env_info": _with_versions(
                {"reward": _reward(rollout), **_ids(rollout, s)},
                "policy_versions",
                None if s.versions is None else list(s.versions),
            ),
            "loss_multiplier": 1.0,
            "idx": s.index,
            "task_name": ENV_NAME,
        }
    ]


def _marin(rollout: Mapping[str, Any], s: _Sample) -> list[Record]:
    reward = _reward_or_zero(rollout)
    out = []
    for (start, end), turn, temp in zip(s.spans, _turns(rollout, s), s.temperatures, strict=True):
        sampling: Mapping[str, Any] = turn.get("sampling") or {}
        out.append(
            {
                "env_name": ENV_NAME,
                "env_example_id": rollout["rollout_id"],
                "prompt_tokens": s.token_ids[:start],
                "response_tokens": s.token_ids[start:end],
                "response_logprobs": s.logprobs[start:end],
                "token_rewards": [reward] * (end - start),
                "episode_reward": reward,
                "decoding": {
                    "temperature": temp,
                    "top_k": sampling.get("top_k"),
                    "top_p": sampling.get("top_p"),
                    "repetition_penalty": sampling.get("repetition_penalty"),
                    "seed": sampling.get("seed"),
                    "max_output_tokens": sampling.get("max_new_tokens"),
                    "stop_token_ids": list(sampling.get("stop_token_ids") or []),
                },
                "is_truncated": turn.get("finish_reason") == "length",
                # marin's weight step: the version of the turn's first token (-1: unknown)
                "metadata": {
                    "worker_id": "",
                    "timestamp": 0.0,
                    "weight_step": -1 if s.versions is None or start >= end else s.versions[start],
                },
                "correctness_reward": None,
            }
        )
    return out


_ADAPTERS: dict[str, Callable[[Mapping[str, Any], _Sample], list[Record]]] = {
    "verl": _verl,
    "openrlhf": _openrlhf,
    "slime": _slime,
    "skyrl": _skyrl,
    "prime-rl": _prime_rl,
    "nemo-rl": _nemo_rl,
    "marin": _marin,
}


def _check_schema(schema: str) -> None:
    if schema not in SCHEMAS:
        raise ValueError(f"unknown rollout schema {schema!r}; expected one of {', '.join(SCHEMAS)}")


def adapt(rollout: dict[str, Any], schema: str) -> list[dict[str, Any]]:
    """Native rollout -> records of that trainer (usually one per sample; marin: one per turn; tokentrail: [rollout]).

    Rewards: the rollout's ``reward``; None (unrated) stays None where the trainer's field admits it and
    scores such samples itself (verl, openrlhf, slime, and the free-form reward slots of prime-rl and
    nemo-rl), and becomes 0.0 where the trainer requires a float (skyrl ``rewards``, marin
    ``episode_reward``/``token_rewards``). See the module docstring for each record's layout.
    """
    _check_schema(schema)
    if schema == "tokentrail":
        return [rollout]
    adapter = _ADAPTERS[schema]
    records: list[Record] = []
    for i, raw in enumerate(rollout["samples"]):
        records.extend(adapter(rollout, _parse_sample(i, raw)))
    return records


# --- records -> native sample views ----------------------------------------------------------------


def _mask_runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _floats(values: Any, what: str) -> list[float]:
    if values is None:
        raise ValueError(f"the record carries no {what}: it cannot be verified")
    return [float(v) for v in values]


def _view(
    token_ids: Sequence[Any],
    loss_mask: Sequence[Any],
    logprobs: Sequence[Any],
    prompt_length: int,
    spans: list[tuple[int, int]] | None = None,
    temperatures: Sequence[Any] | None = None,
    versions: Sequence[Any] | None = None,
    paths: Any = None,
) -> NativeSampleView:
    ids = [int(t) for t in token_ids]
    mask = [1 if m else 0 for m in loss_mask]
    lps = [float(lp) for lp in logprobs]
    if not (len(ids) == len(mask) == len(lps)):
        raise ValueError(f"token ids ({len(ids)}), loss mask ({len(mask)}) and logprobs ({len(lps)}) differ in length")
    if not 0 <= prompt_length <= len(ids):
        raise ValueError(f"prompt length {prompt_length} is outside the sequence ({len(ids)} tokens)")
    spans = _mask_runs(mask) if spans is None else spans
    temps = None if temperatures is None else [float(t) for t in temperatures]
    if temps is not None and len(temps) != len(spans):
        raise ValueError(f"{len(temps)} temperatures for {len(spans)} completion spans")
    vers = None if versions is None else [int(v) for v in versions]
    if vers is not None and len(vers) != len(ids):
        raise ValueError(f"{len(vers)} policy versions for {len(ids)} tokens")
    return {
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": lps,
        "prompt_length": prompt_length,
        "turn_spans": spans,
        "temperatures": temps,
        "policy_versions": vers,
        "policy_paths": None if paths is None else {str(k): v for k, v in _json_object(paths).items()},
    }


def _prefixed(p: int, response_versions: Sequence[Any] | None) -> list[int] | None:
    """Response-aligned versions as full-length ones (-1 on the prompt)."""
    return None if response_versions is None else [-1] * p + [int(v) for v in response_versions]


def _split_view(
    prompt: Sequence[Any],
    response: Sequence[Any],
    response_mask: Sequence[Any],
    response_logprobs: Any,
    temperatures: Sequence[Any] | None,
    response_versions: Sequence[Any] | None = None,
    paths: Any = None,
) -> NativeSampleView:
    """A prompt + response record (verl, slime, skyrl): the prompt is context, logprobs 0.0 there."""
    lps = _floats(response_logprobs, "response logprobs")
    if not (len(response) == len(response_mask) == len(lps)):
        raise ValueError("response ids, mask and logprobs differ in length")
    p = len(prompt)
    mask = [0] * p + list(response_mask)
    versions = _prefixed(p, response_versions)
    return _view([*prompt, *response], mask, [0.0] * p + lps, p, None, temperatures, versions, paths)


def _from_tokentrail(r: Mapping[str, Any]) -> list[NativeSampleView]:
    out = []
    for i, raw in enumerate(r["samples"]):
        s = _parse_sample(i, raw)
        paths = r.get("policy_paths") if s.versions is not None else None
        spans = list(s.spans)
        out.append(
            _view(s.token_ids, s.loss_mask, s.logprobs, s.prompt_length, spans, s.temperatures, s.versions, paths)
        )
    return out


def _from_verl(r: Mapping[str, Any]) -> list[NativeSampleView]:
    extra = _json_object(r.get("extra_fields"))  # JSON text in Parquet files
    temps = extra.get("temperatures")
    versions, paths = extra.get("policy_versions"), extra.get("policy_paths")
    lps = r.get("response_logprobs")
    return [_split_view(r["prompt_ids"], r["response_ids"], r["response_mask"], lps, temps, versions, paths)]


def _from_openrlhf(r: Mapping[str, Any]) -> list[NativeSampleView]:
    tokens = r["observation_tokens"]
    spans = sorted((int(a), int(b)) for a, b in r["action_ranges"])
    mask = [0] * len(tokens)
    for a, b in spans:
        if not 0 <= a <= b <= len(tokens):
            raise ValueError(f"action range [{a}, {b}) lies outside the {len(tokens)} observation tokens")
        mask[a:b] = [1] * (b - a)
    prompt_length = spans[0][0] if spans else len(tokens)
    lps = _floats(r.get("rollout_log_probs"), "rollout_log_probs")
    return [_view(tokens, mask, lps, prompt_length, spans, None, r.get("policy_versions"))]


def _from_slime(r: Mapping[str, Any]) -> list[NativeSampleView]:
    tokens = list(r["tokens"])
    n_resp = int(r["response_length"])
    if not 0 <= n_resp <= len(tokens):
        raise ValueError(f"response_length {n_resp} exceeds the {len(tokens)} tokens")
    p = len(tokens) - n_resp
    mask = r.get("loss_mask")
    mask = [1] * n_resp if mask is None else mask  # slime: None means all ones
    meta = _json_object(r.get("metadata"))
    temps, versions, paths = meta.get("temperatures"), meta.get("policy_versions"), meta.get("policy_paths")
    return [_split_view(tokens[:p], tokens[p:], mask, r.get("rollout_log_probs"), temps, versions, paths)]


def _from_skyrl(r: Mapping[str, Any]) -> list[NativeSampleView]:
    prompts, responses, masks = r["prompt_token_ids"], r["response_ids"], r["loss_masks"]
    lps = r.get("rollout_logprobs")
    if lps is None:
        raise ValueError("the record carries no rollout_logprobs: it cannot be verified")
    if not (len(prompts) == len(responses) == len(masks) == len(lps)):
        raise ValueError("the batch's prompt_token_ids, response_ids, loss_masks and rollout_logprobs differ in length")
    versions = r.get("policy_versions") or [None] * len(prompts)
    if len(versions) != len(prompts):
        raise ValueError("the batch's policy_versions and response_ids differ in length")
    entries = zip(prompts, responses, masks, lps, versions, strict=True)
    return [_split_view(p, resp, m, lp, None, v) for p, resp, m, lp, v in entries]


def _from_prime_rl(r: Mapping[str, Any]) -> list[NativeSampleView]:
    mask = [1 if m else 0 for m in r["mask"]]
    spans = _mask_runs(mask)
    token_temps = r.get("temperatures")
    temps = None if token_temps is None else [float(token_temps[a]) for a, _ in spans]
    prompt_length = spans[0][0] if spans else len(mask)  # no prompt split: the first trainable token
    lps = _floats(r.get("logprobs"), "logprobs")
    return [_view(r["token_ids"], mask, lps, prompt_length, spans, temps, r.get("policy_versions"))]


def _from_nemo_rl(r: Mapping[str, Any]) -> list[NativeSampleView]:
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    spans: list[tuple[int, int]] = []
    for msg in r["message_log"]:
        toks = [int(t) for t in msg["token_ids"]]
        gen = msg.get("generation_logprobs")
        if msg.get("role") == "assistant" and gen is not None:  # NeMo-RL trains exactly these messages
            if len(gen) != len(toks):
                raise ValueError("an assistant message's generation_logprobs and token_ids differ in length")
            spans.append((len(ids), len(ids) + len(toks)))
            mask += [1] * len(toks)
            lps += [float(x) for x in gen]
        else:
            mask += [0] * len(toks)
            lps += [0.0] * len(toks)
        ids += toks
    prompt_length = spans[0][0] if spans else len(ids)
    info = _json_object(r.get("extra_env_info"))
    temps, versions, paths = info.get("temperatures"), info.get("policy_versions"), info.get("policy_paths")
    return [_view(ids, mask, lps, prompt_length, spans, temps, versions, paths)]


def _from_marin(r: Mapping[str, Any]) -> list[NativeSampleView]:
    prompt, response = list(r["prompt_tokens"]), list(r["response_tokens"])
    lps = _floats(r.get("response_logprobs"), "response_logprobs")
    if len(lps) != len(response):
        raise ValueError("response_tokens and response_logprobs differ in length")
    p = len(prompt)
    temp = (r.get("decoding") or {}).get("temperature")
    temps = None if temp is None else [temp]
    span = [(p, p + len(response))]
    step = int((r.get("metadata") or {}).get("weight_step", -1))  # one version for the turn; -1: unknown
    versions = None if step < 0 else [-1] * p + [step] * len(response)
    mask = [0] * p + [1] * len(response)
    return [_view(prompt + response, mask, [0.0] * p + lps, p, span, temps, versions)]


_READERS: dict[str, Callable[[Mapping[str, Any]], list[NativeSampleView]]] = {
    "tokentrail": _from_tokentrail,
    "verl": _from_verl,
    "openrlhf": _from_openrlhf,
    "slime": _from_slime,
    "skyrl": _from_skyrl,
    "prime-rl": _from_prime_rl,
    "nemo-rl": _from_nemo_rl,
    "marin": _from_marin,
}


def to_native_samples(record: dict[str, Any], schema: str) -> list[NativeSampleView]:
    """Map an adapter record back to what ``tokentrail verify`` needs, where possible: token_ids, loss_mask,
    logprobs (position-aligned, unshifted, full length), prompt_length, turn spans, per-turn
    temperatures if the record carries them (else None), per-position policy versions (full length, -1
    off the generated tokens; marin's ``weight_step`` for the whole turn) and the versions' checkpoint
    directories, where the record carries them (else None).

    One view per sample (a skyrl batch gives one per entry; a marin record, one single-turn sample).
    Where a record has no prompt/response split (prime-rl), the prompt length is the first trainable
    token; where it has no turn boundaries, spans are the runs of the loss mask. Raises ValueError for
    unknown schemas and for records that lack a field or whose lengths disagree.
    """
    _check_schema(schema)
    try:
        return _READERS[schema](record)
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"not a valid {schema} record: {type(exc).__name__}: {exc}") from exc
