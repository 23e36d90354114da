"""Quantized dense layers: matmuls against float64, GGUF types against the gguf package's
own dequantization, tiny models quantized against their float weights, flags and memory."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from radixserve import LLM
from radixserve.cli import build_parser, engine_kwargs
from radixserve.engine.config import EngineConfig
from radixserve.executor import quant
from radixserve.executor.builder import size_kv_cache
from radixserve.executor.linear import Linear
from radixserve.executor.quant import (
    Int4Linear,
    Int8GroupLinear,
    Int8Linear,
    add_prefill_copies,
    dequantize_int4,
    dequantize_int8,
    prefill_copy_bytes,
    quantize_int4,
    quantize_int8,
    resolve_quantization,
)
from radixserve.executor.weights import decide_prefill_copy
from tests.helpers import greedy

# A bfloat16 output rounds to 8 significant bits; a K-long dot product of bfloat16 inputs
# accumulated in float32 adds far less. Allowed: 2^-7 of the output's largest magnitude.
MATMUL_RTOL = 2.0**-7


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    err = (y.double() - ref).abs().max().item()
    assert err <= MATMUL_RTOL * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("rows", [1, 7, 64])  # PyTorch's kernel below 64 rows, then ours
def test_int8_matmul_matches_float64(rows):
    torch.manual_seed(rows)
    w = torch.randn(96, 160) * 0.05
    bias = torch.randn(96).to(torch.bfloat16)
    x = torch.randn(rows, 160).to(torch.bfloat16)
    q, scale = quantize_int8(w)
    ref = _reference(x, dequantize_int8(q, scale)) + bias.double()
    for use_kernel in (True, False):  # torch's kernel and the fallback
        _close(Int8Linear(q, scale, bias, use_kernel=use_kernel)(x), ref)
    # per-channel quantization error: at most half a step of each row's scale
    err = (dequantize_int8(q, scale) - w).abs().amax(dim=1)
    assert torch.all(err <= scale / 2 + 1e-7)


# rows: the panel kernel's row tiles (1 row alone; one tile of 3 and of 9; 67 as 12 + 5 x 11)
# and its dequantize + GEMM path (200); PyTorch's kernel (9) and its dequantize + GEMM
# (200) for the other layout
@pytest.mark.parametrize("rows", [1, 3, 9, 67, 200])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_matmul_matches_float64(rows, group, symmetric):
    torch.manual_seed(group + symmetric)
    w = torch.randn(100, 256) * 0.05  # 100 rows: the padding to 16 / 64 is exercised
    x = torch.randn(rows, 256).to(torch.bfloat16)
    q, scale, zero = quantize_int4(w, group, symmetric)
    deq = dequantize_int4(q, scale, zero, group)
    ref = _reference(x, deq)
    panels = Int4Linear(q, scale, zero, group)
    torch_layout = Int4Linear(q, scale, zero, group, panels=False)
    fallback = Int4Linear(q, scale, zero, group, use_kernel=False)
    for layer in (panels, torch_layout, fallback):
        out = layer(x)
        assert out.shape == (rows, 100)
        _close(out, ref)
    _close(panels.fallback(x), ref)  # the plain-torch path from the panel layout
    if panels.panels is not None:  # both native paths at every row count, whatever the cut
        from radixserve.executor import quant

        lib = quant._panel_lib()
        _close(panels._panel_gemm(lib, x), ref)
        _close(panels._panel_dequant_gemm(lib, x), ref)
    # group-wise error: half a step of the group's scale (plus the zero's bfloat16 rounding);
    # symmetric (Q4_0's rule): one step, where +8 steps clamps to the largest code, +7
    steps = scale.float().abs().repeat_interleave(group, dim=1)
    allowed = steps * (1.0 if symmetric else 0.5) + 2.0**-8 * w.abs().amax() + 1e-6
    assert torch.all((deq - w).abs() <= allowed)
    if symmetric:
        assert torch.all(zero == 0)


def _amx_libs() -> tuple:
    from radixserve.executor.native import amx_permission, load_int4_panels, load_int8_panels

    l4, l8 = load_int4_panels(), load_int8_panels()
    if l4 is None or l8 is None or not (l4.int4_panels_has_amx() and amx_permission()):
        pytest.skip("no AMX tiles here (or the kernel refused them)")
    return l4, l8


def _elementwise_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Each output within bfloat16's rounding of its own value, plus float32 sums' error:
    a wrong scale for one group or column, or one tile row's products dropped, fails."""
    err = (y.double() - ref).abs()
    allowed = 2.0**-8 * ref.abs() + 2.0**-16 * ref.abs().max()
    assert torch.all(err <= allowed), (err - allowed).max().item()


