"""Writers for exported records: JSON Lines (orjson) and Parquet (pyarrow, row groups of N records).

Both stream: memory holds at most one row group. Non-finite floats never reach a file: the
exporter writes None (JSON null) for a -inf logprob.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Protocol

import orjson


class RecordWriter(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    BUFFER = 1 << 16  # records are tens of KB: a few per write(2); larger buffers measured slower

    def __init__(self, out: Path | BinaryIO) -> None:
        self._own = isinstance(out, Path)
        self._fh: BinaryIO = open(out, "wb", buffering=self.BUFFER) if isinstance(out, Path) else out  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))

    def close(self) -> None:
        if self._own:
            self._fh.close()
        else:
            self._fh.flush()


class ParquetWriter:
    """One row per record; nested lists and objects become Parquet list and struct columns.

    Free-form objects (sampling parameters, tool schemas, tool calls, the version -> checkpoint map
    ``policy_paths``, and trainers' free-form, often empty, dicts: Parquet has no struct without fields)
    are stored as JSON text so that every row group has the same schema."""

    JSON_KEYS = frozenset(
        {"sampling", "tools", "tool_calls", "stop_reason", "extra_fields", "metrics", "policy_paths"}
        | {"multi_modal_data", "extra_logs", "rollout_metrics"}
    )
    ROW_GROUP = 1000

    def __init__(self, path: Path) -> None:
        self._path = path
        self._rows: list[dict[str, Any]] = []
        self._writer: Any = None
        self._schema: Any = None

    def write(self, record: dict[str, Any]) -> None:
        self._rows.append(_jsonify(record, self.JSON_KEYS))
        if len(self._rows) >= self.ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = None
        if self._schema is None:
            inferred = pa.Table.from_pylist(self._rows)
            self._schema = _fill_null_types(inferred.schema)
            if self._schema.equals(inferred.schema):
                table = inferred
            # Plain encoding: dictionaries of token ids and logprobs only cost time (zstd does better).
            self._writer = pq.ParquetWriter(self._path, self._schema, compression="zstd", use_dictionary=False)
        if table is None:
            table = pa.Table.from_pylist(self._rows, schema=self._schema)
        self._rows = []
        self._writer.write_table(table)

    def close(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
        elif not self._path.exists():  # nothing exported: still leave a valid (empty) file
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({}), self._path)

    def __enter__(self) -> ParquetWriter:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


# Types for fields that were null in every row of the first row group (so pyarrow inferred "null").
_NULL_FIELD_TYPES = {"reward": "float64", "reward_score": "float64", "episode_reward": "float64"}


def _fill_null_types(schema: Any) -> Any:
    import pyarrow as pa

    def fix(f: Any) -> Any:
        t = f.type
        if pa.types.is_null(t):
            return pa.field(f.name, pa.type_for_alias(_NULL_FIELD_TYPES.get(f.name, "string")), nullable=True)
        if pa.types.is_struct(t):
            return pa.field(f.name, pa.struct([fix(c) for c in t]), nullable=f.nullable)
        if pa.types.is_list(t):
            inner = fix(pa.field(f.name, t.value_type)).type
            return pa.field(f.name, pa.list_(inner), nullable=f.nullable)
        return f

    return pa.schema([fix(f) for f in schema])


def _jsonify(value: Any, keys: frozenset[str]) -> Any:
    """Objects under ``keys`` (at any depth) as JSON text; lists of scalars are returned as they are."""
    if isinstance(value, dict):
        return {
            k: (
                orjson.dumps(v).decode()
                if k in keys
                else (_jsonify(v, keys) if isinstance(v, _CONTAINERS) and v else v)
            )
            for k, v in value.items()
        }
    if isinstance(value, list) and value and isinstance(value[0], _CONTAINERS):
        return [_jsonify(v, keys) for v in value]
    return value


_CONTAINERS = (dict, list)


def open_writer(path: Path, fmt: str) -> RecordWriter:
    if fmt == "jsonl":
        return JsonlWriter(path)
    if fmt == "parquet":
        return ParquetWriter(path)
    raise ValueError(f"unknown format {fmt!r}: jsonl or parquet")
