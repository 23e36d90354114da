"""Assembles what runs a model, for every path (the engine's rank 0, a tensor-parallel
worker, CPU and CUDA runners): the KV cache sized and the runner chosen around a model
``weights.load_model`` loaded. ``engine/engine.py`` and the worker call these and nothing
below them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.core.page_table import PageTable
from radixserve.executor import batch_invariant
from radixserve.executor.kv_cache import KVCache, bytes_per_page
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.models.base import CausalLM
from radixserve.executor.quant import weight_memory
from radixserve.executor.sampler import Sampler
from radixserve.executor.weights import available_memory_bytes

if TYPE_CHECKING:
    from radixserve.executor.distributed import TensorParallelGroup


@dataclass(frozen=True)
class KVSizing:
    """How many pages of ``page_bytes`` the KV cache gets, why (``basis``, for the start-up
    line: empty when a size was given), and the weights' bytes by precision. Invariant:
    ``num_pages >= 1``."""

    num_pages: int
    page_bytes: int
    weight_bytes: dict[str, int]
    basis: str = ""


# without a size: at most this share of the memory free once the weights are in
KV_AUTO_MEMORY_SHARE = 0.5


def size_kv_cache(
    model: CausalLM,
    page_size: int,
    kv_cache_memory_gb: float | None,
    memory_budget_gb: float | None = None,
    *,
    max_model_len: int = 0,
    requests: int = 1,
    free_bytes: int | None = None,
    kv_cache_dtype: str = "auto",
) -> KVSizing:
    """Pages for ``kv_cache_memory_gb``; or for what ``memory_budget_gb`` leaves after the
    weights (``ValueError`` when that is not one page); or, with neither, for ``requests``
    requests of ``max_model_len`` tokens, at most ``KV_AUTO_MEMORY_SHARE`` of
    ``free_bytes`` (default: what the model's device has free now, the weights loaded).
    Counts this rank's kv heads."""
    c = model.config
    page_bytes = bytes_per_page(
        c.num_hidden_layers,
        c.num_key_value_heads,
        c.head_dim,
        page_size,
        model.dtype,
        kv_cache_dtype,
    )
    weights = weight_memory(model)
    if kv_cache_memory_gb is None and memory_budget_gb is None:
        pages = requests * -(-max_model_len // page_size)
        basis = f"{requests} requests of {max_model_len} tokens"
        free = _free_bytes(model) if free_bytes is None else free_bytes
        if free is not None and pages * page_bytes > KV_AUTO_MEMORY_SHARE * free:
            pages = int(KV_AUTO_MEMORY_SHARE * free) // page_bytes
            basis = f"half the {free / 2**30:.1f} GiB free; {basis} asked for more"
        return KVSizing(max(1, pages), page_bytes, weights, basis)
    kv_bytes = int((kv_cache_memory_gb or 0) * 2**30)
    if memory_budget_gb is not None:
        kv_bytes = int(memory_budget_gb * 2**30) - sum(weights.values())
        if kv_bytes < page_bytes:
            raise ValueError(
                f"memory_budget_gb {memory_budget_gb} leaves no room for the KV cache"
                f" after {sum(weights.values()) / 2**30:.3f} GiB of weights"
            )
    return KVSizing(max(1, kv_bytes // page_bytes), page_bytes, weights)


def _free_bytes(model: CausalLM) -> int | None:
    """Memory free now where the model's KV cache will live (None: unknown)."""
    device = model.embed.device
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory_bytes() if device.type == "cpu" else None


def build_runner(
    model: CausalLM,
    num_pages: int,
    page_size: int,
    page_table: PageTable,
    sampler: Sampler,
    *,
    runner: str,
    device: torch.device,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    cuda_graph_max_bs: int | None = None,
    tp: TensorParallelGroup | None = None,
    kv_cache_dtype: str = "auto",
    deterministic: bool = False,
) -> tuple[Any, Any]:
    """Rank 0's runner and its sampler: ``runner`` ``cuda`` (Triton kernels, device
    sampler, CUDA graphs unless under ``tp``) or ``cpu`` (C kernels); with ``tp`` the
    tensor-parallel runner of that kind. ``deterministic``: the CPU runner computing each row
    alone (``executor/batch_invariant.py``; ``ValueError`` naming what of the model it cannot
    keep so)."""
    if runner == "cuda":
        from radixserve.executor.cuda.build import build_cuda_runner  # needs triton

        return build_cuda_runner(
            model,
            num_pages,
            page_size,
            page_table,
            vocab_size,
            eos_token_ids,
            device,
            cuda_graph_max_bs,
            tp,
            kv_cache_dtype,
        )
    kv_cache = KVCache.for_model(model, num_pages, page_size, kv_cache_dtype=kv_cache_dtype)
    if tp is not None:
        from radixserve.executor.tp_runner import TPModelRunner

        return TPModelRunner(model, kv_cache, page_table, sampler, tp), sampler
    runner = ModelRunner(model, kv_cache, page_table, sampler, deterministic=deterministic)
    if deterministic:
        refusal = batch_invariant.unsupported(model, runner.attention)
        if refusal:
            raise ValueError(f"deterministic mode cannot keep {refusal} batch-invariant yet")
        batch_invariant.prepare_kernels()
    return runner, sampler


def build_worker_runner(
    model: CausalLM,
    num_pages: int,
    page_size: int,
    runner: str,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    """A tensor-parallel worker's runner, the same kind as rank 0's, over a KV cache of
    rank 0's size with this rank's kv heads; it only follows steps."""
    if runner == "cuda":
        from radixserve.executor.cuda.build import build_worker_runner as cuda_worker

        return cuda_worker(model, num_pages, page_size, device, kv_cache_dtype)
    kv_cache = KVCache.for_model(model, num_pages, page_size, kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(model, kv_cache, None, None)
