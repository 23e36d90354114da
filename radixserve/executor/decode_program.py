"""A decode step (one token per sequence) of a Llama-family or Gemma 3 model as one
native call.

A decode step of a small model is ~300 kernel calls (SmolLM2-135M: 0.3-1.8 MB a layer);
called one by one from Python each pays ctypes, argument checks, a fresh output tensor and
its threads' wake-up: as much as a kernel at one row, ~13% of a step at 16 rows.
``DecodeProgram`` lays the step's calls out once (``native/decode_program.c``), over
activations preallocated for up to ``capacity`` rows, and runs them with one call per
step; the row count, token ids, positions, slots and pages are read from the step. Every
call is the op-by-op path's own kernel with that path's arguments, so the hidden states
are the same bit for bit (tests compare the two at one row and at several). Gemma 3's scaled
embedding runs as its forward runs it (PyTorch), before the native call; its per-head
q/k RMSNorm and GeGLU are the ``LayerOps`` kernels.

It applies where every op of the step has its native kernel: bfloat16 on the CPU, one
rank, the native ``LayerOps``, the native KV write and paged decode (no shared prefix
attended once, no attention sinks), q/k norms per head (Qwen3, Gemma 3) or over the whole
projection (OLMoE) through ``LayerOps``' kernel but no ``clip_qkv``, every dense layer
held as int4 panels or int8 group panels, with a bfloat16 bias (Qwen2's q/k/v) or none
(what ``--quantization auto`` makes of a GGUF file of Q4_0/Q4_1/Q4_K/Q5_x/Q6_K/Q8_0
tensors; a bfloat16 ``Linear`` goes through oneDNN, which has no entry point here), and
every sparse layer's routed experts as one ``OP_MOE`` (``routed_experts.py``; no shared
expert), for steps of fewer rows than any layer leaves its panel kernel at
(``program_ops.panel_rows``; at most ``MAX_ROWS``). Elsewhere ``build`` returns None, or
``accepts`` refuses the step, and the model keeps its op-by-op forward;
``RADIXSERVE_DECODE_PROGRAM=0`` (or ``ENABLED = False`` before a model's first step) keeps
it everywhere, and ``RADIXSERVE_NATIVE_MOE=0`` for MoE models.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixserve.executor import batch_invariant
from radixserve.executor import program_ops as po
from radixserve.executor.attention import TorchNativeAttention, TorchNativeMetadata
from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.lora import GROUP_MODULES, LoRAShapes, LoRAStep, slot
from radixserve.executor.native import address, load_decode_program, load_elementwise, load_lora
from radixserve.executor.program_ops import (
    ACT,
    COPY_ROWS,
    DECODE,
    DECODE_INT8,
    EMBED,
    KV_WRITE,
    KV_WRITE_INT8,
    LORA,
    MAX_ROWS,
    NORM,
    NORM_HEADS,
    ROTARY,
    ROTARY_ROWS,
    bits,
    linear_ok,
    linear_ops,
    panel_rows,
    ptr,
)
from radixserve.executor.quant import in_long_prompt_step
from radixserve.executor.routed_experts import RoutedExperts, routed_experts_for

# None: RADIXSERVE_DECODE_PROGRAM decides, read when a model's program is built (at engine
# start, not at import); a benchmark sets True or False to compare both paths
ENABLED: bool | None = None


def enabled() -> bool:
    if ENABLED is not None:
        return ENABLED
    return os.environ.get("RADIXSERVE_DECODE_PROGRAM", "1") != "0"


class DecodeProgram:
    """The calls of one decode step of one token per sequence, in order, over buffers it
    owns, for up to ``capacity`` sequences.

    Invariant: ``run`` computes what the model's op-by-op forward computes for a pure
    decode step of n <= ``capacity`` rows (the same kernels on the same arguments, and the
    same PyTorch op for Gemma 3's scaled embedding, a hook before the native call), for
    the linears it was built from (``matches`` says whether the model still holds them),
    the KV cache of ``attention`` and ``threads`` threads; the tensor it returns is its
    own (a copy)."""

    def __init__(
        self, model: Any, attention: TorchNativeAttention, threads: int, capacity: int
    ) -> None:
        self.threads = threads
        self.capacity = capacity
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
        self.qkv_size = self.q_size + 2 * self.kv_size
        self.eps = bits(c.rms_norm_eps)
        ew = load_elementwise()
        self._norm_fn, self._rotary_fn, self._silu_fn = (
            address(getattr(ew, f"{n}_bf16")) for n in ("add_rms_norm", "rotary", "silu_and_mul")
        )
        self._gelu_fn = address(ew.gelu_tanh_and_mul_bf16) if ew.has_gelu_tanh_and_mul() else 0
        lora = load_lora()
        # the LoRA op after each projection (a no-op in a step without adapters); None: no
        # kernel, and a step with adapters runs op by op
        self._lora_fn = None if lora is None else address(lora.lora_apply_bf16)
        self._lora_shapes = LoRAShapes.of(c)
        self._kv_write_fn = address(ew.kv_write)
        self._decode_fn = address(attention.native.paged_decode_bf16)
        # an int8 KV cache: its C writer and decode (kv_cache.py, paged_decode_int8)
        self._kv_write_int8_fn = address(ew.kv_write_int8_bf16)
        self._decode_int8_fn = address(attention.native.paged_decode_i8_bf16)
        bf16 = torch.bfloat16
        hidden, rows = self.hidden, capacity

        def rows_of(width: int) -> torch.Tensor:
            return torch.empty(rows, width, dtype=bf16)

        # activations: the residual stream, normed rows, each projection's output
        self.residual = rows_of(hidden)
        self.normed = rows_of(hidden)
        self.qkv = rows_of(self.qkv_size)
        self.q = rows_of(self.q_size)  # q contiguous (paged decode reads [n, heads, d])
        self.k = rows_of(self.kv_size)  # Gemma 3: normed k
        self.attn = rows_of(self.q_size)
        self.o = rows_of(hidden)
        self.o_normed = rows_of(hidden)
        self.gate_up = rows_of(2 * c.intermediate_size)
        self.act = rows_of(c.intermediate_size)
        self.down = rows_of(hidden)
        self.down_normed = rows_of(hidden)
        self.out = rows_of(hidden)
        # per-call scratch of the GEMM kernels (sized for the widest input)
        self.scratch = po.GemmScratch.sized(rows, max(int(w.in_features) for w in self.linears))
        self._ops: list[list[int]] = []
        # every tensor the table points into, alive as long as the program
        self._keep: list[torch.Tensor] = [model.embed, model.norm]
        self._experts: list[RoutedExperts] = []  # the MoE layers' ops (their tables, scratch)
        self._embed_hook: Callable[[torch.Tensor], None] | None = None
        if _is_gemma3(model):
            self._gemma3(model, attention)
        else:
            self._llama(model, attention)
        self.ops = po.table(self._ops)
        self.step = np.zeros(8, dtype=np.int64)
        self._keep += [attention.kv_cache.k, attention.kv_cache.v]

    # -- building ---------------------------------------------------------------------------
    def _add_norm(
        self, add: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``LayerOps.add_rms_norm(add, residual, w)`` into ``out``."""
        self._keep.append(w)
        self._ops.append(
            [NORM, self._norm_fn, ptr(add), ptr(residual), ptr(w), ptr(out), self.hidden,
             self.eps, self.threads]
        )  # fmt: skip

    def _linear(self, w: Any, x: torch.Tensor, y: torch.Tensor, layer: int, group: str) -> None:
        """``y = w(x)``, then the step's LoRA adapters' products for each module of
        projection ``group`` of ``layer``, on its columns of ``y`` (``LoRAStep.add``'s
        kernel on its arguments)."""
        if w.bias is not None:
            self._keep.append(w.bias)
        self._ops += linear_ops(w, x, y, self.scratch, self.threads)
        if self._lora_fn is None:
            return
        for module in GROUP_MODULES[group]:
            first, rows = self._lora_shapes.out_slices(group)[module]
            self._ops.append(
                [LORA, self._lora_fn, ptr(x), x.stride(0), ptr(y) + 2 * first, y.stride(0),
                 x.shape[1], rows, slot(layer, module), self.threads]
            )  # fmt: skip

    def _rotary_rows(self, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathers ``table``'s (a RotaryEmbedding) rows of the step's positions; returns
        the buffers they land in ([capacity, d] cos and signed sin)."""
        cos = torch.empty(self.capacity, self.d, dtype=torch.bfloat16)
        sin = torch.empty_like(cos)
        self._keep += [table.cos, table.sin_signed, cos, sin]
        self._ops.append(
            [ROTARY_ROWS, 0, ptr(table.cos), ptr(table.sin_signed), table.cos.shape[0],
             self.d, ptr(cos), ptr(sin)]
        )  # fmt: skip
        return cos, sin

    def _rotary(
        self, x: torch.Tensor, heads: int, stride: int, rows: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """``LayerOps.rotary`` of the first ``heads`` heads of each row of ``x`` (rows
        ``stride`` elements apart) by the gathered table rows ``rows``."""
        self._ops.append(
            [ROTARY, self._rotary_fn, ptr(x), heads, self.d, stride, ptr(rows[0]),
             ptr(rows[1]), self.threads]
        )  # fmt: skip

    def _attention(
        self, attention: TorchNativeAttention, layer: int, k: torch.Tensor, k_stride: int
    ) -> None:
        """The KV write of the step's k (rows ``k_stride`` elements apart) and v (in qkv),
        then the paged decode of ``self.q`` into ``attn``."""
        cache = attention.kv_cache
        k_layer, v_layer = ptr(cache._k_layers[layer]), ptr(cache._v_layers[layer])
        v_ptr = ptr(self.qkv) + 2 * (self.q_size + self.kv_size)
        spec = attention.default_spec if attention.specs is None else attention.specs[layer]
        if cache.quantized:
            assert cache.k_scale is not None and cache.v_scale is not None
            k_scale, v_scale = ptr(cache.k_scale[layer]), ptr(cache.v_scale[layer])
            self._ops.append(
                [KV_WRITE_INT8, self._kv_write_int8_fn, ptr(k), v_ptr, k_stride,
                 self.qkv_size, k_layer, v_layer, k_scale, v_scale, self.kv_heads,
                 cache.page_size, self.d]
            )  # fmt: skip
            self._ops.append(
                [DECODE_INT8, self._decode_int8_fn, ptr(self.q), k_layer, v_layer, k_scale,
                 v_scale, self.kv_heads, self.heads // self.kv_heads, cache.page_size, self.d,
                 bits(spec.scale), spec.sliding_window or 0, bits(spec.softcap or 0.0),
                 self.threads, ptr(self.attn)]
            )  # fmt: skip
            return
        self._ops.append(
            [KV_WRITE, self._kv_write_fn, ptr(k), v_ptr, 2 * k_stride, 2 * self.qkv_size,
             k_layer, v_layer, self.kv_heads, cache.page_size, self.d * 2]
        )  # fmt: skip
        self._ops.append(
            [DECODE, self._decode_fn, ptr(self.q), k_layer, v_layer, self.kv_heads,
             self.heads // self.kv_heads, cache.page_size, self.d, bits(spec.scale),
             spec.sliding_window or 0, bits(spec.softcap or 0.0), self.threads,
             ptr(self.attn)]
        )  # fmt: skip

    def _copy_q(self) -> None:
        """Each row's q out of its qkv row, contiguous (``q.contiguous()`` of the
        attention backend)."""
        self._ops.append(
            [COPY_ROWS, 0, ptr(self.qkv), 2 * self.qkv_size, ptr(self.q), 2 * self.q_size]
        )

    def _norm_heads(
        self,
        src: torch.Tensor,
        offset: int,
        heads: int,
        w: torch.Tensor,
        dst: torch.Tensor,
        d: int | None = None,
    ) -> None:
        """``LayerOps.rms_norm_heads`` of the ``heads`` heads of ``d`` (default: the head
        dim) at ``offset`` in each qkv row into ``dst`` [n, heads, d]."""
        self._keep.append(w)
        self._ops.append(
            [NORM_HEADS, self._norm_fn, ptr(src) + 2 * offset, self.qkv_size, heads,
             d or self.d, ptr(w), ptr(dst), self.eps]
        )  # fmt: skip

    def _llama(self, model: Any, attention: TorchNativeAttention) -> None:
        """``LlamaForCausalLM.forward`` of a decode step: all native."""
        embed = model.embed
        self._ops.append(
            [EMBED, 0, ptr(self.residual), ptr(embed), self.hidden * 2, embed.shape[0]]
        )
        rows = self._rotary_rows(model.rotary)
        add: torch.Tensor | None = None
        whole = model.config.qk_norm_whole
        heads, kv_heads = self.heads, self.kv_heads
        for i, lay in enumerate(model.layers):
            self._add_norm(add, self.residual, lay.input_norm, self.normed)
            self._linear(lay.qkv, self.normed, self.qkv, i, "qkv")
            if lay.q_norm is None:
                # q and k rotate together in place, as one [n, heads + kv_heads, d] view
                self._rotary(self.qkv, heads + kv_heads, self.qkv_size, rows)
                self._copy_q()
                k = self.qkv[:, self.q_size :]  # a view: the kv write reads it at qkv's stride
                self._attention(attention, i, k, self.qkv_size)
            else:  # Qwen3's norm per head, OLMoE's over the whole projection
                self._norm_heads(self.qkv, 0, 1 if whole else heads, lay.q_norm, self.q,
                                 self.q_size if whole else self.d)  # fmt: skip
                self._norm_heads(self.qkv, self.q_size, 1 if whole else kv_heads, lay.k_norm,
                                 self.k, self.kv_size if whole else self.d)  # fmt: skip
                self._rotary(self.q, heads, self.q_size, rows)
                self._rotary(self.k, kv_heads, self.kv_size, rows)
                self._attention(attention, i, self.k, self.kv_size)
            self._linear(lay.o, self.attn, self.o, i, "o")
            self._add_norm(self.o, self.residual, lay.post_norm, self.normed)
            if lay.moe is not None:
                experts = routed_experts_for(lay.moe)
                assert experts is not None  # (build checked)
                self._experts.append(experts)
                self._ops.append(experts.op(self.normed, self.down))
            else:
                self._linear(lay.gate_up, self.normed, self.gate_up, i, "gate_up")
                self._ops.append(
                    [ACT, self._silu_fn, ptr(self.gate_up), ptr(self.act), self.act.shape[1],
                     self.threads]
                )  # fmt: skip
                self._linear(lay.down, self.act, self.down, i, "down")
            add = self.down
        self._add_norm(add, self.residual, model.norm, self.out)

    def _gemma3(self, model: Any, attention: TorchNativeAttention) -> None:
        """``Gemma3ForCausalLM.forward`` of a decode step: native but for the scaled
        embedding, which runs as that forward runs it (PyTorch) before the native call."""
        c = model.config
        heads, kv_heads = self.heads, self.kv_heads
        # the hook holds a tensor and a weak reference to the model, never the program or
        # the model: no reference cycle keeps a closed engine's KV cache alive
        residual = self.residual
        owner = weakref.ref(model)

        def embed(input_ids: torch.Tensor) -> None:
            residual[: input_ids.shape[0]].copy_(owner().embed_tokens(input_ids))

        self._embed_hook = embed
        rows = {
            False: self._rotary_rows(model.rotary_global),
            True: self._rotary_rows(model.rotary_local),
        }
        add: torch.Tensor | None = None
        for i, lay in enumerate(model.layers):
            cos_sin = rows[c.is_sliding(i)]
            self._add_norm(add, self.residual, lay.input_norm, self.normed)
            self._linear(lay.qkv, self.normed, self.qkv, i, "qkv")
            self._norm_heads(self.qkv, 0, heads, lay.q_norm, self.q)
            self._norm_heads(self.qkv, self.q_size, kv_heads, lay.k_norm, self.k)
            self._rotary(self.q, heads, self.q_size, cos_sin)
            self._rotary(self.k, kv_heads, self.kv_size, cos_sin)
            self._attention(attention, i, self.k, self.kv_size)
            self._linear(lay.o, self.attn, self.o, i, "o")
            self._add_norm(None, self.o, lay.post_attn_norm, self.o_normed)
            self._add_norm(self.o_normed, self.residual, lay.pre_ffn_norm, self.normed)
            self._linear(lay.gate_up, self.normed, self.gate_up, i, "gate_up")
            self._ops.append(
                [ACT, self._gelu_fn, ptr(self.gate_up), ptr(self.act), self.act.shape[1],
                 self.threads]
            )  # fmt: skip
            self._linear(lay.down, self.act, self.down, i, "down")
            self._add_norm(None, self.down, lay.post_ffn_norm, self.down_normed)
            add = self.down_normed
        self._add_norm(add, self.residual, model.norm, self.out)

    # -- running ---------------------------------------------------------------------------
    def matches(self, model: Any) -> bool:
        """Whether ``model`` still holds the layers this program was built from."""
        return _linears(model) == self.linears

    def accepts(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: TorchNativeMetadata,
        lora: LoRAStep | None = None,
    ) -> bool:
        """Whether the step's inputs are what ``run`` reads through their pointers (and
        its LoRA adapters, if any, all on the native kernel)."""
        g = meta.decode
        n = input_ids.shape[0]
        return (
            (
                lora is None
                or (self._lora_fn is not None and lora.desc is not None and not lora.long)
            )
            and g is not None
            and 0 < n <= self.capacity
            and positions.shape == meta.slots.shape == g.seq_lens.shape == (n,)
            and g.page_tables.shape[0] == n
            and input_ids.dtype == positions.dtype == meta.slots.dtype == torch.int64
            and g.page_tables.dtype == g.seq_lens.dtype == torch.int32
            and input_ids.device.type == positions.device.type == "cpu"
            and all(
                t.is_contiguous()
                for t in (input_ids, positions, meta.slots, g.page_tables, g.seq_lens)
            )
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: TorchNativeMetadata,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """The final hidden states [n, hidden] of the step's n tokens (on their LoRA
        adapters: ``lora``, which ``accepts`` took)."""
        g = meta.decode
        assert g is not None
        n = input_ids.shape[0]
        st = self.step
        st[0] = input_ids.data_ptr()
        st[1] = positions.data_ptr()
        st[2] = meta.slots.data_ptr()
        st[3] = g.page_tables.data_ptr()
        st[4] = g.seq_lens.data_ptr()
        st[5] = g.page_tables.shape[1]
        st[6] = n
        st[7] = 0 if lora is None or lora.desc is None else lora.desc.ctypes.data
        if self._embed_hook is not None:
            self._embed_hook(input_ids)
        rc = self.lib.decode_program_run(self.ops.ctypes.data, len(self.ops), st.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"decode program: op {-rc - 1} refused its arguments")
        return self.out[:n].clone()


def _is_gemma3(model: Any) -> bool:
    return bool(model.layers) and hasattr(model.layers[0], "post_ffn_norm")


def _linears(model: Any) -> list[Any]:
    """Every layer the program multiplies (a sparse layer's: its experts')."""
    out = []
    for lay in model.layers:
        out += (lay.qkv, lay.o)
        if getattr(lay, "moe", None) is not None:
            out += [w for e in lay.moe.experts for w in (e.gate_up, e.down)]
        else:
            out += (lay.gate_up, lay.down)
    return out


def _gelu_ok(model: Any) -> bool:
    """Whether Gemma 3's activation is ``LayerOps.gelu_tanh_and_mul`` on its native kernel."""
    act = model.act
    return (
        getattr(act, "__func__", None) is LayerOps.gelu_tanh_and_mul
        and act.__self__ is model.ops
        and bool(model.ops.native.has_gelu_tanh_and_mul())
    )


