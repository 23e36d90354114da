"""Weight-only quantized dense layers on CPU: int8 per output channel, int4 group-wise.

Activations stay in the model's dtype (bfloat16); the weights stay quantized in memory.
Below a few dozen rows they are multiplied by PyTorch's CPU kernels for them
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``), which beat the bfloat16 GEMM
at one row and lose from about ten; from ``DEQUANT_GEMM_ROWS(_INT8)`` rows (prefill) a
native dequantizer (native/qlinear.c) turns a cache-sized chunk of rows at a time into
bfloat16 for oneDNN's GEMM. A plain-torch fallback computes the same function where the
kernels are missing.

Conventions (those of the kernels):
  * int8: ``W[n, k] = q[n, k] * scale[n]``, ``q`` in [-127, 127];
  * int8 group-wise (GGUF's 5-, 6- and 8-bit types, executed from their codes):
    ``W[n, k] = q[n, k] * scale[n, g] (+ zero[n, g])``, ``g = k // group``, group 32 or 16,
    scales and zeros float16 (native/int8_panels.c);
  * int4: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` with ``g = k // group``,
    ``q`` in [0, 15]. Symmetric: ``zero = 0`` and the scale is the group's largest-magnitude
    value over -8 (llama.cpp's Q4_0 rule, so a Q4_0 tensor re-quantizes to its own codes);
    with zero points: ``scale = (max - min) / 15``, ``zero = min + 8 * scale`` (Q4_1's rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.executor import batch_invariant, gemm
from radixserve.executor.layers.moe import SparseMoE
from radixserve.executor.linear import Linear
from radixserve.executor.loader.gguf_codes import GroupCodes
from radixserve.executor.native import (
    invariant_rows,
    load_int4_panels,
    load_int8_panels,
    load_qlinear,
)

QUANTIZATIONS = ("auto", "none", "int8", "int4")
PREFILL_COPY_MODES = ("auto", "on", "off")  # add_prefill_copies; weights.decide_prefill_copy
INT4_GROUP_SIZES = (32, 64, 128)
# output rows padded to a multiple of 64: PyTorch's CPU int4 packing wants 16, and in blocks
# of 64 its layout is the one the native dequantizer reads
_INT4_N_MULTIPLE = 64


@dataclass(frozen=True)
class QuantScheme:
    """How the dense layers' weights are held. Invariant: ``kind`` is int8 or int4; for int4
    ``group_size`` is one of ``INT4_GROUP_SIZES``."""

    kind: str  # int8 | int4
    group_size: int = 32  # int4 only
    symmetric: bool = False  # int4 only: True = no zero points

    def describe(self) -> str:
        if self.kind == "int8":
            return "int8 per-channel"
        return f"int4 g{self.group_size} {'symmetric' if self.symmetric else 'with zero points'}"


def resolve_quantization(quantization: str, group_size: int) -> QuantScheme | None:
    """The one scheme of every dense layer for the ``quantization`` setting (None: the
    checkpoint's float dtype).

    ``auto``: None. A GGUF file on the CPU in one process does not come here: each tensor
    runs at its own type's precision from its codes (``install_gguf_linears``); anywhere
    else (tensor parallelism, a GPU) it runs dequantized, never below its own precision.
    ``int8``: per-channel; ``int4``: ``group_size`` with zero points (both re-quantize a
    GGUF file's dequantized weights, as asked)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}"
        )
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"quantization group size must be one of {INT4_GROUP_SIZES}; got {group_size}"
        )
    if quantization == "none":
        return None
    if quantization == "int8":
        return QuantScheme("int8")
    if quantization == "int4":
        return QuantScheme("int4", group_size)
    return None


# -- quantizers ---------------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q int8 [N, K], scale float32 [N])."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise int4 along the input dimension: (q uint8 [N, K] in 0..15, scale [N, K/g],
    zero [N, K/g]), scales and zeros rounded to ``scale_dtype`` (what the kernel reads)
    before the codes are chosen."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: input size {k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        idx = g.abs().argmax(dim=2, keepdim=True)
        scale = (torch.gather(g, 2, idx) / -8.0).squeeze(2)
        scale = torch.where(scale != 0, scale, torch.ones_like(scale)).to(scale_dtype).float()
        zero = torch.zeros_like(scale)
        q = torch.round(g / scale[..., None]) + 8
    else:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = (hi - lo) / 15.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype).float()
        zero = (lo + 8 * scale).to(scale_dtype).float()
        q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    q = torch.clamp(q, 0, 15).to(torch.uint8).reshape(n, k)
    return q, scale.to(scale_dtype), zero.to(scale_dtype)


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    s = scale.float().repeat_interleave(group_size, dim=1)
    z = zero.float().repeat_interleave(group_size, dim=1)
    return (q.float() - 8) * s + z


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 → [N, K/2] uint8, two codes a byte (low nibble first)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


# From this many rows on, a layer dequantizes its weight to bfloat16 (native dequantizer,
# a cache-sized chunk of output rows at a time, into a reused buffer) and runs oneDNN's
# bfloat16 GEMM on each chunk instead of PyTorch's quantized kernel, which wins at a few
# rows and loses from about ten; the dequantizing pays off from about these counts
# (benchmarks/quant_matmul.py).
DEQUANT_GEMM_ROWS_INT8 = 64
DEQUANT_GEMM_ROWS = 128  # int4


_CHUNK_ELEMENTS = 1 << 18  # bfloat16 weights dequantized at a time (512 KiB: in L2)


class _Scratch:
    """One growing bfloat16 buffer for dequantized weights. Invariant: a view handed out
    is valid until the next ``take`` (layers run one at a time, on one thread)."""

    buf = torch.empty(0, dtype=torch.bfloat16)

    @classmethod
    def take(cls, rows: int, cols: int) -> torch.Tensor:
        if cls.buf.numel() < rows * cols:
            cls.buf = torch.empty(rows * cols, dtype=torch.bfloat16)
        return cls.buf[: rows * cols].view(rows, cols)


