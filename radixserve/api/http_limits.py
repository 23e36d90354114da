"""Connection-level limits of the HTTP server, enforced inside uvicorn's httptools protocol:
header size and count, a deadline for a request's headers (slowloris: a client that sends
one byte a second cannot hold a connection open), and a cap on open connections.

uvicorn bounds none of the first three with its httptools parser, and its own
``limit_concurrency`` answers in plain text; these answer with an OpenAI-shaped JSON error
and close the connection. The keep-alive timeout is uvicorn's (``timeout_keep_alive``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from radixserve.core.settings import setting

_REASONS = {
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


@dataclass(frozen=True)
class HttpLimits:
    """Invariant: every field is positive."""

    # request line + all header names and values
    max_header_bytes: int = setting(64 * 1024, help="431 beyond")
    max_headers: int = setting(100, help="431 beyond")
    # from the first byte of a request to its last header
    header_timeout_s: float = setting(
        10.0,
        name="--header-timeout",
        metavar="SECONDS",
        help="a request's headers must arrive within this (slow clients get 408)",
    )
    max_connections: int = setting(1024, help="open connections; 503 beyond")
    keep_alive_timeout_s: float = setting(
        5.0,
        name="--keep-alive-timeout",
        metavar="SECONDS",
        help="idle keep-alive connections are closed after this",
    )

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class _Rejected(Exception):
    """Raised inside a parser callback to stop parsing a connection already answered."""


def error_response(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-shaped error body that closes the
    connection."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable_error"
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body))
    )
    return head + body


def limited_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits`` (pass as ``uvicorn.Config(http=...)``)."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        """Invariant: a connection past a limit gets one error response and is closed;
        nothing of it reaches the app. A request's header budget and deadline start at its
        first byte (at the connection's start for the first request) and end with its
        headers; between requests only the keep-alive timeout applies."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._rejected = False
            self._header_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._reject(503, "too many open connections; retry later", "too_many_connections")
                return
            self._start_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._rejected:
                return
            with contextlib.suppress(_Rejected):  # answered already: stop parsing it
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            if not self._rejected:  # (uvicorn's answer to a parser error we raised)
                super().send_400_response(msg)

        # -- parser callbacks ---------------------------------------------------------
        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:  # a keep-alive connection's next request
                self._start_headers()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._headers += 1
            if self._headers > limits.max_headers:
                self._reject(
                    431, f"more than {limits.max_headers} request headers", "too_many_headers"
                )
                raise _Rejected
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._stop_header_timer()
            super().on_headers_complete()

        # -- limits -------------------------------------------------------------------
        def _start_headers(self) -> None:
            self._header_bytes = 0
            self._headers = 0
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._too_slow)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _count(self, nbytes: int) -> None:
            self._header_bytes += nbytes
            if self._header_bytes > limits.max_header_bytes:
                self._reject(
                    431,
                    f"request headers larger than {limits.max_header_bytes} bytes",
                    "headers_too_large",
                )
                raise _Rejected

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self._rejected and not self.transport.is_closing():
                self._reject(
                    408,
                    f"request headers not received within {limits.header_timeout_s:g} s",
                    "header_timeout",
                )

        def _reject(self, status: int, message: str, code: str) -> None:
            self._rejected = True
            self._stop_header_timer()
            self.logger.warning("HTTP %d to %s: %s", status, self.client, message)
            if not self.transport.is_closing():
                self.transport.write(error_response(status, message, code))
                self.transport.close()

    return LimitedHttpToolsProtocol