# rows: shorter tiles (8, 15), one tile (16), a last tile that overlaps (17, 33, 127)
@pytest.mark.parametrize("rows", [8, 15, 16, 17, 33, 127])
@pytest.mark.parametrize("group", [16, 32, 64])
@pytest.mark.parametrize("kind", ["int4", "int8", "int8_zeros"])
def test_amx_panel_gemms_match_float64(rows, group, kind):
    """The AMX tile path of both panel GEMMs against float64 and against the AVX-512 path
    (run with the tiles off), element by element."""
    l4, l8 = _amx_libs()
    gen = torch.Generator().manual_seed(rows * 100 + group)
    n, k = 100, 256  # 100 outputs: a partial last block of 16
    if kind == "int4":
        q, scale, zero = quantize_int4(torch.randn(n, k, generator=gen), group, False)
        layer, lib = Int4Linear(q, scale, zero, group), l4
        w = dequantize_int4(q, scale, zero, group).double()
        setter, getter = lib.int4_panels_set_amx_rows, lib.int4_panels_amx_rows
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = (torch.rand(n, k // group, generator=gen) * 0.01).half().float()
        zero = None
        if kind == "int8_zeros":
            zero = ((torch.rand(n, k // group, generator=gen) - 0.5) * 0.1).half().float()
        layer, lib = quant.Int8GroupLinear(q, scale, zero, group), l8
        w = layer.dequantized().double()
        setter, getter = lib.int8_panels_set_amx_rows, lib.int8_panels_amx_rows
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    ref = x.double() @ w.T
    calls = getattr(lib, f"{kind[:4]}_panels_amx_calls")
    before = getter()
    try:
        setter(1)
        first = calls()
        tiles = layer._panel_gemm(lib, x)
        assert calls() == first + 1  # the tiles ran
        setter(0)
        vectors = layer._panel_gemm(lib, x)
        assert calls() == first + 1
    finally:
        setter(before)
    _elementwise_close(tiles, ref)
    _elementwise_close(vectors, ref)
    # both exact in the weights: they differ only by float32 summation order
    assert (tiles.double() - vectors.double()).abs().max() <= 2.0**-7 * ref.abs().max()


# rows: tiles of 2-16 (two accumulator sets below 8), two tiles (17, 33)
@pytest.mark.parametrize("rows", [2, 5, 8, 16, 17, 33])
@pytest.mark.parametrize("group", [16, 32, 64])
@pytest.mark.parametrize("zeros", [False, True])
def test_int8_pair_products_match_float64(rows, group, zeros):
    """The int8 panel GEMM's bfloat16-pair path (vdpbf16ps on pairs of codes) against
    float64 and against the float32 multiply-add path, element by element."""
    from radixserve.executor.native import load_int8_panels

    lib = load_int8_panels()
    if lib is None:
        pytest.skip("no AVX-512 BF16 build of the int8 panels here")
    gen = torch.Generator().manual_seed(rows * 10 + group)
    n, k = 100, 256  # a partial last block of 16
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.01).half().float()
    zero = (
        ((torch.rand(n, k // group, generator=gen) - 0.5) * 0.1).half().float() if zeros else None
    )
    layer = quant.Int8GroupLinear(q, scale, zero, group)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    ref = x.double() @ layer.dequantized().double().T
    dp, amx = lib.int8_panels_dp_rows(), lib.int8_panels_amx_rows()
    try:
        lib.int8_panels_set_amx_rows(0)
        lib.int8_panels_set_dp_rows(2)
        pairs = layer._panel_gemm(lib, x)
        lib.int8_panels_set_dp_rows(0)
        plain = layer._panel_gemm(lib, x)
    finally:
        lib.int8_panels_set_dp_rows(dp)
        lib.int8_panels_set_amx_rows(amx)
    _elementwise_close(pairs, ref)
    _elementwise_close(plain, ref)


def test_int8_pair_rows_follow_the_vendor_and_the_override(monkeypatch):
    """The pair products are on from 2 rows on AMD CPUs only (one vdpbf16ps costs two
    multiply-adds on Intel's), and RADIXSERVE_INT8_PAIR_ROWS sets the row count (0: off)."""
    from radixserve.executor.native import int8_pair_rows

    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in next((line for line in f if line.startswith("vendor_id")), "")
    monkeypatch.delenv("RADIXSERVE_INT8_PAIR_ROWS", raising=False)
    assert int8_pair_rows() == (2 if amd else 0)
    monkeypatch.setenv("RADIXSERVE_INT8_PAIR_ROWS", "0")
    assert int8_pair_rows() == 0
    monkeypatch.setenv("RADIXSERVE_INT8_PAIR_ROWS", "5")
    assert int8_pair_rows() == 5


def test_amx_rows_choose_the_path():
    """From the AMX row count (and the engine's own default, native.INT4_AMX_ROWS) the
    layer runs in the tiles; below it, and up to AMX_DEQUANT_ROWS with the tiles, not the
    dequantizer."""
    from radixserve.executor.native import INT4_AMX_ROWS

    l4, _ = _amx_libs()
    assert l4.int4_panels_amx_rows() == INT4_AMX_ROWS  # the loader turned them on
    torch.manual_seed(3)
    q, scale, zero = quantize_int4(torch.randn(64, 128), 32, False)
    layer = Int4Linear(q, scale, zero, 32)
    before = l4.int4_panels_amx_rows()
    try:
        l4.int4_panels_set_amx_rows(21)
        for rows, tiles in ((20, False), (21, True), (quant.PANEL_DEQUANT_ROWS, True)):
            first = l4.int4_panels_amx_calls()
            layer(torch.randn(rows, 128).to(torch.bfloat16))
            assert l4.int4_panels_amx_calls() == first + tiles, rows
    finally:
        l4.int4_panels_set_amx_rows(before)


def test_panel_layout_round_trips_and_is_used_where_built():
    from radixserve.executor import quant
    from radixserve.executor.native import load_int4_panels

    torch.manual_seed(5)
    q, scale, zero = quantize_int4(torch.randn(37, 96), 32, False)
    panels, sz = quant.to_panels(q, scale, zero)
    assert panels.shape == (3, 12, 16) and sz.shape == (3, 3, 2, 16)
    q2, scale2, zero2 = quant.from_panels(panels, sz, 37)
    assert torch.equal(q2, q) and torch.equal(scale2, scale) and torch.equal(zero2, zero)
    layer = Int4Linear(q, scale, zero, 32)
    if load_int4_panels() is None:
        assert layer.panels is None  # no AVX-512 BF16 build: PyTorch's layout
    else:
        assert layer.panels is not None and layer.packed is None
        assert layer.nbytes == panels.nbytes + sz.nbytes


def test_native_dequantizer_reads_pytorch_int4_layout():
    """The int4 dequantizer reads PyTorch's internal packed layout; the check at first use
    (which would turn it off) passes on this PyTorch."""
    import shutil

    from radixserve.executor import quant

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the native dequantizer is off, PyTorch's kernels run")
    if os.environ.get("RADIXSERVE_NATIVE") == "0":
        pytest.skip("native kernels disabled")
    lib = quant._dequantizer()
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        # PyTorch packs int4 in 32-output blocks on AVX2 (64 on AVX-512): the native
        # dequantizer reads only the latter, and the first-use check turns it off
        assert lib is None
        pytest.skip("PyTorch's AVX2 int4 layout: the native dequantizer is off, as checked")
    assert lib is not None and lib is quant.load_qlinear()  # the native library, in use
    # its output equals the reference dequantization on data the first-use check never saw
    assert all(quant._int4_layout_ok(lib, seed) for seed in (1, 2, 3))


# -- GGUF types ---------------------------------------------------------------------------------
# -- tiny models --------------------------------------------------------------------------------
def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced: log p of each prompt token after the first, and the model's top-1
    token at each of those positions."""
    outs = llm.generate(prompts, greedy(1, prompt_logprobs=1), use_tqdm=False)
    llm.engine.check_idle()
    entries = [lp for o in outs for lp in o.prompt_logprobs[1:]]
    return np.array([e.logprob for e in entries]), np.array([e.top[0][0] for e in entries])


PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(24)] for i in range(4)]


@pytest.fixture(scope="module")
def float_reference(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", quantization="none")
    ref = _prompt_logprobs(llm, PROMPTS)
    llm.engine.close()
    return ref


# Measured on this tiny random model (92 positions; its predictions are near-uniform, so
# top-1 is fragile): bf16 alone is off float32 by 0.021 nats on average (top-1 0.97);
# int8 with float32 activations 0.038 (0.93), int8 with bf16 0.049 (0.96); int4 g32 0.49
# (0.54), g128 0.57 (0.39). The bounds leave ~1.5-2x room; a broken kernel is off by nats.
@pytest.mark.parametrize(
    ("dtype", "quantization", "group", "max_mean_err", "min_top1"),
    [
        ("float32", "int8", 32, 0.08, 0.85),
        ("bfloat16", "int8", 32, 0.1, 0.85),
        ("bfloat16", "int4", 32, 0.8, 0.4),
        ("bfloat16", "int4", 128, 0.9, 0.3),
    ],
)
def test_tiny_model_quantized_close_to_float32(
    tiny_llama, float_reference, dtype, quantization, group, max_mean_err, min_top1
):
    """Teacher-forced prompt log-probs within a mean absolute error of the float32 model's,
    and the top-1 token agreeing at most positions."""
    ref_lp, ref_top = float_reference
    llm = LLM(
        str(tiny_llama), dtype=dtype, quantization=quantization, quantization_group_size=group
    )
    assert quantization in llm.engine.startup_line
    lp, top = _prompt_logprobs(llm, PROMPTS)
    llm.engine.close()
    err = np.abs(lp - ref_lp).mean()
    assert err <= max_mean_err, err
    assert np.mean(top == ref_top) >= min_top1


def test_bf16_int8_int4_memory_and_kv_budget(tiny_llama):
    """The start-up line's weight memory by precision; a memory budget sizes the KV cache
    from what the weights leave."""
    sizes = {}
    for q, copy in (("none", "off"), ("int8", "off"), ("int4", "off"), ("int4", "on")):
        llm = LLM(
            str(tiny_llama),
            dtype="bfloat16",
            quantization=q,
            memory_budget_gb=0.01,
            prefill_weight_copy=copy,
        )
        e = llm.engine
        sizes[q, copy] = sum(e.weight_bytes.values())
        left = int(0.01 * 2**30) - sizes[q, copy]
        assert e.pool.num_pages == left // _page_bytes(e)
        assert "weights" in e.startup_line and "KV cache" in e.startup_line
        if q != "none":
            assert e.weight_bytes.get(q, 0) > 0
        # the bfloat16 prefill copy is counted (and taken from the KV cache's share)
        copy_bytes = e.weight_bytes.get("bfloat16_prefill_copy", 0)
        if copy == "on":
            assert copy_bytes >= prefill_copy_bytes(e.model) > 0
        else:
            assert copy_bytes == 0
        assert ("bfloat16_prefill_copy" in e.startup_line) == (copy == "on")
        llm.engine.close()
    # embeddings and LM head stay bfloat16: only the layers shrink, int4 below int8 below bf16
    assert sizes["int4", "off"] < sizes["int8", "off"] < sizes["none", "off"]
    assert sizes["int4", "on"] > sizes["int4", "off"]
    with pytest.raises(ValueError, match="no room for the KV cache"):
        LLM(str(tiny_llama), quantization="int8", memory_budget_gb=1e-6)


def test_default_kv_cache_holds_the_requests_asked_for_within_free_memory(tiny_llama):
    """Without --kv-cache-memory the KV cache holds --kv-cache-requests requests of
    --max-model-len tokens (the start-up line says so), at most half the memory free once
    the weights are in; a size given is kept (today's 1 GiB with ``--kv-cache-memory 1``)."""
    llm = LLM(str(tiny_llama), dtype="float32", page_size=4, max_model_len=96,
              kv_cache_requests=3)  # fmt: skip
    e = llm.engine
    assert e.pool.num_pages == 3 * 96 // 4
    assert "(72 pages of 4; 3 requests of 96 tokens)" in e.startup_line
    page = _page_bytes(e)
    small = size_kv_cache(e.model, 4, None, max_model_len=96, requests=3, free_bytes=20 * page)
    assert small.num_pages == 10 and "half the" in small.basis  # capped
    given = size_kv_cache(e.model, 4, 1.0, max_model_len=96, requests=3, free_bytes=page)
    assert given.num_pages == 2**30 // page and given.basis == ""
    llm.engine.close()
    with pytest.raises(ValueError, match="kv_cache_requests"):
        EngineConfig(kv_cache_requests=0)


def _int8_group_rows() -> int:
    """Where an Int8GroupLinear leaves its panel kernel here (64 with the pair products,
    32 without; the cut only exists where the kernel is built)."""
    lib = quant._int8_panel_lib()
    return quant.INT8_PANEL_DEQUANT_ROWS if lib is None else quant.int8_panel_rows(lib)


def _copy_cases() -> list[tuple[str, object, int]]:
    """(name, a quantized layer, its copy threshold in rows): each kind with a copy."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(80, 256, generator=gen)
    q8 = torch.randint(-127, 128, (48, 128), generator=gen, dtype=torch.int8)
    scale = torch.rand(48, 4, generator=gen) * 0.01 + 0.001
    return [
        ("int4", Int4Linear.from_float(w, group_size=32), quant.PANEL_COPY_ROWS),
        ("int8", Int8Linear.from_float(w), quant.DEQUANT_GEMM_ROWS_INT8),
        ("int8-group", Int8GroupLinear(q8, scale, None, 32), _int8_group_rows()),
        ("int8-group-zero", Int8GroupLinear(q8, scale, -scale * 3, 32), _int8_group_rows()),
    ]


@pytest.mark.parametrize("case", range(4))
def test_prefill_copy_runs_from_its_threshold_and_equals_the_dequantized_weight(case):
    """Below the threshold a layer with a copy computes bit for bit what it did without
    one (its codes); from it, the copy: the bfloat16 weight the dequantize path multiplies,
    within a float32 dot's rounding of the float64 reference."""
    name, layer, rows = _copy_cases()[case]
    gen = torch.Generator().manual_seed(4)
    few = torch.randn(rows - 1, layer.in_features, generator=gen).to(torch.bfloat16)
    many = torch.randn(rows + 5, layer.in_features, generator=gen).to(torch.bfloat16)
    before_few = layer(few)
    assert layer.prefill is None
    model = SimpleNamespace(layers=[SimpleNamespace(proj=layer)])
    assert prefill_copy_bytes(model) == 2 * layer.out_features * layer.in_features
    assert add_prefill_copies(model) == prefill_copy_bytes(model)
    assert layer.prefill is not None, name
    assert torch.equal(layer(few), before_few), name
    w = quant._dense_bf16(layer).double()
    if name == "int4":
        q, scale, zero = layer.codes()
        want_w = dequantize_int4(q, scale, zero, layer.group_size)
    else:
        want_w = layer.dequantized()
    # the copy is the dequantized weight rounded once to bfloat16 (without zeros exactly
    # that: the dequantize kernel's code x scale is the same single float32 rounding)
    assert torch.allclose(w, want_w.double(), rtol=2**-8, atol=0), name
    if name == "int8-group":
        assert torch.equal(quant._dense_bf16(layer), want_w.to(torch.bfloat16))
    got = layer(many).double()
    want = many.double() @ w.T
    assert (got - want).abs().max() <= MATMUL_RTOL * want.abs().max(), name
    # the rows from the threshold go through the copy and no other way
    layer.prefill = Linear(torch.zeros(layer.out_features, layer.in_features).to(torch.bfloat16))
    assert not layer(many).any() and torch.equal(layer(few), before_few), name
    # a step of a long prompt's chunk: the copy from LONG_PROMPT_COPY_ROWS rows too (where
    # the layer's own threshold is higher), the codes below, and only in that step
    long_rows = min(rows, quant.LONG_PROMPT_COPY_ROWS)
    short = few[: long_rows - 1]
    before_short = layer(short)
    with quant.long_prompt_step(True):
        assert not layer(many[:long_rows]).any(), name
        assert torch.equal(layer(short), before_short), name
    assert torch.equal(layer(few), before_few), name


def test_long_prompts_prefill_their_chunks_on_the_copy(tiny_llama):
    """A prompt of PANEL_COPY_ROWS tokens or more runs its chunks of LONG_PROMPT_COPY_ROWS
    tokens or more on the prefill copy, its last, shorter chunk on the codes; a short
    prompt's steps and the decode steps never use the copy."""
    from radixserve.executor.forward_batch import ForwardBatch

    llm = LLM(
        str(tiny_llama),
        dtype="bfloat16",
        quantization="int4",
        prefill_weight_copy="on",
        max_num_batched_tokens=64,
        disable_radix_cache=True,
    )
    flags: list[tuple[int, bool]] = []
    build = ForwardBatch.build.__func__

    def spy(cls, *a, **k):
        fb = build(cls, *a, **k)
        flags.append((fb.num_tokens, fb.long_prompt))
        return fb

    layer = llm.engine.model.layers[0].down
    copy_calls = []
    inner = layer.prefill

    class Counting:
        def __call__(self, x):
            copy_calls.append(x.shape[0])
            return inner(x)

    layer.prefill = Counting()
    ForwardBatch.build = classmethod(spy)
    try:
        long = [(5 * j) % 400 + 3 for j in range(quant.PANEL_COPY_ROWS + 30)]  # 158: 3 chunks
        llm.generate([long], greedy(3), use_tqdm=False)
        assert [f for _, f in flags] == [True, True, True, False, False], flags
        assert quant.LONG_PROMPT_COPY_ROWS <= 64
        assert copy_calls == [64, 64], copy_calls  # the last chunk's 30 rows on the codes
        flags.clear(), copy_calls.clear()
        short = [(3 * j) % 400 + 3 for j in range(quant.PANEL_COPY_ROWS - 1)]  # 127: 2 chunks
        llm.generate([short], greedy(2), use_tqdm=False)
        assert [f for _, f in flags] == [False, False, False], flags
        assert copy_calls == []
    finally:
        ForwardBatch.build = classmethod(build)
        llm.engine.close()


def test_prefill_copy_decision():
    gib = 2**30
    assert decide_prefill_copy("on", 10 * gib, available=gib)
    assert not decide_prefill_copy("on", 0)  # nothing quantized: nothing to copy
    assert not decide_prefill_copy("off", 1, available=64 * gib)
    assert decide_prefill_copy("auto", gib // 4, available=gib)
    assert not decide_prefill_copy("auto", gib // 4 + 1, available=gib)
    assert not decide_prefill_copy("auto", 0, available=gib)
    with pytest.raises(ValueError, match="prefill_weight_copy"):
        decide_prefill_copy("always", 1)
    with pytest.raises(ValueError, match="prefill_weight_copy"):
        EngineConfig(model="x", prefill_weight_copy="always")


def _page_bytes(engine) -> int:
    from radixserve.executor.kv_cache import bytes_per_page

    mc = engine.model_config
    return bytes_per_page(
        mc.num_hidden_layers,
        mc.num_key_value_heads,
        mc.head_dim,
        engine.config.page_size,
        engine.dtype,
    )


# -- GGUF files made here ------------------------------------------------------------------------
def write_tiny_gguf(path: Path, type_name: str, seed: int = 0) -> Path:
    """A 2-layer llama GGUF whose layer matrices are of ``type_name`` (a byte-level
    vocabulary of 258 tokens)."""
    import gguf
    from gguf.quants import quantize

    hidden, inter, heads, kv_heads, layers = 64, 128, 4, 2, 2
    head_dim = hidden // heads
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 323)]
    tokens = [*alphabet[:256], alphabet[0] + alphabet[1], "<|im_end|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([f"{tokens[0]} {tokens[1]}"])
    w.add_token_types([1] * 257 + [3])
    w.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output.weight", mat(vocab, hidden))
    for i in range(layers):
        shapes = {
            "attn_q": (heads * head_dim, hidden),
            "attn_k": (kv_heads * head_dim, hidden),
            "attn_v": (kv_heads * head_dim, hidden),
            "attn_output": (hidden, heads * head_dim),
            "ffn_gate": (inter, hidden),
            "ffn_up": (inter, hidden),
            "ffn_down": (hidden, inter),
        }
        for name, (rows, cols) in shapes.items():
            w.add_tensor(
                f"blk.{i}.{name}.weight", quantize(mat(rows, cols), qtype), raw_dtype=qtype
            )
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("type_name", "expect", "max_mean_err"),
    [
        ("Q8_0", "14 int8-g32 (Q8_0)", 0.04),
        ("Q4_0", "14 int4-g32 (Q4_0)", 0.04),
        ("Q4_1", "14 int4-g32 (Q4_1)", 0.04),
    ],
)
def test_gguf_file_runs_quantized(tmp_path, type_name, expect, max_mean_err):
    """``auto`` runs a Q8_0 / Q4_0 / Q4_1 file's layer tensors from their own codes (int8
    group-wise / int4, the start-up line says so per tensor); its prompt log-probs stay
    close to the same file dequantized to bfloat16 (the same values, so only rounding
    differs, about as much as bfloat16 differs from float32 on these models, 0.02 nats)."""
    path = write_tiny_gguf(tmp_path / f"tiny-{type_name}.gguf", type_name)
    prompts = [[(5 * i + 3 * j) % 250 for j in range(20)] for i in range(3)]
    dense = LLM(str(path), dtype="bfloat16", quantization="none")
    ref, _ = _prompt_logprobs(dense, prompts)
    dense.engine.close()
    quant = LLM(str(path), dtype="bfloat16")  # auto
    assert expect in quant.engine.startup_line
    assert "embeddings and LM head bfloat16" in quant.engine.startup_line
    lp, _ = _prompt_logprobs(quant, prompts)
    quant.engine.close()
    assert np.abs(lp - ref).mean() <= max_mean_err


def test_resolve_quantization_choices():
    # auto: one scheme for no model (an HF checkpoint runs in its dtype; a GGUF file per
    # tensor from its codes, tests/executor/test_gguf_codes.py)
    assert resolve_quantization("auto", 32) is None
    assert resolve_quantization("none", 32) is None
    assert resolve_quantization("int8", 128).describe() == "int8 per-channel"
    assert resolve_quantization("int4", 128).describe() == "int4 g128 with zero points"


def test_bad_quantization_values_are_clear_errors(tiny_llama):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="memory_budget_gb"):
        EngineConfig(memory_budget_gb=0)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama), quantization="fp8")
    parser = build_parser()
    for cmd in (["generate", "hi"], ["serve"]):
        args = parser.parse_args(
            [*cmd, "--quantization", "int4", "--quantization-group-size", "128"]
        )
        kw = engine_kwargs(args)
        assert kw["quantization"] == "int4" and kw["quantization_group_size"] == 128
        with pytest.raises(SystemExit):
            parser.parse_args([*cmd, "--quantization", "int2"])


def test_int4_group_falls_back_to_a_divisor():
    """Input sizes that 128 does not divide (SmolLM2's 576) take the largest group that
    does; the result is still the function of the dequantized weight."""
    from radixserve.executor.linear import Linear
    from radixserve.executor.quant import QuantScheme, quantize_linear

    w = (torch.randn(64, 576) * 0.05).to(torch.bfloat16)
    layer = quantize_linear(Linear(w), QuantScheme("int4", 128))
    assert isinstance(layer, Int4Linear) and layer.group_size == 64
    x = torch.randn(3, 576).to(torch.bfloat16)
    rel = (layer(x).float() - x.float() @ w.float().T).norm() / (x.float() @ w.float().T).norm()
    assert rel < 0.1 and not math.isnan(rel)
