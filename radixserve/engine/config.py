"""Engine settings, defined once (each with its flag) and validated once."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.core.request import PREFIX_CACHE_SCOPES
from radixserve.core.settings import floats, scaled, setting, zero_is_none
from radixserve.engine.structured import DEFAULT_COMPILE_TIMEOUT_S
from radixserve.executor.kv_cache import KV_CACHE_DTYPES
from radixserve.executor.placement import check_gpu_count
from radixserve.executor.quant import INT4_GROUP_SIZES, PREFILL_COPY_MODES, QUANTIZATIONS
from radixserve.executor.weights import available_memory_bytes
from radixserve.scheduler.policy import POLICIES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# kv_cache_dir alone: the host tier is this many times the KV cache, at most this share of
# the memory available at start; the disk tier this share of the folder's free disk, at
# most this many GiB (docs/kv-tiers.md)
KV_HOST_AUTO_KV_MULTIPLE = 4.0
KV_HOST_AUTO_MEMORY_SHARE = 0.25
KV_DISK_AUTO_SHARE = 0.5
KV_DISK_AUTO_MAX_GB = 64.0
logger = logging.getLogger(__name__)
SPECULATIVE_MODES = ("off", "ngram", "draft", "auto")
# when a speculative mode speculates: measured (a cost controller per batch size, cold start
# from spec_auto_max_batch), threshold (while at most spec_auto_max_batch requests decode),
# always (every step it can)
SPEC_POLICIES = ("measured", "threshold", "always")
# the n-gram proposer's adaptive length cap when spec_max_tokens is not given (a request
# starts at half of it): chosen by replaying SmolLM2's greedy outputs through the rules at
# the verify cost measured on the development machine (docs/speculative.md)
DEFAULT_SPEC_MAX_TOKENS = 16


@dataclass
class EngineConfig:
    """Every engine setting, defined once: each ``setting(...)`` field is also a flag of
    ``radixserve serve`` and ``generate`` (``core.settings``: the flag is ``--field-name``
    unless named, its help is written here) and a keyword of ``LLM(...)``; the fields made
    without ``setting`` are keywords only.

    Invariant: every field is within range after ``__post_init__`` (else ``ValueError``)."""

    model: str | None = setting(
        None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    dtype: str = setting("auto", choices=("auto", *DTYPES))
    kv_cache_memory_gb: float | None = setting(
        None,
        name="--kv-cache-memory",
        help="KV cache size in GiB (default: enough for --kv-cache-requests requests of "
        "--max-model-len tokens, at most half the memory the weights leave)",
    )
    kv_cache_requests: int = setting(
        4,
        help="without --kv-cache-memory: how many requests of --max-model-len tokens the KV "
        "cache holds at once",
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: auto (the model's dtype) or int8 (a scale per token "
        "and head: about half of bfloat16's memory)",
    )
    deterministic: bool = setting(
        False,
        help="compute each request's tokens and logprobs as if it ran alone: the same "
        "whatever its batch, its prompt's chunking, its prefix hits or speculation "
        "(docs/deterministic.md; slower; refused where a part cannot keep it yet)",
    )
    page_size: int = setting(16, help="tokens per KV page")
    max_num_batched_tokens: int = setting(2048, help="prompt + decode tokens in one step")
    max_num_seqs: int = setting(
        256, aliases=("--max-running-requests",), help="requests running at once"
    )
    max_model_len: int | None = setting(
        None, help="longest prompt + output in tokens (default: the model's context)"
    )
    long_prefill_threshold: int | None = setting(
        None, help="a prompt longer than this is prefilled in chunks alongside decodes"
    )
    num_threads: int | None = setting(None, help="CPU threads of the model (default: all)")
    # who shares cached KV (core.request.PREFIX_CACHE_SCOPES)
    disable_radix_cache: bool = setting(False, group="scheduler", help="no prefix caching")
    prefix_cache_scope: str = setting(
        "tenant",
        group="scheduler",
        choices=PREFIX_CACHE_SCOPES,
        help="tenant: a tenant's requests reuse only its own cached prefixes, so none learns "
        "another's prompts from cached_tokens or time to first token (no-op without "
        "--api-keys-file); global: all tenants share (docs/many-users.md)",
    )
    # KV-cache events for llm-d's indexer and Ray's KV-aware router (engine/kv_publisher.py)
    kv_events_endpoint: str | None = setting(
        None,
        group="kv events",
        metavar="ZMQ_ENDPOINT",
        help="publish the radix tree's page inserts and evictions as vLLM's KV events "
        "(msgpack KVEventBatch over ZMQ PUB), e.g. tcp://*:5557 (bound) or "
        "tcp://indexer:5557 (connected to); data-parallel engine r adds r to the port",
    )
    kv_events_replay_endpoint: str | None = setting(
        None,
        group="kv events",
        metavar="ZMQ_ENDPOINT",
        help="a ROUTER socket that replays the buffered batches from a sequence number",
    )
    kv_events_topic: str = setting(
        "",
        group="kv events",
        help="the first frame of each batch; llm-d reads kv@POD_IP:PORT@MODEL",
    )
    # which engine of a data-parallel group this is (dp_client sets it; KV events' port)
    data_parallel_rank: int = 0
    schedule_policy: str = setting("fcfs", group="scheduler", choices=POLICIES)
    max_waiting_requests: int | None = setting(None, group="scheduler", help="refuse beyond this")
    max_queue_time_s: float | None = setting(
        None, name="--max-queue-time", group="scheduler", help="seconds a request may wait"
    )
    batch_wait_ms: float = setting(0.0, group="scheduler", help="wait for more arrivals")
    # 0 admits as much as fits now (more preemptions later), 1 is the default, smaller
    # values trade safety for batch size
    schedule_conservativeness: float = setting(
        1.0, group="scheduler", help="decode reserve kept at admission, 0..1"
    )
    # 64: every chunk of a long prompt runs on the quantized layers' bfloat16 prefill copy
    # (prefill_weight_copy), and a light tenant's next request waits for a step of at most
    # 64 prompt tokens (docs/many-users.md)
    fair_step_prefill_tokens: int | None = setting(
        64,
        group="scheduler",
        parse=zero_is_none(int),
        metavar="N",
        help="policy fair: while a tenant served less is active, the tenants served more add "
        "at most N prefill tokens per step between them (0: no cap)",
    )
    fair_active_window_s: float = setting(
        10.0,
        name="--fair-active-window",
        group="scheduler",
        metavar="SECONDS",
        help="policy fair: a tenant counts as active this long after its last request",
    )
    # 35 ms: a 64-token chunk's step takes 30 ms on two threads, 48 ms on one, where the cap
    # then settles at 16-30 tokens (SmolLM2, docs/many-users.md)
    fair_step_target_s: float | None = setting(
        0.035,
        name="--fair-step-target-ms",
        group="scheduler",
        parse=scaled(float, 1e-3, zero_none=True),
        metavar="MS",
        help="policy fair: steer that cap (16 tokens up to N) so such a step takes about MS "
        "milliseconds on the device, or 1.5 decode-only steps where longer, measured step by "
        "step (0: the token cap alone; default 35)",
    )
    # No weights: instant synthetic tokens (for measuring the scheduler, the API and the
    # server around the model).
    simulated_device: bool = setting(
        False, help="no weights: instant synthetic tokens (benchmarks of everything but the model)"
    )
    # launching returns at once, the CPU is free meanwhile, like a GPU queue
    simulated_device_time: bool = setting(
        False,
        help="the simulated device takes the cost model's time for real, asynchronously "
        "like a GPU queue (implies --simulated-device)",
    )
    # ~10 ms for 256 decodes of ~600-token sequences
    simulated_device_cost: tuple[float, float, float] = setting(
        (0.006, 1e-5, 1e-8),
        parse=floats(3),
        metavar="A,B,C",
        help="timed simulated device: seconds per step, per batched token, per KV token read",
    )
    simulated_kv_tokens: int | None = setting(
        None, help="simulated device: KV cache size in tokens (default: never full)"
    )
    # Overlapped loop: launch step N, then finish step N-1 and prepare N+1 while N runs (on
    # CPU the model then runs on a worker thread).
    enable_overlap: bool | None = setting(
        None,
        off="--disable-overlap",
        help="prepare step N+1 while the device runs step N (default: on for the timed "
        "simulated device and on CUDA, off on CPU)",
    )
    device: str = setting(
        "auto",
        choices=("auto", "cpu", "cuda"),
        help="where the model runs (auto: cuda when torch sees a GPU, else cpu)",
    )
    # a folder holding only config.json is enough; token-id prompts only without a tokenizer
    load_format: str = setting(
        "auto",
        choices=("auto", "dummy"),
        help="dummy: random weights for the model folder's config.json (no checkpoint needed)",
    )
    # The model runner (a keyword, no flag): auto = the CUDA runner (Triton kernels) on
    # cuda, the CPU runner on cpu; "cuda" on a cpu device runs the CUDA runner's code on CPU
    # tensors under Triton's interpreter (TRITON_INTERPRET=1): how the tests cover the CUDA
    # path without a GPU.
    runner: str = "auto"  # auto | cpu | cuda
    cuda_graph_max_bs: int = setting(256, help="largest decode batch replayed from a CUDA graph")
    disable_cuda_graph: bool = setting(False, help="run decode steps eagerly")
    # (with bfloat16 activations; float32 runs a GGUF file dequantized)
    quantization: str = setting(
        "auto",
        choices=QUANTIZATIONS,
        help="dense-layer weights: auto (a GGUF file in the closest precision to its own, an HF "
        "checkpoint in its dtype), none, int8 (per channel), int4 (groups, zero points)",
    )
    quantization_group_size: int = setting(
        32, choices=INT4_GROUP_SIZES, help="int4: weights per group"
    )
    prefill_weight_copy: str = setting(
        "auto",
        choices=PREFILL_COPY_MODES,
        help="CPU, quantized dense layers: also keep a bfloat16 copy of each for prefill "
        "chunks, which otherwise dequantize the weights every step (2 bytes a weight; auto: "
        "when it takes at most a quarter of the memory available at load)",
    )
    memory_budget_gb: float | None = setting(
        None,
        name="--memory-budget",
        help="GiB for weights + KV cache: the KV cache gets what the weights leave "
        "(instead of --kv-cache-memory)",
    )
    # the server's frontend bounds its parse of the grammar by the same
    grammar_compile_timeout_s: float = setting(
        DEFAULT_COMPILE_TIMEOUT_S,
        name="--grammar-compile-timeout",
        metavar="SECONDS",
        help="seconds a structured-output grammar may take to compile (longer: the server "
        "answers 400; offline, the request fails)",
    )
    generation_config: str = setting(
        "auto",
        choices=("auto", "neutral"),
        help="sampling fields a request leaves unset: auto = the model's generation_config.json "
        "(offline, HTTP and gRPC alike); neutral = OpenAI-style (temperature 1, top_p 1)",
    )
    # Tensor parallelism: rank 0 in this process and one worker process per other rank,
    # rank r of a node on cuda:LOCAL_RANK; across nnodes machines, torchrun style.
    tensor_parallel_size: int = setting(1, aliases=("-tp",), group="parallel", help="ranks in all")
    nnodes: int = setting(1, group="parallel", help="machines the ranks span")
    node_rank: int = setting(0, group="parallel", help="this machine (0 runs the engine)")
    master_addr: str = setting("127.0.0.1", group="parallel", help="node 0's address")
    master_port: int | None = setting(
        None, group="parallel", help="rendezvous port on node 0 (default: any free port, one node)"
    )
    distributed_timeout_s: float = setting(
        300.0,
        name="--distributed-timeout",
        group="parallel",
        help="seconds a collective may wait before the group is declared lost",
    )
    # Each speculating request verifies its last token + up to num_spec_tokens proposals in
    # one extend chunk; "auto" is the name of "on where it pays".
    speculative_mode: str = setting(
        "off",
        group="speculative",
        choices=SPECULATIVE_MODES,
        help="ngram: propose from the request's own prompt and output (prompt lookup), "
        "verify in one step; draft: a smaller model with the same tokenizer proposes "
        "(--spec-draft-model); auto: ngram (with the default --spec-policy measured, every "
        "mode speculates only at batch sizes where it measured a gain)",
    )
    spec_draft_model: str | None = setting(
        None,
        group="speculative",
        help="HF folder or .gguf of the draft model (--speculative-mode draft)",
    )
    # int8 or int4 runs the draft in bfloat16 whatever the target's dtype
    spec_draft_quantization: str = setting(
        "auto",
        group="speculative",
        choices=QUANTIZATIONS,
        help="how the draft's layers run (as --quantization); int8/int4 run it in bfloat16, "
        "so a model can take an int4 copy of itself as its draft",
    )
    # the n-gram proposer's length adapts per request (executor/spec/length.py), from half
    # the cap, doubling when all are kept and halving on a rejection, between
    # num_spec_tokens and spec_max_tokens, the length above num_spec_tokens shared by the
    # batch (spec_max_tokens // batch each)
    num_spec_tokens: int = setting(
        4,
        group="speculative",
        help="proposals per request per step: a draft model's always; the n-gram "
        "proposer's adaptive length is allowed this many at any batch size",
    )
    spec_max_tokens: int | None = setting(
        None,
        group="speculative",
        help="the n-gram proposer's adaptive length cap, shared by the batch above "
        "--num-spec-tokens (default 16, or --num-spec-tokens if larger; 0: fixed at "
        "--num-spec-tokens)",
    )
    spec_ngram_max: int = setting(4, group="speculative", help="longest suffix looked up")
    spec_ngram_min: int = setting(2, group="speculative", help="shortest suffix looked up")
    spec_policy: str = setting(
        "measured",
        group="speculative",
        choices=SPEC_POLICIES,
        help="which steps speculate: measured (per batch size, where measured tokens/s say "
        "it pays; starts from --spec-auto-max-batch), threshold (while at most "
        "--spec-auto-max-batch requests decode), always (every step it can)",
    )
    # None: per proposer, as measured on the development machine (docs/speculative.md)
    spec_auto_max_batch: int | None = setting(
        None,
        group="speculative",
        help="the crossover: measured starts by speculating at this many decoding requests "
        "or fewer; threshold keeps that rule (default: 1 with a draft model, 16 for n-gram)",
    )
    # KV tiers under the radix tree (docs/kv-tiers.md): a restarted engine of the same model
    # reads the disk tier again; kv_cache_dir without the sizes turns both tiers on at sizes
    # chosen from free memory and disk (_size_tiers)
    kv_host_gb: float = setting(
        0.0,
        help="host tier under the radix cache, GiB: evicted KV is kept here and promoted "
        "back on a hit (0: off; docs/kv-tiers.md)",
    )
    kv_disk_gb: float = setting(0.0, help="disk tier size, GiB (with --kv-cache-dir)")
    kv_cache_dir: str | None = setting(
        None,
        help="disk tier folder: KV pages leaving the host tier are written here and found "
        "again after a restart (alone, it turns both tiers on, sized from free memory and "
        "disk: the start-up line says how big)",
    )

    # LoRA adapters (executor/lora.py; docs/lora.md): served beside the base model, named
    # by the request's ``model``
    lora_modules: tuple[str, ...] = setting(
        (),
        group="lora",
        repeat=True,
        many=True,
        metavar="NAME=PATH",
        help="LoRA adapters to serve, as NAME=PATH (a PEFT folder); repeatable, several "
        "per flag; more can be loaded at run time (POST /v1/load_lora_adapter)",
    )
    max_loras: int = setting(8, group="lora", help="different adapters in one batch at most")
    max_lora_rank: int = setting(64, group="lora", help="the highest adapter rank accepted")
    max_cpu_loras: int | None = setting(
        None,
        group="lora",
        parse=zero_is_none(int),
        help="adapters kept in memory, at least --max-loras (the least recently used beyond "
        "are read again from their folder when next asked for); 0: no limit",
    )

    @property
    def lora_adapters(self) -> dict[str, str]:
        """``lora_modules`` as adapter name -> path."""
        return dict(item.partition("=")[::2] for item in self.lora_modules)

    def __post_init__(self) -> None:
        if self.simulated_device_time:
            self.simulated_device = True
        cost = tuple(float(x) for x in self.simulated_device_cost)
        if len(cost) != 3 or any(not x >= 0 for x in cost):
            raise ValueError(
                f"simulated_device_cost must be three seconds >= 0, got {self.simulated_device_cost}"
            )
        self.simulated_device_cost = cost  # type: ignore[assignment]
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.deterministic and not self.simulated_device:
            refusal = self._deterministic_refusal()
            if refusal:
                raise ValueError(f"deterministic mode cannot keep {refusal} batch-invariant yet")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): the adapters of a batch stay in memory"
            )
        self.lora_modules = tuple(self.lora_modules)
        for item in self.lora_modules:
            name, eq, path = item.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"a LoRA module is NAME=PATH, got {item!r}")
        if self.kv_cache_requests < 1:
            raise ValueError(f"kv_cache_requests must be >= 1, got {self.kv_cache_requests}")
        self._check_kv_events()
        for name in ("page_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fair_step_prefill_tokens is not None and self.fair_step_prefill_tokens < 1:
            raise ValueError("fair_step_prefill_tokens must be >= 1 (None: no cap)")
        if not self.fair_active_window_s >= 0:
            raise ValueError("fair_active_window_s must be >= 0")
        if self.fair_step_target_s is not None and not self.fair_step_target_s > 0:
            raise ValueError("fair_step_target_s must be > 0 (None: the token cap alone)")
        if not 0 <= self.schedule_conservativeness <= 1:
            raise ValueError(
                f"schedule_conservativeness must be in [0, 1], got {self.schedule_conservativeness}"
            )
        if self.simulated_kv_tokens is not None and self.simulated_kv_tokens < self.page_size:
            raise ValueError(
                f"simulated_kv_tokens must be >= page_size, got {self.simulated_kv_tokens}"
            )
        if self.generation_config not in ("auto", "neutral"):
            raise ValueError(
                f"generation_config must be one of auto, neutral; got {self.generation_config!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of auto, cpu, cuda; got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU")
        if self.runner not in ("auto", "cpu", "cuda"):
            raise ValueError(f"runner must be one of auto, cpu, cuda; got {self.runner!r}")
        if self.runner == "cpu" and self.resolved_device == "cuda":
            raise ValueError("runner 'cpu' runs on the CPU only; the cuda device uses 'cuda'")
        if (
            self.runner == "cuda"
            and self.resolved_device == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError(
                "runner 'cuda' on the cpu device runs Triton kernels in Triton's interpreter: "
                "set TRITON_INTERPRET=1 (slow; meant for tests)"
            )
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(
                f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}; "
                f"got {self.prefix_cache_scope!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}"
            )
        if self.prefill_weight_copy not in PREFILL_COPY_MODES:
            raise ValueError(
                f"prefill_weight_copy must be one of {', '.join(PREFILL_COPY_MODES)}; "
                f"got {self.prefill_weight_copy!r}"
            )
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}"
                f"; got {self.quantization_group_size}"
            )
        if self.quantization in ("int8", "int4") and self.resolved_device != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU only")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb must be > 0, got {self.memory_budget_gb}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}"
            )
        self._check_parallel()
        self._check_speculative()
        self._check_tiers()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def _check_parallel(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nnodes < 1:
            raise ValueError(f"tensor_parallel_size and nnodes must be >= 1; got {tp}, {nnodes}")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in [0, {nnodes}); got {self.node_rank}")
        if tp % nnodes:
            raise ValueError(f"tensor_parallel_size {tp} is not a multiple of nnodes {nnodes}")
        if nnodes > 1 and self.master_port is None:
            raise ValueError("more than one node needs master_port (and master_addr)")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if tp > 1 and self.simulated_device:
            raise ValueError("tensor parallelism needs a model (not a simulated device)")
        if tp > 1 and self.resolved_device == "cuda":  # one GPU per rank of this node
            check_gpu_count(tp // nnodes, torch.cuda.device_count(), f"-tp {tp} on cuda")

    def _check_speculative(self) -> None:
        if self.speculative_mode not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative_mode must be one of {', '.join(SPECULATIVE_MODES)}; "
                f"got {self.speculative_mode!r}"
            )
        if self.num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {self.num_spec_tokens}")
        cap = self.spec_max_tokens
        if cap is not None and cap != 0 and cap < self.num_spec_tokens:
            raise ValueError(
                f"spec_max_tokens must be 0 (fixed length) or >= num_spec_tokens "
                f"({self.num_spec_tokens}), got {cap}"
            )
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ValueError(
                f"need 1 <= spec_ngram_min <= spec_ngram_max; got {self.spec_ngram_min}, "
                f"{self.spec_ngram_max}"
            )
        if self.spec_draft_quantization not in QUANTIZATIONS:
            raise ValueError(
                f"spec_draft_quantization must be one of {QUANTIZATIONS}, "
                f"got {self.spec_draft_quantization!r}"
            )
        if (self.speculative_mode == "draft") != (self.spec_draft_model is not None):
            raise ValueError("speculative_mode 'draft' and spec_draft_model go together")
        if self.spec_policy not in SPEC_POLICIES:
            raise ValueError(
                f"spec_policy must be one of {', '.join(SPEC_POLICIES)}; got {self.spec_policy!r}"
            )
        if self.spec_auto_max_batch is not None and self.spec_auto_max_batch < 1:
            raise ValueError(f"spec_auto_max_batch must be >= 1, got {self.spec_auto_max_batch}")
        if self.speculative_mode != "off" and (
            self.simulated_device or self.tensor_parallel_size > 1
        ):
            raise ValueError(
                "speculative decoding needs a model on one rank (no simulated device, no TP)"
            )

    def _check_kv_events(self) -> None:
        if self.kv_events_endpoint is None:
            if self.kv_events_replay_endpoint is not None:
                raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
            return
        from radixserve.engine.kv_publisher import check_endpoint

        check_endpoint(self.kv_events_endpoint, "--kv-events-endpoint")
        if self.kv_events_replay_endpoint is not None:
            check_endpoint(self.kv_events_replay_endpoint, "--kv-events-replay-endpoint")
        if self.disable_radix_cache:
            raise ValueError("KV events are the radix cache's: it is disabled")

    def _check_tiers(self) -> None:
        if not self.kv_host_gb >= 0 or not self.kv_disk_gb >= 0:
            raise ValueError(
                f"kv_host_gb and kv_disk_gb must be >= 0; got {self.kv_host_gb}, {self.kv_disk_gb}"
            )
        if self.kv_disk_gb > 0 and self.kv_cache_dir is None:
            raise ValueError("the disk tier needs a folder: set kv_cache_dir")
        if self.kv_cache_dir is not None:
            self._size_tiers(self.kv_cache_dir)
        if not self.tiers:
            return
        if self.disable_radix_cache:
            raise ValueError("KV tiers live under the radix cache: it is disabled")
        if self.simulated_device:
            raise ValueError("KV tiers need a model's KV cache (not a simulated device)")
        if self.tensor_parallel_size > 1:
            raise ValueError("KV tiers are not supported with tensor parallelism (yet)")
        if self.resolved_runner != "cpu":
            raise ValueError("KV tiers run on the CPU runner only (the CUDA runner: not yet)")
        if self.overlap:
            raise ValueError("KV tiers need the serial loop (enable_overlap off)")
        if self.speculative_mode in ("draft", "auto") and self.spec_draft_model is not None:
            raise ValueError("KV tiers do not move a draft model's KV: no draft speculation")

    def _size_tiers(self, folder: str) -> None:
        """A folder given without sizes turns the tiers on at sizes chosen from what is
        free now (logged): the host tier ``KV_HOST_AUTO_KV_MULTIPLE`` times the KV cache,
        at most ``KV_HOST_AUTO_MEMORY_SHARE`` of the memory available; the disk tier
        ``KV_DISK_AUTO_SHARE`` of the folder's free disk, at most ``KV_DISK_AUTO_MAX_GB``."""
        chosen = []
        if self.kv_host_gb == 0:
            # (relative to 1 GiB when the KV cache is sized at load, after this)
            host = KV_HOST_AUTO_KV_MULTIPLE * (self.kv_cache_memory_gb or 1.0)
            available = available_memory_bytes()
            if available is not None:
                host = min(host, KV_HOST_AUTO_MEMORY_SHARE * available / 2**30)
            self.kv_host_gb = round(host, 3)
            chosen.append(f"kv_host_gb {self.kv_host_gb}")
        if self.kv_disk_gb == 0:
            existing = Path(folder).expanduser().absolute()
            while not existing.exists() and existing != existing.parent:
                existing = existing.parent
            free = shutil.disk_usage(existing).free / 2**30
            self.kv_disk_gb = round(min(KV_DISK_AUTO_SHARE * free, KV_DISK_AUTO_MAX_GB), 3)
            chosen.append(f"kv_disk_gb {self.kv_disk_gb} ({free:.1f} GiB free there)")
        if self.kv_host_gb <= 0 or self.kv_disk_gb <= 0:
            raise ValueError(
                f"kv_cache_dir {folder}: no room for the tiers (kv_host_gb {self.kv_host_gb}, "
                f"kv_disk_gb {self.kv_disk_gb}); give the sizes"
            )
        if chosen:
            logger.info("kv_cache_dir without sizes: %s", ", ".join(chosen))

    @property
    def tiers(self) -> bool:
        """Whether the KV tiers (host, and disk under it) are on."""
        return self.kv_host_gb > 0

    @property
    def speculative(self) -> bool:
        """Whether speculative decoding may run (``auto`` decides per step)."""
        return self.speculative_mode != "off"

    @property
    def spec_crossover(self) -> int:
        """``spec_auto_max_batch`` as given, else the measured default of the proposer in
        use: a draft model pays at one decoding request at most, n-gram lookup up to 16."""
        if self.spec_auto_max_batch is not None:
            return self.spec_auto_max_batch
        return 1 if self.spec_draft_model is not None else 16

    @property
    def spec_length_cap(self) -> int:
        """The adaptive proposal length's cap, 0 when the length is fixed at
        ``num_spec_tokens`` (``spec_max_tokens`` 0, or a draft model: its steps cost per
        token, so it keeps its length)."""
        if self.spec_draft_model is not None or self.spec_max_tokens == 0:
            return 0
        if self.spec_max_tokens is None:
            return max(DEFAULT_SPEC_MAX_TOKENS, self.num_spec_tokens)
        return self.spec_max_tokens

    @property
    def overlap(self) -> bool:
        """Whether the engine runs the overlapped loop."""
        if self.enable_overlap is not None:
            return self.enable_overlap
        if self.simulated_device:
            return self.simulated_device_time
        return self.resolved_device == "cuda"  # the GPU runs while the host prepares

    def _deterministic_refusal(self) -> str | None:
        """What of these settings deterministic mode cannot keep batch-invariant, in words
        (None: nothing); the model's own parts are checked when it is built."""
        if self.resolved_runner != "cpu":
            return "the CUDA runner (its Triton kernels split work by batch)"
        if self.tensor_parallel_size > 1:
            return "tensor parallelism"
        if self.lora_modules:
            return "LoRA adapters (their products batch the adapters' rows)"
        if self.prefill_weight_copy == "on":
            return "a prefill weight copy (oneDNN's GEMM, blocked by the step's rows)"
        return None

    @property
    def resolved_runner(self) -> str:
        """``cpu`` or ``cuda``: the model runner (``auto``: the device's)."""
        return self.resolved_device if self.runner == "auto" else self.runner

    @property
    def resolved_device(self) -> str:
        """``cpu`` or ``cuda`` (``auto``: cuda when torch sees a GPU)."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """``auto``: the checkpoint's float32, else bfloat16 (float16 is slow on CPU)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.float32 if checkpoint_dtype == "float32" else torch.bfloat16
