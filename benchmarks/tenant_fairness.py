"""Two tenants on the simulated device: one floods long prompts, one sends short ones now
and then. The light tenant's TTFT with the flood present, under ``fair`` and ``fcfs``,
against the light tenant alone; the real scheduler, radix cache and page pool on a
virtual clock (``tools/simulator.py``), so the figures are deterministic and need no model.

    python benchmarks/tenant_fairness.py            # ~20 s
    python benchmarks/tenant_fairness.py --duration 120

Prints a table and, last, one JSON line with light_tenant_ttft_p99_ratio (light tenant's
p99 TTFT with the flooder present / alone, policy fair), the same with fcfs
(light_tenant_ttft_p99_ratio_fcfs), the light tenant's p99 TTFT counted in steps (the
steps that ended between a request's arrival and its first token, the one running at its
arrival included) under each, heavy_share_fair (the heavy tenant's share of the output
tokens under fair) and fair_preemptions (heavy requests preempted for a light one).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from radixserve.core.request import Tenant
from radixserve.executor.simulated import CostModel
from radixserve.scheduler.scheduler import SchedulerConfig
from radixserve.tools.simulator import Simulator, TraceRequest


def trace(args: argparse.Namespace, flood: bool) -> list[TraceRequest]:
    heavy, light = Tenant("heavy", max_running=args.heavy_cap), Tenant("light")
    rng = np.random.default_rng(args.seed)
    out: list[TraceRequest] = []
    if flood:
        t = 0.0
        while t < args.duration:
            prompt = rng.integers(0, 32000, args.heavy_prompt, dtype=np.int32)
            out.append(TraceRequest(t, prompt, args.heavy_output, tenant=heavy))
            t += rng.exponential(1.0 / args.heavy_rate)
    t = 0.5
    while t < args.duration:
        prompt = rng.integers(0, 32000, args.light_prompt, dtype=np.int32)
        out.append(TraceRequest(t, prompt, args.light_output, tenant=light))
        t += rng.exponential(1.0 / args.light_rate)
    return out


def simulate(args: argparse.Namespace, policy: str, flood: bool, cap: int | None = None) -> dict:
    config = SchedulerConfig(
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.max_seqs,
        long_prefill_threshold=args.chunk,
        policy=policy,
        fair_prefill_yield_tokens=args.fair_yield,
        fair_step_prefill_tokens=cap,
    )
    sim = Simulator(config, num_pages=args.pages, page_size=16, cost=CostModel())
    outputs: dict[str, int] = {"heavy": 0, "light": 0}
    ends: list[float] = []  # when each step ended
    light_first: dict[str, tuple[float, float]] = {}  # request -> (arrival, first token)

    def on_step(_batch, received):
        now = sim.clock.now
        ends.append(now)
        for req in received:
            outputs[req.tenant.name] += 1
            if req.tenant.name == "light" and req.request_id not in light_first:
                light_first[req.request_id] = (req.arrival_time, now)

    result = sim.run(trace(args, flood), on_step=on_step)
    sim.check_pages()
    light = result.ttft_by_tenant["light"]
    heavy = result.ttft_by_tenant.get("heavy", [])
    total = sum(outputs.values())
    end = np.asarray(ends)
    # steps that ended after a light request arrived, up to the one giving its first token:
    # the scheduler's part of its TTFT (the step running when it arrives counts as one)
    steps = [int(np.count_nonzero((end > a) & (end <= f))) for a, f in light_first.values()]
    # the light requests that arrived once the engine had seen the tenant (after its first
    # first token): a tenant's very first request waits for whatever step is running
    seen = min(f for _, f in light_first.values())
    later = [f - a for a, f in light_first.values() if a > seen]
    return {
        "policy": policy if cap is None or policy != "fair" else f"fair/{cap}",
        "light_ttft_p99_seen_s": float(np.percentile(later, 99)),
        "heavy_tok_s": outputs["heavy"] / end[-1],
        "flood": flood,
        "light_requests": len(light),
        "light_ttft_p50_s": float(np.percentile(light, 50)),
        "light_ttft_p99_s": float(np.percentile(light, 99)),
        "light_ttft_p99_steps": float(np.percentile(steps, 99)),
        "step_p50_s": float(np.percentile(np.diff(end, prepend=0.0), 50)),
        "heavy_ttft_p50_s": float(np.percentile(heavy, 50)) if heavy else None,
        "heavy_share": outputs["heavy"] / total if total else 0.0,
        "preemptions": result.preemptions,
        "fair_preemptions": sim.scheduler.stats.num_fair_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--heavy-rate", type=float, default=8.0, help="requests/s")
    parser.add_argument("--heavy-prompt", type=int, default=1024)
    parser.add_argument("--heavy-output", type=int, default=64)
    parser.add_argument(
        "--heavy-cap", type=int, default=None, help="the heavy tenant's max_concurrency"
    )
    parser.add_argument("--light-rate", type=float, default=0.5, help="requests/s")
    parser.add_argument("--light-prompt", type=int, default=128)
    parser.add_argument("--light-output", type=int, default=32)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--pages", type=int, default=2048, help="16-token KV pages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fair-step-prefill-tokens",
        type=int,
        default=256,
        help="fair: prompt tokens per step while more than one tenant is active (0: no cap; "
        "the table also shows fair without the cap)",
    )
    parser.add_argument(
        "--fair-yield",
        type=int,
        default=0,
        help="fair: prefill tokens a more-served tenant keeps in a step admitting another's",
    )
    args = parser.parse_args()

    cap = args.fair_step_prefill_tokens or None
    alone = simulate(args, "fcfs", flood=False)
    rows = [alone, simulate(args, "fair", flood=True, cap=cap)]
    rows.append(simulate(args, "fair", flood=True) if cap is not None else rows[1])
    rows.append(simulate(args, "fcfs", flood=True))
    print(f"{'policy':9} {'flood':6} {'light p50 s':>12} {'light p99 s':>12} {'p99 seen s':>11} "
          f"{'p99 steps':>10} {'step p50 s':>11} {'heavy p50 s':>12} {'heavy tok/s':>12} "
          f"{'heavy share':>12} {'preempt':>8}")  # fmt: skip
    for r in rows[:2] + rows[2 if cap is not None else 3 :]:
        heavy = "-" if r["heavy_ttft_p50_s"] is None else f"{r['heavy_ttft_p50_s']:.3f}"
        print(
            f"{r['policy']:9} {r['flood']!s:6} {r['light_ttft_p50_s']:12.3f} "
            f"{r['light_ttft_p99_s']:12.3f} {r['light_ttft_p99_seen_s']:11.3f} "
            f"{r['light_ttft_p99_steps']:10.1f} {r['step_p50_s']:11.3f} {heavy:>12} "
            f"{r['heavy_tok_s']:12.1f} {r['heavy_share']:12.3f} {r['preemptions']:8d}"
        )
    rows = [rows[0], rows[1], rows[3]]  # alone, fair (as configured), fcfs
    base = alone["light_ttft_p99_s"]
    print(
        json.dumps(
            {
                "light_tenant_ttft_p99_ratio": round(rows[1]["light_ttft_p99_s"] / base, 3),
                "light_tenant_ttft_p99_ratio_fcfs": round(rows[2]["light_ttft_p99_s"] / base, 3),
                "light_tenant_ttft_p99_ratio_seen": round(
                    rows[1]["light_ttft_p99_seen_s"] / alone["light_ttft_p99_seen_s"], 3
                ),
                "heavy_tok_s_fair_over_fcfs": round(
                    rows[1]["heavy_tok_s"] / rows[2]["heavy_tok_s"], 3
                ),
                "light_ttft_p99_steps_fair": round(rows[1]["light_ttft_p99_steps"], 1),
                "light_ttft_p99_steps_fcfs": round(rows[2]["light_ttft_p99_steps"], 1),
                "heavy_share_fair": round(rows[1]["heavy_share"], 3),
                "fair_preemptions": rows[1]["fair_preemptions"],
            }
        )
    )


if __name__ == "__main__":
    main()
