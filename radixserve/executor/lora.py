"""LoRA adapters served over one base model: what an adapter holds for the projections the
models here fuse (q/k/v, o, gate/up, down), and the low-rank products of one step applied
to the rows of each adapter's requests (``LoRAStep``), after the base GEMM ran once for
the whole batch. No adapter is ever merged into the base weights. Reading adapter files
and the server's adapters by name: ``lora_loader``.

An adapter holds, per layer and targeted module (``q_proj`` .. ``down_proj``, Phi-3's fused
``qkv_proj`` and ``gate_up_proj``), ``A`` [r, in] and ``Bt`` [r, rows] (``lora_B``
transposed, the scaling folded in): the module's delta lands on its columns of the fused
projection's output (``LoRAModule``). Nothing is padded to other modules' ranks or rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixserve.executor.model_config import ModelConfig
from radixserve.executor.native import load_lora

__all__ = ["LoRAAdapter", "LoRAModule", "LoRAShapes", "LoRAStep"]

# the fused projections of a decoder layer and the PEFT module names each one holds, with
# the module's slice of the group's output: "q" .. "down" as ``LoRAShapes`` sizes them
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# modules stored fused (Phi-3): the whole group's output
FUSED_MODULES = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
_MODULE_GROUP = {m: g for g, ms in GROUPS.items() for m in ms} | FUSED_MODULES
# every module an adapter may hold, each a slot of ``native/lora.c``'s table, by group
GROUP_MODULES: dict[str, tuple[str, ...]] = {
    g: tuple(m for m in _MODULE_GROUP if _MODULE_GROUP[m] == g) for g in GROUPS
}
MODULES: tuple[str, ...] = tuple(m for ms in GROUP_MODULES.values() for m in ms)
_MODULE_INDEX = {m: i for i, m in enumerate(MODULES)}


@dataclass(frozen=True)
class LoRAShapes:
    """The base model's projection sizes a PEFT adapter must match."""

    num_layers: int
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    # layers whose MLP is a mixture of experts (no gate/up/down LoRA there)
    sparse_layers: frozenset[int] = frozenset()
    head_dim: int = 0  # (a llama-arch GGUF adapter's q/k rows are permuted by head)

    def out_slices(self, group: str) -> dict[str, tuple[int, int]]:
        """(first row, rows) of each module inside ``group``'s output."""
        q, kv, inter = self.q_size, self.kv_size, self.intermediate
        return (
            {
                "qkv": {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)},
                "o": {"o_proj": (0, self.hidden)},
                "gate_up": {"gate_proj": (0, inter), "up_proj": (inter, inter)},
                "down": {"down_proj": (0, self.hidden)},
            }[group]
            | ({"qkv_proj": (0, q + 2 * kv)} if group == "qkv" else {})
            | ({"gate_up_proj": (0, 2 * inter)} if group == "gate_up" else {})
        )

    @classmethod
    def of(cls, c: ModelConfig) -> LoRAShapes:
        """The projection sizes of a model of config ``c``."""
        sparse = c.moe.sparse_layers if c.moe is not None else ()
        return cls(
            num_layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            q_size=c.num_attention_heads * c.head_dim,
            kv_size=c.num_key_value_heads * c.head_dim,
            intermediate=c.intermediate_size,
            sparse_layers=frozenset(i for i, s in enumerate(sparse) if s),
            head_dim=c.head_dim,
        )

    def in_size(self, group: str) -> int:
        return {"qkv": self.hidden, "o": self.q_size, "gate_up": self.hidden}.get(
            group, self.intermediate
        )


