"""Cache-aware vs round-robin routing over two replicas, in one run.

    python benchmarks/router.py            # 8 prefix groups x 8 requests, 2 replicas
    python benchmarks/router.py --kv-tokens 0   # replicas whose KV cache never fills

The workload is W2-like with 8 prefix groups: each group's prompt is W2's system header,
a ~1,024-token reference text of its own (four W1 prompts) and one of W2's questions
(~32 tokens), 32 output tokens; the groups' requests arrive shuffled. Each policy gets two
fresh ``radixserve serve`` replicas on the timed simulated device (the scheduler, radix
cache and server are real; the model is a cost model) and a ``radixserve router`` in front.
The hit rate is the replicas' own (prompt tokens found in their prefix caches / prompt
tokens looked up, from their /metrics). Prints a table, then one JSON line with
``hit_rate_cache_aware``, ``hit_rate_round_robin`` and ``throughput_ratio`` (cache-aware
÷ round-robin output tokens/s).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serving import Job, run_async, run_load, summarize

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def make_jobs(groups: int, per_group: int, seed: int) -> list[Job]:
    w1 = [json.loads(x) for x in (WORKLOADS / "w1_offline.jsonl").read_text().splitlines()]
    w2 = [json.loads(x) for x in (WORKLOADS / "w2_shared_prefix.jsonl").read_text().splitlines()]
    if groups * 4 > len(w1):
        raise SystemExit(f"at most {len(w1) // 4} groups (four W1 prompts each)")
    header = w2[0]["prompt"].split("Reference:\n", 1)[0] + "Reference:\n"
    questions = ["\n\n###\n" + r["prompt"].split("\n\n###\n", 1)[1] for r in w2]
    jobs = []
    for g in range(groups):
        reference = " ".join(r["prompt"] for r in w1[4 * g : 4 * g + 4])
        for j in range(per_group):
            question = questions[(g * per_group + j) % len(questions)]
            jobs.append(Job(header + reference + question, 32))
    random.Random(seed).shuffle(jobs)
    return jobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], ready_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited during startup")
        try:
            if httpx.get(url + ready_path, timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{args[0]} did not start")


def cache_counters(url: str) -> tuple[float, float]:
    """(prompt tokens found cached, prompt tokens looked up) of one replica."""
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        for s in f.samples
    }
    return (
        values.get("radixserve_prefix_cache_hits_total", 0.0),
        values.get("radixserve_prefix_cache_queries_total", 0.0),
    )


def run_policy(policy: str, jobs: list[Job], args) -> dict:
    worker_args = [
        "serve",
        "--simulated-device-time",
        "--simulated-device-cost",
        args.cost,
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "4096",
    ]
    if args.kv_tokens:
        worker_args += ["--simulated-kv-tokens", str(args.kv_tokens)]
    procs = []
    try:
        workers = []
        for _ in range(2):
            proc, url = launch(worker_args, "/health")
            procs.append(proc)
            workers.append(url)
        flags = [x for url in workers for x in ("--worker", url)]
        proc, router = launch(["router", "--policy", policy, *flags], "/health")
        procs.append(proc)
        model = httpx.get(router + "/v1/models").json()["data"][0]["id"]
        before = [cache_counters(u) for u in workers]
        results, wall = run_async(run_load(router, model, jobs, args.concurrency, float("inf")))
        after = [cache_counters(u) for u in workers]
        hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        queried = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        s = summarize(results, wall)
        routed = {}
        for family in text_string_to_metric_families(httpx.get(router + "/metrics").text):
            for sample in family.samples:
                if sample.name == "radixserve_router_requests_total":
                    routed[workers.index(sample.labels["worker"])] = sample.value
        return {
            "hit_rate": hits / queried if queried else 0.0,
            "output_tok_s": s["output_tok_s"],
            "median_ttft_ms": s.get("median_ttft_ms", 0.0),
            "failed": s["failed"],
            "wall_s": wall,
            "requests_per_worker": [routed.get(i, 0) for i in range(2)],
        }
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--requests-per-group", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=5120,
        help="each replica's KV cache in tokens: about 4.7 of the 8 ~1,090-token prompts, so "
        "the two replicas together hold every prefix and neither holds them all; 0: never full",
    )
    parser.add_argument(
        "--cost",
        default="0.006,1e-5,1e-8",
        help="simulated device a,b,c: seconds per step, per batched token, per KV token read",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    jobs = make_jobs(args.groups, args.requests_per_group, args.seed)
    out = {}
    for policy in ("cache-aware", "round-robin"):
        r = run_policy(policy, jobs, args)
        out[policy] = r
        print(
            f"{policy:>12}: prefix hit rate {r['hit_rate']:.3f}, {r['output_tok_s']:.0f} output "
            f"tok/s, median TTFT {r['median_ttft_ms']:.0f} ms, requests per worker "
            f"{r['requests_per_worker']}, {r['failed']} failed"
        )
    ca, rr = out["cache-aware"], out["round-robin"]
    summary = {
        "hit_rate_cache_aware": round(ca["hit_rate"], 4),
        "hit_rate_round_robin": round(rr["hit_rate"], 4),
        "hit_rate_ratio": round(ca["hit_rate"] / rr["hit_rate"], 3) if rr["hit_rate"] else None,
        "throughput_ratio": round(ca["output_tok_s"] / rr["output_tok_s"], 3),
        "output_tok_s_cache_aware": round(ca["output_tok_s"], 1),
        "output_tok_s_round_robin": round(rr["output_tok_s"], 1),
        "median_ttft_ms_cache_aware": round(ca["median_ttft_ms"], 1),
        "median_ttft_ms_round_robin": round(rr["median_ttft_ms"], 1),
        "failed": ca["failed"] + rr["failed"],
        "requests": len(jobs),
        "groups": args.groups,
        "concurrency": args.concurrency,
        "kv_tokens_per_replica": args.kv_tokens or None,
        "cost": args.cost,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