class _Work:
    """One growing float32 buffer for a panel kernel's per-call scratch (the input's float
    copy, its group sums), so a decode step allocates none. Invariant: a view handed out is
    valid until the next ``take`` (layers run one at a time, on one thread)."""

    buf = torch.empty(0, dtype=torch.float32)

    @classmethod
    def take(cls, count: int) -> torch.Tensor:
        if cls.buf.numel() < count:
            cls.buf = torch.empty(count, dtype=torch.float32)
        return cls.buf[:count]


def _dequantizer() -> Any:
    """The native dequantizers, if they build and read PyTorch's int4 layout as checked
    here (it is PyTorch-internal); None otherwise."""
    global _DEQUANTIZER
    if _DEQUANTIZER is False:
        lib = load_qlinear()
        _DEQUANTIZER = lib if lib is not None and _int4_layout_ok(lib) else None
    return _DEQUANTIZER


_DEQUANTIZER: Any = False  # not looked for yet


def _int4_layout_ok(lib: Any, seed: int = 0) -> bool:
    """Whether ``lib`` dequantizes a random int4-packed matrix (``seed``) as the reference."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (128, 64), generator=gen, dtype=torch.int32)
    scale = torch.rand(128, 2, generator=gen).to(torch.bfloat16)
    zero = torch.rand(128, 2, generator=gen).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    out = torch.empty(64, 64, dtype=torch.bfloat16)
    ptrs = (packed.data_ptr(), sz.data_ptr())
    if lib.qdequant_int4pack_bf16(*ptrs, 128, 64, 32, 64, 64, 1, out.data_ptr()):
        return False
    want = dequantize_int4(q, scale, zero, 32)[64:].T
    return torch.allclose(out.float(), want, rtol=2**-7, atol=1e-2)  # roundings may differ


def _threads() -> int:
    return torch.get_num_threads()


# -- layers -------------------------------------------------------------------------------------
class Int8Linear:
    """``y = x @ (q * scale)^T (+ b)``: int8 weights [N, K] with one scale per output row.

    Invariant: ``__call__`` computes ``F.linear(x, dequantize_int8(q, scale), bias)`` up to
    the activation dtype's rounding: through ``_weight_int8pack_mm`` below
    ``DEQUANT_GEMM_ROWS_INT8`` rows (``use_kernel``), through the weight dequantized to bfloat16
    and oneDNN's GEMM from there (bfloat16 inputs, native dequantizer built), else through
    the plain-torch fallback. With a ``prefill`` copy (``add_prefill_copies``), the rows
    that would dequantize multiply that bfloat16 weight instead.
    """

    __slots__ = ("_invariant", "bias", "prefill", "q", "scale", "use_kernel")

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_kernel: bool = True,
    ) -> None:
        self.q = q.contiguous()
        self.scale = scale.float().contiguous()
        self.bias = bias
        self.use_kernel = use_kernel and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        self.prefill: Linear | None = None  # see add_prefill_copies
        # deterministic mode: the weight dequantized (float32, exact), in dense panels
        self._invariant: dict[torch.dtype, batch_invariant.DensePanels] = {}

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, use_kernel: bool = True
    ) -> Int8Linear:
        q, scale = quantize_int8(weight)
        return cls(q, scale, bias, use_kernel)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.q, self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.on():
            return batch_invariant.dense(self._invariant, self.dequantized, self.bias, x)
        if not self.use_kernel or x.device.type != "cpu":
            return self.fallback(x)
        bf16 = x.dtype == torch.bfloat16
        if self.prefill is not None and bf16 and _copy_rows(DEQUANT_GEMM_ROWS_INT8, x.shape[0]):
            return self.prefill(x)
        if x.shape[0] >= DEQUANT_GEMM_ROWS_INT8 and bf16:
            lib = _dequantizer()
            if lib is not None:
                return self._dequant_gemm(lib, x)
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale.to(x.dtype))
        return y if self.bias is None else y + self.bias

    def _dequant_gemm(self, lib: Any, x: torch.Tensor) -> torch.Tensor:
        """Output columns a cache-sized chunk of rows at a time."""
        n, k = self.q.shape
        chunk = max(64, (_CHUNK_ELEMENTS // k) // 64 * 64)
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        for first in range(0, n, chunk):
            count = min(chunk, n - first)
            w = _Scratch.take(count, k)
            lib.qdequant_int8_bf16(
                self.q[first].data_ptr(),
                self.scale[first].data_ptr(),
                count,
                k,
                _threads(),
                w.data_ptr(),
            )
            y[:, first : first + count] = gemm.linear(x, w)
        return y if self.bias is None else y + self.bias

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        w = self.q.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, w, self.bias)


class Int4Linear:
    """``y = x @ W^T (+ b)`` with W held as 4-bit codes, a scale and a zero per ``group_size``
    inputs of each output row.

    Invariant: ``__call__`` computes ``F.linear(x, dequantize_int4(...), bias)`` up to the
    activation dtype's rounding. The codes live in exactly one layout: the panels of
    ``native/int4_panels.c`` where that kernel is built (AVX-512 BF16; below
    ``PANEL_DEQUANT_ROWS`` rows, or ``AMX_DEQUANT_ROWS`` where it multiplies in AMX tiles,
    it multiplies straight from them, from there it dequantizes to bfloat16 for oneDNN's
    GEMM); else PyTorch's packed layout (output rows padded to a
    multiple of 64: its kernel below ``DEQUANT_GEMM_ROWS`` rows, then the weight dequantized
    and oneDNN's GEMM); else two codes a byte for the plain-torch fallback. ``panels=False``
    skips the first choice. With a ``prefill`` copy (``add_prefill_copies``), the rows that
    would dequantize multiply that bfloat16 weight instead.
    """

    __slots__ = (
        "_invariant",
        "bias",
        "group_size",
        "in_features",
        "nibbles",
        "out_features",
        "packed",
        "panels",
        "prefill",
        "psz",
        "sz",
    )

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        use_kernel: bool = True,
        panels: bool = True,
    ) -> None:
        n, k = q.shape
        self.out_features, self.in_features = n, k
        self.group_size = group_size
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.nibbles: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.psz: torch.Tensor | None = None
        self.prefill: Linear | None = None  # see add_prefill_copies
        # deterministic mode, float32 rows: the weight dequantized (float32, exact), in dense panels
        self._invariant: dict[torch.dtype, batch_invariant.DensePanels] = {}
        if use_kernel and panels and group_size % 8 == 0 and _panel_lib() is not None:
            self.panels, self.psz = to_panels(q, scale, zero)
        elif use_kernel and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            pad = (-n) % _INT4_N_MULTIPLE
            qp = F.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qp, 1)
            sz = torch.stack([F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))], dim=-1)
            self.sz = sz.transpose(0, 1).contiguous()  # [K/g, N (padded), 2]
        else:
            self.nibbles = _pack_nibbles(q.to(torch.uint8))
            self.sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group_size: int = 32,
        symmetric: bool = False,
        use_kernel: bool = True,
        panels: bool = True,
    ) -> Int4Linear:
        q, scale, zero = quantize_int4(weight, group_size, symmetric)
        return cls(q, scale, zero, group_size, bias, use_kernel, panels)

    @property
    def nbytes(self) -> int:
        if self.panels is not None:
            assert self.psz is not None
            return self.panels.nbytes + self.psz.nbytes
        codes = self.packed if self.packed is not None else self.nibbles
        assert codes is not None
        return codes.nbytes + self.sz.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.on():
            if self.panels is None or x.dtype != torch.bfloat16:
                return batch_invariant.dense(self._invariant, self.dequantized, self.bias, x)
            lib = _panel_lib()
            return _invariant_gemm(
                lib, "int4_panels", x, lambda rows: self._panel_gemm(lib, rows, invariant=True)
            )
        if self.panels is not None:
            if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2:
                return self.fallback(x)
            lib = _panel_lib()
            m = x.shape[0]
            if self.prefill is not None and _copy_rows(PANEL_COPY_ROWS, m):
                return self.prefill(x)
            if m < PANEL_DEQUANT_ROWS or (
                m < AMX_DEQUANT_ROWS and 0 < lib.int4_panels_amx_rows() <= m
            ):
                return self._panel_gemm(lib, x.contiguous())
            return self._panel_dequant_gemm(lib, x)
        if self.packed is None or x.device.type != "cpu":
            return self.fallback(x)
        n_pad = self.sz.shape[1]
        bf16 = x.dtype == torch.bfloat16
        if self.prefill is not None and bf16 and _copy_rows(DEQUANT_GEMM_ROWS, x.shape[0]):
            return self.prefill(x)
        if x.shape[0] >= DEQUANT_GEMM_ROWS and bf16:
            lib = _dequantizer()
            sz = self.sz if self.sz.dtype == torch.bfloat16 else self.sz.to(torch.bfloat16)
            if lib is not None:
                return self._dequant_gemm(lib, x, sz, n_pad)
        sz = self.sz if self.sz.dtype == x.dtype else self.sz.to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, sz)
        if y.shape[-1] != self.out_features:
            y = y[..., : self.out_features]
        return y if self.bias is None else y + self.bias

    def _dequant_gemm(
        self, lib: Any, x: torch.Tensor, sz: torch.Tensor, n_pad: int
    ) -> torch.Tensor:
        """Output columns a cache-sized chunk of rows at a time: dequantize the chunk to
        bfloat16 W^T, multiply, next chunk."""
        k = self.in_features
        chunk = max(64, (_CHUNK_ELEMENTS // k) // 64 * 64)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        xw = gemm.widen(x)  # once for all chunks
        for first in range(0, self.out_features, chunk):
            count = min(chunk, n_pad - first)
            wt = _Scratch.take(k, count)
            rc = lib.qdequant_int4pack_bf16(
                self.packed.data_ptr(),
                sz.data_ptr(),
                n_pad,
                k,
                self.group_size,
                first,
                count,
                _threads(),
                wt.data_ptr(),
            )
            if rc != 0:
                raise RuntimeError(f"qdequant_int4pack_bf16 refused its arguments ({rc})")
            last = min(first + count, self.out_features)
            y[:, first:last] = gemm.mm(xw, wt[:, : last - first])
        return y if self.bias is None else y + self.bias

    def _panel_gemm(self, lib: Any, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """A few rows: the panel kernel reads the codes straight from the panels.
        ``invariant``: its entry computing each row as alone (deterministic mode)."""
        m, k = x.shape
        y = torch.empty(m, self.out_features, dtype=x.dtype)
        xs = torch.empty(m * (k // self.group_size), dtype=torch.float32)
        xp = torch.empty(m * k, dtype=torch.int32)  # the portable path's float32 copy of x
        entry = lib.int4_panels_gemm_bf16_invariant if invariant else lib.int4_panels_gemm_bf16
        rc = entry(
            x.data_ptr(),
            m,
            k,
            self.panels.data_ptr(),
            self.psz.data_ptr(),
            self.out_features,
            self.group_size,
            xs.data_ptr(),
            xp.data_ptr(),
            y.data_ptr(),
            self.out_features,
            _threads(),
        )
        if rc != 0:
            raise RuntimeError(f"int4_panels_gemm_bf16 refused its arguments ({rc})")
        return y if self.bias is None else y + self.bias

    def _panel_dequant_gemm(self, lib: Any, x: torch.Tensor) -> torch.Tensor:
        """Many rows: dequantize a cache-sized chunk of output blocks to bfloat16 W^T,
        multiply with oneDNN, next chunk."""
        k = self.in_features
        blocks = self.panels.shape[0]
        chunk = max(4, (_CHUNK_ELEMENTS // k) // 16 // 4 * 4)  # output blocks of 16
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        xw = gemm.widen(x)  # once for all chunks
        for first in range(0, blocks, chunk):
            count = min(chunk, blocks - first)
            wt = _Scratch.take(k, 16 * count)
            rc = lib.int4_panels_dequant_bf16(
                self.panels.data_ptr(),
                self.psz.data_ptr(),
                k,
                self.group_size,
                first,
                count,
                _threads(),
                wt.data_ptr(),
            )
            if rc != 0:
                raise RuntimeError(f"int4_panels_dequant_bf16 refused its arguments ({rc})")
            lo, hi = 16 * first, min(16 * (first + count), self.out_features)
            y[:, lo:hi] = gemm.mm(xw, wt[:, : hi - lo])
        return y if self.bias is None else y + self.bias

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] uint8, scale [N, K/g], zero [N, K/g]) from whichever layout is held
        (not the PyTorch kernel's, which is internal to it)."""
        n = self.out_features
        if self.panels is not None:
            return from_panels(self.panels, self.psz, n)
        if self.nibbles is None:
            raise RuntimeError("this Int4Linear holds only the CPU kernel's packed layout")
        sz = self.sz[:, :n].transpose(0, 1)
        return _unpack_nibbles(self.nibbles), sz[..., 0], sz[..., 1]

    def dequantized(self) -> torch.Tensor:
        q, scale, zero = self.codes()
        return dequantize_int4(q, scale, zero, self.group_size)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)


