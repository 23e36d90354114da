"""Per-layer attention specs (sliding window, scale, soft cap) in every CPU path, against a
float64 reference that applies the spec literally: the C decode kernel (portable and AVX-512
BF16 tasks), the shared-prefix two-pass decode, the C prefill kernel (both builds) and the
PyTorch fallbacks (explicit scores, padded SDPA, long prompts, torch decode)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from radixserve.executor.attention import TorchNativeAttention
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.layers.attention import AttentionSpec
from radixserve.executor.native import (
    cpu_tiers,
    load_paged_decode,
    load_paged_prefill,
    make_shared_prefix,
    paged_decode,
    paged_prefill,
)
from tests.executor.test_attention import (
    _Cache,
    _case,
    _decode_batch,
    _shared_prefix_case,
    needs_compiler,
)


def _spec_reference(q, k_cache, v_cache, tables, seq_lens, q_lens, spec: AttentionSpec):
    """Query j of request i sits at position seq_len - q_len + j and attends keys
    ``spec.lowest_key(p) .. p``; scores ``scale * q.k``, capped when the spec says so."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        n, ql = int(n), int(ql)
        pages = tables[i, : -(-n // page_size)]
        keys = k_cache[pages].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].double()
        values = v_cache[pages].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].double()
        keys = keys.repeat_interleave(heads // kv_heads, dim=0)
        values = values.repeat_interleave(heads // kv_heads, dim=0)
        for j in range(ql):
            p = n - ql + j
            lo = spec.lowest_key(p)
            scores = q[row].double()[:, None, :] @ keys[:, lo : p + 1].transpose(1, 2)
            scores = scores * spec.scale
            if spec.softcap is not None:
                scores = spec.softcap * torch.tanh(scores / spec.softcap)
            out[row] = (torch.softmax(scores, dim=-1) @ values[:, lo : p + 1])[:, 0]
            row += 1
    return out


def test_spec_window_bound_and_validation():
    spec = AttentionSpec(0.1, sliding_window=4)
    assert [spec.lowest_key(p) for p in (0, 3, 4, 10)] == [0, 0, 1, 7]
    assert AttentionSpec(0.1).lowest_key(99) == 0
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionSpec(0.1, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        AttentionSpec(0.1, softcap=-1.0)


SPECS = [
    # (window, softcap, scale factor on d ** -0.5)
    pytest.param((5, None, 1.0), id="window5"),
    pytest.param((1, None, 1.0), id="window1"),
    pytest.param((37, None, 0.7), id="window37-scale"),
    pytest.param((None, 3.0, 1.6), id="softcap-scale"),
    pytest.param((20, 2.5, 1.0), id="window20-softcap"),
    pytest.param((10_000, None, 1.0), id="window-beyond-every-sequence"),
]


def _spec(params, d) -> AttentionSpec:
    window, softcap, factor = params
    return AttentionSpec(d**-0.5 * factor, window, softcap)


DECODE_CASES = [
    # seq_lens, heads, kv_heads, head_dim, page_size
    ([1, 16, 17, 300, 33], 9, 3, 64, 16),  # AVX-512 BF16 task for bfloat16 (d % 32 == 0)
    ([129, 2, 50], 6, 2, 48, 32),  # the portable task (d = 48)
    ([70, 3, 45], 8, 1, 128, 7),  # pages that split the 16-key blocks
]


@needs_compiler
@pytest.mark.parametrize("params", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_native_decode_honours_the_spec(case, dtype, params):
    lib = load_paged_decode()
    assert lib is not None
    seq_lens, heads, kv_heads, d, page_size = case
    q, k, v, tables, lens = _case(5, seq_lens, heads, kv_heads, d, page_size, dtype)
    spec = _spec(params, d)
    out = paged_decode(
        lib,
        q,
        k,
        v,
        tables.int(),
        lens.int(),
        spec.scale,
        window=spec.sliding_window,
        softcap=spec.softcap,
    )
    ref = _spec_reference(q, k, v, tables, lens, [1] * len(seq_lens), spec)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_the_window_changes_the_result():
    """The reference (and so every test above) really depends on the window: attending
    the last 5 keys of a 300-key sequence differs from attending all of them."""
    q, k, v, tables, lens = _case(5, [300], 3, 1, 32, 16, torch.float32)
    full = _spec_reference(q, k, v, tables, lens, [1], AttentionSpec(32**-0.5))
    local = _spec_reference(q, k, v, tables, lens, [1], AttentionSpec(32**-0.5, 5))
    assert (full - local).abs().max() > 0.1


@needs_compiler
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_shared_prefix_decode_with_a_cap_and_a_window_that_covers_it(softcap):
    """The two-pass decode caps the prefix's scores too; a window no shorter than every
    sequence keeps the prefix usable and the result equal to the reference."""
    lib = load_paged_decode()
    if lib is None or not lib.paged_decode_has_avx512_bf16():
        pytest.skip("needs the AVX-512 BF16 decode path")
    heads, kv_heads, d, page_size = 9, 3, 64, 16
    q, k, v, tables, lens = _shared_prefix_case(3, 16, [1, 5, 17, 40], heads, kv_heads, d, 16)
    prefix = make_shared_prefix(
        lib, tables.int().numpy(), lens.numpy(), page_size, kv_heads, d, 3, torch.bfloat16
    )
    assert prefix is not None
    window = int(lens.max())
    spec = AttentionSpec(d**-0.5, window, softcap)
    out = paged_decode(lib, q, k, v, tables.int(), lens.int(), spec.scale, prefix, window, softcap)
    ref = _spec_reference(q, k, v, tables, lens, [1] * 4, spec)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="window"):
        paged_decode(lib, q, k, v, tables.int(), lens.int(), spec.scale, prefix, window - 1)


@needs_compiler
@pytest.mark.parametrize("window", [None, 50, 300])
def test_backend_decode_with_a_shared_prefix_and_a_window(window):
    """Rows sharing 256 keys: where the window is shorter than a row, the backend drops the
    shared prefix for that layer (it would attend keys outside the window); where not, it
    keeps it. Both match the reference."""
    heads, kv_heads, d, page_size = 9, 3, 64, 16
    q, k, v, tables, lens = _shared_prefix_case(4, 16, [1, 4, 17, 30, 2], heads, kv_heads, d, 16)
    b = len(lens)
    new_k = torch.randn(b, kv_heads, d).bfloat16()
    new_v = torch.randn(b, kv_heads, d).bfloat16()
    spec = AttentionSpec(d**-0.5, window)
    backend = TorchNativeAttention(_Cache(k, v), heads, d, specs=[spec])
    if backend.native is None or not backend.native.paged_decode_has_avx512_bf16():
        pytest.skip("needs the AVX-512 BF16 decode path")
    meta = backend.prepare(_decode_batch(tables, lens, page_size))
    assert meta.decode.prefix is not None
    out = backend.forward(0, q, new_k, new_v, meta).view(b, heads, d)
    ref = _spec_reference(q, k, v, tables, lens, [1] * b, spec)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


PREFILL_CASES = [
    # seq_lens, q_lens, heads, kv_heads, head_dim, page_size
    ([300, 77, 5], [100, 77, 1], 9, 3, 64, 16),
    ([130, 64], [130, 31], 8, 1, 128, 7),
    ([99, 40], [33, 1], 6, 2, 48, 5),
]


@needs_compiler
@pytest.mark.parametrize("params", SPECS)
@pytest.mark.parametrize("tier", cpu_tiers())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_native_prefill_honours_the_spec(case, dtype, tier, params):
    lib = load_paged_prefill(tier)
    assert lib is not None
    seq_lens, q_lens, heads, kv_heads, d, page_size = case
    g = torch.Generator().manual_seed(8)
    b = len(seq_lens)
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = b * max_pages + 2
    k = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)
    v = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)
    tables = torch.randperm(num_pages, generator=g)[: b * max_pages].view(b, max_pages)
    total = sum(q_lens)
    q = torch.randn(total, heads, d, generator=g).to(dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    out = torch.full((total, heads, d), float("nan"), dtype=dtype)
    spec = _spec(params, d)
    paged_prefill(
        lib,
        q,
        k,
        v,
        tables.int(),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(q_lens, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        spec.scale,
        out,
        window=spec.sliding_window,
        softcap=spec.softcap,
    )
    ref = _spec_reference(q, k, v, tables, seq_lens, q_lens, spec)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def _mixed_step(seed: int, seq_lens, q_lens, heads, kv_heads, d, page_size):
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = b * max_pages
    k_cache = torch.randn(num_pages, kv_heads, page_size, d, generator=g)
    v_cache = torch.randn(num_pages, kv_heads, page_size, d, generator=g)
    tables = torch.randperm(num_pages, generator=g).view(b, max_pages)
    total = sum(q_lens)
    q = torch.randn(total, heads, d, generator=g)
    new_k = torch.randn(total, kv_heads, d, generator=g)
    new_v = torch.randn(total, kv_heads, d, generator=g)
    positions = np.concatenate(
        [np.arange(n - ql, n) for n, ql in zip(seq_lens, q_lens, strict=True)]
    )
    req = np.repeat(np.arange(b), q_lens)
    slots = tables.numpy()[req, positions // page_size] * page_size + positions % page_size
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    batch = ForwardBatch(
        input_ids=np.zeros(total, dtype=np.int64),
        positions=positions,
        q_lens=np.array(q_lens),
        seq_lens=np.array(seq_lens),
        query_start_loc=starts,
        page_tables=tables.numpy(),
        slot_mapping=slots,
        logits_indices=starts[1:] - 1,
        page_size=page_size,
    )
    return batch, k_cache, v_cache, tables, q, new_k, new_v


@pytest.mark.parametrize("params", SPECS)
@pytest.mark.parametrize("path", ["explicit", "padded-sdpa", "long-prompt", "native"])
def test_mixed_step_honours_the_spec(path, params, monkeypatch):
    """A fresh prompt, two chunks extending cached KV and decodes in one step, through each
    prompt path; the decode rows take the C kernel (native) or the torch decode."""
    import radixserve.executor.attention as attention

    if path == "padded-sdpa":
        monkeypatch.setattr(attention, "_SMALL_CONTEXT", 0)
    if path == "long-prompt":  # the fresh prompt takes the long-prompt (SDPA) branch
        monkeypatch.setattr(attention, "_SMALL_CAUSAL", 8)
    heads, kv_heads, d, page_size = 6, 2, 32, 4
    seq_lens, q_lens = [27, 23, 60, 12, 41], [27, 5, 19, 1, 1]
    batch, k_cache, v_cache, tables, q, new_k, new_v = _mixed_step(
        4, seq_lens, q_lens, heads, kv_heads, d, page_size
    )
    spec = _spec(params, d)
    backend = TorchNativeAttention(
        _Cache(k_cache, v_cache), heads, d, use_native=path == "native", specs=[spec]
    )
    if path == "native" and backend.native_prefill is None:
        pytest.skip("native prefill kernel unavailable")
    meta = backend.prepare(batch)
    out = backend.forward(0, q, new_k, new_v, meta).view(len(q), heads, d)
    ref = _spec_reference(q, k_cache, v_cache, tables, seq_lens, q_lens, spec)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_prompt_in_chunks_across_the_window(use_native):
    """A 200-token prompt in chunks under a 24-key window (chunks longer and shorter than
    the window, boundaries mid-page), then decodes past it: each query sees exactly its
    last 24 positions."""
    heads, kv_heads, d, page_size, window = 4, 2, 32, 5, 24
    spec = AttentionSpec(d**-0.5, window)
    boundaries = [0, 37, 38, 90, 171, 200, 201, 202]
    length = boundaries[-1]
    g = torch.Generator().manual_seed(12)
    num_pages = -(-length // page_size)
    k_cache = torch.zeros(num_pages + 2, kv_heads, page_size, d)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_pages + 2, generator=g)[:num_pages]
    q_all = torch.randn(length, heads, d, generator=g)
    k_all = torch.randn(length, kv_heads, d, generator=g)
    v_all = torch.randn(length, kv_heads, d, generator=g)
    backend = TorchNativeAttention(
        _Cache(k_cache, v_cache), heads, d, use_native=use_native, specs=[spec]
    )
    outs = []
    for start, end in itertools.pairwise(boundaries):
        positions = np.arange(start, end)
        slots = table.numpy()[positions // page_size] * page_size + positions % page_size
        batch = ForwardBatch(
            input_ids=np.zeros(end - start, dtype=np.int64),
            positions=positions,
            q_lens=np.array([end - start]),
            seq_lens=np.array([end]),
            query_start_loc=np.array([0, end - start]),
            page_tables=table.numpy()[None, : -(-end // page_size)],
            slot_mapping=slots,
            logits_indices=np.array([end - start - 1]),
            page_size=page_size,
        )
        sl = slice(start, end)
        outs.append(backend.forward(0, q_all[sl], k_all[sl], v_all[sl], backend.prepare(batch)))
    out = torch.cat(outs).view(-1, heads, d)
    ref = _spec_reference(q_all, k_cache, v_cache, table[None], [length], [length], spec)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
