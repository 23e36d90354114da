"""Serving benchmark: an asyncio streaming client for any OpenAI-compatible server.

    # radixserve serving SmolLM2 (launched here), W3 at concurrency 16:
    python benchmarks/serving.py --launch --workload trace --trace ../shared/workloads/w3_online.jsonl --max-concurrency 16
    # a sweep over concurrency levels (random lengths), with a PNG plot if matplotlib exists:
    python benchmarks/serving.py --launch --workload random --sweep 1,4,16,64 --num-requests 64
    # the frontend's own cost: radixserve on a simulated device with instant tokens
    python benchmarks/serving.py --stub
    # the Responses or Messages API against Chat Completions (streamed), one server, one run
    python benchmarks/serving.py --stub --api responses
    python benchmarks/serving.py --stub --api messages
    # the same, streamed over gRPC vs HTTP (SSE) from one server, in one run
    python benchmarks/serving.py --stub --grpc
    # ... both APIs loaded by h2load (native) instead of Python clients: the servers alone
    python benchmarks/serving.py --stub --grpc --h2load
    # any other server:
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --model NAME --workload random

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson
from http_client import Client, HTTPError

W3 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w3_online.jsonl"
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "were",
    "are",
]


@dataclass
class Job:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the server's prefix cache (if it says)
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_jobs(args) -> list[Job]:
    rng = random.Random(0)
    if args.workload == "trace":
        lines = [json.loads(x) for x in Path(args.trace).read_text().splitlines() if x.strip()]
        return [Job(x["prompt"], int(x["max_tokens"])) for x in lines][: args.num_requests or None]
    n = args.num_requests or 64
    if args.workload == "shared-prefix":
        prefixes = [" ".join(rng.choices(_WORDS, k=args.prefix_words)) for _ in range(args.groups)]
        return [
            Job(rng.choice(prefixes) + " " + " ".join(rng.choices(_WORDS, k=32)), args.output_len)
            for _ in range(n)
        ]
    return [
        Job(
            " ".join(rng.choices(_WORDS, k=rng.randint(16, 2 * args.input_words))),
            rng.randint(max(1, args.output_len // 2), args.output_len),
        )
        for _ in range(n)
    ]


def api_body(api: str, model: str, job: Job, stream: bool) -> tuple[str, dict]:
    """(path, body) of ``job`` in ``api``'s shape: greedy, ``job.max_tokens`` tokens."""
    if api == "completions":
        body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "ignore_eos": True}
        path = "/v1/completions"
    elif api == "chat":
        messages = [{"role": "user", "content": job.prompt}]
        body = {"messages": messages, "max_tokens": job.max_tokens, "ignore_eos": True}
        path = "/v1/chat/completions"
    elif api == "responses":  # (no ignore_eos in this API: the stub emits no EOS)
        body = {"input": job.prompt, "max_output_tokens": job.max_tokens}
        path = "/v1/responses"
    else:
        messages = [{"role": "user", "content": job.prompt}]
        body = {"messages": messages, "max_tokens": job.max_tokens}
        path = "/v1/messages"
    body.update(model=model, temperature=0, stream=stream)
    if stream and api in ("completions", "chat"):
        body["stream_options"] = {"include_usage": True}
    return path, body


def _event_text_and_usage(api: str, chunk: dict) -> tuple[str, tuple[int, int] | None]:
    """The text a streamed event carries and (prompt, output) tokens if it has the usage."""
    if api in ("completions", "chat"):
        usage = chunk.get("usage")
        counts = (usage["prompt_tokens"], usage["completion_tokens"]) if usage else None
        choices = chunk.get("choices") or [{}]
        text = choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
        return text, counts
    kind = chunk.get("type")
    if api == "responses":
        if kind == "response.output_text.delta":
            return chunk["delta"], None
        if kind == "response.completed":
            usage = chunk["response"]["usage"]
            return "", (usage["input_tokens"], usage["output_tokens"])
        return "", None
    if kind == "content_block_delta" and chunk["delta"].get("type") == "text_delta":
        return chunk["delta"]["text"], None
    if kind == "message_delta":
        usage = chunk["usage"]
        return "", (
            usage["input_tokens"] + usage["cache_read_input_tokens"],
            usage["output_tokens"],
        )
    return "", None


