"""A one-token decode step of a Llama-family model as one native call.

At batch 1 the decoder's matrices are small (SmolLM2-135M: 0.3-1.8 MB a layer) and a step
is ~300 kernel calls; called one by one from Python each pays ctypes, argument checks and
a fresh output tensor, as much as a kernel costs. ``DecodeProgram`` lays the step's calls
out once (``native/decode_program.c``), with preallocated activations, and runs them with
one call per step. Every call is the op-by-op path's own kernel with that path's
arguments, so the hidden states are the same bit for bit (tests compare the two); only
the row-wise kernels of the one row run on one thread (they parallelise over rows, so the
count changes nothing but the thread wake-ups).

It applies where every op of the step has its native kernel: bfloat16 on the CPU, one
rank, the native ``LayerOps``, the native KV write and paged decode, no per-head q/k norm,
and every dense layer held as int4 panels or int8 group panels without a bias (what
``--quantization auto`` makes of a Q4_0/Q4_1/Q8_0 GGUF file; a bfloat16 ``Linear`` goes
through oneDNN, which has no entry point here). Elsewhere ``build`` returns None and the
model keeps its op-by-op forward; ``RADIXSERVE_DECODE_PROGRAM=0`` (or ``ENABLED = False``
before a model's first step) keeps it everywhere.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from radixserve.executor.attention import TorchNativeAttention, TorchNativeMetadata
from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.native import (
    address,
    load_decode_program,
    load_elementwise,
    load_int4_panels,
    load_int8_panels,
)
from radixserve.executor.quant import Int4Linear, Int8GroupLinear

# op kinds and the row width of native/decode_program.c
_EMBED, _NORM, _INT4, _INT8, _ROTARY, _KV_WRITE, _DECODE, _SILU = range(1, 9)
_OP_WIDTH = 20

ENABLED = os.environ.get("RADIXSERVE_DECODE_PROGRAM", "1") != "0"


def _bits(value: float) -> int:
    """A float as the int64 bits of a double (how an op carries it)."""
    return int(np.array(value, dtype=np.float64).view(np.int64))


class DecodeProgram:
    """The calls of one decode step of one token, in order, over buffers it owns.

    Invariant: ``run`` computes what the model's op-by-op forward computes for one token
    (the same kernels on the same arguments), for the ``layers`` list and linears it was
    built from (``matches`` says whether the model still holds those), the KV cache of
    ``attention`` and ``threads`` threads; the tensor it returns is its own (a copy)."""

    def __init__(self, model: Any, attention: TorchNativeAttention, threads: int) -> None:
        self.attention = attention
        self.threads = threads
        self.linears = _linears(model)
        self.lib = load_decode_program()
        c = model.config
        hidden, heads, kv_heads, d = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        q_size, kv_size = heads * d, kv_heads * d
        bf16 = torch.bfloat16
        ew = load_elementwise()
        norm, rotary, silu = (
            address(getattr(ew, f"{n}_bf16")) for n in ("add_rms_norm", "rotary", "silu_and_mul")
        )
        kv_write = address(ew.kv_write)
        int4, int8 = load_int4_panels(), load_int8_panels()
        decode = address(attention.native.paged_decode_bf16)
        cache = attention.kv_cache
        page_size = cache.page_size
        # activations: the residual stream, a normed row, each projection's output
        self.residual = torch.empty(1, hidden, dtype=bf16)
        self.normed = torch.empty(1, hidden, dtype=bf16)
        self.qkv = torch.empty(1, q_size + 2 * kv_size, dtype=bf16)
        self.attn = torch.empty(1, heads * d, dtype=bf16)
        self.o = torch.empty(1, hidden, dtype=bf16)
        self.gate_up = torch.empty(1, 2 * c.intermediate_size, dtype=bf16)
        self.act = torch.empty(1, c.intermediate_size, dtype=bf16)
        self.down = torch.empty(1, hidden, dtype=bf16)
        self.out = torch.empty(1, hidden, dtype=bf16)
        k_max = max(int(w.in_features) for w in self.linears)
        # per-call scratch of the GEMM kernels (sized for the widest input)
        self.xs = torch.empty(k_max, dtype=torch.float32)  # group sums (>= k / group)
        self.xp = torch.empty(k_max, dtype=torch.int32)  # int4: x as bf16 pairs (k / 2)
        self.xt = torch.empty(k_max, dtype=torch.float32)  # int8: x as float32 (k)
        ops: list[list[int]] = []
        eps = _bits(c.rms_norm_eps)
        nt = threads
        rows_nt = 1  # one row: the row-parallel kernels on one thread, no wake-ups

        def ptr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        def linear(w: Any, x: torch.Tensor, y: torch.Tensor) -> list[int]:
            if isinstance(w, Int4Linear):
                return [
                    _INT4,
                    address(int4.int4_panels_gemm_bf16),
                    ptr(x),
                    w.in_features,
                    ptr(w.panels),
                    ptr(w.psz),
                    w.out_features,
                    w.group_size,
                    ptr(self.xs),
                    ptr(self.xp),
                    ptr(y),
                    nt,
                ]
            return [
                _INT8,
                address(int8.int8_panels_gemm_bf16),
                ptr(x),
                w.in_features,
                ptr(w.panels),
                ptr(w.scale),
                ptr(w.zero),
                w.out_features,
                w.group_size,
                ptr(self.xt),
                ptr(self.xs),
                ptr(y),
                nt,
            ]

        embed = model.embed
        ops.append([_EMBED, 0, ptr(self.residual), ptr(embed), hidden * 2, embed.shape[0]])
        rot = model.rotary
        specs = attention.specs
        q_ptr = ptr(self.qkv)
        k_ptr = q_ptr + 2 * q_size
        v_ptr = k_ptr + 2 * kv_size
        add: torch.Tensor | None = None
        for i, lay in enumerate(model.layers):
            ops.append(
                [
                    _NORM,
                    norm,
                    ptr(add),
                    ptr(self.residual),
                    ptr(lay.input_norm),
                    ptr(self.normed),
                    hidden,
                    eps,
                    rows_nt,
                ]
            )
            ops.append(linear(lay.qkv, self.normed, self.qkv))
            ops.append(
                [
                    _ROTARY,
                    rotary,
                    q_ptr,
                    heads + kv_heads,
                    d,
                    ptr(rot.cos),
                    ptr(rot.sin_signed),
                    rot.cos.shape[0],
                    rows_nt,
                ]
            )
            ops.append(
                [
                    _KV_WRITE,
                    kv_write,
                    k_ptr,
                    v_ptr,
                    ptr(cache._k_layers[i]),
                    ptr(cache._v_layers[i]),
                    kv_heads,
                    page_size,
                    d * 2,
                    rows_nt,
                ]
            )
            spec = attention.default_spec if specs is None else specs[i]
            ops.append(
                [
                    _DECODE,
                    decode,
                    q_ptr,
                    ptr(cache._k_layers[i]),
                    ptr(cache._v_layers[i]),
                    kv_heads,
                    heads // kv_heads,
                    page_size,
                    d,
                    _bits(spec.scale),
                    spec.sliding_window or 0,
                    _bits(spec.softcap or 0.0),
                    nt,
                    ptr(self.attn),
                ]
            )
            ops.append(linear(lay.o, self.attn, self.o))
            ops.append(
                [
                    _NORM,
                    norm,
                    ptr(self.o),
                    ptr(self.residual),
                    ptr(lay.post_norm),
                    ptr(self.normed),
                    hidden,
                    eps,
                    rows_nt,
                ]
            )
            ops.append(linear(lay.gate_up, self.normed, self.gate_up))
            ops.append(
                [_SILU, silu, ptr(self.gate_up), ptr(self.act), c.intermediate_size, rows_nt]
            )
            ops.append(linear(lay.down, self.act, self.down))
            add = self.down
        ops.append(
            [
                _NORM,
                norm,
                ptr(add),
                ptr(self.residual),
                ptr(model.norm),
                ptr(self.out),
                hidden,
                eps,
                rows_nt,
            ]
        )
        table = np.zeros((len(ops), _OP_WIDTH), dtype=np.int64)
        for row, op in zip(table, ops, strict=True):
            row[: len(op)] = op
        self.ops = table
        self.num_ops = len(ops)
        self.step = np.zeros(6, dtype=np.int64)
        # what the table points into stays alive as long as the program
        self._keep = (embed, rot.cos, rot.sin_signed, cache.k, cache.v, model.norm, model.layers)

    def matches(self, model: Any) -> bool:
        """Whether ``model`` still holds the layers this program was built from."""
        return _linears(model) == self.linears

    @staticmethod
    def accepts(
        input_ids: torch.Tensor, positions: torch.Tensor, meta: TorchNativeMetadata
    ) -> bool:
        """Whether the step's inputs are what ``run`` reads through their pointers."""
        g = meta.decode
        return (
            g is not None
            and input_ids.dtype == positions.dtype == meta.slots.dtype == torch.int64
            and g.page_tables.dtype == g.seq_lens.dtype == torch.int32
            and input_ids.device.type == positions.device.type == "cpu"
            and g.page_tables.is_contiguous()
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: TorchNativeMetadata
    ) -> torch.Tensor:
        """The final hidden state [1, hidden] of the step's one token."""
        g = meta.decode
        assert g is not None
        st = self.step
        st[0] = input_ids.data_ptr()
        st[1] = positions.data_ptr()
        st[2] = meta.slots.data_ptr()
        st[3] = g.page_tables.data_ptr()
        st[4] = g.seq_lens.data_ptr()
        st[5] = g.page_tables.shape[1]
        rc = self.lib.decode_program_run(self.ops.ctypes.data, self.num_ops, st.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"decode program: op {-rc - 1} refused its arguments")
        return self.out.clone()


