"""Where tensor-parallel ranks and data-parallel replicas run, without a GPU: the backend per
device type, cuda:LOCAL_RANK, each replica's GPUs as CUDA_VISIBLE_DEVICES, and the start-up
errors when too few GPUs are visible (torch's GPU queries patched where a config needs them)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.model_source import resolve_model
from radixserve.engine.parallel import worker_spec
from radixserve.executor.distributed import WorkerSpec, tensor_group
from radixserve.executor.placement import (
    rank_device,
    replica_environments,
    replica_gpus,
    tensor_backend,
    visible_gpus,
)


def test_backend_is_nccl_for_gpu_tensors_and_gloo_for_cpu_ones():
    assert tensor_backend("cuda") == "nccl"
    assert tensor_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="no tensor-parallel backend"):
        tensor_backend("mps")


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch has NCCL")
def test_an_nccl_group_without_nccl_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs NCCL, which this torch build does not have"):
        tensor_group("nccl", None, 0, 1, 10.0, "127.0.0.1", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="gloo or nccl"):
        tensor_group("mpi", None, 0, 1, 10.0, "127.0.0.1", torch.device("cpu"))


def test_each_rank_uses_cuda_local_rank():
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    assert rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError):
        rank_device("cuda", -1)
    # two nodes of 2 ranks: global ranks 2 and 3 are local ranks 0 and 1 of node 1
    spec = WorkerSpec(kind="hf", path="x", world_size=4, nnodes=2, device="cuda")
    assert [spec.rank_device(r).index for r in range(4)] == [0, 1, 0, 1]
    assert WorkerSpec(kind="hf", path="x", world_size=2).rank_device(1).type == "cpu"


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus(None, 3) == ["0", "1", "2"]
    assert visible_gpus("4,5, 7", 8) == ["4", "5", "7"]
    assert visible_gpus("GPU-aa,GPU-bb", 2) == ["GPU-aa", "GPU-bb"]
    assert visible_gpus("", 8) == []


def test_replicas_get_disjoint_consecutive_gpus():
    assert replica_gpus(2, 2, ["0", "1", "2", "3"]) == [["0", "1"], ["2", "3"]]
    assert replica_gpus(3, 1, ["4", "5", "6", "7"]) == [["4"], ["5"], ["6"]]  # 7 unused
    envs = replica_environments(2, 2, {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3,5,6,7"}, 8)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "6,7"]
    assert all(e["PATH"] == "/bin" for e in envs)
    envs = replica_environments(2, 1, {}, 2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]


def test_too_few_gpus_for_dp_times_tp_is_an_error():
    with pytest.raises(ValueError, match=r"-dp 2 x -tp 2 on cuda needs 4 GPUs.*but 3 are visible"):
        replica_gpus(2, 2, ["0", "1", "2"])
    with pytest.raises(ValueError, match=r"needs 2 GPUs.*but 1 is visible"):
        replica_environments(2, 1, {"CUDA_VISIBLE_DEVICES": "0"}, 8)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees ``n`` GPUs (no CUDA call is made by what these tests build)."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_tp_on_cuda_needs_a_gpu_per_local_rank(gpus, tiny_llama):
    gpus(2)
    assert EngineConfig(device="cuda", tensor_parallel_size=2).resolved_runner == "cuda"
    with pytest.raises(ValueError, match=r"-tp 4 on cuda needs 4 GPUs.*but 2 are visible"):
        EngineConfig(device="cuda", tensor_parallel_size=4)
    # two nodes of 2 ranks each: 2 GPUs per node are enough
    config = EngineConfig(
        model=str(tiny_llama), device="cuda", tensor_parallel_size=4, nnodes=2, master_port=1
    )
    spec = worker_spec(config, resolve_model(config.model))
    assert (spec.device, spec.runner, spec.local_world_size) == ("cuda", "cuda", 2)


def test_runner_choice(monkeypatch):
    assert EngineConfig(device="cpu").resolved_runner == "cpu"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        EngineConfig(device="cpu", runner="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(device="cpu", runner="cuda").resolved_runner == "cuda"
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineConfig(runner="tpu")


def test_data_parallel_replicas_each_get_their_gpus(gpus, monkeypatch):
    from radixserve.serving import dp_client

    made: list[dp_client.DataParallelClient] = []

    def DataParallelClient(*args):
        made.append(dp_client.DataParallelClient(*args))
        return made[-1]

    gpus(4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = EngineConfig(device="cuda", tensor_parallel_size=2)
    client = DataParallelClient(config, None, 2)
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in client.clients] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2,3")
    with pytest.raises(ValueError, match="-dp 2 x -tp 2 on cuda needs 4 GPUs"):
        DataParallelClient(config, None, 2)
    client = DataParallelClient(EngineConfig(device="cuda"), None, 3)
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in client.clients] == ["1", "2", "3"]
    # on the CPU the replicas inherit this process's environment
    cpu = DataParallelClient(EngineConfig(device="cpu"), None, 2)
    assert [c.env for c in cpu.clients] == [None, None]
    for client in made:  # nothing was started: this frees their sockets and folders
        asyncio.run(client.shutdown())
