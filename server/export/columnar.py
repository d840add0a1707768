"""Native rollouts (``path_rollout_parts``) as Arrow columns, for the Parquet writer.

A page of rollouts becomes one record batch: each token field is one flat numpy array (the turns'
arrays joined) with list offsets, never a Python object per token. The schema is the one
``pa.Table.from_pylist`` infers from the records (field names, order and nesting), the free-form
objects stored as JSON text like ``ParquetWriter`` does, with narrower token lists: ids, masks and
versions ``list<int32>`` (the stored ids are int32) and logprobs ``list<float>`` (the stored float32
values; a turn's non-finite logprob is null, as in JSON).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from server.export.arrays import booleans, column, lists, primitive, strings
from server.export.page_rollouts import PageRollouts, PageTurns, rollout_heads, scalar_columns
from server.export.query import Decoders
from server.export.rollouts import TO_FILL
from shared.rollout import NO_VERSION, SCHEMA_NAME, SCHEMA_VERSION, token_versions

_IDS = pa.list_(pa.int32())
_LOGPROBS = pa.list_(pa.float32())
_SPANS = pa.list_(pa.list_(pa.int64()))
_JSON = pa.string()  # free-form objects as JSON text (ParquetWriter.JSON_KEYS)

TURN_TYPE = pa.struct(
    [
        ("message_id", pa.string()),
        ("prompt_delta_ids", _IDS),
        ("completion_ids", _IDS),
        ("logprobs", _LOGPROBS),
        ("finish_reason", pa.string()),
        ("stop_reason", _JSON),
        ("synthetic_closer_ids", _IDS),
        ("reused_prefix_len", pa.int64()),
        ("fork", pa.bool_()),
        ("prompt_method", pa.string()),
        ("prompt_length", pa.int64()),
        ("sampling", _JSON),
        ("reward", pa.float64()),
        ("done", pa.bool_()),
        ("policy_versions", _SPANS),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", _JSON),
        ("created_at", pa.string()),
    ]
)
SAMPLE_TYPE = pa.struct(
    [
        ("token_ids", _IDS),
        ("loss_mask", _IDS),
        ("logprobs", _LOGPROBS),
        ("prompt_length", pa.int64()),
        ("turn_spans", _SPANS),
        ("turn_indices", pa.list_(pa.int64())),
        ("temperatures", pa.list_(pa.float64())),
        ("policy_versions", _IDS),
    ]
)
ROLLOUT_SCHEMA = pa.schema(
    [
        ("schema", pa.string()),
        ("schema_version", pa.int64()),
        ("rollout_id", pa.string()),
        ("chat_id", pa.string()),
        ("leaf_message_id", pa.string()),
        ("user_id", pa.string()),
        ("model_name", pa.string()),
        ("tokenizer_hash", pa.string()),
        ("template_hash", pa.string()),
        ("engine", pa.string()),
        ("system_prompt", pa.string()),
        ("tools", _JSON),
        ("turns", pa.list_(TURN_TYPE)),
        ("samples", pa.list_(SAMPLE_TYPE)),
        ("reward", pa.float64()),
        ("reward_rule", pa.string()),
        ("complete", pa.bool_()),
        ("policy_paths", _JSON),
    ]
)
_JSON_FIELDS = frozenset({"tools", "policy_paths", "stop_reason", "sampling", "tool_calls"})
_ARRAY_FIELDS = frozenset({"turns", "samples"} | {"prompt_delta_ids", "completion_ids", "logprobs"})
_ARRAY_FIELDS |= {"synthetic_closer_ids", "policy_versions", "token_ids", "loss_mask", "turn_spans"}


def _scalars(struct: Any, skip: frozenset[str] = _ARRAY_FIELDS) -> tuple[list[str], list[str]]:
    """A struct's plain fields and its JSON-text fields, by name, in schema order."""
    plain = [f.name for f in struct if f.name not in skip and f.name not in _JSON_FIELDS]
    return plain, [f.name for f in struct if f.name in _JSON_FIELDS]


_ROLLOUT_PLAIN, _ROLLOUT_JSON = _scalars(ROLLOUT_SCHEMA)
_SAMPLE_ARRAYS = ("token_ids", "loss_mask", "logprobs", "policy_versions")
_TURN_PLAIN, _TURN_JSON = _scalars(TURN_TYPE)
_SAMPLE_PLAIN, _ = _scalars(SAMPLE_TYPE)


