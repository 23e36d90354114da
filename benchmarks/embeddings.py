"""Embeddings throughput: ``POST /v1/embeddings`` against the same prompts sent as
completions with ``max_tokens: 1`` (a prefill plus one sampled token), on one server, in one
run, alternating rounds so both sides see the same machine load.

    # radixserve serving SmolLM2 (launched here, --enable-embeddings), one input per request
    # at concurrency 16, then 64 inputs per request:
    python benchmarks/embeddings.py --launch
    # any other server (it must serve both routes):
    python benchmarks/embeddings.py --base-url http://127.0.0.1:8000 --model NAME

Each round sends ``--num-inputs`` distinct prompts of ``--input-words`` random words (no
shared prefixes: the radix cache does not help either side). Prints a table and, last,
one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time

import httpx

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
    "river",
    "stone",
    "light",
    "paper",
    "garden",
    "window",
    "music",
    "winter",
    "market",
    "letter",
    "engine",
    "forest",
    "silver",
]


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(n)]


async def run_side(
    url: str, model: str, api: str, prompts: list[str], batch: int, concurrency: int
) -> dict[str, float]:
    """Send ``prompts`` in requests of ``batch`` inputs, ``concurrency`` at a time."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    latencies: list[float] = []
    tokens = 0
    failed = 0
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(group: list[str]) -> None:
            nonlocal tokens, failed
            if api == "embeddings":
                path, body = "/v1/embeddings", {"model": model, "input": group}
            else:  # the same prefill as a completion of one token
                path = "/v1/completions"
                body = {"model": model, "prompt": group, "max_tokens": 1, "temperature": 0}
            async with sem:
                t = time.perf_counter()
                r = await client.post(path, json=body)
                latencies.append(time.perf_counter() - t)
            if r.status_code != 200:
                failed += 1
                return
            data = r.json()
            count = len(data["data"] if api == "embeddings" else data["choices"])
            assert count == len(group), data
            tokens += data["usage"]["prompt_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(g) for g in groups))
        wall = time.perf_counter() - start
    return {
        "inputs_per_s": len(prompts) / wall,
        "requests_per_s": len(groups) / wall,
        "prompt_tokens_per_s": tokens / wall,
        "median_latency_ms": 1e3 * statistics.median(latencies),
        "failed": failed,
        "wall_s": wall,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """``radixserve serve --enable-embeddings`` on 127.0.0.1 for the run."""

    def __init__(self, extra: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.cli", "serve", "--port", port, *extra],
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
        self.stop()
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--launch", action="store_true", help="start radixserve (SmolLM2) here")
    parser.add_argument("--launch-args", default="", help="extra args for radixserve serve")
    parser.add_argument("--num-inputs", type=int, default=256, help="prompts per round")
    parser.add_argument("--input-words", type=int, default=64)
    parser.add_argument(
        "--configs",
        default="1x16,64x2",
        help="comma-separated BATCHxCONCURRENCY: inputs per request x requests in flight",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations of both sides")
    args = parser.parse_args()

    server = None
    if args.launch:
        server = Launched(["--enable-embeddings", *shlex.split(args.launch_args)])
        url = server.url
    elif args.base_url:
        url = args.base_url.rstrip("/")
    else:
        parser.error("pass --launch or --base-url")
    try:
        model = args.model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        warm = make_prompts(16, args.input_words, seed=0)
        for api in ("embeddings", "completions"):
            asyncio.run(run_side(url, model, api, warm, 4, 4))
        rows = []
        seed = 1
        for config in args.configs.split(","):
            batch, concurrency = (int(x) for x in config.split("x"))
            runs: dict[str, list[dict[str, float]]] = {"embeddings": [], "completions": []}
            for _ in range(args.rounds):
                for api in ("embeddings", "completions"):
                    prompts = make_prompts(args.num_inputs, args.input_words, seed)
                    seed += 1  # fresh prompts every run: no cache hits between runs
                    runs[api].append(
                        asyncio.run(run_side(url, model, api, prompts, batch, concurrency))
                    )
            for api, results in runs.items():
                rows.append(
                    {"batch": batch, "concurrency": concurrency, "api": api, "runs": results}
                )
    finally:
        if server is not None:
            server.stop()

    print(
        f"{'batch':>5} {'conc':>4} {'api':<12} {'inputs/s (each run)':<26} {'tokens/s':>9} {'p50 ms':>7}"
    )
    for row in rows:
        each = ", ".join(f"{r['inputs_per_s']:.1f}" for r in row["runs"])
        tok = statistics.median(r["prompt_tokens_per_s"] for r in row["runs"])
        lat = statistics.median(r["median_latency_ms"] for r in row["runs"])
        print(
            f"{row['batch']:>5} {row['concurrency']:>4} {row['api']:<12} {each:<26} {tok:>9.0f} {lat:>7.0f}"
        )
    summary = {}
    for emb, cmp_ in zip(rows[::2], rows[1::2], strict=True):
        key = f"{emb['batch']}x{emb['concurrency']}"
        e = [r["inputs_per_s"] for r in emb["runs"]]
        c = [r["inputs_per_s"] for r in cmp_["runs"]]
        summary[key] = {
            "embeddings_inputs_per_s": e,
            "completions_inputs_per_s": c,
            "ratio_per_round": [a / b for a, b in zip(e, c, strict=True)],
            "embeddings_tokens_per_s": [r["prompt_tokens_per_s"] for r in emb["runs"]],
            "failed": sum(r["failed"] for r in emb["runs"] + cmp_["runs"]),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
