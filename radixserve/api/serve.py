"""Run the HTTP server: uvicorn, with a drain on SIGTERM that exits 0."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn

from radixserve.api.http_limits import HttpLimits, limited_protocol
from radixserve.api.openai.config import ServerConfig
from radixserve.api.openai.server import create_app
from radixserve.serving.frontend import EngineConfig


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop accepting, let in-flight requests finish (up to the graceful
    shutdown timeout), stop the engine process, exit 0. A drain is a normal exit, so the
    signal is not re-raised afterwards as uvicorn does by default."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout_s: float = 30.0,
    grpc_port: int | None = None,
    http_limits: HttpLimits | None = None,
) -> None:
    limits = http_limits or HttpLimits()
    app = create_app(engine_config, server_config)
    if grpc_port is not None:  # the gRPC API beside HTTP, on the same engine client
        from radixserve.api.grpc.service import GrpcConfig, add_grpc

        add_grpc(app, GrpcConfig(grpc_port, host, server_config.max_body_bytes, shutdown_timeout_s))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # bound to loopback by default; no proxy headers to trust
        timeout_graceful_shutdown=shutdown_timeout_s,
        http=limited_protocol(limits),  # header size/count/deadline, connection cap
        timeout_keep_alive=limits.keep_alive_timeout_s,
    )
    # The listening socket is bound before the engine starts: the port is this server's
    # from the first moment (a tensor-parallel group's rendezvous, picked later, cannot take
    # it), and a port in use fails at once instead of after the model has loaded.
    sock = config.bind_socket()
    DrainingServer(config).run(sockets=[sock])
