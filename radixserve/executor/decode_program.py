"""A one-token decode step of a Llama-family or Gemma 3 model as (nearly) one native call.

At batch 1 the decoder's matrices are small (SmolLM2-135M: 0.3-1.8 MB a layer) and a step
is ~300 kernel calls; called one by one from Python each pays ctypes, argument checks, a
fresh output tensor and its threads' wake-up, as much as a kernel costs. ``DecodeProgram``
lays the step's calls out once (``native/decode_program.c``), with preallocated
activations, and runs them with one call per step. Every call is the op-by-op path's own
kernel with that path's arguments, so the hidden states are the same bit for bit (tests
compare the two); only the row-wise kernels of the one row run on one thread (they
parallelise over rows, so the count changes nothing but the thread wake-ups). Gemma 3's
ops without a native kernel (the scaled embedding, the per-head q/k RMSNorm, GeGLU) run
between native segments as its forward runs them: three native calls a layer.

It applies where every other op of the step has its native kernel: bfloat16 on the CPU,
one rank, the native ``LayerOps``, the native KV write and paged decode, no per-head q/k
norm (Llama family: Qwen3 has one), and every dense layer held as int4 panels or int8
group panels without a bias (what ``--quantization auto`` makes of a GGUF file of
Q4_0/Q4_1/Q4_K/Q5_x/Q6_K/Q8_0 tensors; a bfloat16 ``Linear`` goes through oneDNN, which
has no entry point here). Elsewhere ``build`` returns None and the model keeps its
op-by-op forward; ``RADIXSERVE_DECODE_PROGRAM=0`` (or ``ENABLED = False`` before a
model's first step) keeps it everywhere.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
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
    (the same kernels on the same arguments, and the same PyTorch ops where a model has
    an op with no native kernel: ``hooks`` run between the native segments), for the
    linears it was built from (``matches`` says whether the model still holds them), the
    KV cache of ``attention`` and ``threads`` threads; the tensor it returns is its own
    (a copy)."""

    def __init__(self, model: Any, attention: TorchNativeAttention, threads: int) -> None:
        self.threads = threads
        self.linears = _linears(model)
        self.lib = load_decode_program()
        c = model.config
        self.hidden, self.heads, self.kv_heads, self.d = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_size, self.kv_size = self.heads * self.d, self.kv_heads * self.d
        self.eps = _bits(c.rms_norm_eps)
        ew = load_elementwise()
        self._norm_fn, self._rotary_fn, self._silu_fn = (
            address(getattr(ew, f"{n}_bf16")) for n in ("add_rms_norm", "rotary", "silu_and_mul")
        )
        self._kv_write_fn = address(ew.kv_write)
        int4, int8 = load_int4_panels(), load_int8_panels()
        self._int4_fn = 0 if int4 is None else address(int4.int4_panels_gemm_bf16)
        self._int8_fn = 0 if int8 is None else address(int8.int8_panels_gemm_bf16)
        self._decode_fn = address(attention.native.paged_decode_bf16)
        bf16 = torch.bfloat16
        hidden = self.hidden
        # activations: the residual stream, normed rows, each projection's output
        self.residual = torch.empty(1, hidden, dtype=bf16)
        self.normed = torch.empty(1, hidden, dtype=bf16)
        self.qkv = torch.empty(1, self.q_size + 2 * self.kv_size, dtype=bf16)
        self.attn = torch.empty(1, self.q_size, dtype=bf16)
        self.o = torch.empty(1, hidden, dtype=bf16)
        self.o_normed = torch.empty(1, hidden, dtype=bf16)
        self.gate_up = torch.empty(1, 2 * c.intermediate_size, dtype=bf16)
        self.act = torch.empty(1, c.intermediate_size, dtype=bf16)
        self.down = torch.empty(1, hidden, dtype=bf16)
        self.down_normed = torch.empty(1, hidden, dtype=bf16)
        self.out = torch.empty(1, hidden, dtype=bf16)
        k_max = max(int(w.in_features) for w in self.linears)
        # per-call scratch of the GEMM kernels (sized for the widest input)
        self.xs = torch.empty(k_max, dtype=torch.float32)  # group sums (>= k / group)
        self.xp = torch.empty(k_max, dtype=torch.int32)  # int4: x as bf16 pairs (k / 2)
        self.xt = torch.empty(k_max, dtype=torch.float32)  # int8: x as float32 (k)
        self._ops: list[list[int]] = []
        # every tensor the table points into, alive as long as the program
        self._keep: list[torch.Tensor] = [model.embed, model.norm]
        # (first op, op count, then a hook or None): run in order
        self._segments: list[tuple[int, int, Callable[[], None] | None]] = []
        self._segment_start = 0
        self._embed_hook: Callable[[torch.Tensor], None] | None = None
        if _is_gemma3(model):
            self._gemma3(model, attention)
        else:
            self._llama(model, attention)
        self._cut(None)
        table = np.zeros((len(self._ops), _OP_WIDTH), dtype=np.int64)
        for row, op in zip(table, self._ops, strict=True):
            row[: len(op)] = op
        self.ops = table
        base = table.ctypes.data
        self._runs = [
            (base + first * _OP_WIDTH * 8, count, hook) for first, count, hook in self._segments
        ]
        self.step = np.zeros(6, dtype=np.int64)
        self._keep += [attention.kv_cache.k, attention.kv_cache.v]

    # -- building ---------------------------------------------------------------------------
    def _cut(self, hook: Callable[[], None] | None) -> None:
        """End the current native segment; ``hook`` runs after it."""
        first = self._segment_start
        self._segments.append((first, len(self._ops) - first, hook))
        self._segment_start = len(self._ops)

    def _add_norm(
        self, add: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``LayerOps.add_rms_norm(add, residual, w)`` into ``out`` (one row, one thread)."""
        self._keep.append(w)
        self._ops.append(
            [_NORM, self._norm_fn, _ptr(add), _ptr(residual), _ptr(w), _ptr(out), self.hidden,
             self.eps, 1]
        )  # fmt: skip

    def _linear(self, w: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        nt = self.threads
        if isinstance(w, Int4Linear):
            op = [
                _INT4,
                self._int4_fn,
                _ptr(x),
                w.in_features,
                _ptr(w.panels),
                _ptr(w.psz),
                w.out_features,
                w.group_size,
                _ptr(self.xs),
                _ptr(self.xp),
                _ptr(y),
                nt,
            ]
        else:
            op = [_INT8, self._int8_fn, _ptr(x), w.in_features, _ptr(w.panels), _ptr(w.scale),
                  _ptr(w.zero), w.out_features, w.group_size, _ptr(self.xt), _ptr(self.xs),
                  _ptr(y), nt]  # fmt: skip
        self._ops.append(op)

    def _rotary(self, x_ptr: int, heads: int, table: Any) -> None:
        """``LayerOps.rotary`` of ``heads`` heads from ``x_ptr`` by ``table``'s row of the
        step's position (a RotaryEmbedding)."""
        self._keep += [table.cos, table.sin_signed]
        self._ops.append(
            [_ROTARY, self._rotary_fn, x_ptr, heads, self.d, _ptr(table.cos),
             _ptr(table.sin_signed), table.cos.shape[0], 1]
        )  # fmt: skip

    def _attention(self, attention: TorchNativeAttention, layer: int) -> None:
        """The KV write of the step's k/v, then the paged decode of q into ``attn``."""
        cache = attention.kv_cache
        k_layer, v_layer = _ptr(cache._k_layers[layer]), _ptr(cache._v_layers[layer])
        q_ptr = _ptr(self.qkv)
        k_ptr = q_ptr + 2 * self.q_size
        v_ptr = k_ptr + 2 * self.kv_size
        self._ops.append(
            [_KV_WRITE, self._kv_write_fn, k_ptr, v_ptr, k_layer, v_layer, self.kv_heads,
             cache.page_size, self.d * 2, 1]
        )  # fmt: skip
        spec = attention.default_spec if attention.specs is None else attention.specs[layer]
        self._ops.append(
            [_DECODE, self._decode_fn, q_ptr, k_layer, v_layer, self.kv_heads,
             self.heads // self.kv_heads, cache.page_size, self.d, _bits(spec.scale),
             spec.sliding_window or 0, _bits(spec.softcap or 0.0), self.threads,
             _ptr(self.attn)]
        )  # fmt: skip

    def _llama(self, model: Any, attention: TorchNativeAttention) -> None:
        """``LlamaForCausalLM.forward`` for one token: all native."""
        embed = model.embed
        self._ops.append(
            [_EMBED, 0, _ptr(self.residual), _ptr(embed), self.hidden * 2, embed.shape[0]]
        )
        add: torch.Tensor | None = None
        for i, lay in enumerate(model.layers):
            self._add_norm(add, self.residual, lay.input_norm, self.normed)
            self._linear(lay.qkv, self.normed, self.qkv)
            self._rotary(_ptr(self.qkv), self.heads + self.kv_heads, model.rotary)
            self._attention(attention, i)
            self._linear(lay.o, self.attn, self.o)
            self._add_norm(self.o, self.residual, lay.post_norm, self.normed)
            self._linear(lay.gate_up, self.normed, self.gate_up)
            self._ops.append(
                [_SILU, self._silu_fn, _ptr(self.gate_up), _ptr(self.act), self.act.shape[1], 1]
            )
            self._linear(lay.down, self.act, self.down)
            add = self.down
        self._add_norm(add, self.residual, model.norm, self.out)

    def _gemma3(self, model: Any, attention: TorchNativeAttention) -> None:
        """``Gemma3ForCausalLM.forward`` for one token: native but for the scaled embedding,
        the per-head q/k RMSNorm and GeGLU, which run as that forward runs them (PyTorch)
        between native segments."""
        c = model.config
        eps = c.rms_norm_eps
        heads, kv_heads, d = self.heads, self.kv_heads, self.d
        q = self.qkv[:, : self.q_size].view(1, heads, d)
        k = self.qkv[:, self.q_size : self.q_size + self.kv_size].view(1, kv_heads, d)
        # the hooks hold tensors and a weak reference to the model, never the program or
        # the model: no reference cycle keeps a closed engine's KV cache alive
        residual, gate_up, act_out, act = self.residual, self.gate_up, self.act, model.act
        owner = weakref.ref(model)

        def embed(input_ids: torch.Tensor) -> None:
            residual.copy_(owner().embed_tokens(input_ids))

        def geglu() -> None:
            act_out.copy_(act(gate_up))

        self._embed_hook = embed
        add: torch.Tensor | None = None
        for i, lay in enumerate(model.layers):
            table = model.rotary_local if c.is_sliding(i) else model.rotary_global
            self._add_norm(add, self.residual, lay.input_norm, self.normed)
            self._linear(lay.qkv, self.normed, self.qkv)

            qk_norm = _qk_norm(model.ops, q, k, lay.q_norm, lay.k_norm, eps)
            self._cut(qk_norm)
            self._rotary(_ptr(self.qkv), heads + kv_heads, table)
            self._attention(attention, i)
            self._linear(lay.o, self.attn, self.o)
            self._add_norm(None, self.o, lay.post_attn_norm, self.o_normed)
            self._add_norm(self.o_normed, self.residual, lay.pre_ffn_norm, self.normed)
            self._linear(lay.gate_up, self.normed, self.gate_up)
            self._cut(geglu)
            self._linear(lay.down, self.act, self.down)
            self._add_norm(None, self.down, lay.post_ffn_norm, self.down_normed)
            add = self.down_normed
        self._add_norm(add, self.residual, model.norm, self.out)

    # -- running ----------------------------------------------------------------------------
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
        if self._embed_hook is not None:
            self._embed_hook(input_ids)
        step = st.ctypes.data
        done = 0
        for ops, count, hook in self._runs:
            rc = self.lib.decode_program_run(ops, count, step)
            if rc != 0:
                raise RuntimeError(f"decode program: op {done - rc - 1} refused its arguments")
            done += count
            if hook is not None:
                hook()
        return self.out.clone()


def _qk_norm(
    ops: Any, q: torch.Tensor, k: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor, eps: float
) -> Callable[[], None]:
    """Gemma 3's per-head q and k RMSNorm in place, as its forward computes it
    (``LayerOps.rms_norm_heads``)."""

    def run() -> None:
        q.copy_(ops.rms_norm_heads(q, qw, eps))
        k.copy_(ops.rms_norm_heads(k, kw, eps))

    return run


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _is_gemma3(model: Any) -> bool:
    return bool(model.layers) and hasattr(model.layers[0], "post_ffn_norm")


def _linears(model: Any) -> list[Any]:
    return [w for lay in model.layers for w in (lay.qkv, lay.o, lay.gate_up, lay.down)]


def _linear_ok(w: Any) -> bool:
    if isinstance(w, Int4Linear):
        return w.panels is not None and w.bias is None and load_int4_panels() is not None
    if isinstance(w, Int8GroupLinear):
        return w.bias is None and load_int8_panels() is not None
    return False


def build(model: Any, attention: object) -> DecodeProgram | None:
    """A ``DecodeProgram`` for ``model`` (a ``LlamaForCausalLM`` or ``Gemma3ForCausalLM``)
    over ``attention``, or None where a step's op has no native kernel (see the module
    docstring)."""
    c = model.config
    gemma = _is_gemma3(model)
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
        or (c.qk_norm and not gemma)
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
        if gemma:
            norms = (lay.input_norm, lay.post_attn_norm, lay.pre_ffn_norm, lay.post_ffn_norm)
        elif lay.q_norm is not None or lay.k_norm is not None:
            return None
        else:
            norms = (lay.input_norm, lay.post_norm)
        if not all(_linear_ok(w) for w in (lay.qkv, lay.o, lay.gate_up, lay.down)):
            return None
        if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in norms):
            return None
    tables = (model.rotary_local, model.rotary_global) if gemma else (model.rotary,)
    if model.norm.dtype != torch.bfloat16 or any(
        t.cos.dtype != torch.bfloat16 or t.cos.device.type != "cpu" for t in tables
    ):
        return None
    return DecodeProgram(model, attention, torch.get_num_threads())


def program_for(model: Any, attention: object, meta: object) -> DecodeProgram | None:
    """The model's program for this one-token step over ``attention`` (None: this step or
    this model runs op by op). Built at the model's first such step for a backend, and
    again when the model's layers or the thread count changed since; the model keeps it
    in ``_program`` (None: refused) and the backend it was built for in ``_program_for``."""
    if (
        not isinstance(meta, TorchNativeMetadata)
        or meta.decode is None
        or not meta.decode.whole_batch
        or meta.decode.prefix is not None
    ):
        return None
    program = model._program
    if model._program_for is not attention or (
        program is not None
        and (not program.matches(model) or program.threads != torch.get_num_threads())
    ):
        program = build(model, attention)
        model._program, model._program_for = program, attention
    return program