def build(model: Any, attention: object) -> DecodeProgram | None:
    """A ``DecodeProgram`` for ``model`` (a ``LlamaForCausalLM`` or ``Gemma3ForCausalLM``)
    over ``attention``, or None where a step's op has no native kernel (see the module
    docstring)."""
    c = model.config
    gemma = _is_gemma3(model)
    if (
        not enabled()
        or load_decode_program() is None
        or not isinstance(attention, TorchNativeAttention)
        or attention.native is None
        or type(model.ops) is not LayerOps
        or model.ops.native is None
        or model.tp.world_size != 1
        or model.dtype != torch.bfloat16
        or model.embed.device.type != "cpu"
        or model.embed.dtype != torch.bfloat16
        or c.clip_qkv is not None
        or c.attention_sinks
        or (gemma and not _gelu_ok(model))
    ):
        return None
    cache = attention.kv_cache
    quantized = getattr(cache, "quantized", False)
    if (
        cache.k.dtype != (torch.int8 if quantized else torch.bfloat16)
        or (quantized and (cache.dtype != torch.bfloat16 or cache._kv_write_int8 is None))
        or cache.k.device.type != "cpu"
        or cache._kv_write is None
        or not cache.use_native
    ):
        return None
    if tuple(cache.k.shape[2:]) != (c.num_key_value_heads, cache.page_size, c.head_dim):
        return None
    for lay in model.layers:
        if gemma:
            norms = (lay.input_norm, lay.q_norm, lay.k_norm, lay.post_attn_norm,
                     lay.pre_ffn_norm, lay.post_ffn_norm)  # fmt: skip
        else:
            norms = (lay.input_norm, lay.post_norm)
            if lay.q_norm is not None:
                norms += (lay.q_norm, lay.k_norm)
        if (
            getattr(lay, "moe", None) is not None
        ):  # the routed experts' own op, and no shared expert
            experts = routed_experts_for(lay.moe)
            if experts is None or lay.moe.shared is not None:
                return None
            if not all(linear_ok(w) for w in (lay.qkv, lay.o)):
                return None
        elif not all(linear_ok(w) for w in (lay.qkv, lay.o, lay.gate_up, lay.down)):
            return None
        if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in norms):
            return None
    tables = (model.rotary_local, model.rotary_global) if gemma else (model.rotary,)
    if model.norm.dtype != torch.bfloat16 or any(
        t.cos.dtype != torch.bfloat16
        or t.cos.device.type != "cpu"
        or t.cos.shape[1] != c.head_dim
        or not (t.cos.is_contiguous() and t.sin_signed.is_contiguous())
        for t in tables
    ):
        return None
    capacity = min(panel_rows(w) - 1 for w in _linears(model))
    for lay in model.layers:
        if getattr(lay, "moe", None) is not None:
            capacity = min(capacity, lay.moe.native.capacity)
    if model.mlp_block_rows is not None:
        capacity = min(capacity, model.mlp_block_rows)
    capacity = min(capacity, MAX_ROWS)
    if capacity < 1:
        return None
    return DecodeProgram(model, attention, torch.get_num_threads(), capacity)


def program_for(model: Any, attention: object, meta: object) -> DecodeProgram | None:
    """The model's program for this step over ``attention`` if it is a pure decode step
    (one token per sequence, no shared prefix to attend once; None: this step or this
    model runs op by op). Built at the model's first such step for a backend, and again
    when the model's layers or the thread count changed since; the model keeps it in
    ``_program`` (None: refused) and the backend it was built for in ``_program_for``."""
    if (
        not isinstance(meta, TorchNativeMetadata)
        or meta.decode is None
        or not meta.decode.whole_batch
        or not meta.decode.one_per_request
        or meta.decode.prefix is not None
        or in_long_prompt_step()
        # deterministic mode: only where its one call a layer computes each row alone
        or (batch_invariant.on() and not batch_invariant.whole_calls(meta.num_tokens))
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