# Rows from which an Int4Linear with panels dequantizes to bfloat16 and runs oneDNN's GEMM
# instead of the panel kernel (benchmarks/quant_matmul.py). Where oneDNN has AMX its GEMM is
# so fast that dequantizing would pay from about 48 rows (SmolLM2's four layer shapes, 2
# threads, the Xeon of docs/benchmarks: dequantize + GEMM over the panel kernel 1.1-1.5x at
# 32 rows, 0.84-1.07x at 48, 0.65-0.83x at 68, 0.26-0.35x at 256), but the dequantized
# weights are rounded to bfloat16 once more, and with the cut at 48 a tiny Q4_1 file's
# teacher-forced top-1 left transformers' at a lead of 0.35
# (tests/executor/test_gguf_codes.py): the panel kernel, which never rounds the weights,
# keeps every prompt up to 256 rows on every CPU.
PANEL_DEQUANT_ROWS = 256
# Rows from which an Int4Linear with a bfloat16 prefill copy (add_prefill_copies) multiplies
# the copy, and the prompt length from which a prompt's chunks do from
# LONG_PROMPT_COPY_ROWS (long_prompt_step): oneDNN's GEMM on the copy is 1.7-2.0x the panel
# kernel in AMX tiles at 127 rows, 5x its AVX-512 path at 128 (SmolLM2's layer shapes, 2
# threads, the Xeon of docs/benchmarks). 128 keeps short prompts, decode steps and
# speculative verification on the exact codes.
PANEL_COPY_ROWS = 128
# Rows from which a step computing a chunk of a long prompt (long_prompt_step) multiplies
# the copy: below it the codes cost less (the copy's step reads all its bfloat16 weights
# whatever the rows). benchmarks/prefill_chunks.py (SmolLM2, AMX, the Xeon of
# docs/benchmarks), copy / codes ms per step: 1 thread 16 rows 31.8 / 21.2, 48: 43.8 /
# 42.4, 64: 49.9 / 53.2; 2 threads 16: 19.6 / 13.3, 48: 27.0 / 25.9, 64: 29.7 / 32.3.
LONG_PROMPT_COPY_ROWS = 56


