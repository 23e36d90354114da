"""Where a step's time goes: W1's 64 requests (SmolLM2-135M, bfloat16) under torch's profiler.

    python benchmarks/profile_step.py [--kind decode|prefill] [--steps 10] [--trace OUT.json]

Runs W1's prompts; times the first ``--steps`` steps of the chosen kind (decode: all 64
requests decoding; prefill: any step with prompt tokens) plainly, profiles the next one
under ``torch.profiler``, and prints the top operators by self CPU time and a split: dense
matmuls, other torch ops, and the time outside torch ops (the native C kernels, called
through ctypes, and Python). The timed steps also run with wall-clock timers around each
kind of work (matmuls, attention, KV writes, norms, rotary, SiLU; a few microseconds per
call), and the median step's split is printed: "rest" is Python, small torch ops and sampling.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def add_timer(
    owner: object, name: str, label: str, split: dict[str, float], timing: list[bool]
) -> None:
    """Wrap ``owner.name`` so that, while ``timing[0]`` is set, its calls' seconds add up
    in ``split[label]`` (also used by decode_step.py)."""
    inner = getattr(owner, name)

    def timed_call(*a, **k):
        if not timing[0]:
            return inner(*a, **k)
        start = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            split[label] += time.perf_counter() - start

    setattr(owner, name, timed_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "auto", "int8", "int4"],
        help="weights: none = bfloat16 as loaded (the default here: the shipped GGUF is Q4_1, which the engine's own default, auto, would run in int4)",
    )
    parser.add_argument("--kind", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--workload", default="w1_offline.jsonl", help="a file in ../shared/workloads (W1 default)"
    )
    args = parser.parse_args()

    from radixserve import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", quantization=args.quantization)
    engine = llm.engine
    path = WORKLOADS / args.workload
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][: args.batch]
    for i, line in enumerate(lines):
        params = SamplingParams(temperature=0, max_tokens=line["max_tokens"], ignore_eos=True)
        engine.add_request(f"p{i}", engine.tokenize(line["prompt"]), params)

    split: dict[str, float] = collections.defaultdict(float)
    splits: list[tuple[float, dict[str, float]]] = []
    timing = [False]

    def timer(owner, name: str, label: str) -> None:
        add_timer(owner, name, label, split, timing)

    import radixserve.executor.attention as attention
    from radixserve.executor.kv_cache import KVCache
    from radixserve.executor.layer_ops import LayerOps
    from radixserve.executor.linear import Linear

    timer(Linear, "__call__", "matmuls")
    timer(attention, "paged_decode", "attention (decode kernel)")
    timer(attention, "paged_prefill", "attention (prefill kernel)")
    timer(KVCache, "write", "KV write")
    timer(LayerOps, "add_rms_norm", "add + RMSNorm")
    timer(LayerOps, "rotary", "rotary")
    timer(LayerOps, "silu_and_mul", "SiLU-and-mul")

    runner = engine.runner
    execute = runner.run  # the device side of a step (the engine calls prepare, then run)
    decode_times: list[float] = []
    profiled: list[bool] = []

    def timed(step):
        batch = step.inputs.forward_batch
        is_decode = batch.num_tokens == batch.num_requests
        if is_decode != (args.kind == "decode") or (is_decode and batch.num_requests < args.batch):
            return execute(step)
        if len(decode_times) < args.steps:
            split.clear()
            timing[0] = True
            start = time.perf_counter()
            result = execute(step)
            decode_times.append(time.perf_counter() - start)
            timing[0] = False
            splits.append((decode_times[-1], dict(split)))
            if args.kind == "prefill":
                print(
                    f"prefill step: {batch.num_tokens} tokens, {batch.num_requests} requests, "
                    f"{1e3 * decode_times[-1]:.1f} ms"
                )
            return result
        if not profiled:
            profiled.append(True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                result = execute(step)
                wall = time.perf_counter() - start
            report(prof, wall, args)
            return result
        return execute(step)

    runner.run = timed
    while engine.has_unfinished():
        engine.step()
    decode_times.sort()
    if not decode_times:
        raise SystemExit(f"no {args.kind} step to time")
    splits.sort(key=lambda x: x[0])
    wall, parts = splits[len(splits) // 2]
    print(f"median {args.kind} step by kind of work (wall-clock timers), {1e3 * wall:.1f} ms:")
    for label, seconds in sorted(parts.items(), key=lambda x: -x[1]):
        print(f"  {label:<28} {1e3 * seconds:7.1f} ms  {100 * seconds / wall:5.1f} %")
    rest = wall - sum(parts.values())
    print(
        f"  {'rest (Python, sampling, ...)':<28} {1e3 * rest:7.1f} ms  {100 * rest / wall:5.1f} %"
    )
    print(
        "per-category medians over the timed steps: "
        + ", ".join(
            f"{label} {1e3 * statistics.median(p.get(label, 0.0) for _, p in splits):.1f}"
            for label in sorted(parts)
        )
    )
    print(
        f"{args.kind} step ({args.batch} requests): median {1e3 * decode_times[len(decode_times) // 2]:.1f} ms, "
        f"best {1e3 * decode_times[0]:.1f} ms over {len(decode_times)} steps"
    )


def report(prof, wall: float, args) -> None:
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    total_ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3
    print(f"profiled {args.kind} step: {1e3 * wall:.1f} ms wall (with profiler overhead)")
    print(f"{'op':<45} {'calls':>6} {'self ms':>9}")
    for e in rows[: args.top]:
        print(f"{e.key[:45]:<45} {e.count:>6} {e.self_cpu_time_total / 1e3:>9.2f}")
    matmul = sum(
        e.self_cpu_time_total
        for e in events
        if any(k in e.key for k in ("linear", "mm", "matmul", "mkldnn"))
    )
    print(
        f"matmuls {matmul / 1e3:.1f} ms | other torch ops {total_ops_ms - matmul / 1e3:.1f} ms | "
        f"outside torch ops (native kernels via ctypes, Python) {1e3 * wall - total_ops_ms:.1f} ms"
    )
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
