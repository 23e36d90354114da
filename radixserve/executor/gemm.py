"""Products of bfloat16 activations with bfloat16 weights on CPU, by kernel tier.

On the AVX-512 tiers oneDNN multiplies bfloat16 natively (AVX-512 BF16, AMX) or in its
AVX-512 emulation, and ``torch.mm`` in bfloat16 is the fast path. Below them (AVX2, NEON,
scalar) oneDNN's bfloat16 GEMM is a slow reference loop: 512 x 576 @ 576 x 1536 took
852 ms in bfloat16 and 21 ms in float32 (2 threads, AMD EPYC Zen 3, AVX2 only). There,
products of ``FLOAT32_ROWS`` rows or more run in float32 (inputs widened exactly, the
result rounded once to bfloat16: the same value the bfloat16 GEMM returns up to float32
summation order); fewer rows stay in bfloat16, where the GEMV is memory-bound either way.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from radixserve.executor.native import kernel_tier

# from this many rows a bfloat16 product runs in float32 where ``float32_products()``
# (at 1 row the two take the same time on the Zen 3 above; at 16, float32 2.4x faster)
FLOAT32_ROWS = 4
# weight elements widened to float32 at a time (1 MiB: stays in L2 for the product)
_CHUNK = 1 << 18


@cache
def float32_products() -> bool:
    """Whether this process's many-row bfloat16 products run in float32: on the kernel
    tiers below AVX-512 (``native.kernel_tier``)."""
    return kernel_tier() in ("avx2", "neon", "scalar")


_buffer = torch.empty(0, dtype=torch.float32)


def _chunk_buffer(elements: int) -> torch.Tensor:
    """One growing float32 buffer for a weight chunk, so a step allocates none. Valid until
    the next call (layers run one at a time on the engine thread)."""
    global _buffer
    if _buffer.numel() < elements:
        # a normal tensor, not an inference one: the engine's steps run under inference
        # mode, direct calls (tests, benchmarks) outside it, and both write into it
        with torch.inference_mode(False):
            _buffer = torch.empty(elements, dtype=torch.float32)
    return _buffer[:elements]


def _wide(x: torch.Tensor) -> bool:
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] >= FLOAT32_ROWS
        and float32_products()
    )


def widen(x: torch.Tensor) -> torch.Tensor:
    """x as ``mm`` wants it for a loop over a weight's chunks: widened to float32 once where
    its products run in float32, else x itself."""
    return x.float() if _wide(x) else x


def mm(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``x @ wt`` in bfloat16 for x [m, k] (bfloat16, or ``widen``'s float32 copy) and wt
    [k, n] bfloat16 (a cache-sized chunk of a dequantized weight)."""
    if wt.dtype == torch.bfloat16 and (x.dtype == torch.float32 or _wide(x)):
        return torch.mm(x.float(), wt.float()).to(torch.bfloat16)
    return torch.mm(x, wt)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``; in float32 where ``float32_products()`` and x has
    ``FLOAT32_ROWS`` rows or more, the weight widened a chunk of output rows at a time (the
    whole of a 49152-row LM head widened at once cost more than its product)."""
    if not (_wide(x) and w.dtype == torch.bfloat16 and w.dim() == 2):
        return F.linear(x, w, bias)
    n, k = w.shape
    x32 = x.float()
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    step = max(16, _CHUNK // max(k, 1))
    buf = _chunk_buffer(min(step, n) * k).view(-1, k)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        wc = buf[: hi - lo]
        wc.copy_(w[lo:hi])
        part = torch.mm(x32, wc.t())
        if bias is not None:
            part += bias[lo:hi].float()
        y[:, lo:hi] = part
    return y
