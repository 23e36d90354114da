"""``radixserve router`` flags and entry point, and ``serve``'s data-parallel flags (light
imports: the router runs without torch)."""

from __future__ import annotations

import argparse


def add_balance_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The cache-aware policy's knobs (shared by ``router`` and ``serve -dp``), from
    ``BalanceConfig``'s fields."""
    from radixserve.core.settings import add_flags
    from radixserve.serving.balancer import BalanceConfig

    add_flags(parser, BalanceConfig)  # type: ignore[arg-type]


def balance_config(args: argparse.Namespace):
    from radixserve.core.settings import from_args
    from radixserve.serving.balancer import BalanceConfig

    return BalanceConfig(**from_args(args, BalanceConfig))


def add_router_args(r: argparse.ArgumentParser) -> None:
    """``RouterConfig``'s flags (defined with its fields), ``--host``/``--port``, then the
    cache-aware knobs."""
    from radixserve.api.router.server import RouterConfig
    from radixserve.core.settings import add_flags

    add_flags(r, RouterConfig)
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8080)
    add_balance_args(r)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from radixserve.api.router.server import RouterConfig, create_router_app
    from radixserve.core.settings import from_args

    config = RouterConfig(**from_args(args, RouterConfig), balance=balance_config(args))
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
    """``serve``'s data-parallel knobs for the cache-aware policy (the size and policy are
    ``ServerConfig``'s own flags, in the same section)."""
    add_balance_args(_group(parser, "data parallel"))


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's help section of that title (made if missing)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def dp_kwargs(args: argparse.Namespace) -> dict:
    """``ServerConfig``'s ``dp_balance`` from the cache-aware flags."""
    return {"dp_balance": balance_config(args)}
