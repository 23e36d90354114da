"""The op table of ``native/decode_program.c``: its op kinds and how a layer becomes ops.

A native program (``decode_program.DecodeProgram``, ``routed_experts.RoutedExperts``) is a
[count, ``OP_WIDTH``] int64 table, one kernel call a row: the op's kind, the kernel's
address, then its arguments (pointers as integers, floats as the bits of a double). This
module holds what both programs share: the kinds, and the ops of one linear layer held as
int4 or int8 group panels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.executor import batch_invariant
from radixserve.executor.native import address, load_int4_panels, load_int8_panels
from radixserve.executor.quant import (
    PANEL_COPY_ROWS,
    PANEL_DEQUANT_ROWS,
    Int4Linear,
    Int8GroupLinear,
    int8_panel_rows,
)

# op kinds of native/decode_program.c, and its row width
(
    EMBED,
    NORM,
    INT4,
    INT8,
    ROTARY_ROWS,
    ROTARY,
    KV_WRITE,
    DECODE,
    ACT,
    COPY_ROWS,
    NORM_HEADS,
    BIAS,
    MOE,
    LORA,
    KV_WRITE_INT8,
    DECODE_INT8,
) = range(1, 17)
OP_WIDTH = 20

# the most rows a program is built for (its buffers are this many rows of every activation)
MAX_ROWS = 64


def bits(value: float) -> int:
    """A float as the int64 bits of a double (how an op carries it)."""
    return int(np.array(value, dtype=np.float64).view(np.int64))


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def table(ops: list[list[int]]) -> np.ndarray:
    """``ops`` as the [count, OP_WIDTH] int64 table the native side reads."""
    out = np.zeros((len(ops), OP_WIDTH), dtype=np.int64)
    for row, op in zip(out, ops, strict=True):
        row[: len(op)] = op
    return out


@dataclass
class GemmScratch:
    """Per-call scratch of the panel GEMM kernels for up to ``rows`` rows of inputs up to
    ``width`` wide (group sums, int4's bf16 pairs, int8's float32 copy of x)."""

    xs: torch.Tensor
    xp: torch.Tensor
    xt: torch.Tensor

    @classmethod
    def sized(cls, rows: int, width: int) -> GemmScratch:
        return cls(
            torch.empty(rows * width, dtype=torch.float32),
            torch.empty(rows * width, dtype=torch.int32),
            torch.empty(rows * width, dtype=torch.float32),
        )


def linear_ops(
    w: Any, x: torch.Tensor, y: torch.Tensor, scratch: GemmScratch, threads: int
) -> list[list[int]]:
    """The ops of ``y = w(x)`` for ``w`` an int4 or int8 group-panel layer (``linear_ok``):
    its panel GEMM, then its bias (if any) added in bfloat16, as the op-by-op path adds it."""
    if isinstance(w, Int4Linear):
        lib = load_int4_panels()
        # deterministic mode: the entry computing each row as alone, as the layer does
        gemm = (
            lib.int4_panels_gemm_bf16_invariant
            if batch_invariant.on()
            else lib.int4_panels_gemm_bf16
        )
        op = [INT4, address(gemm), ptr(x), w.in_features, ptr(w.panels),
              ptr(w.psz), w.out_features, w.group_size, ptr(scratch.xs), ptr(scratch.xp),
              ptr(y), threads]  # fmt: skip
    else:
        lib = load_int8_panels()
        op = [INT8, address(lib.int8_panels_gemm_bf16), ptr(x), w.in_features, ptr(w.panels),
              ptr(w.scale), ptr(w.zero), w.out_features, w.group_size, ptr(scratch.xt),
              ptr(scratch.xs), ptr(y), threads]  # fmt: skip
    ops = [op]
    if w.bias is not None:  # Qwen2's q/k/v
        ops.append([BIAS, 0, ptr(y), ptr(w.bias), w.out_features])
    return ops


def linear_ok(w: Any) -> bool:
    """Whether ``w`` is a layer a program multiplies: int4 or int8 group panels with a
    native kernel, and a bias (if any) it can add."""
    if isinstance(w, Int4Linear):
        panels = w.panels is not None and load_int4_panels() is not None
    elif isinstance(w, Int8GroupLinear):
        panels = load_int8_panels() is not None
    else:
        return False
    b = w.bias
    return panels and (
        b is None
        or (
            b.dtype == torch.bfloat16
            and b.device.type == "cpu"
            and b.is_contiguous()
            and tuple(b.shape) == (w.out_features,)
        )
    )


def panel_rows(w: Any) -> int:
    """The rows below which ``w`` multiplies with its panel kernel in a decode step (from
    there on, its prefill copy or dequantize + GEMM: see ``Int4Linear.__call__`` and
    ``Int8GroupLinear.__call__``)."""
    if isinstance(w, Int4Linear):
        return PANEL_COPY_ROWS if w.prefill is not None else PANEL_DEQUANT_ROWS
    return int8_panel_rows(load_int8_panels())
