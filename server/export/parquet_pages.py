"""Parquet files made of row groups that were written apart: export workers compress, one file results.

A worker writes its page as a whole Parquet file of one row group in memory (``page_file``) and hands
over its column chunks, which hold no absolute position, with the row group's metadata as a template
(``RowGroupTemplate``): the Thrift-encoded ``RowGroup`` with its file offsets left open. The writing
side (``StitchedParquetWriter``) appends the chunks to its file, fills the offsets in for where they
landed and ends the file with one footer listing every row group. The bytes of a chunk, its page
headers and statistics are the worker's as pyarrow wrote them; only offsets and counts change.

The footer is Thrift's compact protocol (parquet-format's ``parquet.thrift``): a struct is a run of
fields, each a header byte (the field id as a delta from the previous one, and the type) and a
value; integers are zigzag varints. Only the fields that hold offsets are read; everything else is
copied as bytes, so fields this module does not know pass through unchanged.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"PAR1"

# compact protocol types
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
_FIXED = {_TRUE: 0, _FALSE: 0, _BYTE: 1, _DOUBLE: 8}

# parquet.thrift field ids
_FILE_NUM_ROWS, _FILE_ROW_GROUPS = 3, 4
_GROUP_COLUMNS, _GROUP_FILE_OFFSET, _GROUP_ORDINAL = 1, 5, 7
_CHUNK_OFFSETS = frozenset({2, 4, 6})  # file_offset, offset_index_offset, column_index_offset
_CHUNK_META = 3
_META_OFFSETS = frozenset({9, 10, 11, 14})  # data, index, dictionary page, bloom filter offsets


class ParquetLayoutError(ValueError):
    """A footer this module cannot take apart (not one row group, or not compact Thrift)."""


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 70:
            raise ParquetLayoutError("a varint longer than 10 bytes")


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _zigzag(value: int) -> int:
    return (value << 1) ^ (value >> 63)


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _skip(buf: bytes | memoryview, pos: int, kind: int) -> int:
    if kind in _FIXED:
        return pos + _FIXED[kind]
    if kind in (_I16, _I32, _I64):
        return _varint(buf, pos)[1]
    if kind == _BINARY:
        size, pos = _varint(buf, pos)
        return pos + size
    if kind in (_LIST, _SET):
        size, item, pos = _list_header(buf, pos)
        for _ in range(size):
            pos = pos + 1 if item in (_TRUE, _FALSE) else _skip(buf, pos, item)
        return pos
    if kind == _MAP:
        size, pos = _varint(buf, pos)
        if size:
            types = buf[pos]
            pos += 1
            for _ in range(size):
                pos = _skip(buf, _skip(buf, pos, types >> 4), types & 0x0F)
        return pos
    if kind == _STRUCT:
        return _fields(buf, pos)[1]
    raise ParquetLayoutError(f"unknown compact type {kind}")


def _list_header(buf: bytes | memoryview, pos: int) -> tuple[int, int, int]:
    head = buf[pos]
    pos += 1
    size = head >> 4
    if size == 15:
        size, pos = _varint(buf, pos)
    return size, head & 0x0F, pos


def _list_header_bytes(size: int, item: int) -> bytes:
    return bytes([size << 4 | item]) if size < 15 else bytes([0xF0 | item]) + _put_varint(size)


Field = tuple[int, int, int, int]  # id, type, start and end of its value


def _fields(buf: bytes | memoryview, pos: int) -> tuple[list[Field], int]:
    """The fields of the struct at ``pos``; and the position after its end."""
    out: list[Field] = []
    fid = 0
    while True:
        head = buf[pos]
        pos += 1
        kind = head & 0x0F
        if kind == _STOP:
            return out, pos
        if head >> 4:
            fid += head >> 4
        else:
            raw, pos = _varint(buf, pos)
            fid = _unzigzag(raw)
        end = _skip(buf, pos, kind)
        out.append((fid, kind, pos, end))
        pos = end


def _field_header(fid: int, kind: int, last: int) -> bytes:
    if 0 < fid - last <= 15:
        return bytes([(fid - last) << 4 | kind])
    return bytes([kind]) + _put_varint(_zigzag(fid))


class _Template:
    """Bytes with file positions left open (slots)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = [b""]
        self.values: list[int] = []

    def raw(self, data: bytes | memoryview) -> None:
        self.parts[-1] += bytes(data)

    def offset(self, value: int) -> None:
        """A file position: a slot; 0 (an unset offset, as pyarrow writes the deprecated
        ``ColumnChunk.file_offset``) stays 0."""
        if value == 0:
            self.raw(b"\x00")
            return
        self.values.append(value)
        self.parts.append(b"")