class RolloutColumns:
    """Gathers rollouts (``add``, each as soon as it is built) into a record batch (``batch``): the
    rollouts and their turns are kept as they are and read a column at a time at the end; a sample's
    token fields are gathered as it is added (numpy arrays joined at the end, and runs)."""

    def __init__(self) -> None:
        self.rollouts: list[dict[str, Any]] = []
        self.turns: list[dict[str, Any]] = []
        self.sample_values: dict[str, list[Any]] = {name: [] for name in (*_SAMPLE_PLAIN, "turn_spans")}
        self.sample_lengths: dict[str, list[int]] = {name: [] for name in _SAMPLE_ARRAYS}
        self.samples: list[int] = []  # each rollout's number of samples
        self.sample_ids: list[Any] = []  # a sample's ids: its turns' prompt deltas and completions
        self.sample_logprobs: list[Any] = []
        self.mask_runs: tuple[list[int], list[int]] = ([], [])  # (value, count) runs
        self.version_runs: tuple[list[int], list[int]] = ([], [])

    def add(self, rollout: dict[str, Any]) -> None:
        self.rollouts.append(rollout)
        turns, samples = rollout["turns"], rollout["samples"]
        self.turns += turns
        self.samples.append(len(samples))
        for sample in samples:
            self._add_sample(turns, sample)

    def _add_sample(self, turns: list[dict[str, Any]], sample: dict[str, Any]) -> None:
        for name in (*_SAMPLE_PLAIN, "turn_spans"):
            self.sample_values[name].append(sample[name])
        if sample["token_ids"] is not TO_FILL:  # built by build_samples: lists
            self._add_listed_sample(sample)
            return
        (mask_values, mask_counts), (version_values, version_counts) = self.mask_runs, self.version_runs
        for i in sample["turn_indices"]:
            turn = turns[i]
            delta, completion = turn["prompt_delta_ids"], turn["completion_ids"]
            self.sample_ids += (delta, completion)
            self.sample_logprobs += (_zeros(len(delta)), turn["logprobs"])
            mask_values += (0, 1)
            mask_counts += (len(delta), len(completion))
            version_values.append(NO_VERSION)
            version_counts.append(len(delta))
            _version_runs(turn["policy_versions"], len(completion), version_values, version_counts)
        n = sample["turn_spans"][-1][1]  # the sample's length: the end of its last completion
        for lengths in self.sample_lengths.values():
            lengths.append(n)

    def _add_listed_sample(self, sample: dict[str, Any]) -> None:
        """A sample ``build_samples`` made (its lists may differ in length where a logprob is missing)."""
        self.sample_ids.append(np.asarray(sample["token_ids"], np.int32))
        self.sample_logprobs.append(np.asarray(sample["logprobs"], np.float32))
        for runs, name in ((self.mask_runs, "loss_mask"), (self.version_runs, "policy_versions")):
            runs[0].extend(sample[name])
            runs[1].extend([1] * len(sample[name]))
        for name, lengths in self.sample_lengths.items():
            lengths.append(len(sample[name]))

    def batch(self) -> pa.RecordBatch:
        """The rollouts added so far as one record batch of ``ROLLOUT_SCHEMA``."""
        rollouts, schema = self.rollouts, ROLLOUT_SCHEMA
        columns = {name: column([r[name] for r in rollouts], schema.field(name).type) for name in _ROLLOUT_PLAIN}
        for name in _ROLLOUT_JSON:  # the UTF-8 of the JSON text
            columns[name] = column([orjson.dumps(r[name]) for r in rollouts], _JSON)
        columns["turns"] = lists([len(r["turns"]) for r in rollouts], self._turn_structs())
        columns["samples"] = lists(self.samples, self._sample_structs())
        return pa.RecordBatch.from_arrays([columns[f.name] for f in ROLLOUT_SCHEMA], schema=ROLLOUT_SCHEMA)

    def _turn_structs(self) -> pa.StructArray:
        turns = self.turns
        children = {name: column([t[name] for t in turns], TURN_TYPE.field(name).type) for name in _TURN_PLAIN}
        for name in _TURN_JSON:
            children[name] = column([orjson.dumps(t[name]) for t in turns], _JSON)
        for name in ("prompt_delta_ids", "completion_ids", "synthetic_closer_ids"):
            arrays = [t[name] for t in turns]
            children[name] = _ids([len(a) for a in arrays], arrays)
        arrays = [t["logprobs"] for t in turns]
        logprobs = _joined(arrays, np.float32)
        children["logprobs"] = lists([len(a) for a in arrays], primitive(logprobs, pa.float32(), np.isfinite(logprobs)))
        children["policy_versions"] = column([t["policy_versions"] for t in turns], _SPANS)
        return pa.StructArray.from_arrays([children[f.name] for f in TURN_TYPE], fields=list(TURN_TYPE))

    def _sample_structs(self) -> pa.StructArray:
        lengths = self.sample_lengths
        children = {name: column(values, SAMPLE_TYPE.field(name).type) for name, values in self.sample_values.items()}
        children["token_ids"] = _ids(lengths["token_ids"], self.sample_ids)
        logprobs = _joined(self.sample_logprobs, np.float32)
        zeroed = np.where(np.isfinite(logprobs), logprobs, np.float32(0))
        children["logprobs"] = lists(lengths["logprobs"], primitive(zeroed, pa.float32()))
        for name, (runs, counts) in (("loss_mask", self.mask_runs), ("policy_versions", self.version_runs)):
            values = np.repeat(np.asarray(runs, np.int32), counts)
            children[name] = lists(lengths[name], primitive(values, pa.int32()))
        return pa.StructArray.from_arrays([children[f.name] for f in SAMPLE_TYPE], fields=list(SAMPLE_TYPE))


