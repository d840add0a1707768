"""Writers for exported records: JSON Lines (orjson) and Parquet (pyarrow, row groups of N records).

Both stream: memory holds at most one row group. Non-finite floats never reach a file: the
exporter writes None (JSON null) for a -inf logprob.

An export of rollouts (``server/export/run.py``) builds and encodes a page of chats at a time
(``Encoder``s: on worker processes, see ``server/export/parallel.py``) and hands the bytes to a
``PageWriter``: JSON lines (``LinesEncoder``: native rollouts a page at a time by
``server/export/page_rollouts.py`` and ``server/export/page_jsonl.py``), or for Parquet a row group
of native rollouts, compressed where it was built (``ArrowEncoder``: ``server/export/columnar.py``;
``RolloutParquetWriter``, ``server/export/parquet_pages.py``) or the records of a trainer schema
(``RecordsEncoder``, ``ParquetWriter``). A page with a turn whose logprobs do not line up with its
completion is built one rollout at a time (``rows_rollout_parts``).
"""

from __future__ import annotations

import functools
import os
import pickle
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Protocol

import orjson

from server.export.fastpage import arrow_batch, encode_page, parquet_leaves, parquet_page
from server.export.jsonl import rollout_line
from server.export.page_jsonl import page_lines
from server.export.page_rollouts import Chat, page_rollouts
from server.export.parquet_pages import (
    PageFile,
    RowGroupTemplate,
    StitchedParquetWriter,
    empty_file,
    file_fields,
    leaf_columns,
    page_file,
)
from server.export.query import Decoders, ExportFilters, PolicyPaths
from server.export.rollouts import fill_plain, rows_rollout_parts
from shared.rollout import SCHEMA_NAME


class RecordWriter(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class PageWriter(Protocol):
    def write_page(self, payload: list[Any]) -> None:
        """A page of records as its ``Encoder`` encoded them (bytes-like chunks, to be concatenated)."""
        ...

    def splice_target(self) -> int | None:
        """A file descriptor that takes the pages' bytes as they are (JSON lines to a file), else None."""
        ...

    def close(self) -> None: ...


class JsonlWriter:
    BUFFER = 1 << 16  # records are tens of KB: a few per write(2); larger buffers measured slower

    def __init__(self, out: Path | BinaryIO) -> None:
        self._own = isinstance(out, Path)
        self._fh: BinaryIO = open(out, "wb", buffering=self.BUFFER) if isinstance(out, Path) else out  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))

    def write_page(self, payload: list[Any]) -> None:
        """JSON lines (``LinesEncoder``)."""
        self._fh.writelines(payload)

    def splice_target(self) -> int | None:
        self._fh.flush()
        try:
            fd = self._fh.fileno()
            return fd if stat.S_ISREG(os.fstat(fd).st_mode) or stat.S_ISFIFO(os.fstat(fd).st_mode) else None
        except (AttributeError, OSError, ValueError):  # not a file (a test's buffer)
            return None

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

    def write_page(self, payload: list[Any]) -> None:
        """Records pickled by ``RecordsEncoder``."""
        for record in pickle.loads(b"".join(payload)):
            self.write(record)

    def splice_target(self) -> int | None:
        return None

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


class _PerRollout:
    """An encoder that takes the rollouts of ``rows_rollout_parts`` one at a time (``add``)."""

    def add(self, rollout: dict[str, Any]) -> int:
        raise NotImplementedError

    def add_chats(
        self, chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths
    ) -> tuple[int, int]:
        rollouts = records = 0
        for chat in chats:
            # each rollout is encoded as soon as it is built, while its arrays are in the CPU's caches
            for rollout in rows_rollout_parts(*chat, filters, dec, paths):
                records += self.add(rollout)
                rollouts += 1
        return rollouts, records


