"""The LoRA products of a step on the CUDA path (Punica's SGMV, in Triton): for one module
of one layer, every row of the step on an adapter gets ``y[row] += (A_s x[row]) Bt_s``,
``s`` its adapter's place in the step's stack, in two launches over all the rows:

* ``shrink``: h[row] = A_s x[row], one program per (row, block of ranks), the sum over
  ``in`` in float32, stored rounded to the activations' dtype (as PyTorch's ``x @ A^T``);
* ``expand``: y[row, cols] += h[row] Bt_s[:, cols], one program per (row, block of
  outputs), summed in float32 and rounded once into y (as ``addmm_``).

The step's adapters are stacked ([S, R, in] and [S, R, out], rank R zero-padded:
``lora.CudaLoRAStack``); ``row_adapter`` [T] int32 is each row's place in the stack, -1 for
rows on the base model (left untouched). Launchers accept CPU tensors too, which only the
Triton interpreter (``TRITON_INTERPRET=1``) runs: that is how CI tests these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lora_expand", "lora_shrink"]


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    row_adapter_ptr,
    in_dim,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(row_adapter_ptr + row).to(tl.int64)
    if s >= 0:
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, in_dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xt + k, mask=k < in_dim, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
                mask=(r[:, None] < rank) & (k[None, :] < in_dim),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(h_ptr + row * stride_ht + r, acc.to(h_ptr.dtype.element_ty), mask=r < rank)


@triton.jit
def _expand_kernel(
    h_ptr,
    bt_ptr,
    y_ptr,
    row_adapter_ptr,
    out_dim,
    rank,
    stride_ht,
    stride_bs,
    stride_br,
    stride_yt,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(row_adapter_ptr + row).to(tl.int64)
    if s >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + row * stride_ht + r, mask=r < rank, other=0.0).to(tl.float32)
        bt = tl.load(
            bt_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
            mask=(r[:, None] < rank) & (n[None, :] < out_dim),
            other=0.0,
        ).to(tl.float32)
        delta = tl.sum(h[:, None] * bt, axis=0)
        y_row = y_ptr + row * stride_yt + n
        y = tl.load(y_row, mask=n < out_dim, other=0.0).to(tl.float32)
        tl.store(y_row, (y + delta).to(y_ptr.dtype.element_ty), mask=n < out_dim)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, row_adapter: torch.Tensor) -> torch.Tensor:
    """h [T, R] = A_s x for each row (zeros for rows on no adapter): x [T, in] (rows
    contiguous), a [S, R, in] (last dim contiguous), row_adapter [T] int32."""
    rows, in_dim = x.shape
    rank = a.shape[1]
    assert x.stride(1) == 1 and a.stride(2) == 1 and a.shape[2] == in_dim
    h = x.new_zeros(rows, rank)
    if rows and rank:
        block_r = min(_pow2(rank), 64)
        grid = (rows, triton.cdiv(rank, block_r))
        _shrink_kernel[grid](
            x, a, h, row_adapter, in_dim, rank, x.stride(0), a.stride(0), a.stride(1),
            h.stride(0), BLOCK_R=block_r, BLOCK_K=min(_pow2(in_dim), 128),
        )  # fmt: skip
    return h


def lora_expand(
    h: torch.Tensor, bt: torch.Tensor, y: torch.Tensor, row_adapter: torch.Tensor
) -> torch.Tensor:
    """y[row] += h[row] Bt_s in place for each row on an adapter: h [T, R], bt [S, R, out]
    (last dim contiguous), y [T, out] (a column slice of a wider output is fine: rows
    ``y.stride(0)`` apart). Returns ``y``."""
    rows, rank = h.shape
    out_dim = bt.shape[2]
    assert y.stride(1) == 1 and bt.stride(2) == 1 and y.shape == (rows, out_dim)
    if rows and rank:
        block_n = min(_pow2(out_dim), 128)
        grid = (rows, triton.cdiv(out_dim, block_n))
        _expand_kernel[grid](
            h, bt, y, row_adapter, out_dim, rank, h.stride(0), bt.stride(0), bt.stride(1),
            y.stride(0), BLOCK_R=_pow2(rank), BLOCK_N=block_n,
        )  # fmt: skip
    return y
