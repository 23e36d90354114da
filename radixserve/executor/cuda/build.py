"""Assembles the CUDA path for the engine: KV cache on the device, device sampler, runner."""

from __future__ import annotations

import sys

import torch

from radixserve.core.page_table import PageTable
from radixserve.executor.cuda.layer_ops import TritonLayerOps
from radixserve.executor.cuda.runner import CudaModelRunner
from radixserve.executor.cuda.sampler import DeviceSampler
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.models.llama import LlamaForCausalLM


def place_model(model: LlamaForCausalLM, device: torch.device) -> None:
    """Route the model's row-wise ops through Triton and move its rotary tables to
    ``device`` (its weights are created or moved there by the loader)."""
    model.ops = TritonLayerOps()
    model.rotary.cos = model.rotary.cos.to(device)
    model.rotary.sin_signed = model.rotary.sin_signed.to(device)


def build_cuda_runner(
    model: LlamaForCausalLM,
    num_pages: int,
    page_size: int,
    page_table: PageTable,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    device: torch.device,
    cuda_graph_max_bs: int | None,
) -> tuple[CudaModelRunner, DeviceSampler]:
    """The runner over a KV cache of ``num_pages`` pages plus one scratch page (written by
    the padding rows of CUDA graphs; the page pool never hands it out)."""
    c = model.config
    place_model(model, device)
    # The overlapped loop runs steps on a worker thread that needs the GIL briefly between
    # steps (tokens out, next inputs in) while the host thread schedules in Python: a
    # shorter switch interval (5 ms by default) bounds how long the GPU can wait for it.
    # Its effect on the idle fraction is for the GPU check to measure.
    if device.type == "cuda":
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
    kv_cache = KVCache(
        c.num_hidden_layers,
        num_pages + 1,
        page_size,
        c.num_key_value_heads,
        c.head_dim,
        model.dtype,
        device=device,
    )
    sampler = DeviceSampler(vocab_size, eos_token_ids)
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
