"""The LoRA products of a step (``LoRAStep.add``: ``native/lora.c`` for short segments,
PyTorch GEMMs for long ones) against a float64 reference, in both builds of the kernel
(AVX-512 BF16 and plain C), with rows alone equal to rows in a batch bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.executor import lora as L
from radixserve.executor.lora import LoRAAdapter, LoRAModule, LoRAStep, apply_native, slot
from radixserve.executor.native import cpu_tiers, load_lora

BF16 = torch.bfloat16
# group: (in, out, its modules as (name, first column, rows, rank)): ranks even and odd,
# widths on and off the kernel's blocks of 32
SHAPES = {
    "qkv": (100, 70, [("q_proj", 0, 38, 5), ("k_proj", 38, 16, 4), ("v_proj", 54, 16, 3)]),
    "o": (64, 64, [("o_proj", 0, 64, 8)]),
    "gate_up": (96, 130, [("gate_proj", 0, 65, 7), ("up_proj", 65, 65, 2)]),
    "down": (33, 96, [("down_proj", 0, 96, 16)]),
}


def _adapter(seed: int, layers: int = 2, skip: str | None = None, native: bool = True):
    """Random modules (non-zero B), blocked for the kernel unless ``native`` is False."""
    g = torch.Generator().manual_seed(seed)
    weights = []
    for _ in range(layers):
        mods = {}
        for i, _, parts in SHAPES.values():
            for name, first, rows, r in parts:
                if name == skip:
                    continue
                a = torch.randn(r, i, generator=g).to(BF16)
                b_t = (torch.randn(r, rows, generator=g) * 0.5).to(BF16)
                held = L._blocked(b_t) if native else b_t
                mods[name] = LoRAModule(a, held, first, rows, native)
        weights.append(mods)
    return LoRAAdapter(f"a{seed}", "", 16, f"k{seed}", weights)


def _reference(y, x, adapters_by_row, layer, group):
    """float64: h = A x rounded to bfloat16, then y + h Bt rounded once, per module."""
    out = y.double().clone()
    for row, adapter in enumerate(adapters_by_row):
        for name, first, rows, _ in SHAPES[group][2]:
            m = None if adapter is None else adapter.weights[layer].get(name)
            if m is None:
                continue
            h = (m.a.double() @ x[row].double()).to(BF16).double()
            out[row, first : first + rows] += h @ m.b_t().double()
    return out.to(BF16)


def _native(lib, y, x, layer, group, desc, offset=0):
    """Every module of ``group`` through the kernel, on its columns of ``y``."""
    for name, first, rows, _ in SHAPES[group][2]:
        apply_native(lib, y[:, first : first + rows], x, slot(layer, name), desc, offset)


def _rows(step_rows: list[int], adapters: list[LoRAAdapter | None]) -> list[LoRAAdapter | None]:
    return [a for n, a in zip(step_rows, adapters, strict=True) for _ in range(n)]


@pytest.fixture(params=cpu_tiers())
def lib(request):
    lib = load_lora(request.param)
    if lib is None:
        pytest.skip("no C compiler: the native LoRA kernel is not built")
    return lib


@pytest.mark.parametrize("group", list(SHAPES))
def test_native_equals_float64(lib, group):
    """Segments of 1 to 9 rows on three adapters (one without this projection) and the
    base, neighbours on the same adapter merged; rows in and out of a block at an offset."""
    ads = [_adapter(1), _adapter(2), _adapter(3, skip="k_proj")]
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
    _native(lib, got, x, 1, group, step.desc)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # the same rows in two blocks (the op-by-op MLP's row blocks): the same numbers
    blocks = y.clone()
    for start in range(0, rows, 8):
        _native(lib, blocks[start : start + 8], x[start : start + 8], 1, group, step.desc, start)
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
    _native(lib, got, x, 0, "gate_up", batch.desc)
    for row in (0, 5, 11):
        alone = LoRAStep.build([per_request[row]], np.arange(2))
        one = y[row : row + 1].clone()
        _native(lib, one, x[row : row + 1], 0, "gate_up", alone.desc)
        assert torch.equal(one, got[row : row + 1])


def test_long_segments_take_pytorch_and_agree():
    """A prompt's chunk (more than NATIVE_MAX_ROWS rows) is one GEMM per segment; the
    whole step through PyTorch (adapters held plain, as without the kernel) agrees."""
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
    plain = [_adapter(6, native=False), _adapter(7, native=False)]
    fallback = LoRAStep.build([plain[0], plain[1], plain[0]], qsl)
    assert fallback.desc is None
    torch.testing.assert_close(
        fallback.add(y.clone(), x, 0, "down").float(), want.float(), rtol=2e-2, atol=2e-2
    )


def test_float32_models_take_pytorch():
    """A float32 step (the tests' tiny models) never reaches the bfloat16 kernel."""
    ad = _adapter(8, native=False)
    for lay in ad.weights:
        for m in lay.values():
            m.a, m.b = m.a.float(), m.b.float()
    step = LoRAStep.build([ad], np.array([0, 3]))
    assert step.desc is None
    i, o, _ = SHAPES["gate_up"]
    x, y = torch.randn(3, i), torch.randn(3, o)
    want = y.clone()
    for name, first, rows, _ in SHAPES["gate_up"][2]:
        m = ad.weights[0][name]
        want[:, first : first + rows] += (x @ m.a.t()) @ m.b
    torch.testing.assert_close(step.add(y.clone(), x, 0, "gate_up"), want)


def test_blocked_layout_round_trips():
    b_t = torch.randn(7, 70).to(BF16)
    m = LoRAModule(torch.zeros(7, 4, dtype=BF16), L._blocked(b_t), 0, 70, True)
    assert torch.equal(m.b_t(), b_t)
