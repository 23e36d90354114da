"""Every setting defined once (core/settings.py): the config dataclasses' fields are the
command line's flags, and the flags read back into the same fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixserve.core.settings import add_flags, flag_fields, flag_name, from_args, setting


@dataclasses.dataclass(frozen=True)
class Example:
    count: int = setting(3, help="how many")
    ratio: float | None = setting(None, help="a ratio")
    name: str = setting("a", choices=("a", "b"))
    fast: bool = setting(False, help="go fast")
    watched: bool = setting(True, name="--watch")
    overlap: bool | None = setting(None, off="--no-overlap")
    keys: tuple[str, ...] = setting((), name="--key", repeat=True)
    internal: int = 7  # a keyword only


def _parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    return from_args(parser.parse_args(argv), Example)


def test_flags_are_the_fields():
    assert _parse([]) == {
        "count": 3,
        "ratio": None,
        "name": "a",
        "fast": False,
        "watched": True,
        "overlap": None,
        "keys": (),
    }
    got = _parse(
        [
            "--count",
            "5",
            "--ratio",
            "0.5",
            "--name",
            "b",
            "--fast",
            "--no-watch",
            "--overlap",
            "--key",
            "x",
            "--key",
            "y",
        ]
    )
    assert got == {
        "count": 5,
        "ratio": 0.5,
        "name": "b",
        "fast": True,
        "watched": False,
        "overlap": True,
        "keys": ("x", "y"),
    }
    assert _parse(["--no-overlap"])["overlap"] is False
    assert Example(**got).internal == 7
    with pytest.raises(SystemExit):
        _parse(["--name", "c"])
    with pytest.raises(SystemExit):
        _parse(["--internal", "1"])


def test_serve_takes_every_engine_and_server_setting_with_its_default():
    """The serve command's flags are exactly the configs' settings, and parsing no flags
    gives each config's own defaults (nothing is re-spelled in cli.py)."""
    from radixserve.api.http_limits import HttpLimits
    from radixserve.api.openai.config import ServerConfig
    from radixserve.cli import build_parser, engine_kwargs, http_limits, server_config
    from radixserve.engine.config import EngineConfig
    from radixserve.serving.supervisor import SupervisorConfig

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert EngineConfig(**engine_kwargs(args)) == EngineConfig()
    assert dataclasses.replace(server_config(args), dp_balance=None) == ServerConfig()
    assert http_limits(args) == HttpLimits()
    serve_help = parser.parse_args(["serve"])  # every flag reached the serve command
    from radixserve.serving.balancer import BalanceConfig

    for config in (EngineConfig, ServerConfig, SupervisorConfig, HttpLimits, BalanceConfig):
        for f, fl in flag_fields(config):
            assert hasattr(serve_help, f.name), flag_name(f, fl)
    generate = parser.parse_args(["generate", "hi"])
    assert EngineConfig(**engine_kwargs(generate)) == EngineConfig()
    # a few flags whose text is in another unit or form than the field
    args = parser.parse_args(
        [
            "serve",
            "--fair-step-target-ms",
            "20",
            "--fair-step-prefill-tokens",
            "0",
            "--engine-hang-timeout",
            "0",
            "--max-body-mb",
            "2",
            "--disable-overlap",
        ]
    )
    engine = EngineConfig(**engine_kwargs(args))
    assert engine.fair_step_target_s == pytest.approx(0.02)
    assert engine.fair_step_prefill_tokens is None and engine.enable_overlap is False
    server = server_config(args)
    assert server.supervision.hang_timeout_s is None and server.max_body_bytes == 2 << 20


def test_an_admin_key_from_the_environment_joins_the_flags_and_is_not_passed_on(
    monkeypatch,
) -> None:
    import os

    from radixserve.api.auth import ADMIN_KEY_ENV
    from radixserve.cli import build_parser, server_config

    args = build_parser().parse_args(["serve", "--admin-api-key", "flag-key"])
    monkeypatch.setenv(ADMIN_KEY_ENV, "env-key")
    assert server_config(args).admin_api_keys == ("flag-key", "env-key")
    assert ADMIN_KEY_ENV not in os.environ  # (the engine's process does not inherit it)
    assert server_config(args).admin_api_keys == ("flag-key",)
