"""A tensor-parallel worker: ``python -m radixserve.executor.worker SPEC_JSON``.

Rank, group size and rendezvous come from torchrun's environment variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``LOCAL_RANK`` for logs). The worker
loads its shard (on ``cuda:LOCAL_RANK`` when the spec's device is cuda), agrees on the KV
cache with rank 0, then follows every step rank 0 broadcasts with the same kind of runner
as rank 0's (``ModelRunner.follow_step``) until told to stop. If the group fails (a rank died, rank 0 went silent past
the timeout) or its parent process dies, it exits with an error instead of waiting.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch

from radixserve.executor.builder import build_worker_runner
from radixserve.executor.distributed import (
    HEADER_LEN,
    OP_NOOP,
    OP_STOP,
    DeviceLost,
    TPGroup,
    WorkerSpec,
    decode_step,
    default_threads,
    handshake,
    load_shard_model,
)
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.models.base import CausalLM

logger = logging.getLogger("radixserve.worker")


def worker_runner(spec: WorkerSpec, model: CausalLM, num_pages: int, page_size: int) -> ModelRunner:
    """This rank's runner, the same kind as rank 0's (``spec.runner``), over a KV cache of
    rank 0's size with this rank's kv heads; it only follows steps."""
    return build_worker_runner(
        model, num_pages, page_size, spec.runner, model.embed.device, spec.kv_cache_dtype
    )


def serve(spec: WorkerSpec, rank: int, master_addr: str, master_port: int) -> None:
    torch.set_num_threads(spec.num_threads or default_threads(spec))
    device = spec.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton kernels and NCCL use the current device
    group = TPGroup(rank, spec.world_size, master_addr, master_port, spec.timeout_s, device=device)
    loaded = load_shard_model(spec, group)
    model = loaded.model
    num_pages, page_size = handshake(group, model, loaded.scheme)
    runner = worker_runner(spec, model, num_pages, page_size)
    c = model.config
    logger.info(
        "rank %d/%d ready on %s (%s runner, %s collectives): %d heads, %d kv heads, %d KV pages",
        rank,
        spec.world_size,
        device,
        spec.runner,
        group.backend,
        c.num_attention_heads,
        c.num_key_value_heads,
        num_pages,
    )
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            group.broadcast(header, control=True)
            op = int(header[0])
            if op == OP_NOOP:
                continue
            if op == OP_STOP:
                return
            payload = torch.empty(int(header[7]), dtype=torch.int64)
            group.broadcast(payload, control=True)
            step = decode_step(header, payload, page_size)
            runner.follow_step(step.batch, step.copies, step.plans)


def _watch_parent() -> None:
    """Exit when the process that started this one is gone (rank 0 or a node launcher)."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            logger.error("the parent process (pid %d) is gone; exiting", parent)
            os._exit(3)


def main() -> None:
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s"
    )
    spec = WorkerSpec.from_json(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    threading.Thread(target=_watch_parent, daemon=True, name="radixserve-parent-watch").start()
    try:
        serve(spec, rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except DeviceLost as exc:
        logger.error("%s; exiting", exc)
        os._exit(1)  # no interpreter teardown: gloo's threads may still hold the dead group
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
