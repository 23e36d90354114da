"""RMSNorm weights as the models store them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fold_one_plus(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by ``(1 + w)``: fold the 1 in at load time, so every norm
    of every family is ``rms_norm(x) * w`` and runs through the same kernels. Computed in
    float32, then cast back (what Gemma's own ``(1 + w.float())`` computes)."""
    return (1.0 + weight.float()).to(weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (a per-head norm of [T, heads, d] included), in float32
    for low-precision inputs, returned in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
