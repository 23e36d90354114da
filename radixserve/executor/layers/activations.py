"""Gated activations over a fused [T, 2d] gate/up projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh(x[:, :d]) * x[:, d:] (GeGLU, Gemma), computed in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# hidden_act names of config.json that a gated MLP accepts, besides silu (the LayerOps kernel)
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}