class LinesEncoder(_PerRollout):
    """Rollouts as JSON lines: native ones a page at a time (``page_rollouts``, ``page_lines``), else
    by ``rollout_line``; others as the records of their trainer schema (``adapt``)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.lines: list[bytes] = []

    def add_chats(
        self, chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths
    ) -> tuple[int, int]:
        if self.schema == SCHEMA_NAME and (encoded := encode_page(chats, filters, dec, paths)) is not None:
            text, rollouts = encoded
            self.lines.append(text)
            return rollouts, rollouts
        page = page_rollouts(chats, filters, dec, paths) if self.schema == SCHEMA_NAME else None
        if page is None:  # a trainer schema, or a turn without a logprob per token
            return super().add_chats(chats, filters, dec, paths)
        self.lines += page_lines(page, dec, filters.reward_rule)
        return len(page), len(page)

    def add(self, rollout: dict[str, Any]) -> int:
        if self.schema == SCHEMA_NAME:
            self.lines.append(rollout_line(rollout))
            return 1
        from shared.rollout_adapters import adapt

        records = adapt(fill_plain(rollout), self.schema)
        self.lines += [orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records]
        return len(records)

    def payload(self) -> list[Any]:
        return self.lines


class RecordsEncoder(_PerRollout):
    """The records of a trainer schema, pickled for ``ParquetWriter.write_page``."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.records: list[dict[str, Any]] = []

    def add(self, rollout: dict[str, Any]) -> int:
        from shared.rollout_adapters import adapt

        records = adapt(fill_plain(rollout), self.schema)
        self.records += records
        return len(records)

    def payload(self) -> list[Any]:
        return [pickle.dumps(self.records, protocol=pickle.HIGHEST_PROTOCOL)]


class ArrowEncoder(_PerRollout):
    """Native rollouts as a Parquet row group: written by the compiled encoder where it takes the page
    (``fastpage.parquet_page``), else an Arrow record batch (``server/export/columnar.py``) that pyarrow
    writes."""

    def __init__(self) -> None:
        from server.export.columnar import RolloutColumns

        self.columns = RolloutColumns()
        self.page: Any = None  # a page built at once (``page_batch``)
        self.file: PageFile | None = None  # a page written at once (``parquet_page``)

    @staticmethod
    def warm_up() -> None:
        """What the first page would do once per process (pyarrow's first file: ~10 ms), done while a
        worker waits for its first page's bounds."""
        native_parquet_fields()

    def add_chats(
        self, chats: Sequence[Chat], filters: ExportFilters, dec: Decoders, paths: PolicyPaths
    ) -> tuple[int, int]:
        """One page's chats (an encoder per page: ``server/export/parallel.py``)."""
        from server.export.columnar import page_batch

        if not self.columns.rollouts and self.page is None and self.file is None:
            fields = native_parquet_fields()
            written = None if fields is None else parquet_page(chats, filters, dec, paths, ZSTD_LEVEL)
            if fields is not None and written is not None:
                (chunks, parts, offsets, rows), rollouts = written
                if rollouts:
                    self.file = PageFile(memoryview(chunks), RowGroupTemplate(parts, offsets, rows), fields)
                return rollouts, rollouts
            built = arrow_batch(chats, filters, dec, paths)
            if built is not None:
                self.page = built
                return built.num_rows, built.num_rows
        page = page_rollouts(chats, filters, dec, paths)
        if page is None or self.page is not None or self.file is not None or self.columns.rollouts:
            return super().add_chats(chats, filters, dec, paths)  # a turn without a logprob per token
        self.page = page_batch(page, dec, filters.reward_rule)
        return len(page), len(page)

    def add(self, rollout: dict[str, Any]) -> int:
        if self.page is not None or self.file is not None:  # what came first stays first
            raise RuntimeError("ArrowEncoder: a rollout added after a page")
        self.columns.add(rollout)
        return 1

    def payload(self) -> list[Any]:
        """The rollouts added as a Parquet row group (``parquet_pages``; the encoder starts again empty)."""
        from server.export.columnar import ROLLOUT_SCHEMA, RolloutColumns

        if self.file is not None:
            written, self.file = self.file, None
            return written.payload()
        batch = self.page if self.page is not None else self.columns.batch()
        self.columns, self.page = RolloutColumns(), None
        if not batch.num_rows:
            return []
        # The C library's allocator, not Arrow's default (mimalloc), which hands a page's freed memory
        # back to the system within milliseconds, so that every page faults its buffers in again:
        # measured with benchmarks/export.py, ~6% less CPU and half the memory per export worker.
        import pyarrow as pa

        options = rollout_parquet_options() | {"memory_pool": pa.system_memory_pool()}
        return page_file(batch, ROLLOUT_SCHEMA, **options).payload()


