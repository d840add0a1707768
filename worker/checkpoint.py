"""Checking a pushed checkpoint before any engine touches it.

A weights push names a directory in the model's own layout: Hugging Face safetensors, the same tensor
names and shapes as the checkpoint the worker started from, and (when it has a ``config.json``) the same
architecture. Only safetensors headers are read here (a JSON table; no tensor data, no pickle: a
checkpoint must never run code), so the check is cheap and the same for every engine. A failed check
raises ``WeightsError`` and changes nothing.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import Any

from shared.errors import ErrorCode
from worker.engines.contract import WeightsError

__all__ = ["check_checkpoint", "matched_tensors", "safetensors_files", "tensor_shapes"]

log = logging.getLogger(__name__)

_PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own bound on the JSON header
_SHOWN = 5  # differences named in an error
# Bytes per element of safetensors' dtypes (the sub-byte float formats are left out: not checked).
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of checkpoint directory ``path`` (shards included), sorted."""
    root = Path(path)
    try:
        if not root.is_dir():
            raise WeightsError(ErrorCode.weights_not_found, f"{path} is not a directory")
        # os.listdir, not Path.glob: glob answers an unreadable directory with no matches
        names = sorted(os.listdir(root))
    except PermissionError as exc:
        raise WeightsError(ErrorCode.weights_not_found, f"{path} cannot be read: {exc.strerror}") from exc
    except OSError as exc:
        raise WeightsError(ErrorCode.weights_not_found, f"{path} cannot be read: {exc}") from exc
    files = [root / n for n in names if n.endswith(".safetensors") and not (root / n).is_dir()]
    pickles = [n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in _PICKLES)]
    if not files:
        found = f" (it holds {', '.join(pickles[:_SHOWN])}: pickled weights are never loaded)" if pickles else ""
        raise WeightsError(ErrorCode.weights_not_safetensors, f"{path} holds no *.safetensors file{found}")
    return files


def _header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from one safetensors file's header, whose byte ranges must fit the file
    (a truncated or corrupt file fails here, not half-way through an engine's load)."""
    try:
        with file.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise ValueError(f"header of {size} bytes")
            head = f.read(size)
            if len(head) != size:
                raise ValueError(f"a header of {size} bytes in a shorter file")
            table = json.loads(head)
            data_size = os.fstat(f.fileno()).st_size - 8 - size
    except PermissionError as exc:
        raise WeightsError(ErrorCode.weights_not_found, f"{file} cannot be read: {exc.strerror}") from exc
    except (OSError, ValueError) as exc:
        raise WeightsError(ErrorCode.weights_not_safetensors, f"{file} is not a safetensors file: {exc}") from exc
    if not isinstance(table, dict):
        raise WeightsError(ErrorCode.weights_not_safetensors, f"{file} is not a safetensors file")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(ErrorCode.weights_not_safetensors, f"{file}: bad header entry for {name!r}") from exc
        itemsize = _ITEMSIZE.get(dtype)
        if (
            any(d < 0 for d in shape)
            or not 0 <= start <= end <= data_size
            or (itemsize is not None and end - start != math.prod(shape) * itemsize)
        ):
            raise WeightsError(
                ErrorCode.weights_not_safetensors,
                f"{file}: {name!r} ({dtype} {list(shape)}, bytes {start}-{end}) does not fit the file's "
                f"{data_size} data bytes (truncated or corrupt)",
            )
        out[name] = (dtype, shape)
    return out


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of checkpoint directory ``path`` with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        for name, (_, shape) in _header(file).items():
            if name in shapes:
                raise WeightsError(ErrorCode.weights_mismatch, f"{name!r} is in more than one file of {path}")
            shapes[name] = shape
    return shapes


def _architecture(path: str | Path) -> tuple[str | None, tuple[str, ...]]:
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        return None, ()
    except (OSError, ValueError) as exc:
        raise WeightsError(ErrorCode.weights_mismatch, f"{config} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise WeightsError(ErrorCode.weights_mismatch, f"{config} is not a JSON object")
    arch = data.get("architectures") or ()
    return data.get("model_type"), tuple(str(a) for a in arch) if isinstance(arch, list) else ()


def check_checkpoint(path: str, base: str) -> dict[str, tuple[int, ...]]:
    """Check checkpoint directory ``path`` against ``base`` (the checkpoint the engine started from);
    returns its tensors' shapes, or raises ``WeightsError``. Dtypes may differ (the engine casts)."""
    new = tensor_shapes(path)
    old = tensor_shapes(base)
    new_type, new_arch = _architecture(path)
    old_type, old_arch = _architecture(base)
    if new_type is not None and old_type is not None and (new_type, new_arch) != (old_type, old_arch):
        raise WeightsError(
            ErrorCode.weights_mismatch,
            f"{path} is a {new_type} {list(new_arch)}, the model a {old_type} {list(old_arch)}",
        )
    problems = [f"missing {n!r}" for n in sorted(old.keys() - new.keys())]
    problems += [f"unexpected {n!r}" for n in sorted(new.keys() - old.keys())]
    problems += [
        f"{n!r} has shape {list(new[n])}, the model {list(old[n])}"
        for n in sorted(old.keys() & new.keys())
        if new[n] != old[n]
    ]
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise WeightsError(
            ErrorCode.weights_mismatch,
            f"{path} does not fit the model: {'; '.join(problems[:_SHOWN])}{more}",
        )
    return new


def matched_tensors(model: Any, path: str | Path) -> list[tuple[Any, Any]]:
    """Read checkpoint directory ``path`` with safetensors (never pickle) and pair each tensor with the
    parameter or persistent buffer of ``model`` (a torch module) it replaces, by name. Tied weights are
    one tensor under several names, of which a checkpoint saved with ``save_pretrained`` keeps one; names
    the model does not have are skipped, as ``from_pretrained`` skips them. Raises ``WeightsError``
    (``weights_load_failed``) naming shape mismatches and parameters left without a value; touches no
    parameter, so a failure changes nothing."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in safetensors_files(path):
            tensors.update(load_file(str(file), device="cpu"))
    except WeightsError:
        raise
    except Exception as exc:  # a file that passed the header check but cannot be read
        raise WeightsError(ErrorCode.weights_load_failed, f"cannot read the checkpoint {path}: {exc}") from exc
    targets = model.state_dict(keep_vars=True)
    skipped = sorted(tensors.keys() - targets.keys())
    if skipped:
        log.info("checkpoint %s: %d tensors the model does not have: %s", path, len(skipped), skipped[:_SHOWN])
    problems = [
        f"{name!r} has shape {list(tensor.shape)}, the model's {list(targets[name].shape)}"
        for name, tensor in sorted(tensors.items())
        if name in targets and tensor.shape != targets[name].shape
    ]
    covered = {id(targets[name]) for name in tensors if name in targets}
    problems += [
        f"nothing for parameter {name!r}"
        for name, target in targets.items()
        if isinstance(target, torch.nn.Parameter) and id(target) not in covered
    ]
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise WeightsError(
            ErrorCode.weights_load_failed,
            f"{path} cannot be loaded into the model by name: {'; '.join(problems[:_SHOWN])}{more}",
        )
    return [(targets[name], tensor) for name, tensor in tensors.items() if name in targets]
