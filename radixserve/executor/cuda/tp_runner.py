"""The CUDA runner on rank 0 of a tensor-parallel group (NCCL for the model's collectives)."""

from __future__ import annotations

import torch

from radixserve.core.page_table import PageTable
from radixserve.executor.cuda.runner import CudaModelRunner
from radixserve.executor.cuda.sampler import DeviceSampler
from radixserve.executor.distributed import TensorParallelGroup
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.models.base import CausalLM
from radixserve.executor.tp_runner import TensorParallelRunner


class CudaTPModelRunner(TensorParallelRunner, CudaModelRunner):
    """``CudaModelRunner`` (Triton kernels, staged inputs, device sampling) driven by the
    tensor-parallel mixin: each step is broadcast to the workers before its model work.

    Invariant: no CUDA graphs (``graphs`` is None): every step runs eagerly, so each
    collective is an ordinary NCCL call whose failure the group can see (see
    ``build_cuda_runner`` for why graphs are off under tensor parallelism)."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        page_table: PageTable,
        sampler: DeviceSampler,
        device: torch.device,
        scratch_page: int,
        tp: TensorParallelGroup,
    ) -> None:
        CudaModelRunner.__init__(
            self, model, kv_cache, page_table, sampler, device, scratch_page, None
        )
        self._start_tp(tp)
