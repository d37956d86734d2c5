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
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, on the CPU; ``ValueError`` naming the file if it is unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None


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


def read_safetensors_files(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files``; ``ValueError`` naming a tensor that two of them hold."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in read_safetensors_file(file).items():
            if key in tensors:
                raise ValueError(f"{key} is in more than one file of {file.parent}")
            tensors[key] = tensor
    return tensors


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
