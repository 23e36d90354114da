"""Deterministic mode's numerics: every row of a step computed as if it were alone.

A request's tokens and logprobs change with its batch when a kernel's sums run in an order
that depends on the number of rows: oneDNN's and MKL's GEMMs pick their blocking by it, the
panel GEMMs pick their row tiles and accumulator chains by it, a decode batch's shared
prefix is attended once for all, and a prompt's chunk is attended by another kernel than a
decode step ("Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025). Inside
``invariant_step(True)`` (the model runner of an engine built with ``deterministic``):

* every quantized layer multiplies in calls whose row counts its kernel reports as
  invariant (``native.invariant_rows``: padded with zero rows below, split above), never
  dequantizing to oneDNN or using a prefill copy;
* every plain layer multiplies through ``dense_panels.c`` (one chain of float32
  multiply-adds per output, in input order), from a copy of its weight in that layout made
  at the first such call (``DensePanels``);
* attention runs every query row, prompt or decode, through the paged decode kernel over
  the keys up to its position (``TorchNativeAttention(deterministic=True)``), with no shared
  prefix; the one-call decode program only for decode steps whose row count every panel
  GEMM computes each row alone in (``whole_calls``).

The norms, activations and rotary kernels already compute each row alone
(``layer_ops``), the sampler draws with each request's own generator, and the argmax and
softmax of a row read that row only. ``unsupported(model)`` names what the mode cannot keep
deterministic yet; the engine refuses it at start-up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from radixserve.executor.native import (
    invariant_rows,
    load_dense_panels,
    load_int4_panels,
    load_int8_panels,
)

log = logging.getLogger(__name__)

_local = threading.local()


def on() -> bool:
    """Whether the step being computed on this thread is a deterministic one."""
    return getattr(_local, "on", False)


@contextmanager
def invariant_step(active: bool) -> Iterator[None]:
    """Within it (on this thread), the layers compute each row as if it were alone."""
    previous = on()
    _local.on = active
    try:
        yield
    finally:
        _local.on = previous


def in_row_counts(
    x: torch.Tensor, lo: int, hi: int | None, call: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``call`` over the rows of ``x`` in calls of ``lo`` to ``hi`` rows (hi None: any):
    rows beyond ``hi`` in further calls, a call short of ``lo`` padded with zero rows (their
    outputs dropped). Each call's rows are a contiguous copy, so every call reads its rows
    from the same alignment."""
    m = x.shape[0]
    if m >= lo and (hi is None or m <= hi) and x.is_contiguous():
        return call(x)
    step = m if hi is None else hi
    outs = []
    for start in range(0, m, max(step, 1)):
        part = x[start : start + step]
        rows = part.shape[0]
        if rows < lo:
            part = torch.cat([part, part.new_zeros(lo - rows, *part.shape[1:])])
        outs.append(call(part.contiguous())[:rows])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def to_dense_panels(weight: torch.Tensor) -> torch.Tensor:
    """``dense_panels.c``'s layout of a weight [N, K]: [N/16, K, 16] (N padded with zero
    rows to a multiple of 16), the weight's own dtype."""
    n, k = weight.shape
    pad = (-n) % 16
    w = weight.detach().contiguous()
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view((n + pad) // 16, 16, k).transpose(1, 2).contiguous()


_DENSE_FUNCTIONS = {
    (torch.bfloat16, torch.bfloat16): "dense_panels_bf16",
    (torch.float32, torch.float32): "dense_panels_f32",
    (torch.bfloat16, torch.float32): "dense_panels_bf16_f32w",
}


class DensePanels:
    """A plain weight [N, K] in ``dense_panels.c``'s layout for ``x_dtype`` rows.

    Invariant: ``__call__(x)`` is ``x @ W^T`` rounded once to x's dtype, each output one
    chain of float32 multiply-adds over the inputs in order: row i of the result depends on
    row i of x alone (not on the other rows, their number, or the thread count). The panels
    hold the weight in its own dtype, but in float32 for float32 rows."""

    __slots__ = ("function", "n", "panels")

    def __init__(self, weight: torch.Tensor, x_dtype: torch.dtype) -> None:
        lib = load_dense_panels()
        if lib is None:
            raise ValueError("deterministic mode needs the native dense kernel (dense_panels.c)")
        w_dtype = weight.dtype if x_dtype == torch.bfloat16 else torch.float32
        name = _DENSE_FUNCTIONS.get((x_dtype, w_dtype))
        if name is None:
            raise ValueError(
                f"deterministic mode multiplies no {x_dtype} rows by {w_dtype} weights"
            )
        self.function = getattr(lib, name)
        self.n = weight.shape[0]
        self.panels = to_dense_panels(weight.to(w_dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty(m, self.n, dtype=x.dtype)
        rc = self.function(
            x.data_ptr(),
            m,
            k,
            self.panels.data_ptr(),
            self.n,
            y.data_ptr(),
            self.n,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"dense panels refused a [{m}, {k}] x [{self.n}, {k}]^T product")
        return y


def dense(
    cache: dict[torch.dtype, DensePanels],
    weight: Callable[[], torch.Tensor],
    bias: torch.Tensor | None,
    x: torch.Tensor,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` through ``DensePanels`` kept in ``cache`` (one per row dtype,
    built from ``weight()`` at the first call)."""
    panels = cache.get(x.dtype)
    if panels is None:
        panels = cache[x.dtype] = DensePanels(weight(), x.dtype)
    y = panels(x)
    return y if bias is None else y + bias


def unsupported(model: Any, attention: Any) -> str | None:
    """What of ``model`` and its attention backend deterministic mode cannot keep
    batch-invariant yet, in words; None when it can."""
    if getattr(attention, "native", None) is None:
        return "attention without the native paged decode kernel (RADIXSERVE_NATIVE=0?)"
    if getattr(attention, "has_sinks", False):
        return "attention sinks (their scores computed per sequence, by another path)"
    if load_dense_panels() is None:
        return "plain layers without the native dense kernel (dense_panels.c did not build)"
    if getattr(model.config, "moe", None) is not None:
        return "mixture-of-experts layers (their rows grouped by expert across the batch)"
    return None


def whole_calls(rows: int) -> bool:
    """Whether a call of ``rows`` rows to every panel GEMM is one that computes each row
    alone (``native.invariant_rows``): then the one-call decode program, which multiplies a
    step's rows in one call a layer, computes what the layers do (deterministic mode runs it
    for such steps only)."""
    for load, prefix in ((load_int4_panels, "int4_panels"), (load_int8_panels, "int8_panels")):
        lib = load()
        if lib is None:
            continue
        counts = invariant_rows(lib, prefix)
        if counts is None or rows < counts[0] or (counts[1] is not None and rows > counts[1]):
            return False
    return True


def prepare_kernels() -> None:
    """Turn off, for this process, the panel GEMMs' AMX tiles where they would leave no row
    count computing each row alone (``native.invariant_rows``: int8's tiles, from as few rows
    as its one-set tiles; int4's invariant entry never uses them)."""
    for load, prefix in ((load_int4_panels, "int4_panels"), (load_int8_panels, "int8_panels")):
        lib = load()
        if lib is not None and invariant_rows(lib, prefix) is None:
            getattr(lib, f"{prefix}_set_amx_rows")(0)
            log.info("deterministic mode: %s multiplies without AMX tiles in this process", prefix)
