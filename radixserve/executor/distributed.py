"""Tensor parallelism over torch.distributed: the process group, the per-step broadcast from
rank 0, rank 0's runner, and the launch of the other ranks as worker processes.

One rank (0) runs the engine: scheduler, radix cache, page pool, sampler. Every rank holds
its shard of the weights and its own KV pages (same page ids, its own kv heads). Each step,
rank 0 broadcasts the step's ``ForwardBatch`` arrays (int64 tensors, no pickle) on a
control group; then all ranks run the forward together, summing row-parallel outputs with
all-reduces and gathering the sampled rows' logits on a second group: gloo for CPU
tensors, NCCL for GPU ones (``placement.tensor_backend``); the control group is always gloo.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed import AllreduceOptions, PrefixStore, ProcessGroupGloo, TCPStore

from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.loader import Checkpoint
from radixserve.executor.loader.gguf_loader import gguf_hf_config, gguf_tensor_names, read_metadata
from radixserve.executor.loader.safetensors_loader import read_hf_config
from radixserve.executor.loader.sharded import ShardLayout
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.base import CausalLM
from radixserve.executor.placement import rank_device, tensor_backend
from radixserve.executor.quant import QuantScheme
from radixserve.executor.weights import load_model, resolve_dtype

logger = logging.getLogger(__name__)

OP_STOP, OP_STEP, OP_NOOP = 0, 1, 2
HEADER_LEN = 9
HEARTBEAT_S = 2.0  # rank 0 sends a no-op step when it has sent nothing for this long
# a worker that hears nothing from rank 0 (not even a heartbeat) this long exits; shorter
# when the group's timeout is
CONTROL_TIMEOUT_S = 60.0
# the start-up handshake waits for the slowest rank to load its shard
STARTUP_TIMEOUT_S = 1800.0


def control_timeout(timeout_s: float) -> float:
    return min(CONTROL_TIMEOUT_S, timeout_s)


def heartbeat_interval(timeout_s: float) -> float:
    return min(HEARTBEAT_S, control_timeout(timeout_s) / 4)


_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2}


class DeviceLost(RuntimeError):
    """A rank of the tensor-parallel group died or a collective failed: the group is out of
    step and cannot run another step. The engine fails every request and stops."""


@dataclass
class WorkerSpec:
    """What every rank needs to build its part of the model (sent as JSON, never pickled).

    Invariant: every rank derives the same dtype, quantization and layout from it (checked
    at start-up: a rank that disagrees fails the start)."""

    kind: str  # hf | gguf
    path: str
    world_size: int
    load_format: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"
    quantization_group_size: int = 32
    num_threads: int | None = None
    timeout_s: float = 300.0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    device: str = "cpu"  # cpu | cuda: each rank's tensors (cuda:LOCAL_RANK)
    # the model runner every rank builds: "cpu" (ModelRunner) or "cuda" (CudaModelRunner,
    # Triton kernels; on CPU tensors under the Triton interpreter, as the tests run it)
    runner: str = "cpu"
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nnodes

    def rank_device(self, rank: int) -> torch.device:
        """Rank ``rank``'s device: ``cuda:LOCAL_RANK`` on GPUs (torchrun's convention)."""
        return rank_device(self.device, rank % self.local_world_size)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """The engine's rule (``EngineConfig.torch_dtype``): auto = the checkpoint's float32,
        else bfloat16."""
        return resolve_dtype(self.dtype, checkpoint_dtype)


def peek_layout(spec: WorkerSpec, rank: int = 0) -> ShardLayout:
    """The layout from the config alone (no weights read): validates the split early."""
    path = Path(spec.path)
    if spec.kind == "gguf":
        names = gguf_tensor_names(path)
        hf_config = gguf_hf_config(path, read_metadata(path), names)
    else:
        hf_config = read_hf_config(path)
    return ShardLayout(ModelConfig.from_hf_dict(hf_config), rank, spec.world_size)


# -- the process group -----------------------------------------------------------------------
def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _gloo(store: Any, rank: int, size: int, timeout_s: float, addr: str) -> ProcessGroupGloo:
    opts = ProcessGroupGloo._Options()
    if _is_loopback(addr):  # one machine: keep every connection on 127.0.0.1
        device = ProcessGroupGloo.create_device(hostname="127.0.0.1")
    elif os.environ.get("GLOO_SOCKET_IFNAME"):
        device = ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"])
    else:
        device = ProcessGroupGloo.create_default_device()
    opts._devices = [device]
    opts._timeout = timedelta(seconds=timeout_s)
    return ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: Any, rank: int, size: int, timeout_s: float, device: torch.device) -> Any:
    """An NCCL group bound to this rank's GPU (connected now: a bad setup fails at start-up)."""
    if not torch.distributed.is_nccl_available():
        raise RuntimeError(
            "tensor parallelism on cuda needs NCCL, which this torch build does not have "
            "(torch.distributed.is_nccl_available() is False)"
        )
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    pg = ProcessGroupNCCL(store, rank, size, opts)
    pg.eager_connect_single_device(device)
    return pg


