"""Engine settings, validated once."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.core.request import PREFIX_CACHE_SCOPES
from radixserve.engine.structured import DEFAULT_COMPILE_TIMEOUT_S
from radixserve.executor.placement import check_gpu_count
from radixserve.executor.quant import INT4_GROUP_SIZES, PREFILL_COPY_MODES, QUANTIZATIONS
from radixserve.executor.weights import available_memory_bytes

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
    """Invariant: every field is within range after ``__post_init__`` (else ``ValueError``)."""

    model: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16
    kv_cache_memory_gb: float = 1.0
    page_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    long_prefill_threshold: int | None = None
    num_threads: int | None = None
    disable_radix_cache: bool = False
    # who shares cached KV (core.request.PREFIX_CACHE_SCOPES): tenant = each tenant only
    # its own requests' pages (one tenant learns nothing of another's prompts from
    # cached_tokens or time to first token); global = every tenant's
    prefix_cache_scope: str = "tenant"
    schedule_policy: str = "fcfs"  # fcfs | lpm | dfs-weight | priority
    max_waiting_requests: int | None = None
    max_queue_time_s: float | None = None
    batch_wait_ms: float = 0.0
    # Scales the decode reserve kept at admission: 0 admits as much as fits now (more
    # preemptions later), 1 is the default, smaller values trade safety for batch size.
    schedule_conservativeness: float = 1.0
    # policy fair: while a tenant served less has been active (a request waiting or running)
    # within fair_active_window_s, the tenants served more add at most this many prefill
    # tokens per step between them (None: no cap); 64: every chunk of a long prompt runs on
    # the quantized layers' bfloat16 prefill copy (prefill_weight_copy), and a light
    # tenant's next request waits for a step of at most 64 prompt tokens (docs/many-users.md)
    fair_step_prefill_tokens: int | None = 64
    fair_active_window_s: float = 10.0
    # policy fair: that cap is steered (between 16 tokens and fair_step_prefill_tokens) so
    # such a step takes about this long on the device (or 1.5 decode-only steps, where
    # longer), measured step by step (None: the token cap alone). 35 ms: a 64-token chunk's
    # step takes 30 ms on two threads, 48 ms on one, where the cap then settles at 16-30
    # tokens (SmolLM2, docs/many-users.md)
    fair_step_target_s: float | None = 0.035
    # No weights: instant synthetic tokens from a simulated device (for measuring the
    # scheduler, the API and the server around the model).
    simulated_device: bool = False
    # The simulated device takes real time: a step's results are ready after the cost
    # model's seconds (launching returns at once, the CPU is free meanwhile), like a GPU
    # queue. Implies ``simulated_device``.
    simulated_device_time: bool = False
    # Cost model of the timed simulated device: seconds per step, per batched token, per
    # KV token attended (~10 ms for 256 decodes of ~600-token sequences).
    simulated_device_cost: tuple[float, float, float] = (0.006, 1e-5, 1e-8)
    # KV cache size of the simulated device in tokens (None: large enough never to fill)
    simulated_kv_tokens: int | None = None
    # Overlapped loop: launch step N, then finish step N-1 and prepare N+1 while N runs.
    # None: on where the device is asynchronous (the timed simulated device), off on CPU
    # (where the model itself uses the cores; on, the CPU model runs on a worker thread).
    enable_overlap: bool | None = None
    # Where the model runs: auto = cuda when torch sees a GPU, else cpu.
    device: str = "auto"  # auto | cpu | cuda
    # auto: the checkpoint's weights; dummy: random weights for the config alone (a folder
    # holding only config.json is enough; token-id prompts only without a tokenizer).
    load_format: str = "auto"  # auto | dummy
    # The model runner: auto = the CUDA runner (Triton kernels) on cuda, the CPU runner on
    # cpu; "cuda" on a cpu device runs the CUDA runner's code on CPU tensors under Triton's
    # interpreter (TRITON_INTERPRET=1): how the tests cover the CUDA path without a GPU.
    runner: str = "auto"  # auto | cpu | cuda
    cuda_graph_max_bs: int = 256  # largest decode batch replayed from a CUDA graph
    disable_cuda_graph: bool = False
    # Dense-layer weights held and multiplied quantized (CPU): auto = a GGUF file in the
    # closest precision to its own (with bfloat16 activations; float32 runs it dequantized),
    # an HF checkpoint in its dtype; none = the model dtype;
    # int8 = per output channel; int4 = groups of quantization_group_size with zero points.
    quantization: str = "auto"  # auto | none | int8 | int4
    quantization_group_size: int = 32  # int4: 32 | 64 | 128
    # CPU, quantized dense layers: also keep a bfloat16 copy of each (2 bytes a weight) for
    # the steps with enough rows to dequantize (prefill chunks): on | off | auto (on when the
    # copy takes at most a quarter of the memory available at load)
    prefill_weight_copy: str = "auto"
    # Total memory for weights + KV cache: the KV cache gets what the weights leave (None:
    # the KV cache gets kv_cache_memory_gb).
    memory_budget_gb: float | None = None
    # structured output: a grammar that takes longer to compile fails its request (the
    # server's frontend bounds its parse of the grammar by the same)
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    # Sampling fields a request leaves unset: auto = the model's generation_config.json
    # (offline, HTTP and gRPC alike); neutral = OpenAI-style (temperature 1, top_p 1, ...).
    generation_config: str = "auto"
    # Tensor parallelism (gloo on CPU, NCCL on cuda): the model split over this many ranks,
    # rank 0 in this process and one worker process per other rank, rank r of a node on
    # cuda:LOCAL_RANK; across nnodes machines, torchrun style.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: any free port (one node only)
    distributed_timeout_s: float = 300.0  # a collective that waits longer fails the group
    # Speculative decoding (docs/speculative.md): off | ngram (prompt lookup) | draft (a
    # smaller model with the same tokenizer, spec_draft_model) | auto (ngram; the name of
    # "on where it pays": the default spec_policy, measured, decides per step for every
    # mode). Each speculating request verifies its last token + up to num_spec_tokens
    # proposals in one extend chunk.
    speculative_mode: str = "off"
    spec_draft_model: str | None = None  # HF folder or .gguf of the draft (mode draft)
    # how the draft's dense layers run (as --quantization: auto | none | int8 | int4); int8
    # or int4 runs the draft in bfloat16 whatever the target's dtype, so a bfloat16 (or
    # float32) target can take an int4 copy of itself as its draft
    spec_draft_quantization: str = "auto"
    # the proposals a request verifies per step: a draft model proposes num_spec_tokens
    # every time; the n-gram proposer's length adapts per request (executor/spec/length.py),
    # from half the cap, doubling when all are kept and halving on a rejection, between
    # num_spec_tokens and spec_max_tokens (None: 16, or num_spec_tokens if larger; 0: fixed
    # at num_spec_tokens), the length above num_spec_tokens shared by the batch
    # (spec_max_tokens // batch each)
    num_spec_tokens: int = 4
    spec_max_tokens: int | None = None
    spec_ngram_max: int = 4  # the longest suffix looked up in the request's own tokens
    spec_ngram_min: int = 2  # the shortest
    # which steps speculate (SPEC_POLICIES): measured (default) speculates per batch-size
    # bucket where measured tokens/s say it pays, starting from "at most
    # spec_auto_max_batch decodes" until both sides are measured; threshold keeps that
    # rule fixed; always speculates every step it can
    spec_policy: str = "measured"
    # the crossover: cold start of measured, rule of threshold; None: per proposer, as
    # measured on the development machine (docs/speculative.md): a draft model 1, n-gram 16
    spec_auto_max_batch: int | None = None
    # KV tiers under the radix tree (docs/kv-tiers.md): pages evicted from the pool are
    # demoted into a host tier of kv_host_gb GiB (0: off) and promoted back on a match;
    # host-tier evictions are written to kv_cache_dir (at most kv_disk_gb GiB), which a
    # restarted engine of the same model reads again. kv_cache_dir without the sizes turns
    # both tiers on at sizes chosen from free memory and disk (_size_tiers).
    kv_host_gb: float = 0.0
    kv_disk_gb: float = 0.0
    kv_cache_dir: str | None = None

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
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
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
            host = KV_HOST_AUTO_KV_MULTIPLE * self.kv_cache_memory_gb
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
