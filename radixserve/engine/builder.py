"""Builds what an ``Engine`` loop runs over, once, from an ``EngineConfig``: the model (its
weights, or a simulated device), the tokenizer and the model's sampling defaults, tensor
parallelism, the KV cache and its tiers, the scheduler, the runner and the device that runs
its steps, speculation, fault injection. ``Engine`` (``engine.py``) is the loop: add, abort,
step, stats."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve.core.kv_events import KVEventLog
from radixserve.core.kv_tiers import TierSlots
from radixserve.core.page_pool import PagePool
from radixserve.core.page_table import PageTable
from radixserve.core.radix_cache import RadixCache
from radixserve.engine.config import EngineConfig
from radixserve.engine.faults import FaultInjector
from radixserve.engine.inputs import InputProcessor, sampling_defaults
from radixserve.engine.kv_publisher import KVEventPublisher
from radixserve.engine.model_profile import context_length
from radixserve.engine.model_source import (
    ModelSource,
    model_matryoshka,
    model_pooling,
    resolve_model,
)
from radixserve.engine.parallel import worker_spec
from radixserve.engine.spec_control import SpecController
from radixserve.engine.tokenizer import (
    MissingTokenizer,
    has_tokenizer_files,
    load_hf_tokenizer,
    tokenizer_from_gguf,
)
from radixserve.executor.builder import build_runner, size_kv_cache
from radixserve.executor.device import (
    Device,
    InlineDevice,
    PreparedStep,
    StepResult,
    ThreadDevice,
    TimedDevice,
)
from radixserve.executor.distributed import TensorParallelGroup, default_threads
from radixserve.executor.kv_tiers import DiskKVStore, HostKVStore, TierTransfer, model_identity
from radixserve.executor.loader.gguf_loader import read_metadata
from radixserve.executor.loader.safetensors_loader import read_json
from radixserve.executor.lora import LoRAShapes
from radixserve.executor.lora_loader import LoRARegistry
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.model_runner import ModelRunner
from radixserve.executor.native import kernel_tier
from radixserve.executor.quant import format_weight_memory
from radixserve.executor.sampler import Sampler
from radixserve.executor.simulated import CostModel, SimulatedRunner
from radixserve.executor.spec import AdaptiveLength, DraftProposer, NgramProposer, Proposer
from radixserve.executor.weights import load_model
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("radixserve.engine.engine")  # (the start-up lines' logger)

SIMULATED_KV_PAGES = 1 << 16
SIMULATED_MAX_MODEL_LEN = 8192


@dataclass
class Speculation:
    """Speculative decoding's parts (``config.speculative_mode``); all None when off.
    Invariant: ``draft`` is set only with ``proposer``; ``spec_length`` only without a
    draft model (its steps cost per token, so it keeps its length)."""

    proposer: Proposer | None = None
    draft: DraftProposer | None = None
    control: SpecController | None = None  # the measured policy's controller
    # the n-gram proposer's per-request length (None: fixed at num_spec_tokens)
    length: AdaptiveLength | None = None


@dataclass
class ModelParts:
    """What loading a model (or preparing a simulated one) gave: the tokenizer and the
    model's generation config, its vocabulary and context, how many KV pages fit, its EOS
    ids, and for a real model its weights (``model``: None on a simulated device), their
    config, dtype, device, memory, pooling, Matryoshka sizes and tensor-parallel group."""

    tokenizer: Any
    generation_config: dict[str, Any]
    vocab_size: int
    max_model_len: int
    num_pages: int
    eos_ids: tuple[int, ...]
    detokenize: bool = True
    model: Any = None
    model_config: ModelConfig | None = None
    dtype: torch.dtype | None = None
    torch_device: torch.device | None = None
    weight_bytes: dict[str, int] = field(default_factory=dict)
    model_pooling: str | None = None
    matryoshka_dimensions: list[int] | None = None
    tp: TensorParallelGroup | None = None
    threads_before: int | None = None
    startup_line: str = ""


@dataclass
class EngineParts:
    """Everything an ``Engine`` runs over (the model's own parts in ``loaded``).
    Invariants: ``inputs`` checks prompts against ``loaded``'s vocabulary and context; the
    ``runner``'s KV cache has ``pool``'s pages (the engine runs its steps on
    ``make_device``'s device); ``startup_line`` states what was built."""

    config: EngineConfig
    source: ModelSource
    detokenize: bool  # asked for, and the model has a tokenizer
    eos_token_ids: tuple[int, ...]
    inputs: InputProcessor
    pool: PagePool
    page_table: PageTable
    prefix_cache: RadixCache | None
    kv_manager: KVManager
    scheduler: Scheduler
    sampler: Any  # the CPU Sampler, or the CUDA runner's device sampler
    runner: ModelRunner | SimulatedRunner
    speculation: Speculation
    faults: FaultInjector | None
    kv_transfer: TierTransfer | None
    loaded: ModelParts
    loras: LoRARegistry | None = None  # None: a simulated device (no model to adapt)
    kv_publisher: KVEventPublisher | None = None  # sends prefix_cache.events (if on)
    startup_line: str = ""


def build_engine(config: EngineConfig, detokenize: bool = True) -> EngineParts:
    """Load and assemble everything ``config`` asks for (``detokenize``: as ``Engine``)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    source = resolve_model(config.model)
    load = _simulated_model if config.simulated_device else _load_model
    m = load(config, source)
    eos_ids = _eos_ids(m.tokenizer, m.eos_ids, m.generation_config)
    # every prompt and SamplingParams of the engine is made and checked here
    inputs = InputProcessor(
        m.tokenizer,
        m.vocab_size,
        m.max_model_len,
        sampling_defaults(m.generation_config, config.generation_config),
    )
    pool = PagePool(m.num_pages, config.page_size)
    page_table = PageTable(config.max_num_seqs, pool.pages_for(m.max_model_len))
    prefix_cache = None
    if not config.disable_radix_cache:
        events = KVEventLog(config.page_size) if config.kv_events_endpoint else None
        prefix_cache = RadixCache(pool, events=events)
    kv_manager = KVManager(pool, page_table, prefix_cache)
    scheduler = Scheduler(scheduler_config(config), kv_manager)
    sampler: Any = Sampler(m.vocab_size, eos_ids)
    runner: ModelRunner | SimulatedRunner
    if config.simulated_device_time:
        runner = SimulatedRunner(
            CostModel(*config.simulated_device_cost),
            m.vocab_size,
            page_table=page_table,
            page_size=config.page_size,
        )
    elif config.simulated_device:
        runner = SimulatedRunner(CostModel(0.0, 0.0, 0.0), m.vocab_size)
    else:
        runner, sampler = build_runner(
            m.model,
            m.num_pages,
            config.page_size,
            page_table,
            sampler,
            runner=config.resolved_runner,
            device=m.torch_device,
            vocab_size=m.vocab_size,
            eos_token_ids=eos_ids,
            cuda_graph_max_bs=None if config.disable_cuda_graph else config.cuda_graph_max_bs,
            tp=m.tp,
            kv_cache_dtype=config.kv_cache_dtype,
            deterministic=config.deterministic,
        )
    startup_line = m.startup_line
    if config.deterministic and isinstance(runner, ModelRunner):
        startup_line += "; deterministic"
    if m.torch_device is not None and m.torch_device.type == "cpu":
        startup_line += f"; CPU kernels {kernel_tier()}"
    kv_transfer = None
    if config.tiers:
        assert prefix_cache is not None and isinstance(runner, ModelRunner)
        kv_transfer, line = _build_tiers(config, source, runner, prefix_cache)
        startup_line += "; " + line
    faults = FaultInjector.from_env()  # RADIXSERVE_FAULTS; None (no hook) when unset
    speculation, line = _build_speculation(config, runner, pool, page_table, m)
    if line:
        startup_line += "; " + line
    loras, line = _build_loras(config, m, runner)
    if line:
        startup_line += "; " + line
    kv_publisher = None
    if config.kv_events_endpoint:  # last: nothing after it can fail with its socket open
        kv_publisher = KVEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_topic,
            config.kv_events_replay_endpoint,
            config.data_parallel_rank,
        )
        startup_line += f"; KV events on {kv_publisher.endpoint}"
    return EngineParts(
        config=config,
        source=source,
        detokenize=detokenize and m.detokenize,
        eos_token_ids=eos_ids,
        inputs=inputs,
        pool=pool,
        page_table=page_table,
        prefix_cache=prefix_cache,
        kv_manager=kv_manager,
        scheduler=scheduler,
        sampler=sampler,
        runner=runner,
        speculation=speculation,
        faults=faults,
        kv_transfer=kv_transfer,
        loaded=m,
        loras=loras,
        kv_publisher=kv_publisher,
        startup_line=startup_line,
    )


def _build_loras(
    config: EngineConfig, m: ModelParts, runner: Any
) -> tuple[LoRARegistry | None, str]:
    """The LoRA registry of a real model, with ``--lora-modules`` loaded (a bad adapter
    fails the start, naming it), its adapters on the model's device; adapters are refused
    where their products do not run yet (tensor parallelism), which a load then says."""
    if m.model_config is None:
        return None, ""
    refusal = None
    if m.tp is not None:
        refusal = "LoRA adapters are not served under tensor parallelism yet"
    elif not isinstance(runner, ModelRunner):
        refusal = "LoRA adapters need a model runner (not a simulated device)"
    elif config.deterministic:
        refusal = "LoRA adapters are not served in deterministic mode yet"
    loras = LoRARegistry(
        LoRAShapes.of(m.model_config),
        m.dtype or torch.float32,
        max_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        refusal=refusal,
        device=m.torch_device,
    )
    for item in config.lora_modules:
        name, _, path = item.partition("=")
        loras.load(name, path)
    if not config.lora_modules:
        return loras, ""
    return loras, f"LoRA adapters: {', '.join(loras.names())}"


def scheduler_config(config: EngineConfig) -> SchedulerConfig:
    """The scheduler's settings from the engine's."""
    return SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_loras=config.max_loras,
        long_prefill_threshold=config.long_prefill_threshold,
        policy=config.schedule_policy,
        max_waiting_requests=config.max_waiting_requests,
        max_queue_time_s=config.max_queue_time_s,
        batch_wait_s=config.batch_wait_ms / 1000,
        reserve_ratio_init=0.7 * config.schedule_conservativeness,
        reserve_ratio_min=0.1 * config.schedule_conservativeness,
        fair_step_prefill_tokens=config.fair_step_prefill_tokens,
        fair_active_window_s=config.fair_active_window_s,
        fair_step_target_s=config.fair_step_target_s,
    )


# -- the model ------------------------------------------------------------------------------
def _load_model(config: EngineConfig, source: ModelSource) -> ModelParts:
    """Weights, tokenizer and KV sizing of a real model."""
    torch_device = torch.device(config.resolved_device)
    start = time.perf_counter()
    tp = None
    threads_before = None
    if config.tensor_parallel_size > 1:
        tp, threads_before = _start_tensor_parallel(config, source)
        loaded = tp.loaded
        checkpoint, scheme = loaded.checkpoint, loaded.scheme
        mc = ModelConfig.from_hf_dict(checkpoint.hf_config)
        torch_device = tp.group.device  # rank 0's: cuda:0 on GPUs
    else:
        loaded = load_model(
            source.kind,
            source.path,
            device=torch_device,
            dtype=config.dtype,
            quantization=config.quantization,
            group_size=config.quantization_group_size,
            load_format=config.load_format,
            # deterministic mode multiplies every row from the codes: no bfloat16 copy
            prefill_copy="off" if config.deterministic else config.prefill_weight_copy,
        )
        checkpoint, scheme, mc = loaded.checkpoint, loaded.scheme, loaded.config
    model, dtype = loaded.model, loaded.dtype
    tokenizer, generation_config = _load_tokenizer(source, checkpoint.gguf_metadata)
    pooling = model_pooling(source, checkpoint.gguf_metadata)
    matryoshka = model_matryoshka(source)
    del checkpoint, loaded
    max_model_len = context_length(config, mc.max_model_len)
    sizing = size_kv_cache(
        model,
        config.page_size,
        config.kv_cache_memory_gb,
        config.memory_budget_gb,
        max_model_len=max_model_len,
        requests=config.kv_cache_requests,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    num_pages, page_bytes = sizing.num_pages, sizing.page_bytes
    basis = f"; {sizing.basis}" if sizing.basis else ""
    startup_line = (
        f"weights {format_weight_memory(sizing.weight_bytes)}; dense layers "
        f"{scheme.describe() if scheme else str(dtype).removeprefix('torch.')}, "
        f"embeddings{'' if getattr(scheme, 'head', None) else ' and LM head'} "
        f"{str(dtype).removeprefix('torch.')}; KV cache "
        f"{num_pages * page_bytes / 2**30:.3f} GiB"
        f"{' int8' if config.kv_cache_dtype == 'int8' else ''} ({num_pages} pages of {config.page_size}"
        f"{basis}); "
        f"weights and tokenizer loaded in {time.perf_counter() - start:.2f} s" + _peak_rss_note()
    )
    logger.info("%s", startup_line)
    return ModelParts(
        tokenizer=tokenizer,
        generation_config=generation_config,
        vocab_size=mc.vocab_size,
        max_model_len=max_model_len,
        num_pages=num_pages,
        eos_ids=mc.eos_token_ids,
        # without a tokenizer, outputs carry token ids only
        detokenize=not isinstance(tokenizer, MissingTokenizer),
        model=model,
        model_config=mc,
        dtype=dtype,
        torch_device=torch_device,
        weight_bytes=sizing.weight_bytes,
        model_pooling=pooling,
        matryoshka_dimensions=matryoshka,
        tp=tp,
        threads_before=threads_before,
        startup_line=startup_line,
    )


def _peak_rss_note() -> str:
    """``; peak RSS X GiB`` of this process so far (loading included), where known."""
    from radixserve.executor.weights import peak_rss_bytes

    peak = peak_rss_bytes()
    return "" if peak is None else f"; peak RSS {peak / 2**30:.2f} GiB"


def _start_tensor_parallel(
    config: EngineConfig, source: ModelSource
) -> tuple[TensorParallelGroup, int | None]:
    """Start the other ranks (worker processes on this node; the other nodes start theirs),
    join the group as rank 0 and load this rank's shard; returns the group and torch's
    thread count before it was split between this node's ranks (None: left alone)."""
    if config.node_rank != 0:
        raise ValueError("node_rank > 0 runs workers only (radixserve.executor.distributed)")
    spec = worker_spec(config, source)
    threads_before = None
    if config.num_threads is None:  # the cores split between this node's ranks
        threads_before = torch.get_num_threads()
        torch.set_num_threads(default_threads(spec))
    return TensorParallelGroup(spec), threads_before


def _simulated_model(config: EngineConfig, source: ModelSource) -> ModelParts:
    """The model's tokenizer but no weights: a simulated device (instant synthetic tokens)
    for measuring everything around the model."""
    meta = read_metadata(source.path) if source.kind == "gguf" else None
    tokenizer, generation_config = _load_tokenizer(source, meta)
    pages = SIMULATED_KV_PAGES
    if config.simulated_kv_tokens is not None:
        pages = max(1, config.simulated_kv_tokens // config.page_size)
    return ModelParts(
        tokenizer=tokenizer,
        generation_config=generation_config,
        vocab_size=len(tokenizer),
        max_model_len=config.max_model_len or SIMULATED_MAX_MODEL_LEN,
        num_pages=pages,
        eos_ids=(),
    )


def _load_tokenizer(
    source: ModelSource, gguf_metadata: dict[str, Any] | None
) -> tuple[Any, dict[str, Any]]:
    if source.kind == "gguf":
        return tokenizer_from_gguf(gguf_metadata or {}), {}
    gen_path = source.path / "generation_config.json"
    generation_config = read_json(gen_path) if gen_path.is_file() else {}
    if not has_tokenizer_files(source.path):
        return MissingTokenizer(source.path), generation_config
    return load_hf_tokenizer(source.path), generation_config


def _eos_ids(
    tokenizer: Any, model_eos: tuple[int, ...], generation_config: dict[str, Any]
) -> tuple[int, ...]:
    ids = set(model_eos)
    gen_eos = generation_config.get("eos_token_id")
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


# -- KV tiers, the device, speculation ------------------------------------------------------
def _build_tiers(
    config: EngineConfig, source: ModelSource, runner: ModelRunner, prefix_cache: RadixCache
) -> tuple[TierTransfer, str]:
    """The host tier (and the disk tier under it) below the radix cache; its start-up line."""
    kv = runner.kv_cache
    page_bytes = kv.page_bytes
    slots = int(config.kv_host_gb * 2**30) // page_bytes
    if slots < 1:
        raise ValueError(f"kv_host_gb {config.kv_host_gb} holds no KV page of {page_bytes} B")
    host = HostKVStore(kv, slots)
    disk = None
    line = f"KV host tier {slots * page_bytes / 2**30:.3f} GiB ({slots} pages)"
    if config.kv_cache_dir is not None:
        layers, _, heads, _, head_dim = kv.k.shape
        identity = model_identity(
            source.path,
            kv.k.dtype,
            config.page_size,
            layers,
            heads,
            head_dim,
            extra=f"{source.kind}:{config.quantization}:{config.quantization_group_size}"
            f":{config.load_format}" + (":kv=int8" if kv.quantized else ""),
        )
        disk = DiskKVStore(
            Path(config.kv_cache_dir), identity, int(config.kv_disk_gb * 2**30), page_bytes
        )
        line += (
            f"; disk tier {config.kv_disk_gb} GiB in {disk.folder} "
            f"({disk.num_records} records found)"
        )
    transfer = TierTransfer(kv, host, disk)
    prefix_cache.host = TierSlots(slots)
    prefix_cache.transfer = transfer
    logger.info("%s", line)
    return transfer, line


def make_device(
    config: EngineConfig,
    run: Callable[[PreparedStep], StepResult],
    faults: FaultInjector | None,
) -> Device:
    """What runs a step (``run``: the engine's runner's, looked up at each step, so a runner
    swapped in later is the one that runs): inline, on a worker thread (the CPU model as an
    asynchronous device, for the overlapped loop) or timed (the simulated device);
    ``faults`` injected before each step when set."""
    step = run
    if faults is not None:

        def step(prepared: PreparedStep) -> StepResult:
            faults.on_step()
            return run(prepared)

    if config.simulated_device_time:
        return TimedDevice(step)
    if config.overlap:
        return ThreadDevice(step)
    return InlineDevice(step)


def _build_speculation(
    config: EngineConfig,
    runner: ModelRunner | SimulatedRunner,
    pool: PagePool,
    page_table: PageTable,
    m: ModelParts,
) -> tuple[Speculation, str]:
    """Speculative decoding's proposer, draft model and policy (``config.speculative_mode``)
    and its start-up line ("" when off)."""
    spec = Speculation()
    if not config.speculative:
        return spec, ""
    if not isinstance(runner, ModelRunner) or config.resolved_runner != "cpu":
        raise ValueError("speculative decoding runs on the CPU runner only (for now)")
    spec.proposer = NgramProposer(config.spec_ngram_max, config.spec_ngram_min)
    cap = config.spec_length_cap
    if cap:
        spec.length = AdaptiveLength(config.num_spec_tokens, cap)
        length = (
            f"{spec.length.start} proposals per step to start, adapted per request "
            f"between {config.num_spec_tokens} and {cap} (above {config.num_spec_tokens}, "
            f"{cap} shared by the batch)"
        )
    else:
        length = f"up to {config.num_spec_tokens} proposals per step"
    line = (
        f"speculative decoding: {config.speculative_mode}, {length} (n-gram "
        f"{config.spec_ngram_min}..{config.spec_ngram_max})"
    )
    if config.spec_draft_model is not None:
        source = resolve_model(config.spec_draft_model)
        assert m.dtype is not None
        spec.draft = DraftProposer(
            source.kind,
            source.path,
            pool.num_pages,
            config.page_size,
            page_table,
            m.dtype,
            m.vocab_size,
            config.spec_draft_quantization,
        )
        runner.shadow = spec.draft.shadow
        scheme = spec.draft.scheme
        precision = scheme.describe() if scheme is not None else str(spec.draft.dtype)
        line = (
            f"speculative decoding: draft model {source.path.name} ({precision}), up to "
            f"{config.num_spec_tokens} proposals per step; its KV cache "
            f"{spec.draft.kv_bytes / 2**30:.3f} GiB on the same pages"
        )
    if config.spec_policy == "measured":
        spec.control = SpecController(config.spec_crossover)
        line += (
            f"; on where measured tokens/s say it pays, per batch size (cold start: at "
            f"most {config.spec_crossover} decoding requests)"
        )
    elif config.spec_policy == "threshold":
        line += f"; while at most {config.spec_crossover} requests decode"
    else:
        line += "; every step"
    logger.info("%s", line)
    return spec, line
