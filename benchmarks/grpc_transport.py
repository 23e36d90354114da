"""The transports alone: what grpc.aio and uvicorn (httptools, uvloop) cost per streamed call.

    python benchmarks/grpc_transport.py                 # 1, 4 and 16 messages per call
    python benchmarks/grpc_transport.py --messages 16 --requests 8000

Both servers run in this process's event loop (uvloop), one after the other, with a handler
that does no work: it reads the request and streams ``k`` fixed messages (gRPC: one
``GenerateResponse`` per message, server-streaming ``radixserve.v1.GenerateService/Generate``;
HTTP: one SSE event per chunk, chunked HTTP/1.1). The load comes from ``h2load`` (nghttp2's
native load generator; Debian package ``nghttp2-client``), the same program for both, so no
Python client cost is in the figures: 64 HTTP/1.1 connections, or 4 HTTP/2 connections with
16 streams each for gRPC. Per call, the server's event-loop thread is the bottleneck, so
``1e6 / req_s`` is roughly the transport's cost per call in microseconds.

This is the floor under ``serving.py --stub --grpc``: radixserve's own work per request is
the same on both APIs (the same engine client, output processing and validation).

Prints a table and, last, one JSON line (``grpc_req_s_<k>``, ``http_req_s_<k>``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import struct
import sys

GRPC_PORT = 8797
HTTP_PORT = 8798
_DONE = re.compile(rb"([\d.]+) req/s")
_COUNTS = re.compile(rb"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded")


async def h2load(args: list[str], requests: int) -> float:
    """Requests per second of one h2load run; every request must have succeeded."""
    proc = await asyncio.create_subprocess_exec(
        "h2load", "-n", str(requests), "-t", "1", *args, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    counts = _COUNTS.search(out)
    done = _DONE.search(out)
    if counts is None or done is None or int(counts.group(3)) != requests:
        raise RuntimeError(f"h2load failed: {out[-400:].decode(errors='replace')}")
    return float(done.group(1))


async def grpc_server(k: int):
    import grpc

    from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
    from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc

    class Null(pb_grpc.GenerateServiceServicer):
        async def Generate(self, request, context):
            for _ in range(k):
                yield pb.GenerateResponse(request_id="r", index=0, text="hello")

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_GenerateServiceServicer_to_server(Null(), server)
    if server.add_insecure_port(f"127.0.0.1:{GRPC_PORT}") == 0:
        raise OSError(f"port {GRPC_PORT} is taken")
    await server.start()
    return server


async def http_server(k: int):
    import uvicorn

    event = b'data: {"text": "hello"}\n\n'

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(k):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(
        app, host="127.0.0.1", port=HTTP_PORT, loop="none", http="httptools", log_level="error"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    return server, task


async def measure(k: int, requests: int, rounds: int, bodies: dict[str, str]) -> dict[str, float]:
    grpc_args = [
        "-c", "4", "-m", "16", "-d", bodies["grpc"],
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        f"http://127.0.0.1:{GRPC_PORT}/radixserve.v1.GenerateService/Generate",
    ]  # fmt: skip
    http_args = [
        "--h1", "-c", "64", "-d", bodies["http"], "-H", "content-type: application/json",
        f"http://127.0.0.1:{HTTP_PORT}/v1/completions",
    ]  # fmt: skip
    best = {"grpc": 0.0, "http": 0.0}
    for _ in range(rounds):  # alternating; the best run of each side counts
        server, task = await http_server(k)
        try:
            best["http"] = max(best["http"], await h2load(http_args, requests))
        finally:
            server.should_exit = True
            await task
        server = await grpc_server(k)
        try:
            best["grpc"] = max(best["grpc"], await h2load(grpc_args, requests))
        finally:
            await server.stop(0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", default="1,4,16", help="messages per call (list)")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("h2load") is None:
        sys.exit("needs h2load (Debian: apt-get install nghttp2-client)")

    import tempfile

    from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb

    message = pb.GenerateRequest(
        text="hello " * 16,
        sampling_params=pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    ).SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        bodies = {"grpc": f"{tmp}/grpc.bin", "http": f"{tmp}/http.json"}
        with open(bodies["grpc"], "wb") as f:  # gRPC framing: uncompressed, length, message
            f.write(b"\0" + struct.pack(">I", len(message)) + message)
        with open(bodies["http"], "w") as f:
            json.dump({"prompt": "hello " * 16, "max_tokens": 16, "stream": True}, f)

        async def run() -> dict[str, float]:
            out: dict[str, float] = {}
            print(f"{'messages':>8} {'gRPC req/s':>11} {'HTTP req/s':>11} {'gRPC µs':>8} "
                  f"{'HTTP µs':>8} {'ratio':>6}")  # fmt: skip
            for k in (int(x) for x in args.messages.split(",")):
                best = await measure(k, args.requests, args.rounds, bodies)
                g, h = best["grpc"], best["http"]
                print(f"{k:>8} {g:>11.0f} {h:>11.0f} {1e6 / g:>8.1f} {1e6 / h:>8.1f} "
                      f"{g / h:>6.2f}")  # fmt: skip
                out[f"grpc_req_s_{k}"] = g
                out[f"http_req_s_{k}"] = h
            return out

        try:
            import uvloop

            result = uvloop.run(run())
        except ImportError:
            result = asyncio.run(run())
    print(json.dumps({key: round(v, 1) for key, v in result.items()}))


if __name__ == "__main__":
    main()
