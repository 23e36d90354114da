"""Checkpoint loading: Hugging Face folders (safetensors) and GGUF files."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # dense layers built from a GGUF file's codes, by the HF name of their group's first tensor
    gguf_linears: dict[str, Any] = field(default_factory=dict)


def load_checkpoint(kind: str, path: Path, codes: bool = False) -> Checkpoint:
    """``codes`` (GGUF): dense layers straight from the file's codes (``load_gguf``)."""
    if kind == "gguf":
        contents = load_gguf(path, codes=codes)
        return Checkpoint(
            contents.hf_config,
            contents.weights,
            contents.metadata,
            contents.tensor_types,
            contents.linears,
        )
    return Checkpoint(read_hf_config(path), load_safetensors(path))
