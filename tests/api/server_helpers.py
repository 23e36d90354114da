"""Start and stop a real radixserve server on 127.0.0.1 for tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``radixserve serve`` in a subprocess; ``url`` is its base URL."""

    def __init__(self, *args: str, startup_timeout: float = 120.0, wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"radixserve-test-{self.port}.log"
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        self.startup_timeout = startup_timeout
        if wait:
            self.wait_ready()

    @classmethod
    def start_all(cls, *arg_lists: list[str]) -> list[ServerProcess]:
        """Several servers started at once (their imports and loads overlap), each ready."""
        servers = [cls(*args, wait=False) for args in arg_lists]
        try:
            for server in servers:
                server.wait_ready()
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return servers

    def wait_ready(self) -> None:
        """Until ``/health`` answers 200 (``RuntimeError`` when it exits or times out)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start: {self.log.read_text()[-3000:]}")

    def engine_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"radixserve.serving.engine_process" in cmdline:
                return int(pid)
        raise RuntimeError("no engine process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()


class InProcessServer:
    """``radixserve serve`` with the same flags, run inside the test process: uvicorn on a
    thread, the engine on another (``ServingConfig.engine_in_process``). It answers on
    ``url`` as ``ServerProcess`` does, over real HTTP on 127.0.0.1, without starting two
    interpreters that each import torch. For tests that need no process of their own (a
    test that kills, signals or reads the log of its server keeps ``ServerProcess``)."""

    def __init__(self, *args: str, startup_timeout: float = 120.0) -> None:
        import dataclasses
        import threading

        import uvicorn

        from radixserve.api.http_limits import limited_protocol
        from radixserve.api.openai.server import create_app
        from radixserve.cli import (
            build_parser,
            engine_kwargs,
            http_limits,
            server_config,
            split_models,
        )
        from radixserve.engine.config import EngineConfig

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        parsed = build_parser().parse_args(["serve", "--port", str(self.port), *args])
        split_models(parsed)  # (--model NAME=PATH, repeated: several models)
        self.grpc_port: int | None = parsed.grpc_port
        config = dataclasses.replace(
            server_config(parsed),
            engine_in_process=True,
            model_entries=tuple(parsed.model_entries),
        )
        app = create_app(EngineConfig(**engine_kwargs(parsed)), config)
        if parsed.grpc_port is not None:  # the gRPC API beside HTTP, as serve() adds it
            from radixserve.api.grpc.service import GrpcConfig, add_grpc

            add_grpc(app, GrpcConfig(parsed.grpc_port, "127.0.0.1", config.max_body_bytes, 5.0))
        limits = http_limits(parsed)
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=5,
                http=limited_protocol(limits),
                timeout_keep_alive=limits.keep_alive_timeout_s,
            )
        )
        self.app = app
        self._thread = threading.Thread(target=self._server.run, name="test-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("the in-process server stopped during startup")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("the in-process server did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
