"""A page's rollouts (``page_rollouts``) as JSON lines: for each, the bytes ``rollout_line`` writes.

Formatting numbers is most of the work, and orjson's per-call cost is not small beside a turn's few
dozen numbers: each token field is formatted for all the page's turns in one call (a list of arrays;
the text split at its ``],[``, which no number's text holds), and a sample's masks and versions,
runs of one value, are made for the whole page with numpy and formatted the same way. A turn's record
is made once however many rollouts share it; each rollout is then one ``orjson.dumps`` of dicts whose
arrays are those texts (``orjson.Fragment``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from orjson import Fragment

from server.export.jsonl import ZERO_LOGPROB, json_array, version_runs
from server.export.page_rollouts import PageRollouts, PageTurns, rollout_heads, scalar_columns
from server.export.query import T_SYNTH, Decoders
from shared.rollout import NO_VERSION, SCHEMA_NAME, SCHEMA_VERSION

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_NO_IDS = Fragment(b"[]")


def page_lines(page: PageRollouts, dec: Decoders, reward_rule: str) -> list[bytes]:
    if not len(page):
        return []
    texts = _turn_texts(page.turns)
    columns = scalar_columns(page.turns, dec)
    records = _turn_records(page.turns, texts, columns)
    temperatures = [1.0 if (t := s.get("temperature")) is None else float(t) for s in columns["sampling"]]
    samples = iter(_samples(page, texts, temperatures))
    heads = rollout_heads(page)
    lines = []
    for r, head in enumerate(zip(*heads.values(), strict=True)):
        record: dict[str, Any] = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION}
        record.update(zip(heads, head, strict=True))
        record["turns"] = [records[k] for k in page.turn_lists[r]]
        record["samples"] = [next(samples) for _ in page.groups[r]]
        record["reward"] = page.rewards[r]
        record["reward_rule"] = reward_rule
        record["complete"] = page.completes[r]
        record["policy_paths"] = page.policy_paths[r]
        lines.append(orjson.dumps(record, option=_NUMPY | orjson.OPT_APPEND_NEWLINE))
    return lines


@dataclass(frozen=True)
class _TurnTexts:
    """The page's turns' token fields as JSON items (no brackets), and their lengths."""

    deltas: list[bytes]
    completions: list[bytes]
    logprobs: list[bytes]
    zeroed: list[bytes]  # logprobs with 0.0 for null (not finite): as a sample has them
    n_deltas: list[int]
    n_completions: list[int]


def _turn_texts(turns: PageTurns) -> _TurnTexts:
    n = len(turns)
    co = turns.completion_offsets.tolist()
    wide = turns.logprobs.astype(np.float64)  # the stored float32 widened, as rollout_line prints them
    logprobs = _split([wide[co[k] : co[k + 1]] for k in range(n)])
    zeroed = list(logprobs)
    finite = np.isfinite(turns.logprobs)
    if not finite.all():
        first_bad = np.searchsorted(turns.completion_offsets, np.flatnonzero(~finite), "right") - 1
        for k in np.unique(first_bad).tolist():
            zeroed[k] = logprobs[k].replace(b"null", b"0.0")
    return _TurnTexts(
        deltas=_split([turns.delta(k) for k in range(n)]),
        completions=_split([turns.completions[co[k] : co[k + 1]] for k in range(n)]),
        logprobs=logprobs,
        zeroed=zeroed,
        n_deltas=(np.diff(turns.prompt_offsets) - np.asarray(turns.prev_lens, np.int64)).tolist(),
        n_completions=np.diff(turns.completion_offsets).tolist(),
    )


def _turn_records(turns: PageTurns, texts: _TurnTexts, columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Each turn's record (``_turn``'s fields, in its order)."""
    c = columns
    mid, finish, stop, reused = c["message_id"], c["finish_reason"], c["stop_reason"], c["reused_prefix_len"]
    fork, method, length, sampling = c["fork"], c["prompt_method"], c["prompt_length"], c["sampling"]
    reward, done, spans, content = c["reward"], c["done"], c["policy_versions"], c["content"]
    reasoning, tool_calls, created = c["reasoning_content"], c["tool_calls"], c["created_at"]
    records = []
    for k in range(len(turns)):
        synth = turns.toks[k][T_SYNTH]
        records.append(
            {
                "message_id": mid[k],
                "prompt_delta_ids": Fragment(b"[%b]" % texts.deltas[k]),
                "completion_ids": Fragment(b"[%b]" % texts.completions[k]),
                "logprobs": Fragment(b"[%b]" % texts.logprobs[k]),
                "finish_reason": finish[k],
                "stop_reason": stop[k],
                "synthetic_closer_ids": Fragment(orjson.dumps(turns.closer(k), option=_NUMPY)) if synth else _NO_IDS,
                "reused_prefix_len": reused[k],
                "fork": fork[k],
                "prompt_method": method[k],
                "prompt_length": length[k],
                "sampling": sampling[k],
                "reward": reward[k],
                "done": done[k],
                "policy_versions": spans[k],
                "content": content[k],
                "reasoning_content": reasoning[k],
                "tool_calls": tool_calls[k],
                "created_at": created[k],
            }
        )
    return records


def _samples(page: PageRollouts, texts: _TurnTexts, temperatures: list[float]) -> list[dict[str, Any]]:
    """The page's samples, rollout after rollout (``sample_record``'s fields, in its order)."""
    mask_runs: tuple[list[int], list[int]] = ([], [])  # (values, counts)
    version_runs_: tuple[list[int], list[int]] = ([], [])
    lengths: list[int] = []
    samples = []
    for r, ks in enumerate(page.turn_lists):
        for group in page.groups[r]:
            ids: list[bytes] = []
            lps: list[bytes] = []
            spans: list[tuple[int, int]] = []
            end = 0
            for i in group:
                k = ks[i]
                nd, nc = texts.n_deltas[k], texts.n_completions[k]
                ids += (texts.deltas[k], texts.completions[k])
                lps += (ZERO_LOGPROB.repeat(nd), texts.zeroed[k])
                mask_runs[0].extend((0, 1))
                mask_runs[1].extend((nd, nc))
                version_runs_[0].append(NO_VERSION)
                version_runs_[1].append(nd)
                version_runs(page.turns.spans[k], nc, *version_runs_)
                start = end + nd
                end = start + nc
                spans.append((start, end))
            lengths.append(end)
            samples.append(
                {
                    "token_ids": json_array(ids),
                    "loss_mask": None,
                    "logprobs": json_array(lps),
                    "prompt_length": spans[0][0],
                    "turn_spans": spans,
                    "turn_indices": group,
                    "temperatures": [temperatures[ks[i]] for i in group],
                    "policy_versions": None,
                }
            )
    bounds = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=bounds[1:])
    b = bounds.tolist()
    for name, (values, counts) in (("loss_mask", mask_runs), ("policy_versions", version_runs_)):
        flat = np.repeat(np.asarray(values, np.int32), counts)
        for sample, text in zip(samples, _split([flat[b[j] : b[j + 1]] for j in range(len(lengths))]), strict=True):
            sample[name] = Fragment(b"[%b]" % text)
    return samples


def _split(arrays: list[np.ndarray[Any, Any]]) -> list[bytes]:
    """Each array's JSON items (no brackets), from one ``orjson.dumps`` of them all."""
    text = orjson.dumps(arrays, option=_NUMPY)
    parts = text[2:-2].split(b"],[")
    if len(parts) != len(arrays):  # not a list of arrays of numbers
        raise ValueError(f"{len(arrays)} arrays, {len(parts)} parts")
    return parts
