"""How long a GGUF file takes to load: ``load_model`` (read, convert, build; ``auto``) in a
fresh process per run, for this checkout and, with ``--baseline PYTHONPATH``, for another
one (e.g. the main branch's checkout) in the same invocation, alternating runs.

    python benchmarks/gguf_load.py --gguf smollm2 --gguf gemma3=PATH [--runs 3] \\
        [--baseline OTHER_CHECKOUT]

Prints every run, then one JSON line: load_s_<label> (and load_s_baseline_<label>: the
median of the runs), speedup_<label> (baseline / this).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import sys, time, torch
from radixserve.executor.weights import load_model
from radixserve.engine.model_source import default_model_path
path = sys.argv[1] or str(default_model_path())
t = time.perf_counter()
loaded = load_model("gguf", __import__("pathlib").Path(path), device=torch.device("cpu"))
print(time.perf_counter() - t)
print(loaded.scheme.describe() if loaded.scheme else "dense")
"""

REPO = Path(__file__).resolve().parents[1]


def one_run(pythonpath: str, path: str) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run(  # run in that checkout: ``-c`` puts the working directory first
        [sys.executable, "-c", _CHILD, path],
        capture_output=True,
        text=True,
        env=env,
        cwd=pythonpath,
        check=True,
        timeout=900,
    )
    lines = out.stdout.strip().splitlines()
    return float(lines[-2]), lines[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", action="append", default=[], metavar="LABEL[=PATH]")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", help="PYTHONPATH of the checkout to compare with")
    args = ap.parse_args()
    result: dict[str, float] = {}
    for spec in args.gguf or ["smollm2"]:
        label, _, path = spec.partition("=")
        sides = {"this": str(REPO)}
        if args.baseline:
            sides["baseline"] = args.baseline
        times: dict[str, list[float]] = {side: [] for side in sides}
        for run in range(args.runs):
            for side, pythonpath in sides.items():
                seconds, scheme = one_run(pythonpath, path)
                times[side].append(seconds)
                print(f"{label} run {run} {side}: {seconds:.2f} s  ({scheme})", flush=True)
        result[f"load_s_{label}"] = round(statistics.median(times["this"]), 2)
        if args.baseline:
            base = statistics.median(times["baseline"])
            result[f"load_s_baseline_{label}"] = round(base, 2)
            result[f"speedup_{label}"] = round(base / result[f"load_s_{label}"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
