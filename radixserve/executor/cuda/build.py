"""Assembles the CUDA path for the engine: KV cache on the device, device sampler, runner."""

from __future__ import annotations

import logging
import sys

import torch

from radixserve.core.page_table import PageTable
from radixserve.executor.cuda.layer_ops import TritonLayerOps
from radixserve.executor.cuda.runner import CudaModelRunner
from radixserve.executor.cuda.sampler import DeviceSampler
from radixserve.executor.distributed import TensorParallelGroup
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.models.base import CausalLM

logger = logging.getLogger(__name__)


def place_model(model: CausalLM, device: torch.device) -> None:
    """Route the model's row-wise ops through Triton and move its rotary tables to
    ``device`` (its weights are created or moved there by the loader)."""
    model.use_layer_ops(TritonLayerOps())
    model.to_device(device)


def build_cuda_runner(
    model: CausalLM,
    num_pages: int,
    page_size: int,
    page_table: PageTable,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    device: torch.device,
    cuda_graph_max_bs: int | None,
    tp: TensorParallelGroup | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[CudaModelRunner, DeviceSampler]:
    """The runner over a KV cache of ``num_pages`` pages plus one scratch page (written by
    the padding rows of CUDA graphs; the page pool never hands it out). With ``tp`` (rank 0
    of a tensor-parallel group): the TP runner, without CUDA graphs.

    Why no graphs under tensor parallelism: capturing NCCL collectives is possible
    (torch supports it), but a replayed graph's all-reduce is invisible to the group's
    failure handling (a dead rank would stall the replay instead of raising
    ``DeviceLost``), and no machine available to this project has two GPUs to verify a
    captured TP step; eager steps are correct and their failures are seen."""
    place_model(model, device)
    # The overlapped loop runs steps on a worker thread that needs the GIL briefly between
    # steps (tokens out, next inputs in) while the host thread schedules in Python: a
    # shorter switch interval (5 ms by default) bounds how long the GPU can wait for it.
    # Its effect on the idle fraction is for the GPU check to measure.
    if device.type == "cuda":
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    # + the scratch page; an int8 cache's scales are written and read by the Triton kernels
    kv_cache = KVCache.for_model(model, num_pages + 1, page_size, device, kv_cache_dtype)
    sampler = DeviceSampler(vocab_size, eos_token_ids)
    if tp is not None:
        from radixserve.executor.cuda.tp_runner import CudaTPModelRunner

        if cuda_graph_max_bs:
            logger.warning(
                "CUDA graphs are off under tensor parallelism (size %d): decode steps run "
                "eagerly, so a failed collective is seen by the group instead of stalling a "
                "graph replay",
                tp.spec.world_size,
            )
        runner: CudaModelRunner = CudaTPModelRunner(
            model, kv_cache, page_table, sampler, device, num_pages, tp
        )
        return runner, sampler
    runner = CudaModelRunner(
        model,
        kv_cache,
        page_table,
        sampler,
        device,
        scratch_page=num_pages,
        cuda_graph_max_bs=cuda_graph_max_bs,
    )
    return runner, sampler


def build_worker_runner(
    model: CausalLM,
    num_pages: int,
    page_size: int,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> CudaModelRunner:
    """A tensor-parallel worker's CUDA runner: rank 0's KV size (``num_pages`` includes
    the scratch page), no sampler, no graphs; it only follows steps."""
    place_model(model, device)
    kv_cache = KVCache.for_model(model, num_pages, page_size, device, kv_cache_dtype)
    return CudaModelRunner(model, kv_cache, None, None, device, scratch_page=num_pages - 1)
