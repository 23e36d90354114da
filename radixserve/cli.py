"""The ``radixserve`` command line.

Each command's flags and code load only when that command runs (``COMMANDS``): ``radixserve
router`` and ``radixserve --help`` never import torch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from radixserve.engine.config import DTYPES
    from radixserve.executor.quant import INT4_GROUP_SIZES, PREFILL_COPY_MODES, QUANTIZATIONS

    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    g.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV cache size in GiB")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument(
        "--kv-host-gb",
        type=float,
        default=0.0,
        help="host tier under the radix cache, GiB: evicted KV is kept here and promoted "
        "back on a hit (0: off; docs/kv-tiers.md)",
    )
    g.add_argument(
        "--kv-disk-gb", type=float, default=0.0, help="disk tier size, GiB (with --kv-cache-dir)"
    )
    g.add_argument(
        "--kv-cache-dir",
        default=None,
        help="disk tier folder: KV pages leaving the host tier are written here and found "
        "again after a restart (alone, it turns both tiers on, sized from free memory and "
        "disk: the start-up line says how big)",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument(
        "--max-num-seqs", "--max-running-requests", dest="max_num_seqs", type=int, default=256
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--long-prefill-threshold", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument(
        "--simulated-device",
        action="store_true",
        help="no weights: instant synthetic tokens (benchmarks of everything but the model)",
    )
    g.add_argument(
        "--simulated-device-time",
        action="store_true",
        help="the simulated device takes the cost model's time for real, asynchronously "
        "like a GPU queue (implies --simulated-device)",
    )
    g.add_argument(
        "--simulated-device-cost",
        type=_cost,
        default=(0.006, 1e-5, 1e-8),
        metavar="A,B,C",
        help="timed simulated device: seconds per step, per batched token, per KV token read",
    )
    g.add_argument(
        "--simulated-kv-tokens",
        type=int,
        default=None,
        help="simulated device: KV cache size in tokens (default: never full)",
    )
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (auto: cuda when torch sees a GPU, else cpu)",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights for the model folder's config.json (no checkpoint needed)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=256,
        help="largest decode batch replayed from a CUDA graph",
    )
    g.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps eagerly")
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds a structured-output grammar may take to compile (longer: the server "
        "answers 400; offline, the request fails)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "neutral"],
        help="sampling fields a request leaves unset: auto = the model's generation_config.json "
        "(offline, HTTP and gRPC alike); neutral = OpenAI-style (temperature 1, top_p 1)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATIONS),
        help="dense-layer weights: auto (a GGUF file in the closest precision to its own, an HF "
        "checkpoint in its dtype), none, int8 (per channel), int4 (groups, zero points)",
    )
    g.add_argument(
        "--quantization-group-size", type=int, default=32, choices=list(INT4_GROUP_SIZES)
    )
    g.add_argument(
        "--prefill-weight-copy",
        default="auto",
        choices=list(PREFILL_COPY_MODES),
        help="CPU, quantized dense layers: also keep a bfloat16 copy of each for prefill "
        "chunks, which otherwise dequantize the weights every step (2 bytes a weight; auto: "
        "when it takes at most a quarter of the memory available at load)",
    )
    g.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        help="GiB for weights + KV cache: the KV cache gets what the weights leave "
        "(instead of --kv-cache-memory)",
    )
    overlap = g.add_mutually_exclusive_group()
    overlap.add_argument(
        "--enable-overlap",
        dest="enable_overlap",
        action="store_true",
        default=None,
        help="prepare step N+1 while the device runs step N (default: on for the timed "
        "simulated device and on CUDA, off on CPU)",
    )
    overlap.add_argument("--disable-overlap", dest="enable_overlap", action="store_false")
    add_speculative_args(parser)
    add_parallel_args(parser)
    add_scheduler_args(parser)


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    from radixserve.engine.config import SPEC_POLICIES, SPECULATIVE_MODES
    from radixserve.executor.quant import QUANTIZATIONS

    g = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    g.add_argument(
        "--speculative-mode",
        default="off",
        choices=SPECULATIVE_MODES,
        help="ngram: propose from the request's own prompt and output (prompt lookup), "
        "verify in one step; draft: a smaller model with the same tokenizer proposes "
        "(--spec-draft-model); auto: ngram (with the default --spec-policy measured, every "
        "mode speculates only at batch sizes where it measured a gain)",
    )
    g.add_argument(
        "--spec-draft-model",
        default=None,
        help="HF folder or .gguf of the draft model (--speculative-mode draft)",
    )
    g.add_argument(
        "--spec-draft-quantization",
        default="auto",
        choices=list(QUANTIZATIONS),
        help="how the draft's layers run (as --quantization); int8/int4 run it in bfloat16, "
        "so a model can take an int4 copy of itself as its draft",
    )
    g.add_argument(
        "--num-spec-tokens",
        type=int,
        default=4,
        help="proposals per request per step: a draft model's always; the n-gram "
        "proposer's adaptive length is allowed this many at any batch size",
    )
    g.add_argument(
        "--spec-max-tokens",
        type=int,
        default=None,
        help="the n-gram proposer's adaptive length cap, shared by the batch above "
        "--num-spec-tokens (default 16, or --num-spec-tokens if larger; 0: fixed at "
        "--num-spec-tokens)",
    )
    g.add_argument("--spec-ngram-max", type=int, default=4, help="longest suffix looked up")
    g.add_argument("--spec-ngram-min", type=int, default=2, help="shortest suffix looked up")
    g.add_argument(
        "--spec-policy",
        default="measured",
        choices=SPEC_POLICIES,
        help="which steps speculate: measured (per batch size, where measured tokens/s say "
        "it pays; starts from --spec-auto-max-batch), threshold (while at most "
        "--spec-auto-max-batch requests decode), always (every step it can)",
    )
    g.add_argument(
        "--spec-auto-max-batch",
        type=int,
        default=None,
        help="the crossover: measured starts by speculating at this many decoding requests "
        "or fewer; threshold keeps that rule (default: 1 with a draft model, 16 for n-gram)",
    )


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "tensor parallelism (gloo on CPU, NCCL on cuda; torchrun's conventions)"
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks in all")
    g.add_argument("--nnodes", type=int, default=1, help="machines the ranks span")
    g.add_argument("--node-rank", type=int, default=0, help="this machine (0 runs the engine)")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0")
    g.add_argument(
        "--distributed-timeout",
        type=float,
        default=300.0,
        help="seconds a collective may wait before the group is declared lost",
    )


def _cost(text: str) -> tuple[float, float, float]:
    try:
        a, b, c = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three numbers a,b,c; got {text!r}") from None
    return a, b, c


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    from radixserve.core.request import PREFIX_CACHE_SCOPES
    from radixserve.scheduler.policy import POLICIES

    g = parser.add_argument_group("scheduler")
    g.add_argument("--schedule-policy", default="fcfs", choices=list(POLICIES))
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix caching")
    g.add_argument(
        "--prefix-cache-scope",
        default="tenant",
        choices=list(PREFIX_CACHE_SCOPES),
        help="tenant: a tenant's requests reuse only its own cached prefixes, so none learns "
        "another's prompts from cached_tokens or time to first token (no-op without "
        "--api-keys-file); global: all tenants share (docs/many-users.md)",
    )
    g.add_argument("--max-waiting-requests", type=int, default=None, help="refuse beyond this")
    g.add_argument("--max-queue-time", type=float, default=None, help="seconds a request may wait")
    g.add_argument("--batch-wait-ms", type=float, default=0.0, help="wait for more arrivals")
    g.add_argument(
        "--schedule-conservativeness", type=float, default=1.0, help="decode reserve, 0..1"
    )
    g.add_argument(
        "--fair-step-prefill-tokens",
        type=int,
        default=64,
        metavar="N",
        help="policy fair: while a tenant served less is active, the tenants served more add "
        "at most N prefill tokens per step between them (0: no cap)",
    )
    g.add_argument(
        "--fair-step-target-ms",
        type=float,
        default=35.0,
        metavar="MS",
        help="policy fair: steer that cap (16 tokens up to N) so such a step takes about MS "
        "milliseconds on the device, or 1.5 decode-only steps where longer, measured step by "
        "step (0: the token cap alone)",
    )
    g.add_argument(
        "--fair-active-window",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="policy fair: a tenant counts as active this long after its last request",
    )


def add_supervision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("reliability")
    g.add_argument(
        "--engine-hang-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with requests in flight and no engine step finished for this long, the engine "
        "counts as hung: /health is 503 and its requests fail (then it is restarted); 0: off",
    )
    g.add_argument(
        "--engine-restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start a new engine process when it dies or hangs (in-flight requests fail)",
    )
    g.add_argument(
        "--engine-restart-attempts",
        type=int,
        default=3,
        help="failed engine starts in a row before giving up",
    )
    g.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve /debug/flush_cache and /debug/engine (for soak tests; behind --api-key)",
    )
    h = parser.add_argument_group("HTTP connection limits (answered with a JSON error)")
    h.add_argument("--max-header-bytes", type=int, default=64 * 1024, help="431 beyond")
    h.add_argument("--max-headers", type=int, default=100, help="431 beyond")
    h.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a request's headers must arrive within this (slow clients get 408)",
    )
    h.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS")
    h.add_argument("--max-connections", type=int, default=1024, help="open connections; 503 beyond")


def http_limits(args: argparse.Namespace):
    from radixserve.api.http_limits import HttpLimits

    return HttpLimits(
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        header_timeout_s=args.header_timeout,
        max_connections=args.max_connections,
        keep_alive_timeout_s=args.keep_alive_timeout,
    )


def supervision_config(args: argparse.Namespace):
    from radixserve.serving.supervisor import SupervisorConfig

    return SupervisorConfig(
        hang_timeout_s=args.engine_hang_timeout or None,
        restart=args.engine_restart,
        max_restart_attempts=args.engine_restart_attempts,
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_memory_gb": args.kv_cache_memory,
        "page_size": args.page_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "long_prefill_threshold": args.long_prefill_threshold,
        "num_threads": args.num_threads,
        "simulated_device": args.simulated_device,
        "simulated_device_time": args.simulated_device_time,
        "simulated_device_cost": args.simulated_device_cost,
        "simulated_kv_tokens": args.simulated_kv_tokens,
        "enable_overlap": args.enable_overlap,
        "device": args.device,
        "load_format": args.load_format,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "disable_cuda_graph": args.disable_cuda_graph,
        "quantization": args.quantization,
        "quantization_group_size": args.quantization_group_size,
        "prefill_weight_copy": args.prefill_weight_copy,
        "memory_budget_gb": args.memory_budget,
        "disable_radix_cache": args.disable_radix_cache,
        "prefix_cache_scope": args.prefix_cache_scope,
        "schedule_policy": args.schedule_policy,
        "max_waiting_requests": args.max_waiting_requests,
        "max_queue_time_s": args.max_queue_time,
        "batch_wait_ms": args.batch_wait_ms,
        "schedule_conservativeness": args.schedule_conservativeness,
        "fair_step_prefill_tokens": args.fair_step_prefill_tokens or None,
        "fair_active_window_s": args.fair_active_window,
        "fair_step_target_s": args.fair_step_target_ms / 1000 or None,
        "tensor_parallel_size": args.tensor_parallel_size,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "distributed_timeout_s": args.distributed_timeout,
        "generation_config": args.generation_config,
        "grammar_compile_timeout_s": args.grammar_compile_timeout,
        "speculative_mode": args.speculative_mode,
        "num_spec_tokens": args.num_spec_tokens,
        "spec_max_tokens": args.spec_max_tokens,
        "spec_ngram_max": args.spec_ngram_max,
        "spec_ngram_min": args.spec_ngram_min,
        "spec_auto_max_batch": args.spec_auto_max_batch,
        "spec_policy": args.spec_policy,
        "spec_draft_model": args.spec_draft_model,
        "spec_draft_quantization": args.spec_draft_quantization,
        "kv_host_gb": args.kv_host_gb,
        "kv_disk_gb": args.kv_disk_gb,
        "kv_cache_dir": args.kv_cache_dir,
    }


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt")
    gen.add_argument("--no-chat", action="store_true", help="raw completion, no chat template")
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    gen.add_argument("--max-tokens", type=int, default=256)
    # sampling flags left unset take the model's generation config, or else CLI_SAMPLING
    gen.add_argument("--temperature", type=float, default=None, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(gen)


def add_serve_args(srv: argparse.ArgumentParser) -> None:
    from radixserve.api.router.cli import add_dp_args

    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", action="append", default=[], help="repeatable")
    srv.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="inference keys, one 'NAME:KEY [weight=W] [max_concurrency=N] "
        "[subtenants=true]' a line, each naming its tenant (docs/many-users.md); "
        "re-read on SIGHUP",
    )
    srv.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        help="guards /metrics, /v1/engine/*, /debug/* and the radix view's prompt text "
        "(repeatable); without one those routes are served only on a loopback --host",
    )
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--max-n", type=int, default=16)
    srv.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        choices=range(21),
        metavar="{0..20}",
        help="most top logprobs a request may ask for",
    )
    srv.add_argument("--max-body-mb", type=float, default=8.0, help="request body size limit (MiB)")
    srv.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request body must arrive this long after its headers (408 otherwise); 0: none",
    )
    lim = srv.add_argument_group("per-request limits (a 400 naming the limit)")
    lim.add_argument("--max-prompts-per-request", type=int, default=64)
    lim.add_argument("--max-sequences-per-request", type=int, default=256, help="prompts x n")
    lim.add_argument("--max-prompt-tokens-per-request", type=int, default=1 << 18)
    lim.add_argument(
        "--max-completion-tokens-per-request",
        type=int,
        default=1 << 20,
        help="max_tokens x n x prompts",
    )
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain time on SIGTERM")
    srv.add_argument(
        "--grpc-port", type=int, default=None, help="also serve the gRPC API on this port (off)"
    )
    srv.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes", "llama3_json"],
        help="how tool calls are read from chat output: <tool_call> tags or Llama 3 JSON",
    )
    srv.add_argument(
        "--enable-embeddings",
        action="store_true",
        help="serve /v1/embeddings on a generative model: its final-norm hidden states, "
        "pooled (an embedding model's are always served; otherwise it is a 400)",
    )
    srv.add_argument(
        "--embedding-pooling",
        default=None,
        choices=["last", "mean"],
        help="how /v1/embeddings pools the prompt's hidden states (default: the model's "
        "own pooling if it is an embedding model, else the last token)",
    )
    add_dp_args(srv)
    add_supervision_args(srv)
    add_engine_args(srv)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    from radixserve.api.router.cli import add_router_args as add

    add(parser)


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    """``soak``'s flags: the soak's own, ``--tenants``' and ``--router``'s, then the serve
    flags after ``--``."""
    from radixserve.tools.router_soak import add_router_soak_args
    from radixserve.tools.soak import add_soak_args as add
    from radixserve.tools.tenant_soak import add_tenant_soak_args

    add(parser)
    add_tenant_soak_args(parser)
    add_router_soak_args(parser)
    parser.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: flags for radixserve serve"
    )


def add_simulate_args(sim: argparse.ArgumentParser) -> None:
    from radixserve.scheduler.policy import POLICIES

    src = sim.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", type=Path, help="JSONL trace (see tools/simulator.py)")
    src.add_argument(
        "--synthetic",
        choices=["shared-prefix"],
        help="64 prefix groups x 16 requests, 1024-token prefixes, 128-token questions",
    )
    sim.add_argument("--policy", default="fcfs", choices=list(POLICIES))
    sim.add_argument("--request-rate", type=float, default=8.0, help="synthetic: requests/s")
    sim.add_argument("--output-tokens", type=int, default=256, help="synthetic: per request")
    sim.add_argument("--num-pages", type=int, default=16384)
    sim.add_argument("--page-size", type=int, default=16)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--long-prefill-threshold", type=int, default=None)
    sim.add_argument("--disable-radix-cache", action="store_true")
    sim.add_argument(
        "--cost", default="0.02,0.0008,2e-6", help="a,b,c: s/step, s/token, s/kv token"
    )


def run_router(args: argparse.Namespace) -> int:
    from radixserve.api.router.cli import run_router as run

    return run(args)


def run_soak(args: argparse.Namespace) -> int:
    """The soak ``args`` ask for: ``--router`` (tools/router_soak.py), ``--tenants``
    (tools/tenant_soak.py), else the soak-and-chaos run (tools/soak.py)."""
    from radixserve.tools.soak import normalize_args

    args = normalize_args(args)
    if args.router:
        from radixserve.tools.router_soak import run_router_soak

        return run_router_soak(args)
    if args.tenants:
        from radixserve.tools.tenant_soak import run_tenant_soak

        return run_tenant_soak(args)
    from radixserve.tools.soak import run_soak as run

    return run(args)


# command -> (help, adds its flags, runs it); each imports what it needs when called
Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s flags are added (None: every command's)."""
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, _) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or command == name:
            add_args(sp)
    return parser


