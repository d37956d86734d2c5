"""Reading a checkpoint directory's files, with errors that name the file: both models' loaders use these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


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
