"""Row-wise decoder-layer ops: SiLU-and-multiply (and GeGLU), RMSNorm with the residual add
folded in (and per head), and rotary embeddings (in place).

Each uses the fused C kernel (``native/elementwise.c``) for contiguous CPU tensors in
bfloat16 or float32, and plain PyTorch otherwise; both compute the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.executor.layers.norms import rms_norm
from radixserve.executor.native import load_elementwise
from radixserve.executor.rotary import apply_rotary

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _threads(rows: int) -> int:
    """Threads for a kernel that parallelises over ``rows``: no more than rows (one row,
    one thread: no other thread woken to do nothing; each row's result is the same on any
    count)."""
    return max(1, min(rows, torch.get_num_threads()))


class LayerOps:
    """Invariant: ``add_rms_norm`` leaves ``residual + add`` in ``residual`` (in place) and
    returns its RMS-normalised rows times ``weight``; ``silu_and_mul`` maps [T, 2d] to
    [T, d]; ``rotary`` rotates [T, heads, d] by ``RotaryEmbedding`` tables (a subclass may
    do it in place and return its input). ``use_native=False`` forces the PyTorch path."""

    def __init__(self, use_native: bool = True) -> None:
        self.native = load_elementwise() if use_native else None
        # (name, dtype) -> the C function: resolved once (a decode step makes ~150 calls, so
        # per-call lookups and checks are a visible part of a one-request step)
        self._fns: dict[tuple[str, torch.dtype], object] = {}
        if self.native is not None:
            for name in ("silu_and_mul", "add_rms_norm", "rotary"):
                for dtype, suffix in _SUFFIX.items():
                    self._fns[name, dtype] = getattr(self.native, f"{name}_{suffix}")
            if self.native.has_gelu_tanh_and_mul():
                self._fns["gelu_tanh_and_mul", torch.bfloat16] = self.native.gelu_tanh_and_mul_bf16

    def _kernel(self, name: str, *tensors: torch.Tensor):
        fn = self._fns.get((name, tensors[0].dtype))
        if fn is None:
            return None
        dtype = tensors[0].dtype
        for t in tensors:
            if not t.is_contiguous() or t.dtype != dtype or not t.is_cpu:
                return None
        return fn

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[:, :d]) * x[:, d:] for x [T, 2d]."""
        kernel = self._kernel("silu_and_mul", x)
        if kernel is None:
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        rows, width = x.shape
        out = x.new_empty(rows, width // 2)
        kernel(x.data_ptr(), out.data_ptr(), rows, width // 2, _threads(rows))
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """gelu_pytorch_tanh(x[:, :d]) * x[:, d:] for x [T, 2d] (GeGLU: Gemma)."""
        kernel = self._kernel("gelu_tanh_and_mul", x)
        if kernel is None:
            gate, up = x.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        rows, width = x.shape
        out = x.new_empty(rows, width // 2)
        kernel(x.data_ptr(), out.data_ptr(), rows, width // 2, _threads(rows))
        return out

    def rms_norm_heads(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of [T, heads, d] (per-head q and k norms), in float32,
        returned contiguous in x's dtype (x may be a view into a fused qkv row)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # a copy when x is a view
        if self._kernel("add_rms_norm", rows, weight) is None:
            return rms_norm(x, weight, eps)
        return self.add_rms_norm(None, rows, weight, eps).view(x.shape)

    def add_rms_norm(
        self, add: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += add`` (skipped when ``add`` is None), then RMSNorm(residual)."""
        tensors = (residual, weight) if add is None else (residual, weight, add)
        kernel = self._kernel("add_rms_norm", *tensors)
        if kernel is None:
            if add is not None:
                residual.add_(add)
            return F.rms_norm(residual, (residual.shape[-1],), weight, eps)
        rows, width = residual.shape
        out = torch.empty_like(residual)
        kernel(
            None if add is None else add.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            width,
            eps,
            _threads(rows),
        )
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``x`` [T, heads, d] rotated by the tables of ``RotaryEmbedding.tables``. The native
        kernel rotates in place (x may be a view into a fused qkv row) and returns ``x``."""
        kernel = self._kernel("rotary", cos, sin_signed) if x.dtype == cos.dtype else None
        rows, heads, d = x.shape
        if (
            kernel is None
            or x.device.type != "cpu"
            or x.stride(2) != 1
            or x.stride(1) != d
            or cos.shape != (rows, 1, d)
        ):
            return apply_rotary(x, cos, sin_signed)
        kernel(
            x.data_ptr(),
            rows,
            heads,
            d,
            x.stride(0),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            _threads(rows),
        )
        return x
