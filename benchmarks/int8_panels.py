"""The group-wise int8 panel GEMM (GGUF's Q8_0, Q6_K, Q5_0 tensors from their codes) on
Gemma 3 270M's shapes, by row count: its two inner loops against each other and against
the two ways the engine leaves it for more rows.

For each shape and row count, milliseconds per call (median of --repeats rounds, the
kinds alternating within a round) of:
  fma      the panel kernel with float32 multiply-adds (codes widened to float32)
  pairs    the panel kernel with bfloat16 pairs of codes through vdpbf16ps
           (int8_panels.c: dp_rows; native.int8_pair_rows() chooses it by CPU)
  copy     a bfloat16 copy of the weight through oneDNN (the prefill copy's GEMM)
  dequant  dequantize a chunk of outputs to bfloat16, then oneDNN (no copy held)
and the largest error of each panel loop against float64, relative to the row's largest
output. Prints a table, then one JSON line: per kind and row count the geometric mean over
shapes of its time over fma's (pairs_over_fma_rows16 < 1: pairs faster).

    python benchmarks/int8_panels.py [--rows 1,2,4,8,16,32,64,128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from radixserve.executor import quant
from radixserve.executor.native import load_int8_panels

SHAPES = {  # name: (out N, in K, group)
    "lm_head.q8_0": (262144, 640, 32),
    "gate_up.q5_0": (2048, 640, 32),
    "down.q5_0": (640, 2048, 32),
    "qkv.q5_0": (1536, 640, 32),
    "q6_k": (1024, 640, 16),
}
KINDS = ("fma", "pairs", "copy", "dequant")


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(
    lib,
    layer: quant.Int8GroupLinear,
    dense: torch.Tensor,
    copy: torch.Tensor,
    x: torch.Tensor,
    repeats: int,
    calls: int,
) -> tuple[dict[str, float], list[float]]:
    """Median seconds per call of each kind (alternating within a round) and each panel
    loop's largest error against float64, relative to its row's largest output."""

    def panel(pair_rows: int) -> torch.Tensor:
        lib.int8_panels_set_dp_rows(pair_rows)
        return layer._panel_gemm(lib, x)

    fns = {
        "fma": lambda: panel(0),
        "pairs": lambda: panel(1),
        "copy": lambda: F.linear(x, copy),
        "dequant": lambda: layer._panel_dequant_gemm(lib, x),
    }
    ref = x.double() @ dense.double().T
    scale = ref.abs().amax(dim=1, keepdim=True)
    errs = [((panel(p).double() - ref).abs() / scale).max().item() for p in (0, 1)]
    times: dict[str, list[float]] = {kd: [] for kd in KINDS}
    for _ in range(repeats):
        for kd in KINDS:
            times[kd].append(timed(fns[kd], calls))
    return {kd: statistics.median(v) for kd, v in times.items()}, errs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    lib = load_int8_panels()
    if lib is None:
        raise SystemExit("the int8 panel kernel is not built here (needs AVX-512 BF16)")
    default_pairs, amx = lib.int8_panels_dp_rows(), lib.int8_panels_amx_rows()
    lib.int8_panels_set_amx_rows(0)
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"threads {torch.get_num_threads()}; pair products by default from {default_pairs} rows "
        f"(0: never); ms per call, median of {args.repeats}"
    )
    print(
        f"{'shape':<14}{'rows':>5}" + "".join(f"{k:>10}" for k in KINDS) + "   err fma  err pairs"
    )
    ratios: dict[str, dict[int, list[float]]] = {k: {m: [] for m in rows} for k in KINDS[1:]}
    torch.manual_seed(0)
    try:
        for name in args.shapes.split(","):
            n, k, group = SHAPES[name]
            q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
            layer = quant.Int8GroupLinear(q, torch.rand(n, k // group) * 0.01, None, group)
            dense = layer.dequantized()
            copy = dense.to(torch.bfloat16)
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                calls = 3 if n > 100_000 else max(5, 200 // max(8, m))
                t, errs = measure(lib, layer, dense, copy, x, args.repeats, calls)
                print(
                    f"{name:<14}{m:>5}"
                    + "".join(f"{t[kd] * 1e3:>10.3f}" for kd in KINDS)
                    + f"{errs[0]:>10.1e}{errs[1]:>11.1e}"
                )
                for kd in KINDS[1:]:
                    ratios[kd][m].append(t[kd] / t["fma"])
    finally:
        lib.int8_panels_set_dp_rows(default_pairs)
        lib.int8_panels_set_amx_rows(amx)
    summary = {
        f"{kd}_over_fma_rows{m}": round(math.exp(sum(map(math.log, v)) / len(v)), 3)
        for kd, by_rows in ratios.items()
        for m, v in by_rows.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
