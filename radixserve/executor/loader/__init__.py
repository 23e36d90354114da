"""Checkpoint loading: Hugging Face folders (safetensors) and GGUF files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.executor.loader.gguf_loader import load_gguf
from radixserve.executor.loader.safetensors_loader import load_safetensors, read_hf_config


@dataclass
class Checkpoint:
    """A model's config (Hugging Face dict form) and its weights by Hugging Face name."""

    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    gguf_metadata: dict[str, Any] | None = None
    gguf_tensor_types: dict[str, str] | None = None  # GGML type name by HF name (GGUF only)


def load_checkpoint(kind: str, path: Path) -> Checkpoint:
    if kind == "gguf":
        contents = load_gguf(path)
        return Checkpoint(
            contents.hf_config, contents.weights, contents.metadata, contents.tensor_types
        )
    return Checkpoint(read_hf_config(path), load_safetensors(path))
