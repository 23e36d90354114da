"""Tensor-parallel launch from engine settings: the spec every rank builds its part from,
and the worker-only side of a multi-node group (``node_rank > 0``)."""

from __future__ import annotations

import contextlib
import signal
import subprocess

from radixserve.engine.config import EngineConfig
from radixserve.engine.model_source import ModelSource, resolve_model
from radixserve.executor.distributed import WorkerSpec, launch_workers


def worker_spec(config: EngineConfig, source: ModelSource) -> WorkerSpec:
    """What every rank of ``config``'s group needs to build its shard (the same on every
    node given the same flags)."""
    return WorkerSpec(
        kind=source.kind,
        path=str(source.path),
        world_size=config.tensor_parallel_size,
        load_format=config.load_format,
        dtype=config.dtype,
        quantization=config.quantization,
        quantization_group_size=config.quantization_group_size,
        num_threads=config.num_threads,
        timeout_s=config.distributed_timeout_s,
        nnodes=config.nnodes,
        master_addr=config.master_addr,
        master_port=config.master_port,
        device=config.resolved_device,
        runner=config.resolved_runner,
        kv_cache_dtype=config.kv_cache_dtype,
    )


def run_node(config: EngineConfig) -> int:
    """Node ``config.node_rank`` (> 0) of a multi-node group: start this node's ranks as
    worker processes and wait for them (they exit when rank 0 stops, dies or goes
    silent). SIGTERM / SIGINT are passed on to them. Returns the worst exit code."""
    if config.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine, not run_node")
    assert config.master_port is not None  # EngineConfig requires it with nnodes > 1
    spec = worker_spec(config, resolve_model(config.model))
    procs = launch_workers(spec, config.node_rank, config.master_port)

    def forward(signum: int, _frame: object) -> None:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = []
    for proc in procs.values():
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes.append(proc.wait(1.0))
                break
    return max((abs(c) for c in codes), default=0)


def replica_environments(
    data_parallel: int, tensor_parallel: int, environ: dict[str, str]
) -> list[dict[str, str]]:
    """Each data-parallel replica's process environment on cuda: ``environ`` with
    ``CUDA_VISIBLE_DEVICES`` narrowed to that replica's GPUs (``executor.placement``);
    ``ValueError`` when fewer GPUs are visible than replicas x ranks."""
    import torch

    from radixserve.executor import placement

    return placement.replica_environments(
        data_parallel, tensor_parallel, environ, torch.cuda.device_count()
    )
