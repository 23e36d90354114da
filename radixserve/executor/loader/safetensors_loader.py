"""Weights and config of a Hugging Face model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: not a Hugging Face model folder")
    return read_json(path)


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those named by model.safetensors.index.json, else every
    *.safetensors in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that do not exist: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    return files


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            weights.update(load_file(path))
        except (SafetensorError, OSError) as exc:
            raise ValueError(
                f"cannot read {path}: corrupt or not a safetensors file ({exc})"
            ) from None
    return weights
