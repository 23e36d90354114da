"""Greedy sampling's argmax over bfloat16 logits (``sampler.first_max_indices``): the native
kernel gives exactly ``torch.max(dim=-1).indices``, ties, NaN and -inf rows included, for
one row spread over every thread and for many rows; other inputs take PyTorch's path."""

from __future__ import annotations

import pytest
import torch

from radixserve.executor import sampler
from radixserve.executor.native import cpu_tiers
from radixserve.executor.sampler import first_max_indices

native = pytest.mark.skipif(
    sampler._argmax_kernel() is None, reason="no C compiler: the native kernels are not built"
)


def _with_ties(rows: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen).to(torch.bfloat16)
    for r in range(rows):  # the maximum again, later in the row: the first one wins
        i = int(x[r].float().argmax())
        x[r, (i + 1 + n // 2) % n] = x[r, i]
        x[r, i // 2] = x[r, i]  # and earlier, in another lane or span
    return x


@native
@pytest.mark.parametrize(
    "rows,n", [(1, 1), (1, 15), (1, 17), (2, 33), (1, 4099), (3, 49152), (16, 262144), (5, 1000)]
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_argmax_is_torch_max_indices(rows, n, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(3):
            x = _with_ties(rows, n, seed)
            assert torch.equal(first_max_indices(x), x.max(dim=-1).indices)
    finally:
        torch.set_num_threads(before)


@native
def test_nan_and_infinite_rows():
    x = torch.full((5, 3000), float("-inf"), dtype=torch.bfloat16)
    x[1, 1700], x[1, 2500], x[1, 10] = float("nan"), float("nan"), 5.0  # first NaN wins
    x[2, 2999] = float("inf")
    x[3, 40], x[3, 2000] = float("inf"), float("inf")
    x[4] = 1.0  # all equal: index 0
    want = x.max(dim=-1).indices
    assert want.tolist() == [0, 1700, 2999, 40, 0]
    assert torch.equal(first_max_indices(x), want)


def test_other_inputs_take_pytorch_s_path():
    gen = torch.Generator().manual_seed(1)
    f32 = torch.randn(4, 100, generator=gen)
    assert torch.equal(first_max_indices(f32), f32.max(dim=-1).indices)
    strided = torch.randn(100, 4, generator=gen).to(torch.bfloat16).t()
    assert not strided.is_contiguous()
    assert torch.equal(first_max_indices(strided), strided.max(dim=-1).indices)


@pytest.mark.parametrize("tier", [t for t in cpu_tiers() if t != "avx512bf16"])
def test_the_scalar_build_agrees_too(tier):
    """Built for a tier below AVX-512 BF16 (the kernel's scalar loop, under the file's
    -ffast-math), the argmax still finds the first maximum and the first NaN."""
    from radixserve.executor import native

    lib = native.load_elementwise(tier)  # argtypes declared by the loader
    if lib is None:
        pytest.skip("no C compiler: the native kernels are not built")
    fn = lib.argmax_rows_bf16
    x = _with_ties(6, 1000, 0)
    x[2, 300], x[2, 900] = float("nan"), float("nan")
    x[3] = float("-inf")
    out = torch.empty(6, dtype=torch.int64)
    fn(x.data_ptr(), 6, 1000, out.data_ptr(), 2)
    assert torch.equal(out, x.max(dim=-1).indices)
    assert out[2] == 300 and out[3] == 0
    fn(x.data_ptr(), 0, 1000, out.data_ptr(), 2)  # no rows: nothing to do, no crash


def test_no_rows():
    empty = torch.empty(0, 50, dtype=torch.bfloat16)
    assert first_max_indices(empty).shape == (0,)
