"""Overlap scheduling: the serial loop vs the overlapped one on the timed simulated device.

    python benchmarks/overlap.py            # ~1 minute
    python benchmarks/overlap.py --quick

The simulated device takes the cost model's time for real and releases the CPU meanwhile
(like a GPU queue), so what the engine's host side costs per step shows up as device idle
time in the serial loop and is hidden in the overlapped one. Two workloads, each run serial
then overlapped in this process:

* decode-heavy: 256 requests decoding (512-token prompts, 32 shared 256-token prefixes),
  1,000 more waiting behind them, policy lpm; timed over a fixed number of decode steps;
* mixed: requests of 64-1,024 prompt tokens (some sharing prefixes) and 16-256 output tokens,
  all submitted at once and run to completion: prefill chunks and decodes share steps.

The engine runs as in the server's engine process: token ids out (the frontend detokenizes),
and each step's outputs are encoded into the message that process sends (msgspec). Prints
a table (step time, device-idle fraction = time the device had nothing queued / wall, output
tokens/s) and, last, one JSON line with serial_device_idle_frac, overlap_device_idle_frac
and speedup (decode-heavy; mixed_* for the mixed workload).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.serving import protocol as p
from radixserve.serving.engine_process import wire_delta

VOCAB = 30000


def make_engine(args: argparse.Namespace, overlap: bool, policy: str) -> Engine:
    return Engine(
        EngineConfig(
            simulated_device_time=True,
            simulated_device_cost=tuple(args.cost),
            enable_overlap=overlap,
            schedule_policy=policy,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            page_size=16,
        ),
        detokenize=False,  # as behind the server: the frontend detokenizes
    )


def step_and_send(engine: Engine, deltas: list | None = None) -> int:
    """One iteration of the engine process's loop (without the socket): a step, and its
    outputs encoded into one message. Returns the number of output tokens."""
    if deltas is None:
        deltas = engine.step()
    if deltas:
        p.encoder.encode(p.Outputs([wire_delta(d) for d in deltas], None))
    return sum(len(d.token_ids) for d in deltas)


def timed_steps(engine: Engine, num_steps: int) -> dict[str, float]:
    """Run ``num_steps`` engine steps from an empty device queue to an empty one."""
    engine.drain()
    engine.device.reset_stats()
    tokens = 0
    start = time.monotonic()
    for _ in range(num_steps):
        tokens += step_and_send(engine)
    tokens += step_and_send(engine, engine.drain())
    wall = time.monotonic() - start
    return summarize(engine, wall, tokens, engine.device.num_launched)


def summarize(engine: Engine, wall: float, tokens: int, steps: int) -> dict[str, float]:
    busy = engine.device.busy_s
    return {
        "steps": steps,
        "wall_s": wall,
        "step_ms": 1e3 * wall / max(1, steps),
        "device_step_ms": 1e3 * busy / max(1, steps),
        "device_idle_frac": max(0.0, wall - busy) / wall,
        "output_tok_s": tokens / wall,
    }


def decode_heavy(args: argparse.Namespace, overlap: bool) -> dict[str, float]:
    rng = np.random.default_rng(0)
    engine = make_engine(args, overlap, "lpm")
    groups = [rng.integers(0, VOCAB, 256).tolist() for _ in range(32)]

    def prompt(i: int) -> list[int]:
        return groups[i % 32] + rng.integers(0, VOCAB, 256).tolist()

    long_run = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(256):
        engine.add_request(f"run-{i}", prompt(i), long_run)
    while len(engine.scheduler.waiting) or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):  # prefill all 256 (untimed)
        engine.step()
    for i in range(1000):
        engine.add_request(f"wait-{i}", prompt(i), SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(5):  # warm up the decode steps
        engine.step()
    result = timed_steps(engine, args.steps)
    assert len(engine.scheduler.running) == 256 and len(engine.scheduler.waiting) == 1000
    engine.close()
    return result


def mixed(args: argparse.Namespace, overlap: bool) -> dict[str, float]:
    rng = np.random.default_rng(1)
    engine = make_engine(args, overlap, "lpm")
    prefixes = [rng.integers(0, VOCAB, 512).tolist() for _ in range(8)]
    for i in range(args.mixed_requests):
        total = int(rng.integers(64, 1025))
        head = prefixes[i % 8][: int(rng.integers(0, min(total, 512)))] if i % 2 else []
        ids = head + rng.integers(0, VOCAB, total - len(head)).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(16, 257)), ignore_eos=True)
        engine.add_request(f"m-{i}", ids, params)
    engine.device.reset_stats()
    tokens = 0
    start = time.monotonic()
    while engine.has_unfinished():
        tokens += step_and_send(engine)
    wall = time.monotonic() - start
    engine.check_idle()
    result = summarize(engine, wall, tokens, engine.device.num_launched)
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=300, help="decode-heavy: timed steps")
    parser.add_argument("--mixed-requests", type=int, default=600)
    parser.add_argument(
        "--cost",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.006, 1e-5, 1e-8],
        help="a,b,c: device seconds per step, per batched token, per KV token read",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.mixed_requests = 60, 150

    rows = []
    for name, run in (("decode-heavy", decode_heavy), ("mixed", mixed)):
        for mode, overlap in (("serial", False), ("overlap", True)):
            rows.append((name, mode, run(args, overlap)))
            r = rows[-1][2]
            print(f"  {name} {mode}: {r['steps']} steps, {r['wall_s']:.2f} s", flush=True)
    print(
        f"\n{'workload':>13} {'loop':>8} {'steps':>6} {'step ms':>8} {'device ms':>10} "
        f"{'device idle':>12} {'out tok/s':>10}"
    )
    for name, mode, r in rows:
        print(
            f"{name:>13} {mode:>8} {r['steps']:>6} {r['step_ms']:>8.2f} "
            f"{r['device_step_ms']:>10.2f} {r['device_idle_frac']:>12.3f} {r['output_tok_s']:>10.0f}"
        )
    by = {(name, mode): r for name, mode, r in rows}
    ds, do = by[("decode-heavy", "serial")], by[("decode-heavy", "overlap")]
    ms, mo = by[("mixed", "serial")], by[("mixed", "overlap")]
    summary = {
        "serial_device_idle_frac": ds["device_idle_frac"],
        "overlap_device_idle_frac": do["device_idle_frac"],
        "speedup": do["output_tok_s"] / ds["output_tok_s"],
        "serial_step_ms": ds["step_ms"],
        "overlap_step_ms": do["step_ms"],
        "mixed_serial_device_idle_frac": ms["device_idle_frac"],
        "mixed_overlap_device_idle_frac": mo["device_idle_frac"],
        "mixed_speedup": mo["output_tok_s"] / ms["output_tok_s"],
    }
    print(
        f"\nspeedup (decode-heavy): {summary['speedup']:.2f}x; mixed: {summary['mixed_speedup']:.2f}x"
    )
    print(json.dumps({k: round(v, 4) for k, v in summary.items()}))


if __name__ == "__main__":
    main()