ZSTD_LEVEL = 1  # Arrow's default level: what pyarrow writes for compression="zstd"


@functools.cache
def native_parquet_fields() -> tuple[tuple[int, int, bytes], ...] | None:
    """The file metadata (``PageFile.file_fields``) of the row groups the compiled encoder writes: what
    pyarrow writes for ``ROLLOUT_SCHEMA``; None where it is not built or writes other leaf columns than
    this pyarrow's schema has (then pyarrow writes every page)."""
    from server.export.columnar import ROLLOUT_SCHEMA

    leaves = parquet_leaves()
    if leaves is None:
        return None
    data = empty_file(ROLLOUT_SCHEMA, **rollout_parquet_options())
    return file_fields(data) if leaf_columns(data) == leaves else None


def rollout_parquet_options() -> dict[str, Any]:
    """How native rollouts are written to Parquet. Plain encoding: dictionaries of token ids and
    logprobs only cost time (zstd does better). Statistics (min and max) only for the scalar columns:
    a token list's cost a third of the writing and no reader skips row groups by token ids."""
    from server.export.columnar import ROLLOUT_SCHEMA

    scalars = [f.name for f in ROLLOUT_SCHEMA if f.name not in ("turns", "samples")]
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": False,
        "write_statistics": scalars,
    }


class RolloutParquetWriter:
    """Native rollouts' row groups, compressed by the encoders (``ArrowEncoder``, on the export's
    worker processes), appended to one Parquet file (``parquet_pages``): a row group per page."""

    def __init__(self, path: Path) -> None:
        from server.export.columnar import ROLLOUT_SCHEMA

        self._writer = StitchedParquetWriter(path, ROLLOUT_SCHEMA, **rollout_parquet_options())

    def write_page(self, payload: list[Any]) -> None:
        data = payload[0] if len(payload) == 1 else b"".join(payload)
        if len(data):  # (a page without rollouts: nothing to add)
            self._writer.add(PageFile.from_payload(data))

    def splice_target(self) -> int | None:
        return None

    def close(self) -> None:
        self._writer.close()
        _release_arrow_memory()  # what pages encoded in this process left in Arrow's allocator


def _release_arrow_memory() -> None:
    """Hands the memory Arrow freed back to the system: its allocator keeps it otherwise, tens of
    megabytes per process (measured with benchmarks/export.py) that the export no longer uses."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def page_writer(out: Path, fmt: str, schema: str) -> tuple[Callable[[], Any], PageWriter]:
    """The ``Encoder`` (a factory of them) and ``PageWriter`` of an export to ``out`` ('-': stdout)."""
    if str(out) == "-" or fmt == "jsonl":
        writer: PageWriter = JsonlWriter(sys.stdout.buffer) if str(out) == "-" else JsonlWriter(out)
        return (lambda: LinesEncoder(schema)), writer
    if fmt != "parquet":
        raise ValueError(f"unknown format {fmt!r}: jsonl or parquet")
    if schema == SCHEMA_NAME:
        return ArrowEncoder, RolloutParquetWriter(out)
    return (lambda: RecordsEncoder(schema)), ParquetWriter(out)


def open_writer(path: Path, fmt: str) -> RecordWriter:
    if fmt == "jsonl":
        return JsonlWriter(path)
    if fmt == "parquet":
        return ParquetWriter(path)
    raise ValueError(f"unknown format {fmt!r}: jsonl or parquet")
