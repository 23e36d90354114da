"""benchmarks/http_client.py against servers that end keep-alive connections: a reused
connection the server closed after its last answer (as llama-server does after a streamed
answer, without ``Connection: close``) is replaced once; a connection that dies mid-answer
is an error, never retried."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from http_client import Client

SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"b\r\ndata: one\n\n\r\n"
    b"e\r\ndata: [DONE]\n\n\r\n"
    b"0\r\n\r\n"
)


async def _serve(handler) -> tuple[asyncio.AbstractServer, str, list[int]]:
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await handler(reader, writer)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)


def test_a_connection_closed_after_a_streamed_answer_is_replaced():
    async def one_answer_then_close(reader, writer):
        await _read_request(reader)
        writer.write(SSE)
        await writer.drain()
        writer.close()

    async def main():
        server, url, connections = await _serve(one_answer_then_close)
        client = Client(url, max_connections=1)
        try:
            for i in range(3):
                events = [data async for _, data in client.events("/v1/completions", {"i": i})]
                assert events == [b"one", b"[DONE]"]
                await asyncio.sleep(0.05)  # the server's close arrives while idle
        finally:
            await client.close()
            server.close()
        return len(connections)

    assert asyncio.run(main()) == 3  # one new connection per request, none failed


def test_a_connection_dying_mid_answer_is_an_error_not_a_retry():
    async def half_a_head(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-")
        await writer.drain()
        writer.close()

    async def main():
        server, url, connections = await _serve(half_a_head)
        client = Client(url, max_connections=1)
        try:
            with pytest.raises(asyncio.IncompleteReadError):
                async for _ in client.events("/v1/completions", {}):
                    pass
            assert client._idle == []  # the dead connection is not kept
        finally:
            await client.close()
            server.close()
        return len(connections)

    assert asyncio.run(main()) == 1
