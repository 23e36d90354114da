"""A step's LoRA adapters on the CUDA path: the ``LoRAStep`` the runner was given, as the
Triton kernels of ``lora_kernels`` read it (the model calls ``add`` as on the CPU)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from radixserve.executor.cuda.lora_kernels import lora_expand, lora_shrink
from radixserve.executor.lora import GROUP_MODULES, LoRAAdapter, LoRAStep

# adapter sets whose stacks are kept (a steady batch keeps its set step after step)
_KEPT_SETS = 4
Stack = tuple[torch.Tensor, torch.Tensor, int]  # A, Bt, the module's first output column


class LoRAStacks:
    """Per set of adapters (in order), each module's weights stacked for the kernels on
    ``device``: A [S, layers, R, in] and Bt [S, layers, R, out], zero where an adapter or a
    layer has none and past each one's rank. Invariant: a set's stacks are built once from
    the adapters' weights, which never change (an adapter loaded again is another object);
    an entry holds its adapters, so no other adapter can take the id it is keyed by while
    it is kept; at most ``_KEPT_SETS`` sets are kept, the least recently used dropped
    first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sets: OrderedDict[
            tuple[int, ...], tuple[tuple[LoRAAdapter, ...], dict[str, Stack]]
        ] = OrderedDict()

    def get(self, adapters: list[LoRAAdapter]) -> dict[str, Stack]:
        key = tuple(id(a) for a in adapters)
        entry = self._sets.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], adapters, strict=True)):
            entry = self._sets[key] = (tuple(adapters), _stack(adapters, self.device))
            while len(self._sets) > _KEPT_SETS:
                self._sets.popitem(last=False)
        self._sets.move_to_end(key)
        return entry[1]


def _stack(adapters: list[LoRAAdapter], device: torch.device) -> dict[str, Stack]:
    out: dict[str, Stack] = {}
    layers = len(adapters[0].weights)
    for module in {m for a in adapters for m in a.columns}:
        found = [m for a in adapters for lay in a.weights if (m := lay.get(module)) is not None]
        rank = max(m.rank for m in found)
        first = found[0]
        shape = (len(adapters), layers, rank)
        a_stack = first.a.new_zeros(*shape, first.a.shape[1], device=device)
        b_stack = first.a.new_zeros(*shape, first.rows, device=device)
        for s, adapter in enumerate(adapters):
            for layer, mods in enumerate(adapter.weights):
                m = mods.get(module)
                if m is not None:
                    a_stack[s, layer, : m.rank] = m.a
                    b_stack[s, layer, : m.rank] = m.b_t()
        out[module] = (a_stack, b_stack, first.first)
    return out


class CudaLoRAStep:
    """``step`` (a ``LoRAStep``) for the Triton kernels: ``row_adapter`` [T] int32 on the
    device, each row's adapter's place in the step's set (-1: the base), and the set's
    stacks. Invariant: ``add`` computes what ``LoRAStep.add`` computes (up to float
    summation order), on the device."""

    def __init__(
        self, step: LoRAStep, num_tokens: int, device: torch.device, stacks: LoRAStacks
    ) -> None:
        adapters: list[LoRAAdapter] = []
        index = torch.full((num_tokens,), -1, dtype=torch.int32)
        for first, end, adapter in step.segments:
            if not any(adapter is a for a in adapters):
                adapters.append(adapter)
            index[first:end] = next(i for i, a in enumerate(adapters) if a is adapter)
        self.row_adapter = index.to(device, non_blocking=True)
        self.stacks = stacks.get(adapters)

    def add(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str, offset: int = 0
    ) -> torch.Tensor:
        """``LoRAStep.add``: every module of ``group`` any adapter of the step targets, on
        its columns of ``y`` (rows ``offset ..`` of the step)."""
        rows = self.row_adapter[offset : offset + x.shape[0]]
        for module in GROUP_MODULES[group]:
            stack = self.stacks.get(module)
            if stack is None:
                continue
            a, b_t, first = stack[0][:, layer], stack[1][:, layer], stack[2]
            h = lora_shrink(x, a, rows)
            lora_expand(h, b_t, y[:, first : first + b_t.shape[2]], rows)
        return y
