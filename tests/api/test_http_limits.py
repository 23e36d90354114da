"""HTTP connection limits (api/http_limits.py) on a real uvicorn server on 127.0.0.1 with a
trivial app: oversized and too many headers, slowloris clients, the connection cap and the
keep-alive timeout, each answered (where there is an answer) with an OpenAI-shaped error."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from radixserve.api.http_limits import HttpLimits, limited_protocol

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)

LIMITS = HttpLimits(
    max_header_bytes=4096,
    max_headers=20,
    header_timeout_s=1.0,
    max_connections=4,
    keep_alive_timeout_s=0.5,
)


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b'{"ok": true}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"12")],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=free,
        log_level="error",
        http=limited_protocol(LIMITS),
        timeout_keep_alive=LIMITS.keep_alive_timeout_s,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield free
    server.should_exit = True
    thread.join(5)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _request(headers: str = "") -> bytes:
    return f"GET /x HTTP/1.1\r\nhost: t\r\n{headers}connection: close\r\n\r\n".encode()


def _status_and_error(raw: bytes) -> tuple[int, dict | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"] if status != 200 else None


def test_a_plain_request_passes(port):
    with _connect(port) as sock:
        sock.sendall(_request())
        assert _status_and_error(_read_all(sock)) == (200, None)


def test_oversized_headers_get_431(port):
    with _connect(port) as sock:
        sock.sendall(_request(f"x-big: {'a' * 5000}\r\n"))
        status, error = _status_and_error(_read_all(sock))
    assert status == 431 and error["code"] == "headers_too_large"
    assert error["type"] == "invalid_request_error" and "4096" in error["message"]


def test_a_header_sent_in_pieces_is_counted_whole(port):
    with _connect(port) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\nx-big: ")
        for _ in range(5):
            sock.sendall(b"a" * 1000)
            time.sleep(0.02)
        sock.sendall(b"\r\n\r\n")
        status, error = _status_and_error(_read_all(sock))
    assert status == 431 and error["code"] == "headers_too_large"


def test_too_many_headers_get_431(port):
    with _connect(port) as sock:
        sock.sendall(_request("".join(f"x-h{i}: v\r\n" for i in range(30))))
        status, error = _status_and_error(_read_all(sock))
    assert status == 431 and error["code"] == "too_many_headers"


def test_a_slowloris_client_is_cut_off_while_others_are_served(port):
    slow = _connect(port)
    start = time.monotonic()
    received = b""
    try:
        for byte in _request().decode():  # one byte every 0.1 s: 6 s for the whole request
            try:
                slow.sendall(byte.encode())
            except (BrokenPipeError, ConnectionResetError):
                break
            with _connect(port) as other:  # meanwhile the server answers everyone else
                other.sendall(_request())
                assert _status_and_error(_read_all(other))[0] == 200
            slow.settimeout(0.1)
            try:
                chunk = slow.recv(4096)
            except TimeoutError:
                continue
            received += chunk
            break
        received += _read_all(slow)
    finally:
        slow.close()
    elapsed = time.monotonic() - start
    status, error = _status_and_error(received)
    assert status == 408 and error["code"] == "header_timeout"
    # (the event loop's timers run on a clock read once per loop turn, so one can fire a
    # fraction of a millisecond before its time as this process measures it)
    assert LIMITS.header_timeout_s - 0.05 <= elapsed < LIMITS.header_timeout_s + 2.5


def test_the_connection_cap_answers_503_and_frees_up(port):
    held = [_connect(port) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.1)
        with _connect(port) as extra:
            extra.sendall(_request())
            status, error = _status_and_error(_read_all(extra))
        assert status == 503 and error["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    with _connect(port) as sock:
        sock.sendall(_request())
        assert _status_and_error(_read_all(sock))[0] == 200


def test_idle_keep_alive_connections_are_closed(port):
    with _connect(port) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")  # keep-alive
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        sock.settimeout(5)
        assert sock.recv(4096) == b""  # closed by the server
        assert time.monotonic() - start < LIMITS.keep_alive_timeout_s + 1.5


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_headers", 0),
        ("max_header_bytes", -1),
        ("header_timeout_s", 0.0),
        ("max_connections", 0),
    ],
)
def test_bad_limits_are_a_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        HttpLimits(**{field: value})


def test_serve_flags_reach_the_limits():
    from radixserve.cli import build_parser, http_limits

    args = build_parser().parse_args(
        ["serve", "--max-headers", "7", "--header-timeout", "2.5", "--max-connections", "9"]
    )
    limits = http_limits(args)
    assert (limits.max_headers, limits.header_timeout_s, limits.max_connections) == (7, 2.5, 9)
    assert limits.max_header_bytes == 64 * 1024 and limits.keep_alive_timeout_s == 5.0