def _ids(lengths: list[int], arrays: list[Any]) -> pa.ListArray:
    return lists(lengths, primitive(_joined(arrays, np.int32), pa.int32()))


def _joined(arrays: list[Any], dtype: Any) -> np.ndarray[Any, Any]:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


_ZEROS = np.zeros(4096, np.float32)


def _zeros(n: int) -> np.ndarray[Any, Any]:
    """``n`` zero logprobs (a view of a cached array)."""
    global _ZEROS
    if n > len(_ZEROS):
        _ZEROS = np.zeros(2 * n, np.float32)
    return _ZEROS[:n]


def _version_runs(spans: list[list[int]], n: int, values: list[int], counts: list[int]) -> None:
    """A turn's per-token versions (``token_versions``) as (version, count) runs."""
    if len(spans) == 1 and not spans[0][0]:  # one version for the whole completion: the usual case
        values.append(spans[0][1])
        counts.append(n)
        return
    per_token = token_versions(spans, n)
    values.extend(per_token)
    counts.extend([1] * n)


def page_batch(page: PageRollouts, dec: Decoders, reward_rule: str) -> pa.RecordBatch:
    """A page's rollouts (``page_rollouts``) as the record batch ``RolloutColumns`` makes of them: each
    distinct turn's fields once, from the page's joined token arrays, then taken for each rollout."""
    turns, n = page.turns, len(page)
    heads = rollout_heads(page)
    tools = heads.pop("tools")
    columns = {name: column(values, ROLLOUT_SCHEMA.field(name).type) for name, values in heads.items()}
    columns["tools"] = column([orjson.dumps(t) for t in tools], _JSON)
    columns["policy_paths"] = column([orjson.dumps(p) for p in page.policy_paths], _JSON)
    columns["schema"] = column([SCHEMA_NAME] * n, pa.string())
    columns["schema_version"] = column([SCHEMA_VERSION] * n, pa.int64())
    columns["reward"] = column(page.rewards, pa.float64())
    columns["reward_rule"] = column([reward_rule] * n, pa.string())
    columns["complete"] = column(page.completes, pa.bool_())
    order = [k for ks in page.turn_lists for k in ks]  # a turn in several rollouts (a shared prefix) repeats
    structs = _page_turn_structs(turns, dec, order)
    columns["turns"] = lists([len(ks) for ks in page.turn_lists], structs)
    columns["samples"] = lists([len(g) for g in page.groups], _page_sample_structs(page))
    return pa.RecordBatch.from_arrays([columns[f.name] for f in ROLLOUT_SCHEMA], schema=ROLLOUT_SCHEMA)


def _page_turn_structs(turns: PageTurns, dec: Decoders, order: list[int]) -> pa.StructArray:
    """The turns ``order`` (indices of the page's distinct turns) as structs."""
    values = scalar_columns(turns, dec)
    for name in _TURN_JSON:
        values[name] = [orjson.dumps(v) for v in values[name]]
    shared = order != list(range(len(turns)))
    if shared:
        values = {name: [column[k] for k in order] for name, column in values.items()}
    children = {name: column(values[name], TURN_TYPE.field(name).type) for name in _TURN_PLAIN}
    for name in _TURN_JSON:
        children[name] = column(values[name], _JSON)
    children["policy_versions"] = column(values["policy_versions"], _SPANS)
    if shared:
        completions = [turns.completion(k) for k in order]
        lengths: Any = [len(c) for c in completions]
        ids, logprobs = _joined(completions, np.int32), _joined([turns.turn_logprobs(k) for k in order], np.float32)
    else:
        lengths, ids, logprobs = np.diff(turns.completion_offsets), turns.completions, turns.logprobs
    children["completion_ids"] = lists(lengths, primitive(ids, pa.int32()))
    children["logprobs"] = lists(lengths, primitive(logprobs, pa.float32(), np.isfinite(logprobs)))
    deltas = [turns.delta(k) for k in order]
    children["prompt_delta_ids"] = _ids([len(d) for d in deltas], deltas)
    closers = [turns.closer(k) for k in order]
    children["synthetic_closer_ids"] = _ids([len(c) for c in closers], closers)
    return pa.StructArray.from_arrays([children[f.name] for f in TURN_TYPE], fields=list(TURN_TYPE))


