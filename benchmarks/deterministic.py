"""Deterministic mode's price, and the int8 KV cache's measures, in one run.

    python benchmarks/deterministic.py                 # SmolLM2 (the default model)
    python benchmarks/deterministic.py --skip-kv       # without the int8 KV measures
    python benchmarks/deterministic.py --model PATH

Throughput with ``deterministic=False`` (the default) and ``deterministic=True``, the same
model loaded once per mode and workload, the two modes alternating (``--rounds`` rounds,
each ratio the median over rounds):

* **W1** offline: its 64 requests (256 prompt tokens, 64 output tokens, greedy,
  ``ignore_eos``) in one ``generate``, the engine's defaults;
* **W3**: its 128 requests (256 prompt tokens, 128 output tokens) in one ``generate``
  at most 16 running at once (``max_num_seqs`` 16: W3's concurrency, without HTTP).

Both print output tokens/s; ``throughput_ratio_w1`` and ``throughput_ratio_w3`` are
deterministic over default (target >= 0.85). Each mode's greedy outputs are also
checked: the deterministic W1 outputs must be the same in every round (they are a function
of the requests alone). The int8 KV cache's ``ppl_change_int8_kv`` and
``capacity_ratio_int8_kv`` come from ``benchmarks/kv_int8.py``'s measures (its defaults).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from radixserve import LLM, SamplingParams

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def _load(name: str) -> list[dict]:
    return [json.loads(x) for x in (WORKLOADS / name).read_text().splitlines() if x.strip()]


def _run(llm: LLM, requests: list[dict]) -> tuple[float, list[tuple[int, ...]]]:
    """Output tokens/s of one pass over ``requests``, and the outputs."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True)
        for r in requests
    ]
    prompts = [r["prompt"] for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [tuple(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-kv", action="store_true", help="skip the int8 KV cache measures")
    args = ap.parse_args()
    workloads = {
        "w1": (_load("w1_offline.jsonl"), {}),
        "w3": (_load("w3_online.jsonl"), {"max_num_seqs": 16}),
    }
    rates: dict[tuple[str, bool], list[float]] = {}
    outputs: dict[tuple[str, bool], list] = {}
    print(
        f"{'workload':>8} {'round':>5} {'default tok/s':>14} {'deterministic tok/s':>20} {'ratio':>6}"
    )
    for name, (requests, settings) in workloads.items():
        engines = {det: LLM(args.model, deterministic=det, **settings) for det in (False, True)}
        for llm in engines.values():  # warm-up: kernels built, buffers grown
            llm.generate(
                [requests[0]["prompt"]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
            )
        for r in range(args.rounds):
            row = {}
            for det in (False, True) if r % 2 == 0 else (True, False):
                rate, out = _run(engines[det], requests)
                rates.setdefault((name, det), []).append(rate)
                outputs.setdefault((name, det), []).append(out)
                row[det] = rate
            print(
                f"{name:>8} {r + 1:>5} {row[False]:>14.1f} {row[True]:>20.1f} "
                f"{row[True] / row[False]:>6.3f}"
            )
        del engines
    for name in workloads:
        runs = outputs[name, True]
        if any(run != runs[0] for run in runs[1:]):
            sys.exit(f"deterministic {name} outputs differed between rounds")
    result: dict[str, object] = {}
    for name in workloads:
        ratios = [d / b for d, b in zip(rates[name, True], rates[name, False], strict=True)]
        result[f"throughput_ratio_{name}"] = round(statistics.median(ratios), 3)
        result[f"output_tok_s_{name}_default"] = round(statistics.median(rates[name, False]), 1)
        result[f"output_tok_s_{name}_deterministic"] = round(
            statistics.median(rates[name, True]), 1
        )
    if not args.skip_kv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kv_int8 import measure  # a sibling script

        kv = measure(args.model)
        result["ppl_change_int8_kv"] = kv["ppl_change_int8_kv"]
        result["capacity_ratio_int8_kv"] = kv["capacity_ratio_int8_kv"]
        result["throughput_ratio_int8_kv"] = kv["throughput_ratio_int8_kv"]
    result["rounds"] = args.rounds
    print(json.dumps(result))


if __name__ == "__main__":
    main()
