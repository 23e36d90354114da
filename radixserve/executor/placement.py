"""Where the ranks of a tensor-parallel group run: the collective backend for a device type,
each rank's device, and the GPUs of each data-parallel replica.

Conventions (torchrun's): rank r of a node uses ``cuda:LOCAL_RANK`` of the GPUs that node's
processes see. With ``-dp N -tp T`` on one machine, replica i's processes see only the GPUs
``[i*T, (i+1)*T)`` of the frontend's visible set (``CUDA_VISIBLE_DEVICES`` set per replica),
so each replica's rank r is ``cuda:r`` there. Pure functions: tested without a GPU.
"""

from __future__ import annotations

import torch

DEVICE_TYPES = ("cpu", "cuda")


def tensor_backend(device_type: str) -> str:
    """The backend of the collectives on the model's tensors: NCCL for GPU tensors, gloo
    for CPU ones. (Step metadata always goes over a gloo group on the CPU.)"""
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"no tensor-parallel backend for device type {device_type!r}")


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` on GPUs, the CPU otherwise."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"device type must be one of {', '.join(DEVICE_TYPES)}, got {device_type!r}"
        )
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


def visible_gpus(cuda_visible_devices: str | None, device_count: int) -> list[str]:
    """The GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries (indices or
    UUIDs): that variable's entries when set (empty: none), else ``0 .. device_count-1``."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]


def check_gpu_count(needed: int, available: int, what: str) -> None:
    """``ValueError`` naming ``what`` when fewer than ``needed`` GPUs are visible."""
    if available < needed:
        raise ValueError(
            f"{what} needs {needed} GPU{'s' if needed != 1 else ''} (one per tensor-parallel "
            f"rank on this node), but {available} {'is' if available == 1 else 'are'} visible "
            "(CUDA_VISIBLE_DEVICES / torch.cuda.device_count())"
        )


def replica_gpus(data_parallel: int, tensor_parallel: int, visible: list[str]) -> list[list[str]]:
    """The GPUs of each data-parallel replica: replica i gets ``visible[i*T:(i+1)*T]``
    (disjoint; GPUs past ``N*T`` stay unused). ``ValueError`` when too few are visible."""
    if data_parallel < 1 or tensor_parallel < 1:
        raise ValueError(
            f"data and tensor parallel sizes must be >= 1, got {data_parallel}, {tensor_parallel}"
        )
    check_gpu_count(
        data_parallel * tensor_parallel,
        len(visible),
        f"-dp {data_parallel} x -tp {tensor_parallel} on cuda",
    )
    t = tensor_parallel
    return [visible[i * t : (i + 1) * t] for i in range(data_parallel)]


def replica_environments(
    data_parallel: int,
    tensor_parallel: int,
    environ: dict[str, str],
    device_count: int,
) -> list[dict[str, str]]:
    """Each replica's process environment on cuda: ``environ`` with ``CUDA_VISIBLE_DEVICES``
    narrowed to that replica's GPUs (its workers inherit it)."""
    visible = visible_gpus(environ.get("CUDA_VISIBLE_DEVICES"), device_count)
    return [
        {**environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        for gpus in replica_gpus(data_parallel, tensor_parallel, visible)
    ]