@dataclass
class LoRAModule:
    """One layer's LoRA pair of one module: ``a`` [r, in]; ``b`` its ``Bt`` [r, rows]
    (scaled), plain, or ``blocked`` for the native kernel ([ceil(rows / 32), ceil(r / 2),
    32, 2], zero-padded: ``native/lora.c``); its delta lands on columns ``first ..
    first + rows`` of the fused projection's output."""

    a: torch.Tensor
    b: torch.Tensor
    first: int
    rows: int
    blocked: bool = False

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def b_t(self) -> torch.Tensor:
        """``Bt`` [r, rows], plain (a copy when held blocked)."""
        if not self.blocked:
            return self.b
        blocks, pairs = self.b.shape[:2]
        plain = self.b.permute(1, 3, 0, 2).reshape(2 * pairs, blocks * OUT_BLOCK)
        return plain[: self.rank, : self.rows]


@dataclass
class LoRAAdapter:
    """One adapter's weights: ``weights[layer][module]`` (a ``LoRAModule``), a module it
    does not target absent. ``key`` is a hash of what it computes, its weights and scales
    (the prefix cache's partition: a page one adapter computed never serves another, nor
    an adapter loaded again under the same name with other weights). ``table`` is the
    native kernel's view of it ([layers * len(MODULES), 3] int64: (A*, blocked Bt*, r) per
    slot, zeros where it has none)."""

    name: str
    path: str
    rank: int
    key: str
    weights: list[dict[str, LoRAModule]]
    nbytes: int = 0
    modules: tuple[str, ...] = field(default_factory=tuple)
    table: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))

    def __post_init__(self) -> None:
        table = np.zeros((len(self.weights) * len(MODULES), 3), dtype=np.int64)
        # each module it targets, at its columns of the fused output
        self.columns: dict[str, tuple[int, int]] = {}
        self.native = False  # held blocked for native/lora.c
        for layer, mods in enumerate(self.weights):
            for module, m in mods.items():
                self.columns.setdefault(module, (m.first, m.rows))
                if m.blocked:
                    self.native = True
                    table[slot(layer, module)] = (m.a.data_ptr(), m.b.data_ptr(), m.rank)
        self.table = table

    def to(self, device: torch.device) -> LoRAAdapter:
        """This adapter on ``device`` (itself on the CPU; elsewhere ``Bt`` held plain: the
        CUDA path's kernels read it so)."""
        if device.type == "cpu":
            return self
        weights = [
            {
                module: LoRAModule(m.a.to(device), m.b_t().to(device), m.first, m.rows)
                for module, m in layer.items()
            }
            for layer in self.weights
        ]
        return LoRAAdapter(
            self.name, self.path, self.rank, self.key, weights, self.nbytes, self.modules
        )


# segments of at most this many rows go to the native kernel (decode rows); longer ones (a
# prompt's chunk) are one GEMM each through PyTorch
NATIVE_MAX_ROWS = 16
OUT_BLOCK = 32  # native/lora.c's


