"""A sparse MoE layer's routed experts as one native call, at the few rows of a decode step.

``SparseMoE`` in Python pays, per chosen expert, two kernel calls through ctypes, their
argument checks and fresh output tensors, plus the router, the top-k and the sort between
them: at batch 1 on OLMoE's shapes (8 of 64 experts) that was 1.7-2.2x the time of a dense
MLP of the same active size reading the same bytes (``benchmarks/moe_layer.py``).
``RoutedExperts`` lays out every expert's ops once (``program_ops.linear_ops`` over
scratch rows it owns) and runs routing, the grouped expert GEMMs and the weighted sum
as one ``OP_MOE`` of ``native/decode_program.c``; the decode program embeds the same op
in its table, so a decode step of such a model is one native call (Qwen2-MoE's shared
expert keeps its steps op by op, with this op for the routed part).

It applies to the softmax routers of Qwen2/3-MoE, Mixtral and OLMoE (not gpt-oss's biased
top-k softmax and clamped SwiGLU), on bfloat16 CPU activations through the native
``LayerOps``, when every expert's two layers are int4 or int8 group panels without biases
(what ``--quantization auto`` makes of a GGUF file's codes), for steps of fewer rows than
any expert leaves its panel kernel at, and at most ``program_ops.MAX_ROWS``
(``RADIXSERVE_NATIVE_MOE=0`` keeps the Python path). Its numbers differ from the Python
path's in rounding only: the router's logits are float32 dot products rounded to bfloat16
(oneDNN's bfloat16 GEMM sums in another order, so where two logits nearly tie the two
paths may choose differently), and the weighted sum is taken in float32 and rounded once
(the Python path rounds each weighted output).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.executor import program_ops as po
from radixserve.executor.layers.moe import SparseMoE
from radixserve.executor.native import address, load_decode_program, load_elementwise

# None: RADIXSERVE_NATIVE_MOE decides ("0": the Python path), read when a layer's native
# form is built; a benchmark sets True or False to compare both paths
ENABLED: bool | None = None


def enabled() -> bool:
    if ENABLED is not None:
        return ENABLED
    return os.environ.get("RADIXSERVE_NATIVE_MOE", "1") != "0"


class RoutedExperts:
    """The routed experts of one ``SparseMoE`` (its shared expert, if any, stays in
    Python) for up to ``capacity`` rows.

    Invariant: ``run(x)`` is ``OP_MOE`` over the expert layers listed in ``linears`` (the
    objects the layer held when this was built; ``matches`` says whether it still does),
    with the router, scratch and threads fixed at build; ``op(x, out)`` is that op reading
    ``x`` and writing ``out`` (both [rows, hidden] bfloat16, alive while the op is used).
    With at least two chosen experts a thread, each thread runs whole experts alone over
    its own scratch set (one parallel region a layer); with fewer, each expert's GEMMs
    run on all the threads in turn."""

    def __init__(self, moe: SparseMoE, capacity: int, threads: int) -> None:
        c = moe.config
        # what the op reads, fixed here (the buffers below are sized for them); ``matches``
        # checks the layer still holds them
        self.config, self.router = c, moe.router
        self.capacity, self.threads = capacity, threads
        self.linears = _expert_linears(moe)
        self.lib = load_decode_program()
        hidden = moe.router.shape[1]
        inter = moe.experts[0].down.in_features
        self.hidden = hidden
        bf16, sets = torch.bfloat16, threads
        # a scratch set per thread (set t: the rows of the experts thread t runs alone; set
        # 0 also when every expert runs on all the threads)
        self.xg = torch.empty(sets, capacity, hidden, dtype=bf16)
        self.yd = torch.empty(sets, capacity, hidden, dtype=bf16)
        self.gate_up = torch.empty(sets, capacity, 2 * inter, dtype=bf16)
        self.act = torch.empty(sets, capacity, inter, dtype=bf16)
        self.acc = torch.empty(sets, capacity, hidden, dtype=torch.float32)
        k, experts = c.top_k, c.num_experts
        self.ids = torch.empty(capacity * k, dtype=torch.int64)
        self.order = torch.empty(capacity * k, dtype=torch.int64)
        self.weights = torch.empty(capacity * k, dtype=torch.float32)
        self.logits = torch.empty(capacity * experts, dtype=torch.float32)
        self.counts = torch.empty(experts + 1, dtype=torch.int64)
        width = max(int(w.in_features) for w in self.linears)
        self.scratch = [po.GemmScratch.sized(capacity, width) for _ in range(sets)]
        silu = address(load_elementwise().silu_and_mul_bf16)
        # table 0: each op on all the threads over set 0; table 1 + t: on one thread, set t
        tables = [(0, threads)] + [(t, 1) for t in range(sets)]
        ops: list[list[int]] = []
        for t, nt in tables:
            xg, gate_up, act, yd, scratch = (self.xg[t], self.gate_up[t], self.act[t],
                                             self.yd[t], self.scratch[t])  # fmt: skip
            for expert in moe.experts:
                per = po.linear_ops(expert.gate_up, xg, gate_up, scratch, nt)
                per.append([po.ACT, silu, po.ptr(gate_up), po.ptr(act), inter, nt])
                per += po.linear_ops(expert.down, act, yd, scratch, nt)
                ops += per
        self.per = len(ops) // (len(tables) * experts)
        self.expert_ops = po.table(ops)
        self.flags = int(c.norm_topk_prob) | 2 * int(c.float32_weights)
        self._op = po.table([self.op(self.xg, self.yd)])  # pointers set per call
        self._step = np.zeros(8, dtype=np.int64)  # (decode_program.c's step; no LoRA)

    def op(self, x: torch.Tensor, out: torch.Tensor) -> list[int]:
        """The ``OP_MOE`` row reading ``x`` and writing ``out``."""
        c = self.config
        return [po.MOE, self.threads, po.ptr(x), self.hidden, po.ptr(self.router), c.num_experts,
                c.top_k, self.flags, self.expert_ops.ctypes.data, self.per, po.ptr(self.xg),
                po.ptr(self.yd), po.ptr(self.acc), po.ptr(out), po.ptr(self.ids),
                po.ptr(self.weights), po.ptr(self.logits), po.ptr(self.order), self.capacity,
                po.ptr(self.counts)]  # fmt: skip

    def matches(self, moe: SparseMoE) -> bool:
        """Whether ``moe`` still holds the layers this was built from."""
        return (
            moe.config is self.config
            and moe.router is self.router
            and _expert_linears(moe) == self.linears
        )

    def accepts(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and 0 < x.shape[0] <= self.capacity
            and x.shape[1] == self.hidden
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.is_contiguous()
        )

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [rows, hidden] for ``x`` (``accepts(x)``)."""
        out = torch.empty_like(x)
        self._op[0, 2], self._op[0, 13] = x.data_ptr(), out.data_ptr()
        self._step[6] = x.shape[0]
        if self.lib.decode_program_run(self._op.ctypes.data, 1, self._step.ctypes.data) != 0:
            raise RuntimeError("routed experts: the native op refused its arguments")
        return out


