"""The decoder layer's row-wise ops on CUDA, as fused Triton kernels."""

from __future__ import annotations

import torch

from radixserve.executor.cuda import kernels
from radixserve.executor.layer_ops import LayerOps


class TritonLayerOps(LayerOps):
    """``LayerOps`` with each op one Triton kernel: add + RMSNorm in one pass over the row
    (the residual updated in place), SiLU-and-multiply, and rotary embedding in place.

    Invariant: computes the same functions as ``LayerOps(use_native=False)`` (float32
    accumulation; results in the input dtype)."""

    def __init__(self) -> None:
        super().__init__(use_native=False)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x.contiguous())

    def add_rms_norm(
        self, add: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return kernels.add_rms_norm(
            None if add is None else add.contiguous(), residual, weight, eps
        )

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            return super().rotary(x, cos, sin_signed)
        return kernels.rotary(x, cos, sin_signed)