def tensor_group(
    backend: str,
    store: Any,
    rank: int,
    size: int,
    timeout_s: float,
    addr: str,
    device: torch.device,
) -> Any:
    """The process group of the forward's collectives: ``backend`` is gloo or nccl
    (``placement.tensor_backend`` of the device type)."""
    if backend == "gloo":
        return _gloo(store, rank, size, timeout_s, addr)
    if backend == "nccl":
        return _nccl(store, rank, size, timeout_s, device)
    raise ValueError(f"tensor-parallel backend must be gloo or nccl, got {backend!r}")


class TPGroup:
    """One rank's membership of the group: a TCP store on the master address (rank 0 hosts
    it) and two process groups over it, ``pg`` for the collectives of the forward (gloo on
    CPU, NCCL on ``device`` when it is a GPU) and ``control``, always gloo on the CPU, for
    rank 0's step broadcasts and the start-up handshake (a worker waits on it between
    steps).

    Invariant: every operation either completes on every rank or raises ``DeviceLost`` on
    the ranks that see the failure (a closed connection at once, a silent rank after the
    timeout); after one failure the group is not used again.
    Under NCCL an operation returns once queued on the GPU stream, so a failure shows up
    later (NCCL's watchdog aborts the process after the timeout): an untested path, as is
    NCCL with more than one rank.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        listen_fd: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.backend = tensor_backend(self.device.type)
        timeout = timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))  # joining: loads vary
        if rank == 0:
            store = TCPStore(
                master_addr,
                master_port,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=listen_fd,
                use_libuv=listen_fd is None,
            )
        else:
            store = TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
        self._store = store
        self.pg = tensor_group(
            self.backend,
            PrefixStore("radixserve/tp", store),
            rank,
            world_size,
            timeout_s,
            master_addr,
            self.device,
        )
        self.control = _gloo(
            PrefixStore("radixserve/control", store),
            rank,
            world_size,
            control_timeout(timeout_s),
            master_addr,
        )

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:  # gloo raises RuntimeError / DistBackendError
            raise DeviceLost(
                f"a tensor-parallel {what} failed on rank {self.rank} (a rank died or stopped "
                f"answering): {exc}"
            ) from None

    def all_reduce(
        self, tensor: torch.Tensor, timeout_s: float | None = None, control: bool = False
    ) -> None:
        pg = self.control if control else self.pg
        if timeout_s is None:
            self._wait(pg.allreduce([tensor]), "all-reduce")
            return
        opts = AllreduceOptions()
        opts.timeout = timedelta(seconds=timeout_s)
        self._wait(pg.allreduce([tensor], opts), "all-reduce")

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([out], [tensor]), "all-gather")
        return out

    def broadcast(
        self, tensor: torch.Tensor, control: bool = False, timeout_s: float | None = None
    ) -> None:
        pg = self.control if control else self.pg
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._wait(pg.broadcast(tensor, 0, timeout), "broadcast")

    def abort(self) -> None:
        for pg in (self.pg, self.control):
            with contextlib.suppress(Exception):
                pg.abort()


# -- the step message ------------------------------------------------------------------------
def encode_step(
    fb: ForwardBatch,
    input_ids: np.ndarray,
    copies: tuple[torch.Tensor, torch.Tensor] | None,
    plans: list[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) int64 tensors: everything a worker needs to run the step's
    forward in step with rank 0 (``input_ids`` with every placeholder resolved)."""
    num_copies = 0 if copies is None else int(copies[0].numel())
    parts = [
        input_ids,
        fb.positions,
        fb.slot_mapping,
        fb.q_lens,
        fb.seq_lens,
        fb.query_start_loc,
        fb.page_tables.reshape(-1),
        fb.logits_indices,
    ]
    if copies is not None:
        parts += [copies[0].numpy(), copies[1].numpy()]
    parts.append(np.asarray(plans, dtype=np.int64).reshape(-1))
    payload = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])
    header = torch.tensor(
        [
            OP_STEP,
            fb.num_tokens,
            fb.num_requests,
            fb.logits_indices.size,
            fb.page_tables.shape[1],
            num_copies,
            len(plans),
            payload.size,
            int(fb.long_prompt),
        ],
        dtype=torch.int64,
    )
    return header, torch.from_numpy(payload)


@dataclass
class WorkerStep:
    """A decoded step: the batch, page copies (src, dst) or None, the prompt-logprob spans
    (first hidden row, number of rows) in rank 0's order."""

    batch: ForwardBatch
    copies: tuple[torch.Tensor, torch.Tensor] | None
    plans: list[tuple[int, int]]


