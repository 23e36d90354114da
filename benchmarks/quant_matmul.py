"""Quantized matmuls vs the bfloat16 Linear on CPU: SmolLM2-135M and Llama-3.2-1B shapes.

For each layer shape and row count, microseconds per call of:
  bf16        ``Linear`` (oneDNN-prepacked bfloat16)
  int8_torch  ``_weight_int8pack_mm`` at every row count (per-channel int8)
  int8        what the engine runs: that kernel below quant.DEQUANT_GEMM_ROWS_INT8 rows,
              from there the weight dequantized to bfloat16 (qlinear.c, a cache-sized
              chunk of rows at a time) and oneDNN's GEMM
  int4_torch  ``_weight_int4pack_mm_for_cpu`` at every row count (group 32, zero points)
  int4        what the engine runs (group 32), as int8 from quant.DEQUANT_GEMM_ROWS rows
  int4_g128   the same with group 128 (64 where 128 does not divide the input size)
  int4_panel  the panel kernel at every row count (group 32; where it is built), in AMX
              tiles from native.INT4_AMX_ROWS rows where the CPU has them
  int4_avx    the same with the tiles off (its AVX-512 path)
  int4_deq    its dequantize + GEMM path at every row count: where the panel kernel and
              it cross is quant.PANEL_DEQUANT_ROWS (quant.AMX_DEQUANT_ROWS with tiles)
Prints a table, then one JSON line with the speed-ups over bf16 by row count (geometric
mean over shapes).

    python benchmarks/quant_matmul.py [--rows 1,8,64,512] [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from radixserve.executor import quant
from radixserve.executor.linear import Linear
from radixserve.executor.native import load_int4_panels
from radixserve.executor.quant import Int4Linear, Int8Linear

SHAPES = {  # name: (out N, in K)
    "135m.qkv": (960, 576),
    "135m.o": (576, 576),
    "135m.gate_up": (3072, 576),
    "135m.down": (576, 1536),
    "1b.qkv": (3072, 2048),
    "1b.o": (2048, 2048),
    "1b.gate_up": (16384, 2048),
    "1b.down": (2048, 8192),
}


def bench(fn, x: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        fn(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64,128,512")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    kinds = (
        "bf16",
        "int8_torch",
        "int8",
        "int4_torch",
        "int4",
        "int4_g128",
        "int4_panel",
        "int4_avx",
        "int4_deq",
    )
    ratios: dict[str, dict[int, list[float]]] = {k: {m: [] for m in rows} for k in kinds[1:]}
    print(f"threads {torch.get_num_threads()}; microseconds per call")
    print(f"{'shape':<14}{'rows':>6}" + "".join(f"{k:>12}" for k in kinds))
    engine8, engine4 = quant.DEQUANT_GEMM_ROWS_INT8, quant.DEQUANT_GEMM_ROWS
    panel_cut, amx_cut = quant.PANEL_DEQUANT_ROWS, quant.AMX_DEQUANT_ROWS
    lib = load_int4_panels()
    tiles = lib.int4_panels_amx_rows() if lib is not None else 0
    print(f"AMX tiles from {tiles} rows" if tiles else "no AMX tiles")

    def set_tiles(rows: int) -> None:
        if lib is not None:
            lib.int4_panels_set_amx_rows(rows)

    never = 1 << 30  # rows threshold: never dequantize + GEMM
    print(f"quant.PANEL_DEQUANT_ROWS = {panel_cut}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        g128 = quant.int4_group_size(k, 128)
        int4 = Int4Linear.from_float(w, group_size=32)
        layers = {  # kind: (layer, DEQUANT_GEMM_ROWS(_INT8), PANEL_DEQUANT_ROWS)
            "bf16": (Linear(w), never, panel_cut),
            "int8_torch": (Int8Linear.from_float(w), never, panel_cut),
            "int8": (Int8Linear.from_float(w), engine8, panel_cut),
            "int4_torch": (
                Int4Linear.from_float(w, group_size=32, panels=False),
                never,
                panel_cut,
            ),
            "int4": (int4, engine4, panel_cut),
            "int4_g128": (Int4Linear.from_float(w, group_size=g128), engine4, panel_cut),
            "int4_panel": (int4, engine4, never),
            "int4_avx": (int4, engine4, never),
            "int4_deq": (int4, engine4, 0),
        }
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            iters = max(3, args.iters * 8 // max(8, m))
            t = {}
            for kind, (layer, threshold, panel_rows) in layers.items():
                quant.DEQUANT_GEMM_ROWS = quant.DEQUANT_GEMM_ROWS_INT8 = threshold
                quant.PANEL_DEQUANT_ROWS = panel_rows
                quant.AMX_DEQUANT_ROWS = amx_cut if panel_rows == panel_cut else panel_rows
                set_tiles(0 if kind == "int4_avx" else tiles)
                t[kind] = bench(layer, x, iters)
            quant.PANEL_DEQUANT_ROWS, quant.AMX_DEQUANT_ROWS = panel_cut, amx_cut
            set_tiles(tiles)
            print(f"{name:<14}{m:>6}" + "".join(f"{t[kd] * 1e6:>12.1f}" for kd in kinds))
            for kd in kinds[1:]:
                ratios[kd][m].append(t["bf16"] / t[kd])
    summary = {
        f"speedup_{kd}_rows{m}": round(math.exp(sum(map(math.log, v)) / len(v)), 3)
        for kd, by_rows in ratios.items()
        for m, v in by_rows.items()
    }
    print("speed-up over bf16 (geometric mean over shapes):")
    for key, value in summary.items():
        print(f"  {key:<28}{value:>8.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