class _Step:
    """The step being computed, as the quantized layers see it. Invariant: ``long_prompt``
    is True only inside ``long_prompt_step(True)`` (the model runner's forward of a step
    that computes a chunk of a long prompt, ``ForwardBatch.long_prompt``)."""

    long_prompt = False


def in_long_prompt_step() -> bool:
    """Whether the step being computed is a long prompt's (see ``long_prompt_step``)."""
    return _Step.long_prompt


@contextmanager
def long_prompt_step(on: bool) -> Iterator[None]:
    """Within it, every layer with a prefill copy multiplies the copy from
    ``LONG_PROMPT_COPY_ROWS`` rows (not only from its own threshold): the chunks of a
    prompt of ``PANEL_COPY_ROWS`` tokens or more (and the decode rows that share their
    steps) run on the copy wherever it costs less than the codes, as the whole prompt
    would in one step; shorter chunks (a long prompt's last one, the fair policy's steps
    while tenants share) stay on the codes, cheaper there."""
    _Step.long_prompt = on
    try:
        yield
    finally:
        _Step.long_prompt = False


def _invariant_gemm(
    lib: Any, prefix: str, x: torch.Tensor, gemm_rows: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """A panel GEMM in deterministic mode: in calls of the row counts its kernel computes
    each row alone in (``native.invariant_rows``; ``batch_invariant.prepare_kernels`` turned
    off the AMX tiles that would leave none)."""
    rows = invariant_rows(lib, prefix)
    if rows is None:
        raise RuntimeError(f"{prefix}: no row count computes each row alone (AMX tiles on)")
    return batch_invariant.in_row_counts(x, rows[0], rows[1], gemm_rows)


def _copy_rows(layer_rows: int, m: int) -> bool:
    """Whether a layer with a prefill copy multiplies it for ``m`` rows (``layer_rows``:
    its own threshold)."""
    return m >= layer_rows or (_Step.long_prompt and m >= LONG_PROMPT_COPY_ROWS)


# Where the panel GEMMs (int4 and int8) multiply in AMX tiles (native/amx_tiles.h; from
# native.INT4_AMX_ROWS / INT8_AMX_ROWS rows), they stay exact and are faster than
# dequantizing up to this many rows instead of PANEL_DEQUANT_ROWS / INT8_PANEL_DEQUANT_ROWS
# (SmolLM2's 960x576, 3072x576 and 576x1536 layers, 2 threads, the Xeon of docs/benchmarks:
# at 512 rows AMX 1.18-1.44x int4, 1.43-1.49x int8 over dequantize + GEMM; at 1024 rows
# 0.70-0.79x int4, 0.88-0.95x int8).
AMX_DEQUANT_ROWS = 768


def _panel_lib() -> Any:
    return load_int4_panels()  # cached: built and loaded once per process


def to_panels(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The panel layout of ``native/int4_panels.c`` (outputs padded to a multiple of 16 with
    all-zero weights; K a multiple of 8): panels [N/16, K/8, 16] int32, lane j of (block b,
    octet o) = output 16 b + j's codes at inputs 8 o .. 8 o + 7, the one at 8 o + 2 u in
    bits 4 u and the one at 8 o + 2 u + 1 in bits 16 + 4 u (u = 0..3); sz [N/16, K/g, 2,
    16] bfloat16, the block's scales then zeros per group. The codes are rearranged with
    numpy (one thread, no pool to wake: loading converts hundreds of tensors)."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"the int4 panels need inputs in multiples of 8; got {k}")
    groups = scale.shape[1]
    pad = (-n) % 16
    blocks = (n + pad) // 16
    codes = q.numpy() if q.dtype == torch.uint8 else q.to(torch.uint8).numpy()
    if pad:
        codes = np.concatenate([codes, np.full((pad, k), 8, dtype=np.uint8)])
    # a word's little-endian bytes hold codes (0, 2), (4, 6), (1, 3), (5, 7) of its octet,
    # the first of each pair in the low nibble: built byte by byte (a quarter of the memory
    # traffic of shifting 32-bit words; 6.7x faster at 2048 x 2048)
    pairs = codes.reshape(n + pad, k // 8, 4, 2)  # (code 2u, code 2u + 1) for u = 0..3
    out = np.empty((n + pad, k // 8, 4), dtype=np.uint8)
    for byte, (u, v, half) in enumerate(((0, 1, 0), (2, 3, 0), (0, 1, 1), (2, 3, 1))):
        out[..., byte] = pairs[..., u, half] | (pairs[..., v, half] << 4)
    words = out.view(np.uint32).reshape(blocks, 16, k // 8)
    panels = torch.from_numpy(np.ascontiguousarray(words.transpose(0, 2, 1)).view(np.int32))

    def block(t: torch.Tensor, fill: float) -> torch.Tensor:
        a = t.to(torch.bfloat16).view(torch.int16).numpy()
        if pad:
            filler = torch.full((pad, groups), fill, dtype=torch.bfloat16)
            a = np.concatenate([a, filler.view(torch.int16).numpy()])
        return a.reshape(blocks, 16, groups).transpose(0, 2, 1)  # [blocks, groups, 16]

    sz = np.ascontiguousarray(np.stack([block(scale, 1.0), block(zero, 0.0)], axis=2))
    return panels, torch.from_numpy(sz).view(torch.bfloat16)


def from_panels(
    panels: torch.Tensor, sz: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``to_panels``, cut back to ``n`` outputs."""
    blocks, octets, _ = panels.shape
    words = panels.numpy().view(np.uint32).transpose(0, 2, 1)  # [blocks, 16, K/8]
    shifts = np.array([[0, 16], [4, 20], [8, 24], [12, 28]], dtype=np.uint32)
    codes = (words[..., None, None] >> shifts) & 0xF  # [blocks, 16, K/8, 4, 2]
    q = torch.from_numpy(codes.astype(np.uint8).reshape(blocks * 16, 8 * octets)[:n])
    scale = sz[:, :, 0].transpose(1, 2).reshape(blocks * 16, -1)[:n]
    zero = sz[:, :, 1].transpose(1, 2).reshape(blocks * 16, -1)[:n]
    return q, scale, zero


# -- group-wise int8 (GGUF's 5-, 6- and 8-bit types from their codes) -----------------------------
# Rows from which an Int8GroupLinear dequantizes to bfloat16 and runs oneDNN's GEMM instead
# of the panel kernel (float32 multiply-adds). Decode steps of up to 31 requests stay in the
# panel kernel: dequantizing every step's weights (Gemma 3's 262k-row int8 LM head above
# all) costs more than the kernel's multiply-adds. Measured at 16 running requests, same
# machine, one process per setting (benchmarks/gguf_decode_ab.py; docs/benchmarks.md, "GGUF
# types executed from their codes"): Gemma 3 270M Q4_K_M 261 tok/s with the cut at 32 against 128 with it at 2;
# SmolLM2 Q4_1 399 against 352.
INT8_PANEL_DEQUANT_ROWS = 32
# The same cut where the panel kernel multiplies bfloat16 pairs (native.int8_pair_rows: AMD
# CPUs). Against dequantize + GEMM it is 0.34-0.42x the time at 32 rows and 0.72-0.83x at
# 128; against a prefill copy's bfloat16 GEMM 0.64-0.84x at 32 rows, 0.89-1.06x at 64 and
# 1.03-1.12x at 128 (Gemma 3's int8 shapes, 2 threads, Zen 5; benchmarks/int8_panels.py):
# a decode step of 16 requests that shares its step with a prompt's chunk of up to 47
# tokens stays on the codes.
INT8_PAIR_PANEL_ROWS = 64


def _int8_panel_lib() -> Any:
    return load_int8_panels()  # cached: built and loaded once per process


def int8_panel_rows(lib: Any) -> int:
    """Rows from which an Int8GroupLinear leaves the panel kernel (for its prefill copy or
    dequantize + GEMM)."""
    return INT8_PAIR_PANEL_ROWS if lib.int8_panels_dp_rows() > 0 else INT8_PANEL_DEQUANT_ROWS


def to_int8_panels(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The layout of ``native/int8_panels.c`` (outputs padded to a multiple of 16 with zero
    weights): panels [N/16, K, 16] int8, scale and zero [N/16, K/G, 16] float16.
    ``ValueError`` where a scale or zero does not fit float16. Rearranged with numpy, as
    ``to_panels``."""
    n, k = q.shape
    groups = scale.shape[1]
    pad = (-n) % 16
    blocks = (n + pad) // 16
    codes = q.to(torch.int8).numpy()
    if pad:
        codes = np.concatenate([codes, np.zeros((pad, k), dtype=np.int8)])
    panels = np.ascontiguousarray(codes.reshape(blocks, 16, k).transpose(0, 2, 1))

    def half(t: torch.Tensor) -> torch.Tensor:
        a = t.float().numpy()
        with np.errstate(over="ignore"):
            h = a.astype(np.float16)
        if not np.isfinite(h).all():
            raise ValueError("a scale or zero overflows float16")
        if pad:
            h = np.concatenate([h, np.zeros((pad, groups), dtype=np.float16)])
        return torch.from_numpy(
            np.ascontiguousarray(h.reshape(blocks, 16, groups).transpose(0, 2, 1))
        )

    return torch.from_numpy(panels), half(scale), None if zero is None else half(zero)


def from_int8_panels(
    panels: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of ``to_int8_panels`` (scales as float32), cut back to ``n`` outputs."""
    blocks, k, _ = panels.shape
    q = panels.transpose(1, 2).reshape(blocks * 16, k)[:n]

    def unblock(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(blocks * 16, -1)[:n].float()

    return q, unblock(scale), None if zero is None else unblock(zero)


class Int8GroupLinear:
    """``y = x @ W^T (+ b)``, ``W[n, k] = q[n, k] * scale[n, k // group] (+ zero[...])``: int8
    codes with a float16 scale (and zero) per ``group`` inputs of each output row.

    Invariant: ``__call__`` computes ``F.linear(x, self.dequantized(), bias)`` up to the
    activation dtype's rounding. The codes live in the panels of ``native/int8_panels.c``:
    below ``int8_panel_rows()`` rows (``AMX_DEQUANT_ROWS`` where it multiplies in AMX
    tiles and there is no prefill copy) that kernel multiplies straight from them, from
    there it dequantizes a chunk of outputs at a time to bfloat16 for oneDNN's GEMM; where
    it is not built (or the input is not bfloat16 on CPU) the plain-torch fallback. With a
    ``prefill`` copy (``add_prefill_copies``), the rows that would dequantize multiply that
    bfloat16 weight instead.
    """

    __slots__ = (
        "_invariant",
        "bias",
        "group_size",
        "in_features",
        "out_features",
        "panels",
        "prefill",
        "scale",
        "zero",
    )

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        n, k = q.shape
        if k % group_size or group_size % 4:
            raise ValueError(f"int8 groups of {group_size} do not divide {k} inputs")
        self.out_features, self.in_features = n, k
        self.group_size = group_size
        self.bias = bias
        self.panels, self.scale, self.zero = to_int8_panels(q, scale, zero)
        self.prefill: Linear | None = None  # see add_prefill_copies
        # deterministic mode, float32 rows: the weight dequantized (float32, exact), in dense panels
        self._invariant: dict[torch.dtype, batch_invariant.DensePanels] = {}

    @classmethod
    def from_codes(cls, codes: GroupCodes, bias: torch.Tensor | None = None) -> Int8GroupLinear:
        return cls(codes.q, codes.scale, codes.zero, codes.group, bias)

    @property
    def nbytes(self) -> int:
        zero = 0 if self.zero is None else self.zero.nbytes
        return self.panels.nbytes + self.scale.nbytes + zero

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K] int8, scale [N, K/g] float32, zero or None) as held."""
        return from_int8_panels(self.panels, self.scale, self.zero, self.out_features)

    def dequantized(self) -> torch.Tensor:
        q, scale, zero = self.codes()
        n, k = q.shape
        w = q.float().view(n, k // self.group_size, self.group_size) * scale[..., None]
        if zero is not None:
            w = w + zero[..., None]
        return w.view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib = _int8_panel_lib()
        if batch_invariant.on():
            if lib is None or x.dtype != torch.bfloat16:
                return batch_invariant.dense(self._invariant, self.dequantized, self.bias, x)
            return _invariant_gemm(lib, "int8_panels", x, lambda rows: self._panel_gemm(lib, rows))
        if lib is None or x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2:
            return self.fallback(x)
        m = x.shape[0]
        panel_rows = int8_panel_rows(lib)
        if self.prefill is not None and _copy_rows(panel_rows, m):
            return self.prefill(x)
        if m < panel_rows:
            return self._panel_gemm(lib, x.contiguous())
        if m < AMX_DEQUANT_ROWS and 0 < lib.int8_panels_amx_rows() <= m:
            return self._panel_gemm(lib, x.contiguous())
        return self._panel_dequant_gemm(lib, x)

    def _ptr(self, t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    def _panel_gemm(self, lib: Any, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        y = torch.empty(m, self.out_features, dtype=x.dtype)
        work = _Work.take(m * k + m * (k // self.group_size))
        xt, xs = work[: m * k], work[m * k :]
        rc = lib.int8_panels_gemm_bf16(
            x.data_ptr(),
            m,
            k,
            self.panels.data_ptr(),
            self.scale.data_ptr(),
            self._ptr(self.zero),
            self.out_features,
            self.group_size,
            xt.data_ptr(),
            xs.data_ptr(),
            y.data_ptr(),
            self.out_features,
            _threads(),
        )
        if rc != 0:
            raise RuntimeError(f"int8_panels_gemm_bf16 refused its arguments ({rc})")
        return y if self.bias is None else y + self.bias

    def _panel_dequant_gemm(self, lib: Any, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        blocks = self.panels.shape[0]
        chunk = max(4, (_CHUNK_ELEMENTS // k) // 16 // 4 * 4)  # output blocks of 16
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        xw = gemm.widen(x)  # once for all chunks
        for first in range(0, blocks, chunk):
            count = min(chunk, blocks - first)
            wt = _Scratch.take(k, 16 * count)
            self.dequant_blocks(lib, first, count, wt)
            lo, hi = 16 * first, min(16 * (first + count), self.out_features)
            y[:, lo:hi] = gemm.mm(xw, wt[:, : hi - lo])
        return y if self.bias is None else y + self.bias

    def dequant_blocks(self, lib: Any, first: int, count: int, wt: torch.Tensor) -> None:
        """Output blocks ``first`` .. ``first + count - 1`` (16 outputs each) dequantized to
        bfloat16 W^T into ``wt`` [K, 16 * count] by the native kernel."""
        rc = lib.int8_panels_dequant_bf16(
            self.panels.data_ptr(),
            self.scale.data_ptr(),
            self._ptr(self.zero),
            self.in_features,
            self.group_size,
            first,
            count,
            _threads(),
            wt.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"int8_panels_dequant_bf16 refused its arguments ({rc})")

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)


# -- GGUF tensors at their own precision ------------------------------------------------------------
def precision_label(codes: GroupCodes) -> str:
    """What a tensor of these codes executes as: ``int4-g32`` or ``int8-g32`` / ``int8-g16``."""
    return f"int{codes.bits}-g{codes.group}"


def linear_from_codes(codes: GroupCodes) -> Int4Linear | Int8GroupLinear | Linear:
    """The layer executing ``codes`` exactly (up to the 16-bit rounding of scales and zeros):
    4-bit codes in groups of 32 as ``Int4Linear`` (its panels, or PyTorch's int4 layout
    where the panel kernel is not built), the others as ``Int8GroupLinear`` where its
    kernel is built (every kernel tier); else (native kernels off, or a scale beyond
    float16) a bfloat16 ``Linear`` of the dequantized codes: never below the file's
    precision, and through oneDNN rather than the per-call dequantizing fallback."""
    if codes.bits == 4 and codes.group == 32:
        zero = codes.zero if codes.zero is not None else torch.zeros_like(codes.scale)
        q4 = torch.from_numpy(codes.q.numpy().view(np.uint8) + np.uint8(8))  # q + 8 (wraps)
        return Int4Linear(q4, codes.scale, zero, 32)
    if _int8_panel_lib() is not None:
        try:
            return Int8GroupLinear.from_codes(codes)
        except ValueError:
            pass
    return Linear(codes.dequantize().to(torch.bfloat16))


def executed_label(layer: Any) -> str:
    """The precision a dense layer executes at, for the start-up line."""
    if isinstance(layer, Int4Linear):
        return f"int4-g{layer.group_size}"
    if isinstance(layer, Int8GroupLinear):
        return f"int8-g{layer.group_size}"
    if isinstance(layer, Int8Linear):
        return "int8-channel"
    if isinstance(layer, Linear):
        return "bf16"
    return type(layer).__name__


@dataclass(frozen=True)
class GGUFPrecisions:
    """How ``auto`` runs a GGUF file: each dense-layer tensor at its own type's precision.
    Invariant: ``counts`` holds (executed precision, GGML type, number of tensors), each
    tensor of the file's decoder layers counted once."""

    counts: tuple[tuple[str, str, int], ...]
    load_seconds: float = 0.0
    head: str | None = None  # the LM head's, e.g. "int8-g32 (Q8_0)"; None: the model dtype

    kind = "gguf"

    def describe(self) -> str:
        parts = [f"{count} {label} ({ggml})" for label, ggml, count in self.counts]
        head = f"; LM head {self.head}" if self.head else ""
        return "per tensor: " + ", ".join(parts) + head


# Which projections each dense-layer field of the models holds, by layer-relative Hugging
# Face name: the fused ones in order (as loaded), else one stored fused.
LAYER_FIELD_SOURCES: dict[str, tuple[tuple[str, ...], ...]] = {
    "qkv": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        ("self_attn.qkv_proj.weight",),
    ),
    "gate_up": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("mlp.gate_up_proj.weight",)),
    "o": (("self_attn.o_proj.weight",),),
    "down": (("mlp.down_proj.weight",),),
}


def install_gguf_linears(
    model: Any, linears: dict[str, Any], tensor_types: dict[str, str]
) -> dict[tuple[str, str], int]:
    """Put the layers built from a GGUF file's codes (``linears``: by the Hugging Face name
    of each fused group's first tensor) in place of the placeholder ``Linear``s of
    ``model.layers`` (weights on the meta device; experts included), with their biases.
    Returns the count of tensors per (executed precision, GGML type), and ("lm_head", its
    GGML type) when the LM head was built too (``linears["lm_head.weight"]``, replacing
    ``model.lm_head``). ``RuntimeError`` when a placeholder has no layer or a layer no
    placeholder."""
    left = dict(linears)
    counts: dict[tuple[str, str], int] = {}
    for i, layer in enumerate(model.layers):
        for slot in layer_linears(layer, f"model.layers.{i}."):
            value = slot.value
            plain = value.plain_weight if isinstance(value, Linear) else None
            if plain is None or plain.device.type != "meta":  # not a placeholder
                continue
            group = next((g for g in slot.sources if slot.prefix + g[0] in left), None)
            if group is None:
                raise RuntimeError(f"{slot.prefix}{slot.field}: no weights were built for it")
            built = left.pop(slot.prefix + group[0])
            built.bias = value.bias
            slot.set(built)
            label = executed_label(built)
            for part in group:
                key = (label, tensor_types[slot.prefix + part])
                counts[key] = counts.get(key, 0) + 1
    head = left.pop("lm_head.weight", None)
    if head is not None:
        model.lm_head = head
        counts[("lm_head", tensor_types["lm_head.weight"])] = 1
    if left:
        raise RuntimeError(f"weights built for no layer: {sorted(left)[:3]}")
    return counts


def int4_group_size(in_features: int, wanted: int) -> int | None:
    """``wanted`` if it divides ``in_features``, else the largest smaller supported group
    size that does; None if none does."""
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= wanted and in_features % g == 0:
            return g
    return None


def quantize_linear(layer: Linear, scheme: QuantScheme) -> Linear | Int8Linear | Int4Linear:
    """The quantized replacement of a bfloat16/float32 ``Linear`` (the layer itself where
    the scheme cannot hold its shape: int4 with an input size not a multiple of 32)."""
    w, b = layer.weight, layer.bias
    if scheme.kind == "int8":
        return Int8Linear.from_float(w, b)
    group = int4_group_size(w.shape[1], scheme.group_size)
    if group is None:
        return layer
    return Int4Linear.from_float(w, b, group, scheme.symmetric)


AnyLinear = Linear | Int8Linear | Int4Linear | Int8GroupLinear


# An expert's fields, by name relative to its prefix (``mlp.experts.E.``)
EXPERT_FIELD_SOURCES: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up": (("gate_proj.weight", "up_proj.weight"),),
    "down": (("down_proj.weight",),),
}


@dataclass(frozen=True)
class LinearSlot:
    """One field of a decoder layer (or of one of its experts) that holds a linear layer:
    ``owner.field`` is ``value``; ``prefix`` + a name of ``sources`` is a Hugging Face
    name of its weight (the first of each fused group)."""

    owner: Any
    field: str
    value: Any
    prefix: str
    sources: tuple[tuple[str, ...], ...]
    expert: bool

    def set(self, value: Any) -> None:
        setattr(self.owner, self.field, value)


def _fields(obj: Any) -> Iterable[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return list(vars(obj))


def layer_linears(layer: Any, prefix: str = "") -> Iterator[LinearSlot]:
    """Every linear layer a decoder layer holds (whatever its fields are called or fused
    into), the experts of a ``SparseMoE`` field included (``expert=True``)."""
    for name in _fields(layer):
        value = getattr(layer, name)
        if isinstance(value, SparseMoE):
            for part_prefix, expert in value.parts():
                for field in _fields(expert):
                    yield LinearSlot(
                        expert,
                        field,
                        getattr(expert, field),
                        prefix + part_prefix,
                        EXPERT_FIELD_SOURCES[field],
                        True,
                    )
        elif isinstance(value, AnyLinear):
            yield LinearSlot(layer, name, value, prefix, LAYER_FIELD_SOURCES.get(name, ()), False)


def quantize_model(model: Any, scheme: QuantScheme) -> None:
    """Replace, in place, every ``Linear`` held by ``model.layers[i]`` (whatever they are
    called or fused into; experts too) by its quantized form. Embeddings and the LM head
    stay as they are."""
    for layer in model.layers:
        for slot in layer_linears(layer):
            if isinstance(slot.value, Linear):
                slot.set(quantize_linear(slot.value, scheme))


QuantizedLinear = Int8Linear | Int4Linear | Int8GroupLinear


def _dense_bf16(layer: QuantizedLinear) -> torch.Tensor:
    """The layer's weight as the dequantize-then-GEMM path multiplies it: bfloat16 [N, K]
    (an int8 group layer's from that path's kernel, all its blocks in one call, then
    transposed: 0.37 s, two thirds of it the transpose, against ~0.7 s through
    ``dequantized`` for the 84 fused int8 layers of a 0.5B Qwen2 file)."""
    if isinstance(layer, Int4Linear):
        q, scale, zero = layer.codes()
        return dequantize_int4(q, scale, zero, layer.group_size).to(torch.bfloat16)
    lib = _int8_panel_lib() if isinstance(layer, Int8GroupLinear) else None
    if lib is not None and layer.panels.device.type == "cpu":
        blocks = layer.panels.shape[0]
        wt = torch.empty(layer.in_features, 16 * blocks, dtype=torch.bfloat16)
        layer.dequant_blocks(lib, 0, blocks, wt)
        return wt[:, : layer.out_features].t().contiguous()
    return layer.dequantized().to(torch.bfloat16)


def _quantized_layers(model: Any, experts: bool = False) -> Iterable[QuantizedLinear]:
    """The quantized layers of ``model.layers``; the experts' only with ``experts``."""
    for layer in model.layers:
        for slot in layer_linears(layer):
            if isinstance(slot.value, QuantizedLinear) and (experts or not slot.expert):
                yield slot.value


def prefill_copy_bytes(model: Any) -> int:
    """Bytes a bfloat16 copy of every quantized dense layer of ``model.layers`` would take."""
    return sum(2 * layer.out_features * layer.in_features for layer in _quantized_layers(model))


def add_prefill_copies(model: Any) -> int:
    """Give every quantized dense layer of ``model.layers`` (not the embeddings, not the LM
    head) a bfloat16 copy of its weight, reordered once for oneDNN, and return its bytes.

    A layer multiplies from its codes for few rows; from its dequantize threshold
    (``DEQUANT_GEMM_ROWS_INT8``, ``INT8_PANEL_DEQUANT_ROWS``, ``PANEL_DEQUANT_ROWS``) it
    dequantizes its weight to bfloat16 at every call and runs oneDNN's GEMM. The copy is
    that same bfloat16 weight, made once, and those steps multiply it instead (dequantizing
    was two thirds of a 256-row int4 step's time on the development machine,
    benchmarks/quant_matmul.py). An int4 layer with panels uses it from ``PANEL_COPY_ROWS``
    (128), below its dequantize threshold: there the copy adds a rounding of the weights to
    bfloat16. Decode steps still read the codes. The cost is 2 bytes a weight."""
    for layer in _quantized_layers(model):
        if layer.prefill is None:
            layer.prefill = Linear(_dense_bf16(layer), layer.bias)
    return prefill_copy_bytes(model)


def weight_memory(model: Any) -> dict[str, int]:
    """Bytes of the model's weights by precision (``bfloat16``, ``float32``, ``int8``,
    ``int4``), each tensor counted once (tied embeddings once). A bfloat16 ``Linear`` on
    CPU holds its weight only reordered for oneDNN, which is what counts for it; a tied LM
    head's reordered copy, beside the embedding table, is ``onednn_copy``."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(key: str, nbytes: int) -> None:
        out[key] = out.get(key, 0) + nbytes

    def add_tensor(t: torch.Tensor | None) -> None:
        if t is None or t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        add(str(t.dtype).removeprefix("torch."), t.nbytes)

    def add_any(value: Any) -> None:
        if isinstance(value, Int8Linear | Int4Linear | Int8GroupLinear):
            add("int4" if isinstance(value, Int4Linear) else "int8", value.nbytes)
            add_tensor(value.bias)
            if value.prefill is not None and value.prefill.packed is not None:
                add("bfloat16_prefill_copy", value.prefill.packed.nbytes)
            elif value.prefill is not None:
                add("bfloat16_prefill_copy", value.prefill.weight.nbytes)
        elif isinstance(value, Linear):
            plain = value.plain_weight
            add_tensor(plain)
            add_tensor(value.bias)
            if value.packed is not None:  # the oneDNN-reordered weight: a copy beside a
                # plain weight kept for another user (a tied head), else its only form
                key = "onednn_copy" if plain is not None else str(value.packed.dtype)
                add(key.removeprefix("torch."), value.packed.nbytes)
        elif isinstance(value, torch.Tensor):
            add_tensor(value)

    for name in ("embed", "norm", "lm_head"):
        add_any(getattr(model, name, None))
    for layer in model.layers:
        for name in _fields(layer):
            value = getattr(layer, name)
            if isinstance(value, SparseMoE):
                add_tensor(value.router)
                add_tensor(value.shared_gate)
        for slot in layer_linears(layer):
            add_any(slot.value)
        for name in _fields(layer):
            value = getattr(layer, name)
            if isinstance(value, torch.Tensor):
                add_tensor(value)
    return out


def format_weight_memory(memory: dict[str, int]) -> str:
    parts = [f"{key} {nbytes / 2**30:.3f} GiB" for key, nbytes in sorted(memory.items())]
    return f"{sum(memory.values()) / 2**30:.3f} GiB ({', '.join(parts)})"