def decode_step(header: torch.Tensor, payload: torch.Tensor, page_size: int) -> WorkerStep:
    _, t, b, s, max_pages, c, p, _, long_prompt = header.tolist()
    flat = payload.numpy()
    pos = 0

    def take(n: int) -> np.ndarray:
        nonlocal pos
        out = flat[pos : pos + n]
        pos += n
        return out

    input_ids, positions, slot_mapping = take(t), take(t), take(t)
    q_lens, seq_lens, query_start_loc = take(b), take(b), take(b + 1)
    page_tables = take(b * max_pages).reshape(b, max_pages)
    logits_indices = take(s)
    copies = None
    if c:
        copies = (torch.from_numpy(take(c).copy()), torch.from_numpy(take(c).copy()))
    plans = [tuple(x) for x in take(2 * p).reshape(p, 2).tolist()]
    batch = ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        q_lens=q_lens,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        page_tables=page_tables,
        logits_indices=logits_indices,
        page_size=page_size,
        long_prompt=bool(long_prompt),
    )
    return WorkerStep(batch, copies, plans)  # type: ignore[arg-type]


# -- model loading (every rank) --------------------------------------------------------------
@dataclass
class ShardedModel:
    """This rank's part of the model, with the checkpoint's config and metadata (its
    weights are in the model, not in ``checkpoint.weights``)."""

    checkpoint: Checkpoint
    model: CausalLM
    dtype: torch.dtype
    scheme: QuantScheme | None


def load_shard_model(spec: WorkerSpec, group: TPGroup) -> ShardedModel:
    """Read this rank's shard and build its part of the model on ``group.device`` (each
    tensor moved there as it is taken: host memory holds the shard, never the model)."""
    loaded = load_model(
        spec.kind,
        Path(spec.path),
        device=group.device,
        dtype=spec.dtype,
        quantization=spec.quantization,
        group_size=spec.quantization_group_size,
        load_format=spec.load_format,
        rank=group.rank,
        group=group,
    )
    return ShardedModel(loaded.checkpoint, loaded.model, loaded.dtype, loaded.scheme)


def _agreement(model: CausalLM, scheme: QuantScheme | None) -> list[int]:
    """What every rank must agree on, as ints (checked at start-up)."""
    c = model.config
    quant = 0 if scheme is None else (1 if scheme.kind == "int8" else 2)
    return [
        _DTYPE_CODES.get(model.dtype, 0),
        c.num_key_value_heads,
        c.head_dim,
        c.num_hidden_layers,
        quant,
    ]


def handshake(
    group: TPGroup,
    model: CausalLM,
    scheme: QuantScheme | None,
    num_pages: int = 0,
    page_size: int = 0,
) -> tuple[int, int]:
    """Rank 0 sends the KV cache's size; every rank checks it built the same kind of model.
    Returns (num_pages, page_size); ``ValueError`` on every rank if any disagrees. CPU
    integers: on the control group (gloo), whatever the tensor backend."""
    mine = _agreement(model, scheme)
    msg = torch.tensor([num_pages, page_size, *mine], dtype=torch.int64)
    startup = max(STARTUP_TIMEOUT_S, group.timeout_s)  # ranks load at their own pace
    group.broadcast(msg, control=True, timeout_s=startup)
    agreed = msg[2:].tolist() == mine
    flag = torch.tensor([0 if agreed else 1], dtype=torch.int64)
    group.all_reduce(flag, timeout_s=startup, control=True)
    if int(flag.item()):
        raise ValueError(
            "the tensor-parallel ranks built different models (dtype, kv heads or "
            f"quantization differ; rank {group.rank} has {mine}, rank 0 {msg[2:].tolist()})"
        )
    return int(msg[0]), int(msg[1])


# -- rank 0 ----------------------------------------------------------------------------------
def _listen_socket(addr: str, port: int | None) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port or 0))
    sock.listen(128)
    return sock


def worker_env(spec: WorkerSpec, rank: int, node_rank: int, port: int) -> dict[str, str]:
    """torchrun's variables for one worker process."""
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(rank % spec.local_world_size),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(port),
    }


def launch_workers(spec: WorkerSpec, node_rank: int, port: int) -> dict[int, subprocess.Popen]:
    """This node's worker processes (rank 0 excluded: it is the engine's process)."""
    first = node_rank * spec.local_world_size
    procs: dict[int, subprocess.Popen] = {}
    for rank in range(max(first, 1), first + spec.local_world_size):
        procs[rank] = subprocess.Popen(
            [sys.executable, "-m", "radixserve.executor.worker", spec.to_json()],
            env=worker_env(spec, rank, node_rank, port),
        )
    return procs


