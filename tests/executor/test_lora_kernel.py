"""The LoRA products of a step (``LoRAStep.add``: ``native/lora.c`` for short segments,
PyTorch GEMMs for long ones) against a float64 reference, in both builds of the kernel
(AVX-512 BF16 and plain C), with rows alone equal to rows in a batch bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.executor import lora as L
from radixserve.executor.lora import LoRAAdapter, LoRAStep, apply_native, slot
from radixserve.executor.native import load_lora

BF16 = torch.bfloat16
# (in, out, R): ranks even and odd, widths on and off the kernel's blocks of 32
SHAPES = {"qkv": (100, 70, 5), "o": (64, 64, 8), "gate_up": (96, 130, 7), "down": (33, 96, 16)}


def _adapter(seed: int, layers: int = 2, skip: str | None = None) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = []
    for _ in range(layers):
        groups = {}
        for group, (i, o, r) in SHAPES.items():
            if group == skip:
                continue
            a = torch.randn(r, i, generator=g).to(BF16)
            b_t = (torch.randn(r, o, generator=g) * 0.5).to(BF16)
            groups[group] = (a, b_t)
        weights.append(groups)
    return LoRAAdapter(f"a{seed}", "", 16, f"k{seed}", weights)


def _reference(y, x, adapters_by_row, layer, group):
    """float64: h = A x rounded to bfloat16, then y + h Bt rounded once."""
    out = y.double().clone()
    for row, adapter in enumerate(adapters_by_row):
        if adapter is None or group not in adapter.weights[layer]:
            continue
        a, b_t = adapter.weights[layer][group]
        h = (a.double() @ x[row].double()).to(BF16).double()
        out[row] += h @ b_t.double()
    return out.to(BF16)


def _rows(step_rows: list[int], adapters: list[LoRAAdapter | None]) -> list[LoRAAdapter | None]:
    return [a for n, a in zip(step_rows, adapters, strict=True) for _ in range(n)]


LIBS = [False, True]


@pytest.fixture(params=LIBS, ids=["avx512bf16-or-native", "portable"])
def lib(request):
    lib = load_lora(portable=request.param)
    if lib is None:
        pytest.skip("no C compiler: the native LoRA kernel is not built")
    return lib


@pytest.mark.parametrize("group", list(SHAPES))
def test_native_equals_float64(lib, group):
    """Segments of 1 to 9 rows on three adapters (one without this projection) and the
    base, neighbours on the same adapter merged; rows in and out of a block at an offset."""
    ads = [_adapter(1), _adapter(2), _adapter(3, skip="o")]
    counts = [1, 3, 2, 1, 9, 4, 1]
    per_request = [ads[0], None, ads[1], ads[1], ads[2], ads[0], None]
    qsl = np.concatenate([[0], np.cumsum(counts)])
    step = LoRAStep.build(per_request, qsl)
    assert step is not None and step.desc is not None
    rows = int(qsl[-1])
    i, o, _ = SHAPES[group]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, i, generator=g).to(BF16)
    y = torch.randn(rows, o, generator=g).to(BF16)
    want = _reference(y, x, _rows(counts, per_request), 1, group)
    got = y.clone()
    apply_native(lib, got, x, slot(1, group), step.desc, 0)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # the same rows in two blocks (the op-by-op MLP's row blocks): the same numbers
    blocks = y.clone()
    for start in range(0, rows, 8):
        apply_native(lib, blocks[start : start + 8], x[start : start + 8], slot(1, group),
                     step.desc, start)  # fmt: skip
    assert torch.equal(blocks, got)


def test_a_row_alone_equals_the_row_in_a_batch(lib):
    ads = [_adapter(4), _adapter(5)]
    i, o, _ = SHAPES["gate_up"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, i, generator=g).to(BF16)
    y = torch.randn(12, o, generator=g).to(BF16)
    per_request = [ads[i % 2] for i in range(12)]
    batch = LoRAStep.build(per_request, np.arange(13))
    got = y.clone()
    apply_native(lib, got, x, slot(0, "gate_up"), batch.desc, 0)
    for row in (0, 5, 11):
        alone = LoRAStep.build([per_request[row]], np.arange(2))
        one = y[row : row + 1].clone()
        apply_native(lib, one, x[row : row + 1], slot(0, "gate_up"), alone.desc, 0)
        assert torch.equal(one, got[row : row + 1])


def test_long_segments_take_pytorch_and_agree(monkeypatch):
    """A prompt's chunk (more than NATIVE_MAX_ROWS rows) is one GEMM per segment; the
    whole step through PyTorch (no kernel) agrees with it."""
    ads = [_adapter(6), _adapter(7)]
    counts = [L.NATIVE_MAX_ROWS + 5, 1, 2]
    per_request = [ads[0], ads[1], ads[0]]
    qsl = np.concatenate([[0], np.cumsum(counts)])
    step = LoRAStep.build(per_request, qsl)
    if load_lora() is not None:
        assert [s[1] - s[0] for s in step.long] == [counts[0]]
    i, o, _ = SHAPES["down"]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(int(qsl[-1]), i, generator=g).to(BF16)
    y = torch.randn(int(qsl[-1]), o, generator=g).to(BF16)
    want = _reference(y, x, _rows(counts, per_request), 0, "down")
    got = step.add(y.clone(), x, 0, "down")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(L, "load_lora", lambda: None)
    fallback = LoRAStep.build(per_request, qsl)
    assert fallback.desc is None
    torch.testing.assert_close(
        fallback.add(y.clone(), x, 0, "down").float(), want.float(), rtol=2e-2, atol=2e-2
    )


def test_float32_models_take_pytorch():
    """A float32 step (the tests' tiny models) never reaches the bfloat16 kernel."""
    ad = _adapter(8)
    ad.weights = [{g: (a.float(), b.float()) for g, (a, b) in lay.items()} for lay in ad.weights]
    step = LoRAStep.build([ad], np.array([0, 3]))
    i, o, _ = SHAPES["o"]
    x, y = torch.randn(3, i), torch.randn(3, o)
    a, b_t = ad.weights[0]["o"]
    want = y + (x @ a.t()) @ b_t
    torch.testing.assert_close(step.add(y.clone(), x, 0, "o"), want)
