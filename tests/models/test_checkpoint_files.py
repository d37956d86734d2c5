"""stepops.models.checkpoint_files: the safetensors reader both models' loaders use."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from stepops.models.checkpoint_files import SafetensorsCheckpoint

TENSORS = {
    "matrix": torch.randn(3, 4).bfloat16(),
    "scalar": torch.tensor(2.5, dtype=torch.float64),  # 0-dim: its metadata is read
    "empty": torch.zeros(0, 5),
    "codes": torch.randn(4, 8).to(torch.float8_e4m3fn),
    "ids": torch.arange(6).view(2, 3),
}


@pytest.fixture
def files(tmp_path):
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    save_file({k: TENSORS[k] for k in ("matrix", "scalar")}, first)
    save_file({k: TENSORS[k] for k in ("empty", "codes", "ids")}, second)
    return [first, second]


def test_metadata_is_the_shape_and_dtype_of_what_read_gives(files):
    """The loaders check a checkpoint on the metadata, then copy what read() gives: the two must agree."""
    with SafetensorsCheckpoint(files) as checkpoint:
        assert sorted(checkpoint.keys()) == sorted(TENSORS)
        for key, saved in TENSORS.items():
            metadata, tensor = checkpoint.metadata(key), checkpoint.read(key)
            assert metadata.is_meta
            assert (metadata.shape, metadata.dtype) == (saved.shape, saved.dtype), key
            assert torch.equal(tensor.reshape(-1).view(torch.uint8), saved.reshape(-1).view(torch.uint8)), key  # fp8 too


def test_a_tensor_read_outlives_the_checkpoint(files):
    with SafetensorsCheckpoint(files) as checkpoint:
        matrix = checkpoint.read("matrix")
    assert torch.equal(matrix, TENSORS["matrix"])


def test_a_name_in_two_files_is_an_error_naming_it(files, tmp_path):
    save_file({"ids": TENSORS["ids"]}, tmp_path / "third.safetensors")
    with pytest.raises(ValueError, match=r"ids is in more than one file of"):
        SafetensorsCheckpoint([*files, tmp_path / "third.safetensors"])
