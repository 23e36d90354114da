"""One mixture-of-experts MLP against the dense MLP of its active size, on CPU, int4 g32.

The MoE layer is ``SparseMoE`` (executor/layers/moe.py) at a published model's shape with
random weights quantized to int4 (the panels the GGUF Q4_K experts run in); the dense one
is a SwiGLU MLP whose intermediate size is ``top_k`` times the expert's (the same weights a
token reads). At batch 1 both read the same bytes, so their ratio is the cost of routing
(the router GEMM, top-k, one GEMM pair per chosen expert instead of one fused pair); at
larger batches the MoE layer reads more experts (each once) and the ratio grows toward
``num_experts / top_k`` where every expert is chosen.

Prints a table of microseconds per call by row count, then one JSON line with
``moe_over_dense`` by rows (both in the same invocation) and the MoE layer's weight
bandwidth at batch 1 (bytes of the chosen experts over the call's time).

    python benchmarks/moe_layer.py [--shape olmoe-1b-7b|qwen3-30b-a3b] [--rows 1,4,16,64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.layers.moe import ExpertMLP, SparseMoE
from radixserve.executor.model_config import MoEConfig
from radixserve.executor.quant import Int4Linear
from radixserve.executor.routed_experts import routed_experts_for

# (hidden, experts, expert intermediate, top_k): the published config.json of each model
SHAPES = {
    "olmoe-1b-7b": (2048, 64, 1024, 8),  # allenai/OLMoE-1B-7B-0924
    "qwen3-30b-a3b": (2048, 128, 768, 8),  # Qwen/Qwen3-30B-A3B
}


def _int4(rows: int, cols: int, gen: torch.Generator) -> Int4Linear:
    w = torch.randn(rows, cols, generator=gen) * 0.02
    return Int4Linear.from_float(w, None, 32, False)


def _time(fn, x: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        fn(x)
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="olmoe-1b-7b")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    hidden, experts, inter, top_k = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    ops = LayerOps()
    config = MoEConfig(experts, top_k, inter, True, (True,))
    parts = [
        ExpertMLP(_int4(2 * inter, hidden, gen), _int4(hidden, inter, gen)) for _ in range(experts)
    ]
    router = (torch.randn(experts, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    moe = SparseMoE(config, router, parts, ops.silu_and_mul)
    dense = ExpertMLP(_int4(2 * inter * top_k, hidden, gen), _int4(hidden, inter * top_k, gen))

    def dense_mlp(x: torch.Tensor) -> torch.Tensor:
        return dense.down(ops.silu_and_mul(dense.gate_up(x)))

    expert_bytes = parts[0].gate_up.nbytes + parts[0].down.nbytes
    print(f"{args.shape}: {experts} experts of {inter}, top {top_k}, hidden {hidden}, int4 g32")
    print(
        f"{'rows':>5} {'moe_us':>10} {'native_us':>10} {'dense_us':>10} {'ratio':>7} {'native':>7}"
    )
    native = routed_experts_for(moe)  # executor/routed_experts.py: the one-op form
    ratios: dict[int, float] = {}
    native_ratios: dict[int, float] = {}
    moe_bs1_us = native_bs1_us = None
    for rows in [int(r) for r in args.rows.split(",")]:
        x = (torch.randn(rows, hidden, generator=gen)).to(torch.bfloat16)
        moe_us = _time(moe, x, args.iters)
        fast = native is not None and native.accepts(x)
        native_us = _time(native.run, x, args.iters) if fast else float("nan")
        dense_us = _time(dense_mlp, x, args.iters)
        ratios[rows] = round(moe_us / dense_us, 3)
        if fast:
            native_ratios[rows] = round(native_us / dense_us, 3)
        if rows == 1:
            moe_bs1_us, native_bs1_us = moe_us, native_us
        print(
            f"{rows:>5} {moe_us:>10.1f} {native_us:>10.1f} {dense_us:>10.1f} "
            f"{ratios[rows]:>7.3f} {native_us / dense_us:>7.3f}"
        )
    out = {
        "shape": args.shape,
        "threads": torch.get_num_threads(),
        "moe_over_dense": ratios,
        "native_moe_over_dense": native_ratios,
    }
    if moe_bs1_us is not None:
        out["moe_bs1_weight_gb_per_s"] = round(top_k * expert_bytes / moe_bs1_us / 1e3, 2)
        out["native_moe_bs1_weight_gb_per_s"] = round(top_k * expert_bytes / native_bs1_us / 1e3, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