# What `generate` samples with when neither the flags nor the model's generation config say:
# greedy decoding of a small model loops on one sentence.
CLI_SAMPLING = {"temperature": 0.7, "top_p": 0.9}


def run_worker_node(args: argparse.Namespace) -> int | None:
    """``--node-rank`` > 0: this machine only runs its tensor-parallel workers."""
    if args.node_rank == 0:
        return None
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.parallel import run_node

    return run_node(EngineConfig(**engine_kwargs(args)))


def run_generate(args: argparse.Namespace) -> int:
    from radixserve import LLM

    if (code := run_worker_node(args)) is not None:
        return code

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    load_s = time.perf_counter() - t0
    if getattr(llm.engine, "startup_line", None):
        print(f"radixserve: {llm.engine.startup_line}", file=sys.stderr)
    params = llm.engine.default_sampling_params(
        **generate_sampling(args, llm.engine.default_sampling),
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
    )
    if args.no_chat:
        prompt: str | list[dict[str, str]] = args.prompt
    else:
        prompt = [{"role": "user", "content": args.prompt}]
        if args.system:
            prompt.insert(0, {"role": "system", "content": args.system})
    t0 = time.perf_counter()
    first_token_s = None
    num_prompt = num_tokens = 0
    for delta in llm.stream_deltas(prompt, params, chat=not args.no_chat):
        if first_token_s is None and delta.new_token_ids:
            first_token_s = time.perf_counter() - t0
        num_tokens += len(delta.new_token_ids)
        num_prompt = delta.num_prompt_tokens or num_prompt
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    total_s = time.perf_counter() - t0
    print(timings_line(load_s, num_prompt, first_token_s, num_tokens, total_s), file=sys.stderr)
    return 0


