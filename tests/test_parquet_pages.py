"""Row groups written apart and stitched into one Parquet file (``server/export/parquet_pages.py``)
are the file that one ``pyarrow.parquet.ParquetWriter`` writes from the same batches, byte for byte;
with the options that move things around (dictionaries, page indexes, statistics) the file reads back
the same everywhere (pyarrow, row-group by row-group, pandas, datasets' loader)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from server.export.columnar import ROLLOUT_SCHEMA
from server.export.parquet_pages import ParquetLayoutError, StitchedParquetWriter, page_file, split_file
from server.export.writers import rollout_parquet_options

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("n", pa.int64()),
        pa.field("ok", pa.bool_()),
        pa.field("ids", pa.list_(pa.int32())),
        pa.field("logprobs", pa.list_(pa.float32())),
        pa.field("at", pa.timestamp("us", tz="UTC")),
        pa.field("turns", pa.list_(pa.struct([("text", pa.string()), ("ids", pa.list_(pa.int32()))]))),
    ]
)


def _batch(rng: np.random.Generator, start: int, rows: int) -> pa.RecordBatch:
    def ids() -> list[int]:
        return rng.integers(0, 150_000, int(rng.integers(0, 40))).tolist()

    return pa.record_batch(
        {
            "id": [f"r{start + i}" for i in range(rows)],
            "n": [None if i % 7 == 3 else int(rng.integers(-(10**12), 10**12)) for i in range(rows)],
            "ok": [None if i % 5 == 0 else bool(i % 2) for i in range(rows)],
            "ids": [None if i % 9 == 4 else ids() for i in range(rows)],
            "logprobs": [(-rng.random(int(rng.integers(0, 30)))).astype(np.float32).tolist() for _ in range(rows)],
            "at": [1_700_000_000_000_000 + i for i in range(rows)],
            "turns": [
                [{"text": f"t{j} \u00e9" * j, "ids": ids()} for j in range(int(rng.integers(0, 4)))]
                for _ in range(rows)
            ],
        },
        schema=SCHEMA,
    )


def _stitched(path: Path, batches: list[pa.RecordBatch], schema: pa.Schema, **options: Any) -> None:
    writer = StitchedParquetWriter(path, schema, **options)
    for batch in batches:
        # as an export worker hands a page over: through the bytes of its payload
        page = page_file(batch, schema, **options)
        writer.add(type(page).from_payload(b"".join(bytes(chunk) for chunk in page.payload())))
    writer.close()


def _one_writer(path: Path, batches: list[pa.RecordBatch], schema: pa.Schema, **options: Any) -> None:
    with pq.ParquetWriter(path, schema, **options) as writer:
        for batch in batches:
            writer.write_batch(batch, row_group_size=max(1, batch.num_rows))


OPTIONS = [
    {"compression": "zstd", "use_dictionary": False, "write_statistics": ["id", "n", "ok", "at"]},
    {"compression": "snappy"},  # pyarrow's defaults: dictionary pages, statistics of every column
    {"compression": "none", "use_dictionary": ["id"], "data_page_size": 256},  # many pages per chunk
]


@pytest.mark.parametrize("options", OPTIONS, ids=["export", "defaults", "small-pages"])
def test_stitched_row_groups_are_the_file_one_writer_writes(tmp_path: Path, options: dict[str, Any]) -> None:
    rng = np.random.default_rng(3)
    batches = [_batch(rng, 0, 57), _batch(rng, 57, 1), _batch(rng, 58, 240), _batch(rng, 298, 17)]
    _stitched(tmp_path / "stitched.parquet", batches, SCHEMA, **options)
    _one_writer(tmp_path / "one.parquet", batches, SCHEMA, **options)
    assert (tmp_path / "stitched.parquet").read_bytes() == (tmp_path / "one.parquet").read_bytes()
    meta = pq.ParquetFile(tmp_path / "stitched.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [57, 1, 240, 17]


def test_with_page_indexes_and_bloom_filters_the_file_reads_back_the_same(tmp_path: Path) -> None:
    """Page indexes and bloom filters sit past a file's row groups: stitched, each page's follow its
    chunks, at offsets moved with them (another layout than one writer's, the same data)."""
    rng = np.random.default_rng(5)
    batches = [_batch(rng, i * 100, 100) for i in range(4)]
    options = {"compression": "zstd", "write_page_index": True, "bloom_filter_options": {"id": {"ndv": 100}}}
    path = tmp_path / "indexed.parquet"
    _stitched(path, batches, SCHEMA, **options)
    expected = pa.Table.from_batches(batches)
    file = pq.ParquetFile(path)
    assert file.read().equals(expected)
    for i, batch in enumerate(batches):  # each row group where its offsets say
        assert file.read_row_group(i).equals(pa.Table.from_batches([batch]))
    filtered = pq.read_table(path, filters=[("id", "=", "r250")])  # statistics and the page index used
    assert filtered.column("id").to_pylist() == ["r250"]
    import pandas as pd

    assert pd.read_parquet(path)["id"].tolist() == expected.column("id").to_pylist()


def test_rollout_pages_load_with_datasets(tmp_path: Path) -> None:
    """The export's own schema and options, as ``datasets`` reads them."""
    import datasets

    rows = [
        {f.name: None for f in ROLLOUT_SCHEMA} | {"rollout_id": f"r{i}", "turns": [], "samples": []} for i in range(5)
    ]
    batches = [pa.RecordBatch.from_pylist(part, ROLLOUT_SCHEMA) for part in (rows[:3], rows[3:])]
    path = tmp_path / "rollouts.parquet"
    _stitched(path, batches, ROLLOUT_SCHEMA, **rollout_parquet_options())
    loaded = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded["rollout_id"] == [f"r{i}" for i in range(5)]


def test_no_pages_is_an_empty_file_with_the_schema(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    writer = StitchedParquetWriter(path, SCHEMA, compression="zstd")
    writer.add(page_file(_batch(np.random.default_rng(0), 0, 0), SCHEMA, compression="zstd"))  # a page of no rows
    writer.close()
    table = pq.read_table(path)
    assert table.num_rows == 0 and table.schema.equals(SCHEMA)


def test_the_exports_writer_skips_pages_without_rollouts(tmp_path: Path) -> None:
    """A page whose chats give no rollout reaches the writer as an empty payload (from a worker: an
    empty frame) and adds no row group."""
    from server.export.writers import ArrowEncoder, RolloutParquetWriter

    path = tmp_path / "pages.parquet"
    writer = RolloutParquetWriter(path)
    writer.write_page(ArrowEncoder().payload())  # an encoder given no chats
    writer.write_page([bytearray()])  # what the exporting process reads from a worker's empty frame
    writer.close()
    assert pq.read_table(path).num_rows == 0 and pq.ParquetFile(path).metadata.num_row_groups == 0


def test_what_is_not_one_row_group_is_refused() -> None:
    with pytest.raises(ParquetLayoutError, match="not a Parquet file"):
        split_file(b"PAR1 this is not parquet")
    buf = io.BytesIO()
    rng = np.random.default_rng(1)
    with pq.ParquetWriter(buf, SCHEMA) as writer:
        writer.write_batch(_batch(rng, 0, 3))
        writer.write_batch(_batch(rng, 3, 3))
    with pytest.raises(ParquetLayoutError, match="2 row groups"):
        split_file(buf.getvalue())
