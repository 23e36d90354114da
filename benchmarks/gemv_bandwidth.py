"""How close the quantized decode GEMVs (one row) come to the memory bandwidth, on
matrices far larger than the caches: bytes each kernel reads per call over its time,
against a plain read of as many bytes (``torch.sum`` over them as float32, the same
threads; an int32 sum, the first version, ran at under 1 GB/s: no reference).

    python benchmarks/gemv_bandwidth.py [--n 16384] [--k 4096] [--reps 20] [--threads N]

Then what a decode step does: one row through 30 SmolLM2-shaped layers of int4 g32
(q/k/v fused, o, gate/up fused, down: 66 MB, each matrix 0.3-1.8 MB) and its int8 g32 LM
head, every matrix distinct, so each call streams its weights from the last-level cache or
memory rather than the core's own L2 (a single big matrix, or one layer timed in a loop,
hides the ramp-up of the hardware prefetchers at the start of every small matrix).

Prints two tables; last line JSON: read_gbs, per kernel gbs_<kernel> and
fraction_<kernel> (of read_gbs), and pass_ms / pass_gbs for the 30-layer pass (best of
``--reps``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from radixserve.executor.quant import Int4Linear, Int8GroupLinear

    n, k = args.n, args.k
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s = torch.rand(n, k // 32, generator=gen) * 0.01
    int4 = Int4Linear(q4, s, s, 32)
    q8 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    int8_g32 = Int8GroupLinear(q8, s, None, 32)
    int8_g16 = Int8GroupLinear(q8, torch.rand(n, k // 16, generator=gen) * 0.01, None, 16)
    del q4, q8
    layers = {"int4_g32": int4, "int8_g32": int8_g32, "int8_g16": int8_g16}
    big = torch.rand(n * k // 4, generator=gen)  # float32: the sum vectorises
    read_s = best_time(lambda: big.sum(), args.reps)
    read_gbs = big.nbytes / read_s / 1e9
    result: dict[str, float] = {"read_gbs": round(read_gbs, 2)}
    print(f"threads {torch.get_num_threads()}, matrix {n} x {k}")
    print(f"{'kernel':<10}{'MB read':>10}{'ms':>10}{'GB/s':>10}{'of read':>10}")
    print(f"{'read':<10}{big.nbytes / 1e6:>10.1f}{read_s * 1e3:>10.2f}{read_gbs:>10.2f}{1:>10.2f}")
    for name, layer in layers.items():
        seconds = best_time(lambda layer=layer: layer(x), args.reps)
        gbs = layer.nbytes / seconds / 1e9
        result[f"gbs_{name}"] = round(gbs, 2)
        result[f"fraction_{name}"] = round(gbs / read_gbs, 3)
        print(
            f"{name:<10}{layer.nbytes / 1e6:>10.1f}{seconds * 1e3:>10.2f}{gbs:>10.2f}"
            f"{gbs / read_gbs:>10.2f}"
        )
    result.update(model_pass(args.reps))
    print(json.dumps(result))


def model_pass(reps: int) -> dict[str, float]:
    """One decode row through 30 SmolLM2-shaped int4 layers and an int8 LM head."""
    from radixserve.executor.quant import Int4Linear, Int8GroupLinear

    gen = torch.Generator().manual_seed(1)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    layers = []
    for _ in range(30):
        for n, k in shapes:
            q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
            s = torch.rand(n, k // 32, generator=gen) * 0.01
            layers.append((Int4Linear(q, s, s, 32), torch.randn(1, k, generator=gen).bfloat16()))
    head_q = torch.randint(-128, 128, (49152, 576), generator=gen, dtype=torch.int8)
    head = Int8GroupLinear(head_q, torch.rand(49152, 18, generator=gen) * 0.01, None, 32)
    del head_q
    x_head = torch.randn(1, 576, generator=gen).bfloat16()
    int4_bytes = sum(layer.nbytes for layer, _ in layers)

    def one_pass() -> None:
        for layer, x in layers:
            layer(x)
        head(x_head)

    seconds = best_time(one_pass, reps)
    gbs = (int4_bytes + head.nbytes) / seconds / 1e9
    print(f"\n30 SmolLM2-shaped int4 layers ({int4_bytes / 1e6:.1f} MB) + int8 LM head ", end="")
    print(f"({head.nbytes / 1e6:.1f} MB), one row: {seconds * 1e3:.2f} ms, {gbs:.2f} GB/s")
    return {"pass_ms": round(seconds * 1e3, 3), "pass_gbs": round(gbs, 2)}


if __name__ == "__main__":
    main()
