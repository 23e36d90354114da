"""Deterministic mode's products (executor/batch_invariant.py): each row's result is bitwise
the one it gets alone, whatever the number of rows, for every kind of linear layer; and the
products are right (float64 references)."""

from __future__ import annotations

import pytest
import torch

from radixserve.executor import batch_invariant
from radixserve.executor.batch_invariant import DensePanels, in_row_counts, invariant_step
from radixserve.executor.linear import Linear
from radixserve.executor.native import invariant_rows, load_int4_panels, load_int8_panels
from radixserve.executor.quant import Int4Linear, Int8GroupLinear, Int8Linear

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 15, 16, 17, 31, 33, 64)


def _each_row_alone(layer, x: torch.Tensor) -> None:
    """layer(x)'s rows equal layer(row) for every row, bitwise, at every count of rows."""
    with invariant_step(True):
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        for m in ROW_COUNTS:
            for start in (0, x.shape[0] - m):  # the row's place in the batch changes too
                got = layer(x[start : start + m])
                assert torch.equal(got, alone[start : start + m]), (m, start)


def _alone_and_right(layer, x: torch.Tensor, rtol: float, atol: float) -> None:
    """Each row alone (``_each_row_alone``), and the product of x with the layer's
    dequantized weight (float64 reference)."""
    _each_row_alone(layer, x)
    with invariant_step(True):
        got = layer(x)
    want = x.double() @ layer.dequantized().double().T
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_panels_are_the_product_and_compute_each_row_alone(dtype):
    torch.manual_seed(0)
    w = torch.randn(40, 72, dtype=dtype)  # 40 outputs: two blocks of 16 and a partial one
    x = torch.randn(70, 72, dtype=dtype)
    want = x.double() @ w.double().T
    got = DensePanels(w, dtype)(x)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 8)
    layer = Linear(w, torch.randn(40, dtype=dtype))
    _each_row_alone(layer, x)
    with invariant_step(True):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, layer.bias),
                                   rtol=tol, atol=tol * 8)  # fmt: skip


def test_bfloat16_rows_against_a_float32_weight():
    torch.manual_seed(1)
    w = torch.randn(24, 64)
    x = torch.randn(9, 64).to(torch.bfloat16)
    got = DensePanels(w, torch.bfloat16)(x)
    want = (x.double() @ w.double().T).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2)


@pytest.mark.skipif(load_int4_panels() is None, reason="native int4 panels not built")
def test_int4_panels_compute_each_row_alone():
    torch.manual_seed(2)
    w = torch.randn(48, 128)
    layer = Int4Linear.from_float(w, group_size=32)
    assert layer.panels is not None
    _alone_and_right(layer, torch.randn(70, 128).to(torch.bfloat16), 2e-2, 5e-2)
    lo, hi = invariant_rows(load_int4_panels(), "int4_panels")
    assert lo >= 1 and (hi is None or hi >= lo)


@pytest.mark.skipif(load_int8_panels() is None, reason="native int8 panels not built")
@pytest.mark.parametrize("zero", [False, True])
def test_int8_panels_compute_each_row_alone(zero):
    torch.manual_seed(3)
    n, k, g = 40, 128, 32
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // g) * 0.01
    layer = Int8GroupLinear(q, scale, torch.randn(n, k // g) * 0.01 if zero else None, g)
    _alone_and_right(layer, torch.randn(70, k).to(torch.bfloat16), 2e-2, 5e-2)


def test_per_channel_int8_multiplies_its_exact_dequantized_weight():
    torch.manual_seed(4)
    layer = Int8Linear.from_float(torch.randn(33, 64))
    _alone_and_right(layer, torch.randn(20, 64).to(torch.bfloat16), 1e-2, 2e-2)


def test_row_counts_pad_and_split():
    calls = []

    def call(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows * 2

    x = torch.arange(30.0).view(15, 2)
    assert torch.equal(in_row_counts(x, 8, 12, call), x * 2)
    assert calls == [12, 8]  # 15 rows: 12, then 3 padded to 8
    calls.clear()
    assert torch.equal(in_row_counts(x[:1], 2, None, call), x[:1] * 2)
    assert calls == [2]
    assert not batch_invariant.on()
    with invariant_step(True):
        assert batch_invariant.on()
    assert not batch_invariant.on()
