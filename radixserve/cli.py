"""The ``radixserve`` command line.

Each command's flags and code load only when that command runs (``COMMANDS``): ``radixserve
router`` and ``radixserve --help`` never import torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ENGINE_FLAG_GROUPS = {
    None: "engine",
    "scheduler": "scheduler",
    "speculative": "speculative decoding (docs/speculative.md)",
    "parallel": "tensor parallelism (gloo on CPU, NCCL on cuda; torchrun's conventions)",
    "lora": "LoRA adapters (docs/lora.md)",
}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Every ``EngineConfig`` setting but ``skip`` as a flag (defined with the field:
    core/settings.py)."""
    from radixserve.core.settings import add_flags
    from radixserve.engine.config import EngineConfig

    add_flags(parser, EngineConfig, ENGINE_FLAG_GROUPS, skip)


SERVER_FLAG_GROUPS = {
    None: "server",
    "limits": "per-request limits (a 400 naming the limit)",
    "dp": "data parallel",
    "reliability": "reliability",
    "models": "several models (docs/multi-model.md)",
}


def add_server_config_args(parser: argparse.ArgumentParser) -> None:
    """``ServerConfig``'s, ``SupervisorConfig``'s and ``HttpLimits``' flags (each defined
    with its field: core/settings.py)."""
    from radixserve.api.http_limits import HttpLimits
    from radixserve.api.openai.config import ServerConfig
    from radixserve.core.settings import add_flags
    from radixserve.serving.supervisor import SupervisorConfig

    add_flags(parser, ServerConfig, SERVER_FLAG_GROUPS)
    add_flags(parser, SupervisorConfig, {None: "reliability"})
    add_flags(parser, HttpLimits, {None: "HTTP connection limits (answered with a JSON error)"})


def server_config(args: argparse.Namespace):
    """``ServerConfig`` from ``serve``'s flags."""
    from radixserve.api.auth import ADMIN_KEY_ENV
    from radixserve.api.openai.config import ServerConfig
    from radixserve.api.router.cli import dp_kwargs
    from radixserve.core.settings import from_args
    from radixserve.serving.supervisor import SupervisorConfig

    settings = from_args(args, ServerConfig)
    # an admin key may come from the environment too (not seen in the process list, and
    # not passed on to the engine's process)
    from_env = os.environ.pop(ADMIN_KEY_ENV, "")
    if from_env:
        settings["admin_api_keys"] = (*settings.get("admin_api_keys", ()), from_env)
    return ServerConfig(
        **settings,
        **dp_kwargs(args),
        loopback_only=is_loopback(args.host) and not args.behind_proxy,
        supervision=SupervisorConfig(**from_args(args, SupervisorConfig)),
    )


def http_limits(args: argparse.Namespace):
    from radixserve.api.http_limits import HttpLimits
    from radixserve.core.settings import from_args

    return HttpLimits(**from_args(args, HttpLimits))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineConfig``'s keyword arguments from its flags."""
    from radixserve.core.settings import from_args
    from radixserve.engine.config import EngineConfig

    return from_args(args, EngineConfig)


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


class _ModelFlag(argparse.Action):
    """serve's ``--model``: every value is kept in ``model_entries`` (several models give
    NAME=PATH each) and the last is ``model`` (the one model's path)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        namespace.model_entries = [*namespace.model_entries, values]
        namespace.model = values


def add_serve_args(srv: argparse.ArgumentParser) -> None:
    from radixserve.api.router.cli import add_dp_args

    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, help="drain time on SIGTERM")
    srv.add_argument(
        "--grpc-port", type=int, default=None, help="also serve the gRPC API on this port (off)"
    )
    add_server_config_args(srv)
    add_dp_args(srv)
    add_engine_args(srv, skip=("model",))
    # serve's --model also names several models: NAME=PATH, repeatable (split_models)
    srv.set_defaults(model_entries=[])
    srv.add_argument(
        "--model",
        action=_ModelFlag,
        default=None,
        metavar="PATH|NAME=PATH",
        help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct); NAME=PATH, "
        "repeated, serves several models (loaded on demand, like --models-dir)",
    )


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
        if first_token_s is None and delta.token_ids:
            first_token_s = time.perf_counter() - t0
        num_tokens += len(delta.token_ids)
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


def split_models(args: argparse.Namespace) -> None:
    """serve's ``--model``: one PATH (``args.model``), or NAME=PATH for each of several
    models (``args.model_entries``, with ``args.model`` None), never both."""
    entries = args.model_entries
    named = [e for e in entries if "=" in e.split("/")[0]]
    several = bool(named or args.models_dir)
    if (several and len(named) < len(entries)) or (not several and len(entries) > 1):
        raise ValueError("give --model PATH once (one model), or NAME=PATH for each of several")
    args.model = None if several else (entries[0] if entries else None)
    args.model_entries = named


def run_serve(args: argparse.Namespace) -> int:
    split_models(args)
    if (code := run_worker_node(args)) is not None:
        return code
    from radixserve.api.serve import serve
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.faults import FaultInjector

    FaultInjector.from_env()  # a malformed RADIXSERVE_FAULTS fails here, not in the engine
    config = dataclasses.replace(server_config(args), model_entries=tuple(args.model_entries))
    serve(
        EngineConfig(**engine_kwargs(args)),
        config,
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
