"""The price of a prefix cache scoped by tenant: W2 (64 requests sharing a 1,024-token
prefix) spread over tenants, run with ``prefix_cache_scope`` ``tenant`` and ``global`` in
the same process, rounds alternating, every run from an empty cache.

    python benchmarks/tenant_isolation.py                  # 4 tenants, SmolLM2, 3 rounds
    python benchmarks/tenant_isolation.py --tenants 16 --rounds 5

Request i belongs to tenant i mod N and all are queued at once (offline, the engine's
defaults). Under ``tenant`` each tenant computes the shared prefix once for itself; under
``global`` the first request computes it for everyone. Prints a table, then one JSON line:
per scope the prefix hit rate (cached prompt tokens / prompt tokens), the prompt tokens
computed, wall seconds and output tok/s (medians over rounds), and ``throughput_ratio``
(tenant / global).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

DEFAULT_WORKLOAD = (
    Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w2_shared_prefix.jsonl"
)
SCOPES = ("tenant", "global")


def run_once(engine, prompts: list[list[int]], params: list, tenants: list) -> dict:
    """Queue every request at once and step until all are done (from an empty cache)."""
    engine.check_idle()  # also empties the radix tree
    start = time.perf_counter()
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", ids, p, tenant=tenants[i])
    cached = out = 0
    while engine.has_unfinished():
        for d in engine.step():
            out += len(d.token_ids)
            if d.finished:
                assert d.error is None, d.error
                cached += d.num_cached_tokens
    wall = time.perf_counter() - start
    engine.check_page_accounting()
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "hit_rate": cached / prompt_tokens,
        "prompt_tokens_computed": prompt_tokens - cached,
        "wall_s": wall,
        "output_tok_s": out / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.tenants < 1 or args.rounds < 1:
        parser.error("--tenants and --rounds must be at least 1")

    from radixserve import LLM, SamplingParams
    from radixserve.core.request import Tenant

    requests = [json.loads(x) for x in args.workload.read_text().splitlines() if x.strip()]
    llm = LLM(args.model) if args.model else LLM()
    engine = llm.engine
    prompts = [engine.tokenize(r["prompt"]) for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True)
        for r in requests
    ]
    tenants = [Tenant(f"tenant-{i % args.tenants}") for i in range(len(requests))]
    base = engine.config

    def run(scope: str) -> dict:
        engine.config = dataclasses.replace(base, prefix_cache_scope=scope)
        return run_once(engine, prompts, params, tenants)

    run("global")  # warm-up (kernels, allocator)
    results: dict[str, list[dict]] = {s: [] for s in SCOPES}
    for r in range(args.rounds):
        for scope in SCOPES if r % 2 == 0 else SCOPES[::-1]:
            res = run(scope)
            results[scope].append(res)
            print(
                f"  round {r + 1} {scope:<7} hit {res['hit_rate']:.3f}  computed "
                f"{res['prompt_tokens_computed']:>6}  wall {res['wall_s']:.2f} s  "
                f"{res['output_tok_s']:.1f} out tok/s"
            )
    engine.config = base

    summary = {
        scope: {
            key: statistics.median(x[key] for x in runs)
            for key in ("hit_rate", "prompt_tokens_computed", "wall_s", "output_tok_s")
        }
        for scope, runs in results.items()
    }
    n = len(requests)
    print(f"\n{args.workload.name}: {n} requests over {args.tenants} tenants, {args.rounds} rounds")
    print(f"{'scope':<8}{'hit rate':>10}{'computed':>10}{'wall s':>9}{'out tok/s':>11}")
    for scope, s in summary.items():
        print(
            f"{scope:<8}{s['hit_rate']:>10.3f}{s['prompt_tokens_computed']:>10.0f}"
            f"{s['wall_s']:>9.2f}{s['output_tok_s']:>11.1f}"
        )
    ratio = summary["tenant"]["output_tok_s"] / summary["global"]["output_tok_s"]
    print(f"throughput tenant / global: {ratio:.3f}")
    print(
        json.dumps(
            {
                "workload": args.workload.name,
                "requests": n,
                "tenants": args.tenants,
                "rounds": args.rounds,
                **{scope: {k: round(v, 4) for k, v in s.items()} for scope, s in summary.items()},
                "throughput_ratio": round(ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