def default_threads(spec: WorkerSpec) -> int:
    """Threads per rank when not given: the machine's cores split between this node's ranks."""
    return max(1, (os.cpu_count() or 1) // spec.local_world_size)


class TensorParallelGroup:
    """Rank 0's side of the group: the local worker processes, the group, the step sender
    (with a heartbeat while idle) and the failure state.

    Invariants: step messages go out one at a time under ``_lock``, in the order ranks must
    run them; once ``lost`` is set, no message is sent and ``check`` raises it.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.world_size % spec.nnodes:
            raise ValueError(
                f"tensor_parallel_size {spec.world_size} is not a multiple of nnodes {spec.nnodes}"
            )
        self.spec = spec
        self.layout = peek_layout(spec)  # ValueError before any process starts
        sock = _listen_socket(spec.master_addr, spec.master_port)
        port = sock.getsockname()[1]
        self.procs = launch_workers(spec, 0, port)
        self.lost: DeviceLost | None = None
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        try:
            self.group = self._join(port, sock.detach())
            self.loaded = load_shard_model(spec, self.group)
        except BaseException as exc:
            self._reap(grace_s=0.0)
            codes = {r: p.returncode for r, p in self.procs.items() if p.returncode is not None}
            if isinstance(exc, ValueError):
                raise
            raise RuntimeError(
                f"tensor-parallel start-up failed: {exc} (worker exit codes: {codes or 'none'})"
            ) from exc

    def _join(self, port: int, listen_fd: int) -> TPGroup:
        """Form the group (it waits for every rank), failing early if a local worker exits
        before joining (an import error, a bad flag)."""
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                spec = self.spec
                result["group"] = TPGroup(
                    0,
                    spec.world_size,
                    spec.master_addr,
                    port,
                    spec.timeout_s,
                    listen_fd,
                    device=spec.rank_device(0),
                )
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=join, daemon=True, name="radixserve-tp-join")
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            for rank, proc in self.procs.items():
                if thread.is_alive() and proc.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited during start-up (code "
                        f"{proc.returncode}); see its log above"
                    )
        if "error" in result:
            raise result["error"]
        return result["group"]

    # -- messages --
    def start(self, model: CausalLM, num_pages: int, page_size: int) -> None:
        """Agree on the KV cache with every rank, then start the heartbeat."""
        try:
            handshake(self.group, model, self.loaded.scheme, num_pages, page_size)
        except DeviceLost as exc:
            raise RuntimeError(f"tensor-parallel start-up failed: {exc}") from None
        self._heartbeat = threading.Thread(
            target=self._beat, name="radixserve-tp-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def send(self, header: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        with self._lock:
            self.check()
            try:
                self.group.broadcast(header, control=True)
                if payload is not None:
                    self.group.broadcast(payload, control=True)
            except DeviceLost as exc:
                self.fail_after(exc)
                raise self.lost from None  # type: ignore[misc]
            self._last_send = time.monotonic()

    def _beat(self) -> None:
        noop = torch.tensor([OP_NOOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64)
        interval = heartbeat_interval(self.spec.timeout_s)
        while not self._stop.wait(interval / 4):
            if time.monotonic() - self._last_send < interval:
                continue
            try:
                self.send(noop)
            except DeviceLost:
                return

    # -- health --
    def check(self) -> None:
        """Raise ``DeviceLost`` if the group failed or a local worker has exited."""
        if self.lost is None:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    self.fail(f"tensor-parallel rank {rank} exited (code {code})")
                    break
        if self.lost is not None:
            raise self.lost

    def fail_after(self, exc: BaseException, wait_s: float = 1.0) -> None:
        """A collective failed: name the local worker that exited if there is one (its
        connections close a moment before its exit can be seen), else report ``exc``."""
        deadline = time.monotonic() + wait_s
        while self.lost is None and time.monotonic() < deadline:
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    self.fail(f"tensor-parallel rank {rank} exited (code {proc.returncode})")
                    return
            time.sleep(0.05)
        self.fail(str(exc))

    def fail(self, message: str) -> None:
        """Mark the group lost and tear it down: the other ranks see their connections close
        (or time out) and exit; local workers still alive after a grace period are ended."""
        if self.lost is not None:
            return
        self.lost = DeviceLost(f"{message}; the engine cannot run without it and stops")
        logger.error("%s", self.lost)
        self._stop.set()
        self.group.abort()
        threading.Thread(target=self._reap, daemon=True, name="radixserve-tp-reap").start()

    def _reap(self, grace_s: float = 10.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop every rank (a stop message, then wait for the local workers)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.lost is None:
            with contextlib.suppress(DeviceLost):
                self.send(torch.tensor([OP_STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64))
            self.lost = DeviceLost("the tensor-parallel group was closed")
        self._reap(grace_s=10.0)