def generate_sampling(args: argparse.Namespace, model_defaults: dict) -> dict:
    """Sampling settings for ``generate``: the flags given, over the model's generation
    config (applied by the engine), or over ``CLI_SAMPLING`` when the model has none."""
    flags = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
    }
    fallback = {} if "temperature" in model_defaults else CLI_SAMPLING
    return {**fallback, **{k: v for k, v in flags.items() if v is not None}}


def timings_line(
    load_s: float, num_prompt: int, first_token_s: float | None, num_tokens: int, total_s: float
) -> str:
    """Where the time went, like llama.cpp's timings: load, prompt (to the first token),
    then generation rate over the tokens after the first."""
    first = first_token_s if first_token_s is not None else total_s
    decode_s = total_s - first
    rate = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0
    return (
        f"radixserve: load {load_s:.2f} s | prompt {num_prompt} tokens, first token "
        f"{first:.2f} s | {num_tokens} tokens in {total_s:.2f} s, {rate:.1f} tokens/s"
    )


def run_simulate(args: argparse.Namespace) -> int:
    from radixserve.executor.simulated import CostModel
    from radixserve.scheduler.scheduler import SchedulerConfig
    from radixserve.tools.simulator import Simulator, load_trace, shared_prefix_trace

    try:
        a, b, c = (float(x) for x in args.cost.split(","))
    except ValueError:
        raise ValueError(f"--cost must be three numbers a,b,c; got {args.cost!r}") from None
    if args.workload is not None:
        trace = load_trace(args.workload)
    else:
        trace = shared_prefix_trace(
            request_rate=args.request_rate, output_tokens=args.output_tokens
        )
    config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_threshold=args.long_prefill_threshold,
        policy=args.policy,
    )
    sim = Simulator(
        config,
        num_pages=args.num_pages,
        page_size=args.page_size,
        cost=CostModel(a, b, c),
        enable_cache=not args.disable_radix_cache,
    )
    summary = sim.run(trace).summary()
    for key, value in summary.items():
        print(f"{key:>14}  {value}")
    print(json.dumps({"policy": args.policy, **summary}))
    return 0


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def run_serve(args: argparse.Namespace) -> int:
    if (code := run_worker_node(args)) is not None:
        return code
    from radixserve.api.openai.config import ServerConfig
    from radixserve.api.router.cli import dp_kwargs
    from radixserve.api.serve import serve
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.faults import FaultInjector

    FaultInjector.from_env()  # a malformed RADIXSERVE_FAULTS fails here, not in the engine

    serve(
        EngineConfig(**engine_kwargs(args)),
        ServerConfig(
            served_model_name=args.served_model_name,
            api_keys=tuple(args.api_key),
            admin_api_keys=tuple(args.admin_api_key),
            api_keys_file=args.api_keys_file,
            loopback_only=is_loopback(args.host),
            body_timeout_s=args.body_timeout or None,
            max_prompts_per_request=args.max_prompts_per_request,
            max_sequences_per_request=args.max_sequences_per_request,
            max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
            max_completion_tokens_per_request=args.max_completion_tokens_per_request,
            max_n=args.max_n,
            max_logprobs=args.max_logprobs,
            max_body_bytes=int(args.max_body_mb * 2**20),
            tool_call_parser=args.tool_call_parser,
            **dp_kwargs(args),
            supervision=supervision_config(args),
            enable_debug_endpoints=args.enable_debug_endpoints,
            enable_embeddings=args.enable_embeddings,
            embedding_pooling=args.embedding_pooling,
        ),
        host=args.host,
        port=args.port,
        shutdown_timeout_s=args.shutdown_timeout,
        grpc_port=args.grpc_port,
        http_limits=http_limits(args),
    )
    return 0


COMMANDS: dict[str, Command] = {
    "generate": (
        "generate a completion and stream it to the terminal",
        add_generate_args,
        lambda args: run_generate(args),
    ),
    "serve": (
        "serve an OpenAI-compatible HTTP API (and gRPC)",
        add_serve_args,
        lambda args: run_serve(args),
    ),
    "router": (
        "route OpenAI API requests over several `radixserve serve` replicas",
        add_router_args,
        run_router,
    ),
    "soak": (
        "soak-and-chaos test of a live server (see radixserve/tools/soak.py)",
        add_soak_args,
        run_soak,
    ),
    "simulate": (
        "run a request trace through the scheduler on a simulated device",
        add_simulate_args,
        lambda args: run_simulate(args),
    ),
}


def _command_of(argv: list[str]) -> str | None:
    """The command named in ``argv`` (its first word that is not a flag), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(argv) or "").parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except ValueError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
