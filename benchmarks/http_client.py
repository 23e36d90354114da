"""A lean asyncio HTTP/1.1 client for load generation: keep-alive connections, JSON bodies,
Content-Length and chunked responses, server-sent events with arrival times.

The load generator shares the machine with the server under test, so it must cost little
per request: general-purpose clients (httpx) spend about a millisecond of CPU per request
here, more than the server they measure. Plain http:// only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import orjson


class HTTPError(Exception):
    pass


class Connection:
    """One keep-alive connection; one request at a time (the pool guarantees it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def _head(self) -> tuple[int, dict[bytes, bytes]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _chunks(self, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
        if b"content-length" in headers:
            yield await self.reader.readexactly(int(headers[b"content-length"]))
            return
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            raise HTTPError("response has neither Content-Length nor chunked encoding")
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # no trailers are sent by the servers here
                return
            data = await self.reader.readexactly(size + 2)
            yield data[:-2]


class Client:
    """A pool of up to ``max_connections`` keep-alive connections to one host."""

    def __init__(self, base_url: str, max_connections: int, headers: dict | None = None):
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError("the benchmark client speaks plain http:// only")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {self.host}:{self.port}\r\n{extra}".encode()
        self._idle: list[Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def _acquire(self) -> tuple[Connection, bool]:
        """A connection and whether it is a reused keep-alive one (a slot held)."""
        await self._slots.acquire()
        if self._idle:
            return self._idle.pop(), True
        try:
            return await self._connect(), False
        except BaseException:
            self._slots.release()
            raise

    async def _connect(self) -> Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=2**22)
        return Connection(reader, writer)

    async def _start(self, raw: bytes) -> tuple[Connection, int, dict[bytes, bytes]]:
        """Send ``raw`` and read the answer's head (a slot held, released on failure). A
        reused keep-alive connection the server closed while it sat idle answers nothing
        at all: the request goes once more on a new connection (llama-server closes the
        connection after a streamed answer without saying so)."""
        conn, reused = await self._acquire()
        try:
            conn.writer.write(raw)
            status, headers = await conn._head()
            return conn, status, headers
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            retry = reused and not (isinstance(exc, asyncio.IncompleteReadError) and exc.partial)
            if not retry:
                self._release(conn, False)
                raise
            conn.writer.close()
        except BaseException:
            self._release(conn, False)
            raise
        try:
            conn = await self._connect()
            conn.writer.write(raw)
            status, headers = await conn._head()
        except BaseException:
            self._release(conn, False)
            raise
        return conn, status, headers

    def _release(self, conn: Connection, reusable: bool) -> None:
        if reusable:
            self._idle.append(conn)
        else:
            conn.writer.close()
        self._slots.release()

    def _request(self, method: str, path: str, body: object | None) -> bytes:
        payload = b"" if body is None else orjson.dumps(body)
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode() + self._head
        if body is not None:
            head += b"Content-Type: application/json\r\n"
        return head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload

    async def request(self, method: str, path: str, body: object | None = None):
        """(status, body bytes) of one request."""
        conn, status, headers = await self._start(self._request(method, path, body))
        ok = False
        try:
            data = b"".join([c async for c in conn._chunks(headers)])
            ok = headers.get(b"connection", b"").lower() != b"close"
            return status, data
        finally:
            self._release(conn, ok)

    async def events(self, path: str, body: object) -> AsyncIterator[tuple[float, bytes]]:
        """POST and yield (arrival time, data) of each server-sent event. A non-200 answer
        raises HTTPError with its body."""
        conn, status, headers = await self._start(self._request("POST", path, body))
        ok = False
        try:
            # a server that ends the connection after this answer says so
            keep = headers.get(b"connection", b"").lower() != b"close"
            if status != 200:
                data = b"".join([c async for c in conn._chunks(headers)])
                ok = keep
                raise HTTPError(f"HTTP {status}: {data[:200].decode(errors='replace')}")
            buffer = b""
            async for chunk in conn._chunks(headers):
                now = time.perf_counter()
                buffer += chunk
                *complete, buffer = buffer.split(b"\n\n")
                for event in complete:  # "data: ..." (OpenAI) or "event: x\ndata: ..."
                    if event.startswith(b"data: "):
                        yield now, event[6:]
                    elif (at := event.find(b"\ndata: ")) >= 0:
                        yield now, event[at + 7 :]
            ok = keep
        finally:
            self._release(conn, ok)

    async def close(self) -> None:
        for conn in self._idle:
            conn.writer.close()
        self._idle.clear()