def _blocked(b_t: torch.Tensor) -> torch.Tensor:
    """``Bt`` [R, out] as the native kernel reads it: [ceil(out / 32) blocks][ceil(R / 2)
    pairs of k][32 outputs][2 k], zero-padded (``native/lora.c``)."""
    r, out = b_t.shape
    blocks, pairs = -(-out // OUT_BLOCK), -(-r // 2)
    padded = torch.zeros(2 * pairs, blocks * OUT_BLOCK, dtype=b_t.dtype)
    padded[:r, :out] = b_t
    return padded.view(pairs, 2, blocks, OUT_BLOCK).permute(2, 0, 3, 1).contiguous()


def slot(layer: int, module: str) -> int:
    """A module's row in an adapter's ``table`` (``native/lora.c``'s slot)."""
    return layer * len(MODULES) + _MODULE_INDEX[module]


def module_path(layer: int, module: str) -> str:
    """A module's name in the Hugging Face model (what PEFT's patterns are matched to)."""
    part = "self_attn" if _MODULE_GROUP[module] in ("qkv", "o") else "mlp"
    return f"model.layers.{layer}.{part}.{module}"


class LoRAStep:
    """The adapters of one step's rows: ``segments`` are (first row, end row, adapter) in
    row order, rows of base-model requests in none. Invariant: segments do not overlap and
    each lies inside the step's rows; ``desc`` is the native kernel's descriptor of those
    of at most ``NATIVE_MAX_ROWS`` rows on adapters held for it (``native/lora.c``; None:
    none), ``long`` the others (PyTorch); ``modules`` the modules any of them targets, at
    their columns of the fused projections' outputs."""

    __slots__ = ("desc", "long", "modules", "segments")

    def __init__(self, segments: list[tuple[int, int, LoRAAdapter]]) -> None:
        self.segments = segments
        self.modules: dict[str, tuple[int, int]] = {}
        for _, _, adapter in segments:
            self.modules.update(adapter.columns)
        short = [s for s in segments if s[1] - s[0] <= NATIVE_MAX_ROWS and s[2].native]
        self.desc: np.ndarray | None = None
        self.long = segments
        if short:
            desc = np.empty(1 + 3 * len(short), dtype=np.int64)
            desc[0] = len(short)
            for i, (first, end, adapter) in enumerate(short):
                desc[1 + 3 * i : 4 + 3 * i] = (first, end, adapter.table.ctypes.data)
            self.desc = desc
            self.long = [s for s in segments if not any(s is t for t in short)]

    @classmethod
    def build(
        cls, adapters: Sequence[LoRAAdapter | None], query_start_loc: np.ndarray
    ) -> LoRAStep | None:
        """The step of requests ``adapters`` (one per request, None: the base) whose rows
        are ``query_start_loc``'s; None when every request is on the base. Neighbouring
        requests on one adapter become one segment, up to ``NATIVE_MAX_ROWS`` rows (so a
        decode row always takes the native kernel, whatever its neighbours)."""
        segments: list[tuple[int, int, LoRAAdapter]] = []
        bounds = query_start_loc.tolist()
        for i, adapter in enumerate(adapters):
            if adapter is None:
                continue
            if (
                segments
                and segments[-1][2] is adapter
                and segments[-1][1] == bounds[i]
                and bounds[i + 1] - segments[-1][0] <= NATIVE_MAX_ROWS
            ):
                segments[-1] = (segments[-1][0], bounds[i + 1], adapter)
            else:
                segments.append((bounds[i], bounds[i + 1], adapter))
        return cls(segments) if segments else None

    def add(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str, offset: int = 0
    ) -> torch.Tensor:
        """``y`` (projection ``group``'s output over rows ``offset ..`` of the step, [rows,
        out]) plus each adapter's low-rank products over its rows of ``x``, each module's
        on its columns, in place."""
        rows = x.shape[0]
        native = (
            self.desc is not None
            and y.dtype == x.dtype == torch.bfloat16
            and x.stride(1) == 1
            and y.stride(1) == 1
            and x.device.type == "cpu"
        )
        for module in GROUP_MODULES[group]:
            cols = self.modules.get(module)
            if cols is None:
                continue
            part = y[:, cols[0] : cols[0] + cols[1]]
            if native:
                assert self.desc is not None
                apply_native(load_lora(), part, x, slot(layer, module), self.desc, offset)
            for first, end, adapter in self.segments if not native else self.long:
                lo, hi = max(first - offset, 0), min(end - offset, rows)
                m = adapter.weights[layer].get(module)
                if m is None or lo >= hi:
                    continue
                # (addmm_: the expand's sum added to y and rounded once, as the kernel)
                part[lo:hi].addmm_(x[lo:hi] @ m.a.t(), m.b_t())
        return y


def apply_native(
    lib: Any, y: torch.Tensor, x: torch.Tensor, slot_: int, desc: np.ndarray, offset: int
) -> None:
    """``native/lora.c`` (library ``lib``) on rows ``offset ..`` of a step: ``y`` (a
    module's columns: rows ``y.stride(0)`` apart) ``+=`` the products of the adapters in
    ``desc`` for slot ``slot_``."""
    rc = lib.lora_apply_bf16(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], y.shape[1], slot_,
        desc.ctypes.data, offset, x.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("the LoRA kernel could not allocate its scratch")
