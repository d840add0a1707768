"""Packing of token IDs and logprobs into little-endian binary columns (DESIGN D1).

Token IDs are int32, logprobs float32: 4 bytes per value, written once per message.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token IDs as little-endian int32 bytes; refuses values outside int32."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token id outside int32 range")
    return arr.astype(_INT32).tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    if not blob:
        return []
    if len(blob) % 4:
        raise ValueError(f"packed id blob has {len(blob)} bytes, not a multiple of 4")
    return np.frombuffer(blob, dtype=_INT32).astype(np.int64).tolist()  # type: ignore[no-any-return]


def pack_floats(values: Sequence[float]) -> bytes:
    """Logprobs as little-endian float32 bytes; -inf and nan survive the round trip."""
    return np.asarray(values, dtype=np.float64).astype(_FLOAT32).tobytes()


def unpack_floats(blob: bytes | None) -> list[float]:
    if not blob:
        return []
    if len(blob) % 4:
        raise ValueError(f"packed float blob has {len(blob)} bytes, not a multiple of 4")
    return np.frombuffer(blob, dtype=_FLOAT32).astype(np.float64).tolist()  # type: ignore[no-any-return]


def to_float32(values: Sequence[float]) -> list[float]:
    """Round values to float32 precision, as they will be stored, so streamed and stored agree.
    (``array``'s C float: numpy's rounding, overflow to inf included, at a fifth of its cost per step.)"""
    return array("f", values).tolist()