def _page_sample_structs(page: PageRollouts) -> pa.StructArray:
    turns = page.turns
    sampling_temps = [
        1.0 if (t := (w.get("sampling_parameters") or {}).get("temperature")) is None else float(t) for w in turns.works
    ]
    values: dict[str, list[Any]] = {"prompt_length": [], "turn_spans": [], "turn_indices": [], "temperatures": []}
    ids: list[Any] = []
    logprobs: list[Any] = []
    mask_runs: tuple[list[int], list[int]] = ([], [])
    version_runs: tuple[list[int], list[int]] = ([], [])
    lengths: list[int] = []
    for r, ks in enumerate(page.turn_lists):
        for group in page.groups[r]:
            spans: list[tuple[int, int]] = []
            end = 0
            for i in group:
                k = ks[i]
                delta, completion = turns.delta(k), turns.completion(k)
                ids += (delta, completion)
                logprobs += (_zeros(len(delta)), turns.turn_logprobs(k))
                mask_runs[0].extend((0, 1))
                mask_runs[1].extend((len(delta), len(completion)))
                version_runs[0].append(NO_VERSION)
                version_runs[1].append(len(delta))
                _version_runs(turns.spans[k], len(completion), *version_runs)
                start = end + len(delta)
                end = start + len(completion)
                spans.append((start, end))
            lengths.append(end)
            values["prompt_length"].append(spans[0][0])
            values["turn_spans"].append(spans)
            values["turn_indices"].append(group)
            values["temperatures"].append([sampling_temps[ks[i]] for i in group])
    children = {name: column(v, SAMPLE_TYPE.field(name).type) for name, v in values.items()}
    children["token_ids"] = _ids(lengths, ids)
    joined = _joined(logprobs, np.float32)
    children["logprobs"] = lists(lengths, primitive(np.where(np.isfinite(joined), joined, np.float32(0)), pa.float32()))
    for name, (runs, counts) in (("loss_mask", mask_runs), ("policy_versions", version_runs)):
        children[name] = lists(lengths, primitive(np.repeat(np.asarray(runs, np.int32), counts), pa.int32()))
    return pa.StructArray.from_arrays([children[f.name] for f in SAMPLE_TYPE], fields=list(SAMPLE_TYPE))


Buffers = dict[str, tuple[bytes, bytes | None, bytes | None]]  # column -> (values, offsets, validity)


def native_batch(columns: Buffers, n: int, reward_rule: str) -> pa.RecordBatch:
    """The record batch of a page from the compiled encoder's column buffers (``fastpage.arrow_batch``):
    a column's values, string offsets and validity under its name, a list's row lengths under its name
    and its items under ``name.items`` (a list of structs: its fields under ``name.field``)."""
    fixed = {
        "schema": column([SCHEMA_NAME] * n, pa.string()),
        "schema_version": column([SCHEMA_VERSION] * n, pa.int64()),
        "reward_rule": column([reward_rule] * n, pa.string()),
    }
    arrays = [fixed[f.name] if f.name in fixed else _native_array(columns, f.name, f.type) for f in ROLLOUT_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=ROLLOUT_SCHEMA)


def _native_array(columns: Buffers, path: str, type_: pa.DataType) -> pa.Array:
    # (a module function, not a closure: a recursive closure is a reference cycle, and export workers run
    # without the cycle collector, so it would keep every page's buffers)
    values, offsets, valid = columns[path]
    if pa.types.is_list(type_):
        lengths = np.frombuffer(values, np.int32)
        item = type_.value_type
        if pa.types.is_struct(item):
            children = [_native_array(columns, f"{path}.{f.name}", f.type) for f in item]
            return lists(lengths, pa.StructArray.from_arrays(children, fields=list(item)))
        return lists(lengths, _native_array(columns, f"{path}.items", item))
    if pa.types.is_string(type_):
        return strings(offsets, values, valid)
    if pa.types.is_boolean(type_):
        return booleans(values, valid)
    mask = None if valid is None else np.frombuffer(valid, bool)
    return primitive(np.frombuffer(values, type_.to_pandas_dtype()), type_, mask)