def _copy_struct(
    buf: memoryview, fields: list[Field], out: _Template, offsets: frozenset[int], nested: dict[int, Any]
) -> None:
    last = 0
    for fid, kind, start, end in fields:
        out.raw(_field_header(fid, kind, last))
        last = fid
        if fid in offsets and kind == _I64:
            out.offset(_unzigzag(_varint(buf, start)[0]))
        elif fid in nested:
            nested[fid](buf, kind, start, out)
        else:
            out.raw(buf[start:end])
    out.raw(b"\x00")


def _column_meta(buf: memoryview, kind: int, start: int, out: _Template) -> None:
    if kind != _STRUCT:
        raise ParquetLayoutError("ColumnChunk.meta_data is not a struct")
    _copy_struct(buf, _fields(buf, start)[0], out, _META_OFFSETS, {})


def _column_chunks(buf: memoryview, kind: int, start: int, out: _Template) -> None:
    size, item, pos = _list_header(buf, start)
    if kind != _LIST or item != _STRUCT:
        raise ParquetLayoutError("RowGroup.columns is not a list of structs")
    out.raw(buf[start:pos])
    for _ in range(size):
        fields, pos = _fields(buf, pos)
        _copy_struct(buf, fields, out, _CHUNK_OFFSETS, {_CHUNK_META: _column_meta})


@dataclass(frozen=True)
class RowGroupTemplate:
    """A row group's Thrift ``RowGroup`` with its offsets as slots, relative to its first chunk."""

    parts: tuple[bytes, ...]  # one more than values
    values: tuple[int, ...]
    rows: int

    def render(self, at: int) -> bytes:
        """The ``RowGroup`` struct for chunks that start at file position ``at``."""
        out = [self.parts[0]]
        for value, part in zip(self.values, self.parts[1:], strict=True):
            out += (_put_varint(_zigzag(value + at)), part)
        return b"".join(out)


@dataclass(frozen=True)
class PageFile:
    """A worker's page: its column chunks, its row group's template, and the file's other metadata."""

    chunks: memoryview
    group: RowGroupTemplate
    file_fields: tuple[tuple[int, int, bytes], ...]  # FileMetaData's fields but num_rows, row_groups

    def payload(self) -> list[Any]:
        """As bytes-like chunks: a header with the sizes, the column chunks, then the rest pickled."""
        rest = pickle.dumps((self.group, self.file_fields), protocol=pickle.HIGHEST_PROTOCOL)
        return [_SIZES.pack(len(self.chunks), len(rest)), self.chunks, rest]

    @staticmethod
    def from_payload(data: bytes | bytearray | memoryview) -> PageFile:
        view = memoryview(data)
        size, rest = _SIZES.unpack_from(view)
        start = _SIZES.size
        group, file_fields = pickle.loads(view[start + size : start + size + rest])
        return PageFile(view[start : start + size], group, file_fields)


_SIZES = struct.Struct("<QQ")


def split_file(data: bytes | memoryview) -> PageFile:
    """A whole Parquet file of exactly one row group -> its chunks and metadata."""
    view = memoryview(data).cast("B")  # (pyarrow's buffers have format "b": signed)
    fields, footer_start = _footer(view)
    by_id = {fid: (kind, start, end) for fid, kind, start, end in fields}
    if _FILE_ROW_GROUPS not in by_id:
        raise ParquetLayoutError("no row_groups in the footer")
    kind, start, _ = by_id[_FILE_ROW_GROUPS]
    size, item, pos = _list_header(view, start)
    if kind != _LIST or item != _STRUCT or size != 1:
        raise ParquetLayoutError(f"{size} row groups: a page file holds one")
    group_fields, _ = _fields(view, pos)
    out = _Template()
    rows = -1
    last = 0
    for fid, fkind, fstart, fend in group_fields:
        if fid == _GROUP_ORDINAL:  # optional; the row group's index in its file: this file's is not the export's
            continue
        out.raw(_field_header(fid, fkind, last))
        last = fid
        if fid == _GROUP_COLUMNS:
            _column_chunks(view, fkind, fstart, out)
        elif fid == _GROUP_FILE_OFFSET and fkind == _I64:
            out.offset(_unzigzag(_varint(view, fstart)[0]))
        else:
            if fid == 3 and fkind == _I64:  # num_rows
                rows = _unzigzag(_varint(view, fstart)[0])
            out.raw(view[fstart:fend])
    out.raw(b"\x00")
    if rows < 0:
        raise ParquetLayoutError("a row group without num_rows")
    # slot values relative to the first chunk, which the file has at position len(MAGIC)
    group = RowGroupTemplate(tuple(out.parts), tuple(v - len(MAGIC) for v in out.values), rows)
    return PageFile(view[len(MAGIC) : footer_start], group, file_fields(view))


