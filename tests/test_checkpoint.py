"""worker.checkpoint: a pushed checkpoint checked against the model's from safetensors headers alone."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.checkpoint import check_checkpoint, safetensors_files, tensor_shapes
from worker.engines.contract import EngineError, WeightsError

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4}
TENSORS = {"model.embed.weight": (6, 4), "model.norm.weight": (4,), "lm_head.weight": (6, 4)}


def write_checkpoint(
    path: Path,
    shapes: dict[str, tuple[int, ...]] | None = None,
    *,
    config: dict[str, object] | None = CONFIG,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    names = sorted((shapes or TENSORS).items())
    for shard in range(shards):
        part = {name: torch.zeros(shape, dtype=dtype) for name, shape in names[shard::shards]}
        save_file(part, str(path / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "base")


def refused(path: Path, base: Path) -> WeightsError:
    with pytest.raises(WeightsError) as info:
        check_checkpoint(str(path), str(base))
    assert isinstance(info.value, EngineError)  # the engines' callers see an EngineError with a code
    return info.value


def test_same_layout_passes_and_returns_shapes(tmp_path: Path, base: Path) -> None:
    new = write_checkpoint(tmp_path / "new", dtype=torch.bfloat16, shards=2)  # dtype and sharding may differ
    assert check_checkpoint(str(new), str(base)) == TENSORS
    assert len(safetensors_files(new)) == 2
    assert tensor_shapes(base) == TENSORS


def test_no_config_skips_the_architecture_check(tmp_path: Path, base: Path) -> None:
    new = write_checkpoint(tmp_path / "new", config=None)
    assert check_checkpoint(str(new), str(base)) == TENSORS


def test_missing_directory_or_a_file(tmp_path: Path, base: Path) -> None:
    assert refused(tmp_path / "absent", base).code == "weights_not_found"
    file = tmp_path / "file"
    file.write_text("x")
    assert refused(file, base).code == "weights_not_found"


def test_no_safetensors(tmp_path: Path, base: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(empty, base).code == "weights_not_safetensors"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    # Not a pickle at all: were it ever unpickled, the test would fail with an UnpicklingError instead.
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x05 never unpickled")
    (pickled / "config.json").write_text(json.dumps(CONFIG))
    error = refused(pickled, base)
    assert error.code == "weights_not_safetensors"
    assert "pytorch_model.bin" in str(error) and "never loaded" in str(error)


def _framed(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize(
    "content",
    [
        b"\x01\x02",  # shorter than the 8-byte header length
        struct.pack("<Q", 1 << 40) + b"{}",  # a header length beyond safetensors' bound
        _framed(b"{not json}"),  # a header that is not JSON
        _framed(b"\xff\xfe{}"),  # nor UTF-8
        _framed(b"[]"),  # JSON, but not a table of tensors
        struct.pack("<Q", 100) + b'{"a": 1}',  # a header longer than the file
        _framed(b'{"a": {"dtype": "F32"}}'),  # an entry without shape and offsets
        _framed(b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}'),  # a negative dimension
    ],
    ids=["short", "huge-header", "not-json", "not-utf8", "not-a-table", "header-past-end", "bad-entry", "negative"],
)
def test_corrupt_header(tmp_path: Path, base: Path, content: bytes) -> None:
    new = write_checkpoint(tmp_path / "new")
    (new / "model-00001-of-00001.safetensors").write_bytes(content)
    error = refused(new, base)
    assert error.code == "weights_not_safetensors", error


def test_truncated_data(tmp_path: Path, base: Path) -> None:
    """A header whose byte ranges run past the end of the file (a copy cut short) is refused before any
    engine starts reading the tensors."""
    new = write_checkpoint(tmp_path / "new")
    file = new / "model-00001-of-00001.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-8])
    error = refused(new, base)
    assert error.code == "weights_not_safetensors" and "truncated" in str(error)


def test_wrong_byte_count_for_the_shape(tmp_path: Path, base: Path) -> None:
    new = tmp_path / "new"
    new.mkdir()
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (new / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    assert refused(new, base).code == "weights_not_safetensors"


def test_wrong_shape_missing_and_extra_tensors(tmp_path: Path, base: Path) -> None:
    shape = write_checkpoint(tmp_path / "shape", {**TENSORS, "lm_head.weight": (5, 4)})
    error = refused(shape, base)
    assert error.code == "weights_mismatch" and "lm_head.weight" in str(error) and "[5, 4]" in str(error)
    missing = write_checkpoint(tmp_path / "missing", {k: v for k, v in TENSORS.items() if k != "model.norm.weight"})
    error = refused(missing, base)
    assert error.code == "weights_mismatch" and "missing 'model.norm.weight'" in str(error)
    extra = write_checkpoint(tmp_path / "extra", {**TENSORS, "model.extra": (2,)})
    error = refused(extra, base)
    assert error.code == "weights_mismatch" and "unexpected 'model.extra'" in str(error)


def test_many_differences_are_summarised(tmp_path: Path, base: Path) -> None:
    other = write_checkpoint(tmp_path / "other", {f"t{i}": (1,) for i in range(9)})
    error = refused(other, base)
    assert error.code == "weights_mismatch" and "more)" in str(error)


def test_tensor_in_two_files(tmp_path: Path, base: Path) -> None:
    new = write_checkpoint(tmp_path / "new")
    save_file({"model.norm.weight": torch.zeros(4)}, str(new / "extra.safetensors"))
    error = refused(new, base)
    assert error.code == "weights_mismatch" and "more than one file" in str(error)


def test_another_architecture(tmp_path: Path, base: Path) -> None:
    other = write_checkpoint(tmp_path / "other", config={**CONFIG, "model_type": "gpt_neox"})
    error = refused(other, base)
    assert error.code == "weights_mismatch" and "gpt_neox" in str(error)
    arch = write_checkpoint(tmp_path / "arch", config={**CONFIG, "architectures": ["LlamaForSequenceClassification"]})
    assert refused(arch, base).code == "weights_mismatch"


def test_config_that_is_not_json(tmp_path: Path, base: Path) -> None:
    new = write_checkpoint(tmp_path / "new")
    (new / "config.json").write_text("{not json")
    assert refused(new, base).code == "weights_mismatch"
    (new / "config.json").write_text("[1, 2]")
    assert refused(new, base).code == "weights_mismatch"


@contextmanager
def unreadable(path: Path) -> Iterator[None]:
    mode = path.stat().st_mode
    path.chmod(0)
    try:
        yield
    finally:
        path.chmod(mode)


def _chmod_stops_reads(path: Path) -> bool:
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            path.read_bytes()
    except PermissionError:
        return True
    return False  # root (CAP_DAC_OVERRIDE) reads it anyway


def test_unreadable_directory(tmp_path: Path, base: Path) -> None:
    new = write_checkpoint(tmp_path / "new")
    with unreadable(new):
        if not _chmod_stops_reads(new):
            pytest.skip("chmod does not stop this user (root) from reading")
        error = refused(new, base)
    assert error.code == "weights_not_found" and "cannot be read" in str(error)


def test_unreadable_file(tmp_path: Path, base: Path) -> None:
    new = write_checkpoint(tmp_path / "new")
    file = new / "model-00001-of-00001.safetensors"
    with unreadable(file):
        if not _chmod_stops_reads(file):
            pytest.skip("chmod does not stop this user (root) from reading")
        error = refused(new, base)
    assert error.code == "weights_not_found" and "cannot be read" in str(error)