def _linears(model: Any) -> list[Any]:
    return [w for lay in model.layers for w in (lay.qkv, lay.o, lay.gate_up, lay.down)]


def _linear_ok(w: Any) -> bool:
    if isinstance(w, Int4Linear):
        return w.panels is not None and w.bias is None and load_int4_panels() is not None
    if isinstance(w, Int8GroupLinear):
        return w.bias is None and load_int8_panels() is not None
    return False


def build(model: Any, attention: object) -> DecodeProgram | None:
    """A ``DecodeProgram`` for ``model`` (a ``LlamaForCausalLM``) over ``attention``, or
    None where a step's op has no native kernel (see the module docstring)."""
    c = model.config
    if (
        not ENABLED
        or load_decode_program() is None
        or not isinstance(attention, TorchNativeAttention)
        or attention.native is None
        or type(model.ops) is not LayerOps
        or model.ops.native is None
        or model.tp.world_size != 1
        or model.dtype != torch.bfloat16
        or model.embed.device.type != "cpu"
        or model.embed.dtype != torch.bfloat16
        or c.qk_norm
    ):
        return None
    cache = attention.kv_cache
    if (
        cache.k.dtype != torch.bfloat16
        or cache.k.device.type != "cpu"
        or cache._kv_write is None
        or not cache.use_native
    ):
        return None
    if tuple(cache.k.shape[2:]) != (c.num_key_value_heads, cache.page_size, c.head_dim):
        return None
    for lay in model.layers:
        if lay.q_norm is not None or lay.k_norm is not None:
            return None
        if not all(_linear_ok(w) for w in (lay.qkv, lay.o, lay.gate_up, lay.down)):
            return None
        for t in (lay.input_norm, lay.post_norm):
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                return None
    if model.norm.dtype != torch.bfloat16 or model.rotary.cos.dtype != torch.bfloat16:
        return None
    return DecodeProgram(model, attention, torch.get_num_threads())