def empty_file(schema: Any, **options: Any) -> bytes:
    """The Parquet file pyarrow writes for ``schema`` with ``options`` and no rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.ParquetWriter(sink, schema, **options).close()
    return bytes(sink.getvalue())


def file_fields(data: bytes | memoryview) -> tuple[tuple[int, int, bytes], ...]:
    """A Parquet file's footer fields but ``num_rows`` and ``row_groups`` (``PageFile.file_fields``)."""
    view = memoryview(data).cast("B")
    fields, _ = _footer(view)
    return tuple((fid, k, bytes(view[s:e])) for fid, k, s, e in fields if fid not in (_FILE_NUM_ROWS, _FILE_ROW_GROUPS))


def _footer(view: memoryview) -> tuple[list[Field], int]:
    """The fields of a Parquet file's footer (``FileMetaData``), and where it starts."""
    if len(view) < 12 or view[:4] != MAGIC or view[-4:] != MAGIC:
        raise ParquetLayoutError("not a Parquet file")
    (footer_len,) = struct.unpack_from("<I", view, len(view) - 8)
    start = len(view) - 8 - footer_len
    return _fields(view, start)[0], start


def leaf_columns(data: bytes) -> list[tuple[str, str, int, int]]:
    """A Parquet file's leaf columns: (dotted path, physical type, max definition, max repetition level)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pq.ParquetFile(pa.BufferReader(data)).schema
    columns = (schema.column(i) for i in range(len(schema)))
    return [(c.path, c.physical_type, c.max_definition_level, c.max_repetition_level) for c in columns]


def page_file(batch: Any, schema: Any, **options: Any) -> PageFile:
    """``batch`` written as a Parquet file of one row group (``pyarrow.parquet.ParquetWriter`` with
    ``options``), taken apart."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema, **options) as writer:
        writer.write_batch(batch, row_group_size=max(1, batch.num_rows))
    return split_file(memoryview(sink.getvalue()))


class StitchedParquetWriter:
    """Appends ``PageFile``s to one Parquet file, a row group each; ``close`` writes the footer."""

    def __init__(self, path: Path, schema: Any, **options: Any) -> None:
        self._path, self._schema, self._options = path, schema, options
        self._fh: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._fh.write(MAGIC)
        self._pos = len(MAGIC)
        self._groups: list[bytes] = []
        self._rows = 0
        self._file_fields: tuple[tuple[int, int, bytes], ...] | None = None

    def add(self, page: PageFile) -> None:
        if not page.group.rows:
            return
        self._fh.write(page.chunks)
        self._groups.append(page.group.render(self._pos))
        self._pos += len(page.chunks)
        self._rows += page.group.rows
        if self._file_fields is None:
            self._file_fields = page.file_fields

    def close(self) -> None:
        if self._fh.closed:
            return
        if self._file_fields is None:  # no rows: pyarrow's own empty file, with the schema
            self._fh.seek(0)
            self._fh.write(empty_file(self._schema, **self._options))
            self._fh.close()
            return
        fields = [(fid, kind, value) for fid, kind, value in self._file_fields]
        fields.append((_FILE_NUM_ROWS, _I64, _put_varint(_zigzag(self._rows))))
        groups = _list_header_bytes(len(self._groups), _STRUCT) + b"".join(self._groups)
        fields.append((_FILE_ROW_GROUPS, _LIST, groups))
        footer: list[bytes] = []
        last = 0
        for fid, kind, value in sorted(fields, key=lambda f: f[0]):
            footer += (_field_header(fid, kind, last), value)
            last = fid
        footer.append(b"\x00")
        data = b"".join(footer)
        self._fh.write(data + struct.pack("<I", len(data)) + MAGIC)
        self._fh.close()
