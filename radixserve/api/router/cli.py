"""``radixserve router`` flags and entry point, and ``serve``'s data-parallel flags (light
imports: the router runs without torch)."""

from __future__ import annotations

import argparse

from radixserve.core.request import PREFIX_CACHE_SCOPES
from radixserve.serving.balancer import POLICIES


def add_balance_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The cache-aware policy's knobs (shared by ``router`` and ``serve -dp``)."""
    parser.add_argument(
        "--cache-threshold",
        type=float,
        default=0.3,
        help="cache-aware: route by prefix when more than this fraction of the prompt matches",
    )
    parser.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=64,
        help="cache-aware: load is unbalanced when busiest - idlest exceeds this (requests)",
    )
    parser.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="cache-aware: ... and busiest exceeds idlest times this",
    )
    parser.add_argument(
        "--max-tree-size",
        type=int,
        default=1 << 22,
        help="cache-aware: characters (or tokens) remembered per worker",
    )


def balance_config(args: argparse.Namespace):
    from radixserve.serving.balancer import BalanceConfig

    return BalanceConfig(
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_tree_size=args.max_tree_size,
    )


def add_router_args(r: argparse.ArgumentParser) -> None:
    r.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeatable)",
    )
    r.add_argument("--policy", default="cache-aware", choices=list(POLICIES))
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8080)
    r.add_argument("--health-check-interval", type=float, default=5.0, help="seconds")
    r.add_argument("--health-check-timeout", type=float, default=5.0, help="seconds")
    r.add_argument(
        "--health-failure-threshold",
        type=int,
        default=2,
        help="consecutive failed checks before a worker is taken out",
    )
    r.add_argument("--max-body-mb", type=float, default=8.0, help="request body size limit (MiB)")
    r.add_argument(
        "--prefix-cache-scope",
        default="tenant",
        choices=list(PREFIX_CACHE_SCOPES),
        help="as the workers' flag: tenant = a prompt is matched against the prompts sent "
        "with the same key (and X-Tenant) only; global = against all",
    )
    add_balance_args(r)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from radixserve.api.router.server import RouterConfig, create_router_app

    config = RouterConfig(
        workers=tuple(args.worker),
        policy=args.policy,
        balance=balance_config(args),
        health_check_interval_s=args.health_check_interval,
        health_check_timeout_s=args.health_check_timeout,
        health_failure_threshold=args.health_failure_threshold,
        max_body_bytes=int(args.max_body_mb * 2**20),
        prefix_cache_scope=args.prefix_cache_scope,
    )
    app = create_router_app(config)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
    )
    return 0


def add_dp_args(parser: argparse.ArgumentParser) -> None:
    """``serve``'s data-parallel flags: N engine processes behind the one frontend."""
    g = parser.add_argument_group("data parallel")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        dest="data_parallel_size",
        type=int,
        default=1,
        help="engine processes (replicas, each with its own KV cache) behind this frontend",
    )
    g.add_argument(
        "--dp-policy",
        default="cache-aware",
        choices=list(POLICIES),
        help="how requests are spread over the engines",
    )
    add_balance_args(g)


def dp_kwargs(args: argparse.Namespace) -> dict:
    """``ServerConfig`` fields from the data-parallel flags."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    return {
        "data_parallel_size": args.data_parallel_size,
        "dp_policy": args.dp_policy,
        "dp_balance": balance_config(args),
    }
