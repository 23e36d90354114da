"""Memory after loading: the process's resident set once the engine is up, and the weights.

    python benchmarks/load_memory.py                       # the default model, int4 (auto)
    python benchmarks/load_memory.py --quantization none   # bfloat16 dense layers

Each setting loads in a fresh process (``LLM(...)`` with a small KV cache, so the weights
and what loading leaves behind dominate), then reads its resident set from /proc.
Prints a table and, last, one JSON line (``rss_gib_<quantization>``,
``weights_gib_<quantization>``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import gc, json, sys
from radixserve import LLM
from radixserve.executor.quant import weight_memory
llm = LLM(quantization=sys.argv[1], kv_cache_memory_gb=float(sys.argv[2]))
gc.collect()
with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * 4096
weights = weight_memory(llm.engine.model)
print(json.dumps({"rss": rss, "weights": sum(weights.values()), "by_kind": weights}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="auto,none", help="comma-separated")
    parser.add_argument("--kv-cache-gb", type=float, default=0.1)
    args = parser.parse_args()
    out: dict[str, float] = {}
    print(f"{'quantization':>12} {'RSS GiB':>8} {'weights GiB':>12}  by kind (GiB)")
    for q in args.quantization.split(","):
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, q, str(args.kv_cache_gb)],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(run.stdout.strip().splitlines()[-1])
        kinds = ", ".join(f"{k} {v / 2**30:.3f}" for k, v in r["by_kind"].items())
        print(f"{q:>12} {r['rss'] / 2**30:>8.3f} {r['weights'] / 2**30:>12.3f}  {kinds}")
        out[f"rss_gib_{q}"] = round(r["rss"] / 2**30, 3)
        out[f"weights_gib_{q}"] = round(r["weights"] / 2**30, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
