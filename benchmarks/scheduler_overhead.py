"""Scheduler CPU overhead per step, and scheduling policies compared on a simulated device.

    python benchmarks/scheduler_overhead.py           # ~2 minutes
    python benchmarks/scheduler_overhead.py --quick

Prints tables and, last, one JSON line with step_median_ms_256, step_p99_ms_256,
us_per_running_request_4096, hit_rate_fcfs, hit_rate_lpm, hit_rate_dfs_weight.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from radixserve.core.page_pool import PagePool
from radixserve.core.page_table import PageTable
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Request
from radixserve.core.sampling_params import SamplingParams
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.simulated import CostModel, SimulatedRunner, VirtualClock
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.tools.simulator import Simulator, shared_prefix_trace


def step_overhead(num_running: int, num_waiting: int, steps: int, policy: str) -> np.ndarray:
    """Seconds of schedule() + ForwardBatch.build per step with ``num_running`` requests
    decoding and ``num_waiting`` queued behind them (the batch is full: none is admitted)."""
    rng = np.random.default_rng(0)
    page_size = 16
    prompt_len = 512
    pool = PagePool((num_running + 8) * (prompt_len + steps + 64) // page_size, page_size)
    table = PageTable(num_running, (prompt_len + steps + 64) // page_size + 1)
    kv = KVManager(pool, table, RadixCache(pool))
    clock = VirtualClock()
    sched = Scheduler(
        SchedulerConfig(
            # one step prefills everybody (untimed); the timed steps are decode-only
            max_num_batched_tokens=num_running * prompt_len,
            max_num_seqs=num_running,
            policy=policy,
        ),
        kv,
        clock=clock,
    )
    runner = SimulatedRunner(CostModel(0.0, 0.0, 0.0), clock=clock)
    groups = [rng.integers(0, 30000, 256, dtype=np.int32) for _ in range(32)]

    def prompt(i: int) -> np.ndarray:
        return np.concatenate([groups[i % 32], rng.integers(0, 30000, 256, dtype=np.int32)])

    for i in range(num_running):
        sched.add_request(Request(f"run-{i}", prompt(i), SamplingParams(max_tokens=steps + 8)))
    while sched.waiting:  # prefill everyone (untimed)
        batch = sched.schedule()
        sched.update_after_step(batch, runner.execute(batch).tokens)
    for i in range(num_waiting):
        sched.add_request(Request(f"wait-{i}", prompt(i), SamplingParams(max_tokens=16)))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        batch = sched.schedule()
        ForwardBatch.build(batch, table, page_size)
        times.append(time.perf_counter() - t)
        sched.update_after_step(batch, runner.execute(batch).tokens)
        assert len(batch.requests) == num_running
    return np.asarray(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 50 if args.quick else 300
    summary: dict[str, float] = {}

    print(
        f"{'running':>8} {'waiting':>8} {'policy':>10} {'median ms':>10} {'p99 ms':>8} {'us/req':>8}"
    )
    for running, waiting, policy in ((256, 1000, "lpm"), (256, 1000, "fcfs"), (4096, 0, "lpm")):
        t = step_overhead(running, waiting, steps if running < 1000 else steps // 3, policy)
        med, p99 = 1e3 * float(np.median(t)), 1e3 * float(np.percentile(t, 99))
        per_req = 1e3 * med / running
        print(f"{running:>8} {waiting:>8} {policy:>10} {med:>10.3f} {p99:>8.3f} {per_req:>8.2f}")
        if running == 256 and policy == "lpm":
            summary["step_median_ms_256"] = med
            summary["step_p99_ms_256"] = p99
            summary["us_per_running_request_256"] = per_req
        if running == 4096:
            summary["us_per_running_request_4096"] = per_req

    groups, per_group = (16, 8) if args.quick else (64, 16)
    print(
        f"\npolicies on a shared-prefix trace: {groups} groups x {per_group} requests, "
        "1024-token prefixes, 128-token questions, 256 output tokens, Poisson arrivals"
    )
    print(f"{'policy':>10} {'hit rate':>9} {'out tok/s':>10} {'TTFT p50 s':>11} {'preempt':>8}")
    for policy in ("fcfs", "lpm", "dfs-weight"):
        trace = shared_prefix_trace(groups, per_group, request_rate=8.0)
        sim = Simulator(
            SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, policy=policy),
            num_pages=4096,  # 65k tokens: the cache cannot hold every prefix at once
            page_size=16,
        )
        s = sim.run(trace).summary()
        print(
            f"{policy:>10} {s['hit_rate']:>9.3f} {s['output_tok_s']:>10.1f} "
            f"{s['ttft_p50_s']:>11.2f} {s['preemptions']:>8}"
        )
        key = policy.replace("-", "_")
        summary[f"hit_rate_{key}"] = s["hit_rate"]
        summary[f"sim_output_tok_s_{key}"] = s["output_tok_s"]
    print(json.dumps({k: round(v, 4) for k, v in summary.items()}))


if __name__ == "__main__":
    main()