def _whole_usage(api: str, data: dict) -> tuple[int, int]:
    usage = data["usage"]
    if api in ("completions", "chat"):
        return usage["prompt_tokens"], usage["completion_tokens"]
    if api == "responses":
        return usage["input_tokens"], usage["output_tokens"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"]


async def one_request(
    client: Client, model: str, job: Job, stream: bool, api: str = "completions"
) -> Result:
    path, body = api_body(api, model, job, stream)
    start = time.perf_counter()
    res = Result(ok=False)
    try:
        if not stream:
            status, data = await client.request("POST", path, body)
            if status != 200:
                res.error = data[:200].decode(errors="replace")
                return res
            res.prompt_tokens, res.output_tokens = _whole_usage(api, orjson.loads(data))
            res.e2e = res.ttft = time.perf_counter() - start
            res.ok = True
            return res
        last = None
        async for now, data in client.events(path, body):
            if data == b"[DONE]":
                continue
            chunk = orjson.loads(data)
            text, counts = _event_text_and_usage(api, chunk)
            if counts is not None:
                res.prompt_tokens, res.output_tokens = counts
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                res.cached_tokens = details.get("cached_tokens") or 0
            if text:
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except (HTTPError, OSError, asyncio.IncompleteReadError) as exc:
        res.error = repr(exc)
    return res


async def run_load(
    url: str,
    model: str,
    jobs: list[Job],
    concurrency: int,
    rate: float,
    stream: bool = True,
    api: str = "completions",
) -> tuple[list[Result], float]:
    """Send ``jobs`` (Poisson arrivals at ``rate`` per second, or all at once), at most
    ``concurrency`` in flight; returns the results and the wall time."""
    client = Client(url, max_connections=concurrency)
    slots = asyncio.Semaphore(concurrency)  # a request's clock starts when it may be sent
    rng = np.random.default_rng(1)

    async def guarded(job: Job) -> Result:
        async with slots:
            return await one_request(client, model, job, stream, api)

    try:
        start = time.perf_counter()
        tasks = []
        for job in jobs:
            tasks.append(asyncio.create_task(guarded(job)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start
    finally:
        await client.close()


def summarize(results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    out: dict[str, float] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / wall,
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
    }
    series = {
        "ttft_ms": [1e3 * r.ttft for r in ok],
        "tpot_ms": [
            1e3 * (r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
        ],
        "itl_ms": [1e3 * x for r in ok for x in r.itl],
        "e2e_ms": [1e3 * r.e2e for r in ok],
    }
    for name, values in series.items():
        if values:
            out[f"mean_{name}"] = statistics.fmean(values)
            out[f"median_{name}"] = float(np.median(values))
            out[f"p90_{name}"] = float(np.percentile(values, 90))
            out[f"p99_{name}"] = float(np.percentile(values, 99))
    return out


def print_table(rows: list[tuple[int, dict]]) -> None:
    print(
        f"{'conc':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT med/p99 ms':>18} {'TPOT med ms':>12}"
        f" {'ITL p99 ms':>11} {'E2E med ms':>11} {'failed':>7}"
    )
    for c, s in rows:
        print(
            f"{c:>5} {s['request_throughput']:>7.2f} {s['output_tok_s']:>10.1f} "
            f"{s.get('median_ttft_ms', 0):>8.0f} / {s.get('p99_ttft_ms', 0):<7.0f} "
            f"{s.get('median_tpot_ms', 0):>12.1f} {s.get('p99_itl_ms', 0):>11.1f} "
            f"{s.get('median_e2e_ms', 0):>11.0f} {s['failed']:>7}"
        )


class Launched:
    def __init__(self, extra: list[str], port: int = 8765) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited during startup")
            time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def run_async(coro):
    """Run on uvloop when it is installed (as the server does): a cheaper client."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def probe_health(url: str) -> None:
    """``--probe-health URL``: GET /health every 10 ms until stdin closes, then print the
    latencies (ms) as JSON. Runs as its own process, so the load generator's busy event loop
    does not count as server latency."""
    import http.client
    import threading

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    samples = []
    while not stop.is_set():
        t = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        samples.append(1e3 * (time.perf_counter() - t))
        time.sleep(0.01)
    print(json.dumps(samples))


async def health_under_load(url: str, model: str, jobs: list[Job], concurrency: int, stream: bool):
    prober = subprocess.Popen(
        [sys.executable, __file__, "--probe-health", url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    results, wall = await run_load(url, model, jobs, concurrency, float("inf"), stream)
    out, _ = prober.communicate(b"", timeout=60)
    samples = json.loads(out)
    return results, wall, float(np.median(samples)) if samples else 0.0


def run_stub(args) -> dict[str, float]:
    """radixserve on a simulated device (instant tokens): what the frontend can sustain."""
    server = Launched(
        ["--simulated-device", "--max-num-seqs", "512", "--max-num-batched-tokens", "8192"]
    )
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        jobs = [Job("hello " * 16, 16) for _ in range(args.stub_requests)]
        summary = {}
        for stream in (True, False):
            run_async(run_load(server.url, model, jobs[:64], 32, float("inf"), stream))
            results, wall, health_ms = run_async(
                health_under_load(server.url, model, jobs, args.stub_concurrency, stream)
            )
            s = summarize(results, wall)
            label = "streamed" if stream else "nonstreamed"
            summary[f"stub_{label}_req_s"] = s["request_throughput"]
            summary[f"stub_{label}_failed"] = s["failed"]
            if stream:
                summary["health_median_ms_under_load"] = health_ms
                summary["stub_sse_events_s"] = s["request_throughput"] * 16
            print(
                f"stub {label:>11}: {s['request_throughput']:.0f} req/s ({s['failed']} failed), "
                f"/health median {health_ms:.2f} ms under load"
            )
        return summary
    finally:
        server.stop()


def run_stub_api(args) -> dict[str, float]:
    """One stub server: ``args.api`` and Chat Completions, streamed, alternated
    ``args.grpc_rounds`` times; the medians and their ratio (the API's own cost)."""
    server = Launched(
        ["--simulated-device", "--max-num-seqs", "512", "--max-num-batched-tokens", "8192"]
    )
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        # distinct prompts: identical ones would measure the scheduler holding back
        # requests that share a prefill in flight, not the API's own cost
        jobs = [Job(f"request {i}: " + "hello " * 16, 16) for i in range(args.stub_requests)]
        rates: dict[str, list[float]] = {"chat": [], args.api: []}
        for api in rates:  # warm-up
            run_async(run_load(server.url, model, jobs[:64], 32, float("inf"), True, api))
        for r in range(args.grpc_rounds):
            for api in rates:
                results, wall = run_async(
                    run_load(
                        server.url, model, jobs, args.stub_concurrency, float("inf"), True, api
                    )
                )
                s = summarize(results, wall)
                if s["failed"]:
                    raise SystemExit(f"{api}: {s['failed']} requests failed")
                rates[api].append(s["request_throughput"])
                print(f"round {r + 1} {api:>10}: {s['request_throughput']:.0f} req/s streamed")
        chat, other = statistics.median(rates["chat"]), statistics.median(rates[args.api])
        print(f"median: chat {chat:.0f}, {args.api} {other:.0f} req/s ({other / chat:.3f}x)")
        return {
            "stub_chat_req_s": chat,
            f"stub_{args.api}_req_s": other,
            f"{args.api}_vs_chat": other / chat,
        }
    finally:
        server.stop()


async def grpc_request(stub, job: Job) -> Result:
    """One streamed Generate call (radixserve.v1), timed as ``one_request`` times SSE."""
    import grpc

    from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb

    req = pb.GenerateRequest(
        text=job.prompt,
        sampling_params=pb.SamplingParams(
            max_tokens=job.max_tokens, temperature=0, ignore_eos=True
        ),
    )
    start = time.perf_counter()
    res = Result(ok=False)
    last = None
    try:
        async for msg in stub.Generate(req, timeout=600):
            now = time.perf_counter()
            if msg.text:
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
            if msg.finish_reason:
                res.prompt_tokens = msg.usage.prompt_tokens
                res.output_tokens = msg.usage.completion_tokens
        res.e2e = time.perf_counter() - start
        res.ok = True
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code()}: {exc.details()}"
    return res


async def run_grpc_load(target: str, jobs: list[Job], concurrency: int, channels: int = 4):
    """``jobs`` over gRPC, at most ``concurrency`` in flight, spread over ``channels``
    channels (each its own HTTP/2 connection, multiplexing its calls); the results and the
    wall time."""
    import grpc

    from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc

    slots = asyncio.Semaphore(concurrency)
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    pool = [grpc.aio.insecure_channel(target, options=options) for _ in range(channels)]
    stubs = [pb_grpc.GenerateServiceStub(channel) for channel in pool]

    async def guarded(i: int, job: Job) -> Result:
        async with slots:
            return await grpc_request(stubs[i % channels], job)

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(i, job) for i, job in enumerate(jobs)))
        return results, time.perf_counter() - start
    finally:
        for channel in pool:
            await channel.close()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads; not its children)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for (the
    h2load runs; the server is waited for only at the end)."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


class _H2Load:
    """The stub's streamed requests sent by ``h2load`` (nghttp2's native load generator) to
    both APIs, so that no Python client's cost is in the comparison: HTTP/1.1 with one
    connection per request in flight, gRPC over ``--grpc-channels`` HTTP/2 connections
    with the same number of streams in flight. h2load reads each response to its end but
    not its content: the bodies are checked once here, with the Python clients, before."""

    def __init__(self, url: str, target: str, model: str, job: Job, args) -> None:
        import shutil
        import struct
        import tempfile

        from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb

        if shutil.which("h2load") is None:
            raise SystemExit("--h2load needs h2load (Debian: apt-get install nghttp2-client)")
        self._dir = tempfile.TemporaryDirectory()
        http_body, grpc_body = f"{self._dir.name}/http.json", f"{self._dir.name}/grpc.bin"
        with open(http_body, "wb") as f:
            f.write(
                orjson.dumps(
                    {
                        "model": model,
                        "prompt": job.prompt,
                        "max_tokens": job.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                )
            )
        message = pb.GenerateRequest(
            text=job.prompt,
            sampling_params=pb.SamplingParams(
                max_tokens=job.max_tokens, temperature=0, ignore_eos=True
            ),
        ).SerializeToString()
        with open(grpc_body, "wb") as f:  # gRPC framing: not compressed, length, message
            f.write(b"\0" + struct.pack(">I", len(message)) + message)
        concurrency, channels = args.stub_concurrency, args.grpc_channels
        self.args = {
            "http": ["--h1", "-c", str(concurrency), "-d", http_body,
                     "-H", "content-type: application/json", url + "/v1/completions"],
            "grpc": ["-c", str(channels), "-m", str(-(-concurrency // channels)),
                     "-d", grpc_body, "-H", "content-type: application/grpc",
                     "-H", "te: trailers",
                     f"http://{target}/radixserve.v1.GenerateService/Generate"],
        }  # fmt: skip

    def run(self, label: str, n: int) -> dict[str, float]:
        """Throughput only (h2load fails the run unless every request succeeded)."""
        from grpc_transport import h2load

        return {"request_throughput": run_async(h2load(self.args[label], n)), "failed": 0}


def run_stub_grpc(args) -> dict[str, float | str]:
    """One stub server with ``--grpc-port``: the same streamed jobs over HTTP (SSE) and over
    gRPC, alternating (HTTP, gRPC) ``--grpc-rounds`` times; each side's median run counts."""
    grpc_port = 8766
    server = Launched(
        [
            "--simulated-device",
            "--max-num-seqs",
            "512",
            "--max-num-batched-tokens",
            "8192",
            "--grpc-port",
            str(grpc_port),
        ]
    )
    target = f"127.0.0.1:{grpc_port}"
    channels = args.grpc_channels
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        jobs = [Job("hello " * 16, 16) for _ in range(args.stub_requests)]
        for warm in (
            run_async(run_load(server.url, model, jobs[:64], 32, float("inf"), True))[0],
            run_async(run_grpc_load(target, jobs[:64], 32, channels))[0],
        ):  # both APIs answer the job in full (h2load does not look inside the answers)
            bad = [r for r in warm if not r.ok or r.output_tokens != jobs[0].max_tokens]
            if bad:
                raise RuntimeError(f"warm-up failed: {bad[0]}")
        runs: dict[str, list[dict]] = {"http": [], "grpc": []}
        native = _H2Load(server.url, target, model, jobs[0], args) if args.h2load else None
        for _ in range(args.grpc_rounds):
            for label in ("http", "grpc"):
                server_cpu, client_cpu = _cpu_s(server.proc.pid), _own_cpu_s()
                if native is not None:
                    s = native.run(label, len(jobs))
                elif label == "http":
                    s = summarize(
                        *run_async(
                            run_load(server.url, model, jobs, args.stub_concurrency, float("inf"))
                        )
                    )
                else:
                    s = summarize(
                        *run_async(run_grpc_load(target, jobs, args.stub_concurrency, channels))
                    )
                s["server_cpu_ms"] = 1e3 * (_cpu_s(server.proc.pid) - server_cpu) / len(jobs)
                s["client_cpu_ms"] = 1e3 * (_own_cpu_s() - client_cpu) / len(jobs)
                runs[label].append(s)
                ttft = s.get("median_ttft_ms")
                print(
                    f"stub {label:>4} streamed: {s['request_throughput']:.0f} req/s "
                    f"({s['failed']} failed), median TTFT "
                    f"{'not measured' if ttft is None else f'{ttft:.1f} ms'}, "
                    f"CPU per request: server {s['server_cpu_ms']:.2f} ms (frontend process), "
                    f"client {s['client_cpu_ms']:.2f} ms"
                )
        out: dict[str, float | str] = {}
        for label, series in runs.items():
            series.sort(key=lambda s: s["request_throughput"])
            median = series[len(series) // 2]
            out[f"{label}_streamed_req_s"] = median["request_throughput"]
            out[f"{label}_failed"] = sum(s["failed"] for s in series)
            if "median_ttft_ms" in median:
                out[f"{label}_median_ttft_ms"] = median["median_ttft_ms"]
            out[f"{label}_server_cpu_ms_per_req"] = median["server_cpu_ms"]
            out[f"{label}_client_cpu_ms_per_req"] = median["client_cpu_ms"]
        out["grpc_channels"] = channels
        out["load_generator"] = "h2load" if native is not None else "python"
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--launch", action="store_true", help="start radixserve (SmolLM2) here")
    parser.add_argument("--launch-args", default="", help="extra args for radixserve serve")
    parser.add_argument(
        "--workload", choices=["random", "shared-prefix", "trace"], default="random"
    )
    parser.add_argument("--trace", default=str(W3))
    parser.add_argument("--num-requests", type=int, default=0)
    parser.add_argument("--input-words", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prefix-words", type=int, default=600)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--sweep", default=None, help="comma-separated concurrency levels")
    parser.add_argument("--plot", default="serving_latency.png")
    parser.add_argument(
        "--stub", action="store_true", help="measure the frontend on a simulated device"
    )
    parser.add_argument("--stub-requests", type=int, default=2000)
    parser.add_argument("--stub-concurrency", type=int, default=64)
    parser.add_argument(
        "--grpc", action="store_true", help="with --stub: streamed over gRPC vs HTTP, one run"
    )
    parser.add_argument("--grpc-channels", type=int, default=4, help="gRPC client connections")
    parser.add_argument(
        "--api",
        default="completions",
        choices=["completions", "chat", "responses", "messages"],
        help="the API the load speaks (with --stub, responses/messages: against chat)",
    )
    parser.add_argument("--grpc-rounds", type=int, default=3, help="HTTP/gRPC alternations")
    parser.add_argument(
        "--h2load",
        action="store_true",
        help="with --stub --grpc: load both APIs with h2load (native) instead of the Python "
        "clients, so that only the server's cost is compared (no TTFT figures)",
    )
    parser.add_argument("--probe-health", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.probe_health:
        probe_health(args.probe_health)
        return

    if args.stub and args.grpc:
        out = run_stub_grpc(args)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))
        return
    if args.stub and args.api in ("responses", "messages"):
        print(json.dumps({k: round(v, 3) for k, v in run_stub_api(args).items()}))
        return
    if args.stub:
        print(json.dumps({k: round(v, 2) for k, v in run_stub(args).items()}))
        return
    server = Launched(args.launch_args.split()) if args.launch else None
    url = server.url if server else args.base_url
    if url is None:
        parser.error("give --base-url or --launch")
    try:
        model = args.model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        jobs = make_jobs(args)
        levels = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.max_concurrency]
        rows = []
        for c in levels:
            results, wall = run_async(
                run_load(url, model, jobs, c, args.request_rate, True, args.api)
            )
            rows.append((c, summarize(results, wall)))
        print(f"\n{args.workload} workload, {len(jobs)} requests, {url}")
        print_table(rows)
        if len(rows) > 1:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt

                fig, ax = plt.subplots(figsize=(6, 4))
                for key in ("median_ttft_ms", "p99_ttft_ms", "median_e2e_ms", "p99_e2e_ms"):
                    ax.plot(levels, [s.get(key, 0) for _, s in rows], marker="o", label=key)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("concurrency")
                ax.set_ylabel("ms")
                ax.legend()
                fig.savefig(args.plot, dpi=100, bbox_inches="tight")
                print(f"plot: {args.plot}")
            except ImportError:
                print("(matplotlib not installed: no plot)")
        print(
            json.dumps(
                {
                    "workload": args.workload,
                    "levels": {str(c): {k: round(v, 2) for k, v in s.items()} for c, s in rows},
                }
            )
        )
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    main()
