"""Reading a checkpoint directory's files, with errors that name the file: both models' loaders use these."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open

from stepops.specs import is_int


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``ValueError`` naming the file for invalid JSON or another value."""
    try:
        value = json.loads(path.read_bytes())  # UTF-8, -16 or -32, as the JSON standard allows
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def transformers_weight_files(directory: Path) -> list[Path] | None:
    """The safetensors files transformers' ``from_pretrained`` reads from ``directory``: ``model.safetensors``
    when there is one, else the shards ``model.safetensors.index.json`` lists; ``None`` when neither is there.
    A directory saved again in the other format keeps the old files: the others are not read."""
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"]
    if not index.exists():
        return None
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no weight_map object (expected the index save_pretrained writes)")
    not_names = [(key, name) for key, name in weight_map.items() if not isinstance(name, str) or not name]
    if not_names:
        key, name = not_names[0]
        raise ValueError(f"{index}: weight_map[{key!r}] must name a safetensors file, got {name!r}")
    return [directory / name for name in sorted(set(weight_map.values()))]


class SafetensorsCheckpoint:
    """The tensors of a checkpoint's safetensors ``files``, read one at a time. Opening reads only the files'
    headers, so a loader can check every name, shape and dtype (:meth:`metadata`) before it allocates
    anything, then read the tensors (:meth:`read`) and copy them into the model one by one: what a tensor is
    made into on the way (another dtype, a fused or sliced copy) lives only until it is copied, never a
    whole checkpoint of such copies beside the model. (A read tensor maps its file: its pages are read when
    it is first used, and are the kernel's to reclaim.) ``ValueError`` naming the file for one that is not
    safetensors (read at opening), and naming a tensor that two of the files hold. Use it in a ``with``
    block, which closes the files' handles when it ends."""

    def __init__(self, files: list[Path]) -> None:
        self._handles: list[Any] = []  # safe_open handles, one per file
        self._file_of: dict[str, int] = {}  # tensor name -> its file's index
        for index, file in enumerate(files):
            try:
                self._handles.append(safe_open(str(file), framework="pt"))
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{file}: not a readable safetensors file ({error})") from None
            for key in self._handles[index].keys():
                if key in self._file_of:
                    raise ValueError(f"{key} is in more than one file of {file.parent}")
                self._file_of[key] = index

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the files' handles (a tensor already read keeps its own mapping of its file)."""
        self._handles.clear()

    def keys(self) -> list[str]:
        """Every tensor name, file by file in each file's order."""
        return list(self._file_of)

    def metadata(self, key: str) -> torch.Tensor:
        """Tensor ``key``'s shape and dtype as a meta tensor, from the file's header: no data read (a 0-dim
        tensor, a single value, is read to learn its dtype as safetensors converts it)."""
        handle = self._handles[self._file_of[key]]
        tensor_slice = handle.get_slice(key)
        shape = tensor_slice.get_shape()
        # An empty slice reads no data, and has the dtype read() gives.
        dtype = (tensor_slice[:0] if shape else self.read(key)).dtype
        return torch.empty(shape, dtype=dtype, device="meta")

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key``, on the CPU (opening checked the file's header, its offsets against its size)."""
        return self._handles[self._file_of[key]].get_tensor(key)


def read_safetensors_files(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` (as :class:`SafetensorsCheckpoint` reads them: memory-mapped, so a tensor's
    pages are read from the file when it is first used)."""
    with SafetensorsCheckpoint(files) as checkpoint:
        return {key: checkpoint.read(key) for key in checkpoint.keys()}


Config = TypeVar("Config")  # a model config dataclass with output_vocab_size and eos_token_ids


def with_eos_token_ids(config: Config, eos_token_id: object, where: str) -> Config:
    """``config`` with a checkpoint's ``eos_token_id`` (``None``, one id or a list of ids) as its
    ``eos_token_ids``. ``TypeError`` naming ``where`` for another value. An id the model cannot emit (outside
    its vocabulary, or in an Inkling head's padding) never ends a sequence: it is left out with a warning, as
    transformers keeps it with one."""
    ids = [] if eos_token_id is None else eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    if not all(is_int(token) for token in ids):
        raise TypeError(f"{where}: eos_token_id must be null, a token id or a list of them, got {eos_token_id!r}")
    end = config.output_vocab_size
    emitted = tuple(token for token in ids if 0 <= token < end)
    if len(emitted) < len(ids):
        never = [token for token in ids if token not in emitted]
        warnings.warn(f"{where}: eos_token_id {never} outside [0, {end}) (the ids the model emits) is ignored", stacklevel=3)
    return dataclasses.replace(config, eos_token_ids=emitted)
