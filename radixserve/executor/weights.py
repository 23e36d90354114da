"""Loads a model's weights, for every path (the engine's rank 0, a tensor-parallel
worker's shard, a draft model): the checkpoint read, the model of its architecture built,
quantized or run from the file's codes, with its bfloat16 prefill copies where they pay.
``builder.py`` assembles runners around what this loads; ``distributed.load_shard_model``
calls ``load_model`` for a rank's part.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.executor.layers.parallel import Collectives
from radixserve.executor.loader import Checkpoint, load_checkpoint
from radixserve.executor.loader.dummy import dummy_weights
from radixserve.executor.loader.safetensors_loader import read_hf_config
from radixserve.executor.loader.sharded import ShardLayout, load_sharded_checkpoint
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.base import CausalLM
from radixserve.executor.models.registry import build_model
from radixserve.executor.quant import (
    PREFILL_COPY_MODES,
    GGUFPrecisions,
    QuantScheme,
    add_prefill_copies,
    executed_label,
    install_gguf_linears,
    prefill_copy_bytes,
    quantize_model,
    resolve_quantization,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

log = logging.getLogger(__name__)


def resolve_dtype(setting: str, checkpoint_dtype: str | None) -> torch.dtype:
    """``auto``: the checkpoint's float32, else bfloat16 (float16 is slow on CPU)."""
    if setting != "auto":
        return DTYPES[setting]
    return torch.float32 if checkpoint_dtype == "float32" else torch.bfloat16


@dataclass
class LoadedModel:
    """A model built from a checkpoint (one rank's part under tensor parallelism).

    Invariant: ``model``'s weights are on ``device`` in ``dtype`` (dense layers in
    ``scheme`` when set); ``checkpoint`` keeps the config and metadata, not the weights;
    ``config`` is the whole model's config (``model.config`` is this rank's)."""

    checkpoint: Checkpoint
    config: ModelConfig
    model: CausalLM
    dtype: torch.dtype
    scheme: QuantScheme | GGUFPrecisions | None
    load_seconds: float = 0.0


def load_model(
    kind: str,
    path: Path,
    *,
    device: torch.device,
    dtype: str = "auto",
    quantization: str = "auto",
    group_size: int = 32,
    load_format: str = "auto",
    rank: int = 0,
    group: Collectives | None = None,
    prefill_copy: str = "off",
) -> LoadedModel:
    """Load the checkpoint at ``path`` (``kind``: hf or gguf), build the model of its
    architecture on ``device`` and quantize it. With ``group`` (size > 1), only rank
    ``rank``'s shard is read and built. ``load_format="dummy"``: random weights for the
    folder's config (the same on every rank, each cutting its part). ``prefill_copy``
    (auto | on | off): whether quantized dense layers also keep a bfloat16 copy for the
    steps that would dequantize them (``decide_prefill_copy``)."""
    start = time.perf_counter()
    world_size = 1 if group is None else group.world_size
    # a GGUF file run by ``auto`` on the CPU in one process: each dense tensor at its own
    # precision, built from its codes (bfloat16 activations: float32 is a reference run)
    from_codes = (
        kind == "gguf"
        and quantization == "auto"
        and world_size == 1
        and load_format != "dummy"
        and device.type == "cpu"
        and dtype in ("auto", "bfloat16")
    )
    layout: ShardLayout | None = None
    if load_format == "dummy":
        if kind != "hf":
            raise ValueError("load_format 'dummy' takes a folder with a config.json")
        checkpoint = Checkpoint(read_hf_config(path), {})
    elif world_size > 1:
        checkpoint, layout = load_sharded_checkpoint(kind, path, rank, world_size)
    else:
        checkpoint = load_checkpoint(kind, path, codes=from_codes)
    config = ModelConfig.from_hf_dict(checkpoint.hf_config)
    if group is not None and layout is None:
        layout = ShardLayout(config, rank, world_size)
    torch_dtype = resolve_dtype(dtype, checkpoint.hf_config.get("torch_dtype"))
    weights = checkpoint.weights
    checkpoint.weights = {}
    if load_format == "dummy":
        full = dummy_weights(config, torch_dtype, device if layout is None else None)
        if layout is None:
            weights = full
        else:  # the same seed on every rank: each cuts its part of one random model
            weights = {name: layout.shard_tensor(name, full.pop(name)) for name in list(full)}
    if device.type != "cpu":
        for name in list(weights):  # one at a time: host memory stays one tensor over
            weights[name] = weights[name].to(device, torch_dtype)
    if layout is None:
        model = build_model(config, weights, torch_dtype)
    else:
        assert group is not None
        model = build_model(
            layout.local_config(), weights, torch_dtype, layout.tensor_parallel(group)
        )
    del weights
    scheme: QuantScheme | GGUFPrecisions | None = resolve_quantization(quantization, group_size)
    if from_codes:
        if torch_dtype != torch.bfloat16:
            raise RuntimeError(f"a GGUF file resolved to {torch_dtype}, not bfloat16")
        counts = install_gguf_linears(model, checkpoint.gguf_linears, checkpoint.gguf_tensor_types)
        checkpoint.gguf_linears = {}
        seconds = time.perf_counter() - start
        head_type = next((t for (p, t) in counts if p == "lm_head"), None)
        head = f"{executed_label(model.lm_head)} ({head_type})" if head_type else None
        layers = sorted((p, t, c) for (p, t), c in counts.items() if p != "lm_head")
        scheme = GGUFPrecisions(tuple(layers), seconds, head)
    elif scheme is not None:
        quantize_model(model, scheme)
    elif kind == "gguf" and quantization == "auto" and checkpoint.gguf_tensor_types:
        log.info(
            "GGUF tensors run at their own precision on the CPU in one process only: "
            "here (device %s, %d ranks, %s) the file runs dequantized to %s",
            device.type,
            world_size,
            dtype,
            str(torch_dtype).removeprefix("torch."),
        )
    if device.type == "cpu" and decide_prefill_copy(prefill_copy, prefill_copy_bytes(model)):
        add_prefill_copies(model)
    seconds = time.perf_counter() - start
    return LoadedModel(checkpoint, config, model, torch_dtype, scheme, seconds)


# auto keeps the copy when it takes at most this share of the memory available at load
PREFILL_COPY_AUTO_SHARE = 0.25


def peak_rss_bytes() -> int | None:
    """This process's peak resident set so far (VmHWM of /proc/self/status; None where
    there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def decide_prefill_copy(mode: str, copy_bytes: int, available: int | None = None) -> bool:
    """Whether to keep bfloat16 prefill copies of the quantized layers: ``on``/``off`` as
    said; ``auto`` when there are quantized layers and their copy takes at most
    ``PREFILL_COPY_AUTO_SHARE`` of the memory available now (``available``, read from
    /proc/meminfo when not given; unknown: no copy)."""
    if mode not in PREFILL_COPY_MODES:
        raise ValueError(f"prefill_weight_copy must be one of {', '.join(PREFILL_COPY_MODES)}")
    if mode != "auto" or copy_bytes == 0:
        return mode == "on" and copy_bytes > 0
    available = available_memory_bytes() if available is None else available
    return available is not None and copy_bytes <= PREFILL_COPY_AUTO_SHARE * available
