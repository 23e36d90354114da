"""The Ray Serve application against ``radixserve router``, two replicas each, same load.

    python benchmarks/ray_serve.py                 # SmolLM2 (serve's default model)
    python benchmarks/ray_serve.py --simulated     # the timed simulated device: the layers' own cost
    python benchmarks/ray_serve.py --model PATH    # any model serve takes

The load is W3-style (streamed, at concurrency 16, greedy, ``ignore_eos``) over prompts
that share prefixes, so a cache-aware router has something to find: ``router.py``'s 8
prefix groups x 8 requests (each prompt W2's system header, a ~1,024-token reference text
of its group and one of W2's questions; 32 output tokens), shuffled.

Each side gets two fresh replicas with the same ``radixserve serve`` flags on this
machine, each with half the cores (``--num-threads``; Ray would give each replica's
process one OpenMP thread per CPU it reserves, the router's replicas all cores each): first two ``serve`` processes behind ``radixserve router`` (cache-aware), then a
local Ray cluster (``ray.init``) running ``radixserve.api.ray.app:build_app`` with two
replicas of one CPU each (Ray's prefix-aware request router, the ingress). Both get the
same warm-up. The hit rate is the clients' own count: ``cached_tokens`` / prompt tokens
from each answer's usage. After the load, ``--probe-requests`` requests one at a time
(one output token, a prompt cached after the first) measure each path's added latency
with nothing else running.

The two sides take turns, ``--rounds`` times each (default 2), in the order router, Ray,
Ray, router, ...: a 2-core cloud machine's speed drifts by a third within minutes, and a
drift during one side's turn would otherwise be read as that side's speed. Each turn
starts its side afresh and stops it after.

Prints a line per turn, then one JSON line with ``throughput_ratio_vs_router`` (Ray ÷
router output tokens/s, each side's turns pooled: all its output tokens over all its load
time), ``throughput_ratio_rounds`` (the same per round), ``hit_rate_ratio_vs_router``,
``ttft_p50_added_s`` (Ray's median TTFT minus the router's, under the load, medians over
turns) and ``ttft_p50_added_idle_s`` (the same, one request at a time). Needs
``pip install "radixserve[ray]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import time

import httpx
from router import free_port, launch, make_jobs
from serving import Job, run_async, run_load, summarize

WARMUP = [Job("A short warm-up prompt about the weather in " + c, 8) for c in ("Paris", "Oslo")]


def serve_flags(args) -> list[str]:
    flags = ["--max-num-seqs", "64", "--num-threads", str(args.threads_per_replica)]
    if args.model:
        flags += ["--model", args.model]
    if args.simulated:
        flags += [
            "--simulated-device-time",
            "--simulated-device-cost",
            args.cost,
            "--simulated-kv-tokens",
            str(args.kv_tokens),
            "--max-num-batched-tokens",
            "4096",
        ]
    return flags + shlex.split(args.serve_args)


def measure(url: str, jobs: list[Job], args) -> dict:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    run_async(run_load(url, model, WARMUP, len(WARMUP), float("inf")))
    results, wall = run_async(run_load(url, model, jobs, args.concurrency, float("inf")))
    s = summarize(results, wall)
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    probe = [Job(jobs[0].prompt, 1)] * args.probe_requests
    idle = []
    for job in probe:
        r, _ = run_async(run_load(url, model, [job], 1, float("inf")))
        if r[0].ok:
            idle.append(r[0].ttft)
    return {
        "output_tok_s": s["output_tok_s"],
        "output_tokens": sum(r.output_tokens for r in ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "median_ttft_s": s.get("median_ttft_ms", 0.0) / 1e3,
        "p99_ttft_s": s.get("p99_ttft_ms", 0.0) / 1e3,
        "idle_ttft_s": statistics.median(idle[1:]) if len(idle) > 1 else float("nan"),
        "failed": s["failed"],
        "wall_s": wall,
    }


def run_router(jobs: list[Job], args) -> dict:
    procs = []
    try:
        workers = []
        for _ in range(2):
            proc, url = launch(["serve", *serve_flags(args)], "/health")
            procs.append(proc)
            workers.append(url)
        flags = [x for url in workers for x in ("--worker", url)]
        proc, router = launch(["router", "--policy", "cache-aware", *flags], "/health")
        procs.append(proc)
        return measure(router, jobs, args)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(60)


def run_ray(jobs: list[Job], args) -> dict:
    import ray
    from ray import serve

    from radixserve.api.ray.app import build_app

    cpus = os.cpu_count() or 2
    port = free_port()
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            {
                "replicas": "2",
                "num_cpus": str(cpus / 2),
                "serve_args": shlex.join(serve_flags(args)),
                "transport": args.transport,
            }
        )
        serve.run(app, name="radixserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while httpx.get(url + "/health", timeout=30).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the Ray application did not become healthy")
            time.sleep(0.5)
        return measure(url, jobs, args)
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="serve's --model (default: its own)")
    parser.add_argument("--serve-args", default="", help="more serve flags, shell-quoted")
    parser.add_argument("--simulated", action="store_true", help="the timed simulated device")
    parser.add_argument("--cost", default="0.006,1e-5,1e-8", help="simulated device a,b,c")
    parser.add_argument(
        "--kv-tokens", type=int, default=5120, help="simulated KV cache per replica, tokens"
    )
    parser.add_argument(
        "--threads-per-replica",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="each replica's --num-threads (default: half the cores: two replicas that each "
        "spin on every core take turns, several times slower)",
    )
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--requests-per-group", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--probe-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--transport",
        default="loopback",
        choices=("loopback", "ray"),
        help="the Ray application's transport (ray: every answer through Ray's handle)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="turns of each side (router, Ray, Ray, router, ...)"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    jobs = make_jobs(args.groups, args.requests_per_group, args.seed)
    sides = {"router": run_router, "ray": run_ray}
    turns: dict[str, list[dict]] = {"router": [], "ray": []}
    for i in range(args.rounds):
        for side in ("router", "ray") if i % 2 == 0 else ("ray", "router"):
            r = sides[side](jobs, args)
            turns[side].append(r)
            print(
                f"round {i + 1} {side:>6}: {r['output_tok_s']:7.1f} output tok/s, prefix hit "
                f"rate {r['hit_rate']:.3f}, TTFT p50 {r['median_ttft_s']:.3f} s p99 "
                f"{r['p99_ttft_s']:.3f} s, idle TTFT {r['idle_ttft_s'] * 1e3:.1f} ms, "
                f"{r['failed']} failed, {r['wall_s']:.1f} s",
                flush=True,
            )

    def pooled(side: str, key: str) -> float:
        return statistics.fmean(r[key] for r in turns[side])

    def throughput(side: str) -> float:
        return sum(r["output_tokens"] for r in turns[side]) / sum(r["wall_s"] for r in turns[side])

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in turns[side])

    hit_router, hit_ray = pooled("router", "hit_rate"), pooled("ray", "hit_rate")
    summary = {
        "throughput_ratio_vs_router": round(throughput("ray") / throughput("router"), 3),
        "throughput_ratio_rounds": [
            round(a["output_tok_s"] / b["output_tok_s"], 3)
            for a, b in zip(turns["ray"], turns["router"], strict=True)
        ],
        "hit_rate_ratio_vs_router": round(hit_ray / hit_router, 3) if hit_router else None,
        "ttft_p50_added_s": round(
            median("ray", "median_ttft_s") - median("router", "median_ttft_s"), 4
        ),
        "ttft_p50_added_idle_s": round(
            median("ray", "idle_ttft_s") - median("router", "idle_ttft_s"), 4
        ),
        "output_tok_s_ray": round(throughput("ray"), 1),
        "output_tok_s_router": round(throughput("router"), 1),
        "hit_rate_ray": round(hit_ray, 4),
        "hit_rate_router": round(hit_router, 4),
        "failed": sum(r["failed"] for side in turns.values() for r in side),
        "requests": len(jobs),
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "model": "simulated" if args.simulated else (args.model or "default"),
        "threads_per_replica": args.threads_per_replica,
        "transport": args.transport,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