def _expert_linears(moe: SparseMoE) -> list[Any]:
    return [w for e in moe.experts for w in (e.gate_up, e.down)]


def build(moe: SparseMoE) -> RoutedExperts | None:
    """A ``RoutedExperts`` for ``moe``, or None where it does not apply (the module
    docstring says where)."""
    c = moe.config
    router = moe.router
    if (
        not enabled()
        or load_decode_program() is None
        or load_elementwise() is None
        or c.scoring != "softmax"
        or c.activation != "silu"
        or moe.router_bias is not None
        or router.dtype != torch.bfloat16
        or router.device.type != "cpu"
        or not router.is_contiguous()
    ):
        return None
    linears = _expert_linears(moe)
    if not all(po.linear_ok(w) and w.bias is None for w in linears):
        return None
    hidden, inter = router.shape[1], moe.experts[0].down.in_features
    if any(  # the shapes the op's buffers are sized for
        (e.gate_up.in_features, e.gate_up.out_features, e.down.in_features, e.down.out_features)
        != (hidden, 2 * inter, inter, hidden)
        for e in moe.experts
    ):
        return None
    capacity = min(min(po.panel_rows(w) - 1 for w in linears), po.MAX_ROWS)
    if capacity < 1:
        return None
    return RoutedExperts(moe, capacity, torch.get_num_threads())


@dataclass
class _Refused:
    """``build`` refused a layer with this config, router, experts and threads (asked again
    if any of them changes)."""

    config: Any
    router: torch.Tensor
    linears: list[Any]
    threads: int

    def matches(self, moe: SparseMoE) -> bool:
        return (
            moe.config is self.config
            and moe.router is self.router
            and _expert_linears(moe) == self.linears
        )


def routed_experts_for(moe: SparseMoE) -> RoutedExperts | None:
    """``moe``'s native routed experts (built at its first use, again when its layers or
    the thread count changed since; None: the Python path), kept on ``moe.native``."""
    native = moe.native
    threads = torch.get_num_threads()
    if native is None or native.threads != threads or not native.matches(moe):
        native = build(moe) or _Refused(moe.config, moe.router, _expert_linears(moe), threads)
        moe.native = native
    return native if isinstance(native, RoutedExperts) else None
