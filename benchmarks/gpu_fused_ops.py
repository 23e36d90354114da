"""The decoder layer's row-wise ops on the GPU: our Triton kernels against the same PyTorch
code eager and under ``torch.compile``, at Llama-3.1-8B shapes in bf16, for a decode-sized
(64 rows) and a prefill-sized (16,384 rows) step. Prints microseconds per call (CUDA-event
timing via ``triton.testing.do_bench``) and a last-line JSON."""

from __future__ import annotations

import json
import time

import torch
import triton

from radixserve.executor.cuda import kernels
from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.rotary import RotaryEmbedding, apply_rotary

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


def main() -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    eager = LayerOps(use_native=False)
    rope = RotaryEmbedding(HEAD_DIM, 8192, 500000.0, None, dt)
    cos_all, sin_all = rope.cos.to(dev), rope.sin_signed.to(dev)

    def norm_torch(add, residual, weight):
        return eager.add_rms_norm(add, residual, weight, 1e-5)

    def silu_torch(x):
        return eager.silu_and_mul(x)

    def rotary_torch(x, cos, sin):
        return apply_rotary(x, cos, sin)

    compiled = {
        "add_rms_norm": torch.compile(norm_torch, dynamic=False),
        "silu_and_mul": torch.compile(silu_torch, dynamic=False),
        "rotary": torch.compile(rotary_torch, dynamic=False),
    }

    def cases_for(rows: int) -> dict:
        residual = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
        add = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
        weight = torch.randn(HIDDEN, device=dev, dtype=dt)
        gate_up = torch.randn(rows, 2 * INTER, device=dev, dtype=dt)
        qk = torch.randn(rows, HEADS + KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        pos = torch.randint(0, 8192, (rows,), device=dev)
        cos, sin = cos_all[pos].unsqueeze(1), sin_all[pos].unsqueeze(1)
        return {
            "add_rms_norm": (
                lambda: kernels.add_rms_norm(add, residual, weight, 1e-5),
                lambda: norm_torch(add, residual, weight),
                lambda: compiled["add_rms_norm"](add, residual, weight),
            ),
            "silu_and_mul": (
                lambda: kernels.silu_and_mul(gate_up),
                lambda: silu_torch(gate_up),
                lambda: compiled["silu_and_mul"](gate_up),
            ),
            "rotary": (
                lambda: kernels.rotary(qk, cos, sin),
                lambda: rotary_torch(qk, cos, sin),
                lambda: compiled["rotary"](qk, cos, sin),
            ),
        }

    results = {}
    for rows in (64, 16384):
        cases = cases_for(rows)
        for name, (ours, plain, comp) in cases.items():
            start = time.perf_counter()
            comp()  # compile
            compile_s = time.perf_counter() - start
            times = [
                triton.testing.do_bench(f, warmup=10, rep=50) * 1e3 for f in (ours, plain, comp)
            ]
            results[f"{name}_{rows}"] = dict(
                zip(("triton_us", "eager_us", "compile_us"), times, strict=True)
            )
            print(
                f"{name:>13} rows={rows:>5}: triton {times[0]:8.1f} us, eager {times[1]:8.1f} us, "
                f"torch.compile {times[2]:8.1f} us (compiled in {compile_s:.1f} s)",
                flush=True,
            )
    print(json.dumps({k: {m: round(v, 1) for m, v in d.items()} for k, d in results.items()}))


if __name__ == "__main__":
    main()
