"""Arrow arrays from numpy arrays and lists of Python values, by ``pa.Array.from_buffers``.

Not ``pa.array``: each process's first call imports pandas where it is installed (to look for pandas
types in the input), a quarter of a second and 50 MB in every export worker. Here the buffers are
numpy arrays (zero copy) or bytes built from the values; a None value is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa


def primitive(values: np.ndarray[Any, Any], type_: pa.DataType, valid: np.ndarray[Any, Any] | None = None) -> pa.Array:
    """A numeric array of ``values`` (their dtype is ``type_``'s), null where ``valid`` is False."""
    bitmap, nulls = _validity(valid)
    return pa.Array.from_buffers(type_, len(values), [bitmap, pa.py_buffer(np.ascontiguousarray(values))], nulls)


def lists(lengths: Sequence[int] | np.ndarray[Any, Any], items: pa.Array) -> pa.ListArray:
    """A list array: row i is the next ``lengths[i]`` of ``items``."""
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(primitive(offsets, pa.int32()), items)


def column(values: list[Any], type_: pa.DataType) -> pa.Array:
    """An array of Python values (None: null) of a string, bytes-as-string, integer, float or bool type,
    or a list, or list of lists, of integers or floats."""
    if pa.types.is_list(type_):
        return lists([len(v) for v in values], column([x for v in values for x in v], type_.value_type))
    valid = None if None not in values else np.fromiter((v is not None for v in values), bool, len(values))
    if pa.types.is_string(type_):
        return _strings(values, valid)
    if pa.types.is_boolean(type_):
        bits = np.packbits(np.fromiter((bool(v) for v in values), bool, len(values)), bitorder="little")
        bitmap, nulls = _validity(valid)
        return pa.Array.from_buffers(type_, len(values), [bitmap, pa.py_buffer(bits)], nulls)
    filled = values if valid is None else [0 if v is None else v for v in values]
    return primitive(np.fromiter(filled, _DTYPES[type_], len(values)), type_, valid)


_DTYPES = {pa.int32(): np.int32, pa.int64(): np.int64, pa.float32(): np.float32, pa.float64(): np.float64}


def _strings(values: list[str | bytes | None], valid: np.ndarray[Any, Any] | None) -> pa.Array:
    data = [b"" if v is None else v if type(v) is bytes else v.encode() for v in values]  # type: ignore[union-attr]
    offsets = np.zeros(len(data) + 1, np.int32)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    bitmap, nulls = _validity(valid)
    buffers = [bitmap, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))]
    return pa.Array.from_buffers(pa.string(), len(data), buffers, nulls)


def _validity(valid: np.ndarray[Any, Any] | None) -> tuple[pa.Buffer | None, int]:
    if valid is None:
        return None, 0
    nulls = len(valid) - int(np.count_nonzero(valid))
    return (pa.py_buffer(np.packbits(valid, bitorder="little")), nulls) if nulls else (None, 0)


def strings(offsets: bytes | None, data: bytes, valid: bytes | None) -> pa.Array:
    """A string array from its int32 offsets (None: no rows), UTF-8 data and validity bytes (one per
    row, 0 for null; None: no nulls)."""
    offsets = offsets or b"\0\0\0\0"
    n = len(offsets) // 4 - 1
    bitmap, nulls = _validity(None if valid is None else np.frombuffer(valid, bool))
    return pa.Array.from_buffers(pa.string(), n, [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)], nulls)


def booleans(values: bytes, valid: bytes | None) -> pa.Array:
    """A boolean array from one byte per row (0: false) and validity bytes (as ``strings``)."""
    bits = np.packbits(np.frombuffer(values, bool), bitorder="little")
    bitmap, nulls = _validity(None if valid is None else np.frombuffer(valid, bool))
    return pa.Array.from_buffers(pa.bool_(), len(values), [bitmap, pa.py_buffer(bits)], nulls)
