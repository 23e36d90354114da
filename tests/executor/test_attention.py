"""Paged attention against dense float64 references: the native decode and prefill kernels
(the prefill kernel also in its portable, non-AVX-512 build), the PyTorch paths, mixed steps
(fresh prompts, chunks extending cached KV, decodes) and a prompt run chunk by chunk."""

from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest
import torch

from radixserve.executor.attention import TorchNativeAttention
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.native import (
    cpu_tiers,
    load_paged_decode,
    load_paged_prefill,
    make_shared_prefix,
    paged_decode,
    paged_decode_supports,
    paged_prefill,
    paged_prefill_supports,
)

needs_compiler = pytest.mark.skipif(
    (shutil.which("cc") is None and shutil.which("gcc") is None)
    or os.environ.get("RADIXSERVE_NATIVE") == "0",
    reason="no C compiler, or native kernels turned off",
)


class _Cache:
    """Just the caches of one layer, as KVCache.write would hand them out."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def write(self, layer, slots, k, v):
        page_size = self.k.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        self.k[pages, :, offsets] = k
        self.v[pages, :, offsets] = v
        return self.k, self.v


def _case(seed, seq_lens, heads, kv_heads, d, page_size, dtype):
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = b * max_pages + 3
    k = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)
    v = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)
    q = torch.randn(b, heads, d, generator=g).to(dtype)
    # shuffled, non-contiguous pages per sequence
    perm = torch.randperm(num_pages, generator=g)[: b * max_pages].view(b, max_pages)
    return q, k, v, perm, torch.tensor(seq_lens)


def _dense_reference(q, k, v, page_tables, seq_lens):
    """Per sequence: gather its tokens, plain softmax attention in float64."""
    b, heads, d = q.shape
    kv_heads, page_size = k.shape[1], k.shape[2]
    out = torch.empty(b, heads, d, dtype=torch.float64)
    for i in range(b):
        n = int(seq_lens[i])
        pages = page_tables[i, : -(-n // page_size)]
        keys = k[pages].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].double()
        values = v[pages].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].double()
        keys = keys.repeat_interleave(heads // kv_heads, dim=0)
        values = values.repeat_interleave(heads // kv_heads, dim=0)
        scores = q[i].double()[:, None, :] @ keys.transpose(1, 2) * d**-0.5  # [heads, 1, n]
        out[i] = (torch.softmax(scores, dim=-1) @ values)[:, 0]
    return out


def _decode_batch(tables: torch.Tensor, lens: torch.Tensor, page_size: int) -> ForwardBatch:
    """One decode row per sequence: its new token at position len - 1, in its last page."""
    b = len(lens)
    last = lens - 1
    slots = tables[torch.arange(b), last // page_size] * page_size + last % page_size
    return ForwardBatch(
        input_ids=np.zeros(b, dtype=np.int64),
        positions=last.numpy(),
        q_lens=np.ones(b, dtype=np.int64),
        seq_lens=lens.numpy(),
        query_start_loc=np.arange(b + 1),
        page_tables=tables.numpy(),
        slot_mapping=slots.numpy(),
        logits_indices=np.arange(b),
        page_size=page_size,
    )


CASES = [
    # seq_lens, heads, kv_heads, head_dim, page_size
    ([1, 16, 17, 300, 33], 9, 3, 64, 16),
    ([5, 1, 64], 4, 4, 32, 1),
    ([7, 40], 8, 1, 128, 8),
    ([129, 2], 6, 2, 48, 32),
    # long contexts (the online softmax rescales across many 16-key blocks), GQA group 8
    ([1100, 31, 16], 9, 3, 64, 16),
    ([70, 3], 8, 1, 128, 1),
    ([45], 10, 2, 64, 7),  # group 5, pages that split the 16-key blocks
    ([1, 17, 300], 8, 2, 256, 16),  # Gemma 3's head_dim 256 and group 4
]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_native_kernel_matches_dense_reference(case, dtype):
    lib = load_paged_decode()
    assert lib is not None, "the native kernel did not build although a compiler exists"
    seq_lens, heads, kv_heads, d, page_size = case
    q, k, v, tables, lens = _case(1, seq_lens, heads, kv_heads, d, page_size, dtype)
    out = paged_decode(lib, q, k, v, tables.int(), lens.int(), d**-0.5)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    ref = _dense_reference(q, k, v, tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("use_native", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_through_backend_matches_dense_reference(use_native, dtype):
    """The backend's decode (torch path or kernel) over a ForwardBatch of decode rows: it
    writes each row's new K/V at its slot, then attends over the row's whole context."""
    seq_lens, heads, kv_heads, d, page_size = [3, 16, 17, 50], 6, 2, 32, 16
    q, k, v, tables, lens = _case(2, seq_lens, heads, kv_heads, d, page_size, dtype)
    new_k = torch.randn(len(seq_lens), kv_heads, d).to(dtype)
    new_v = torch.randn(len(seq_lens), kv_heads, d).to(dtype)
    b = len(seq_lens)
    batch = _decode_batch(tables, lens, page_size)
    backend = TorchNativeAttention(_Cache(k, v), heads, d, use_native=use_native)
    if use_native and backend.native is None:
        pytest.skip("native kernel unavailable")
    out = backend.forward(0, q, new_k, new_v, backend.prepare(batch)).view(b, heads, d)
    ref = _dense_reference(q, k, v, tables, lens)  # k/v now hold the new tokens too
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_bfloat16_decode_uses_avx512_bf16_where_the_cpu_has_it():
    """On a CPU with AVX-512 BF16 (this project's machines) the bfloat16 entry must take the
    vectorised path that the cases above then check; elsewhere the portable C path."""
    lib = load_paged_decode()
    if lib is None:
        pytest.skip("native kernel unavailable")
    with open("/proc/cpuinfo") as f:
        has_bf16 = "avx512_bf16" in f.read()
    assert lib.paged_decode_has_avx512_bf16() == int(has_bf16)


def _shared_prefix_case(seed, prefix_pages, suffix_lens, heads, kv_heads, d, page_size):
    """bfloat16 decode rows that all start with the same `prefix_pages` pages (shuffled page
    ids, as the radix cache hands them out), then pages of their own."""
    g = torch.Generator().manual_seed(seed)
    b = len(suffix_lens)
    own = max(-(-s // page_size) for s in suffix_lens)
    num_pages = prefix_pages + b * own + 2
    k = torch.randn(num_pages, kv_heads, page_size, d, generator=g).bfloat16()
    v = torch.randn(num_pages, kv_heads, page_size, d, generator=g).bfloat16()
    q = (2 * torch.randn(b, heads, d, generator=g)).bfloat16()  # sharper softmax
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.empty(b, prefix_pages + own, dtype=torch.int64)
    tables[:, :prefix_pages] = perm[:prefix_pages]
    tables[:, prefix_pages:] = perm[prefix_pages : prefix_pages + b * own].view(b, own)
    lens = torch.tensor([prefix_pages * page_size + s for s in suffix_lens])
    return q, k, v, tables, lens


SHARED_CASES = [
    # prefix pages, suffix lengths, heads, kv_heads, head_dim, page_size
    (64, [1, 2, 15, 16, 17, 40, 1, 9], 9, 3, 64, 16),  # SmolLM2's shape, ragged suffixes
    (8, [3, 3, 3, 3, 3], 8, 2, 128, 16),  # GQA 4, head_dim 128, exactly 128 shared keys
    (300, [1, 5, 70, 2], 8, 1, 128, 1),  # page size 1: prefix cut to a multiple of 16
    (20, [7, 1, 33, 4], 10, 2, 64, 8),  # group 5, 160 keys: a chunk and a part-chunk
]


@needs_compiler
@pytest.mark.parametrize("case", SHARED_CASES)
def test_shared_prefix_decode_matches_dense_reference(case):
    """Two-pass decode (the shared prefix once for all rows, then each row's own pages from
    that partial state) against float64, and against the one-pass kernel."""
    lib = load_paged_decode()
    if lib is None or not lib.paged_decode_has_avx512_bf16():
        pytest.skip("needs the AVX-512 BF16 decode path")
    prefix_pages, suffix_lens, heads, kv_heads, d, page_size = case
    q, k, v, tables, lens = _shared_prefix_case(
        3, prefix_pages, suffix_lens, heads, kv_heads, d, page_size
    )
    prefix = make_shared_prefix(
        lib,
        tables.int().numpy(),
        lens.numpy(),
        page_size,
        kv_heads,
        d,
        heads // kv_heads,
        torch.bfloat16,
    )
    assert prefix is not None and prefix.length >= 128
    assert prefix.length % 16 == 0 and prefix.length <= prefix_pages * page_size
    two_pass = paged_decode(lib, q, k, v, tables.int(), lens.int(), d**-0.5, prefix)
    one_pass = paged_decode(lib, q, k, v, tables.int(), lens.int(), d**-0.5)
    ref = _dense_reference(q, k, v, tables, lens)
    torch.testing.assert_close(two_pass.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(two_pass.double(), one_pass.double(), atol=1.6e-2, rtol=1e-2)


@needs_compiler
def test_backend_decode_of_rows_sharing_a_prefix_takes_the_two_pass_kernel():
    """A decode batch whose rows share their leading pages (as after a radix-cache hit) goes
    through the two-pass path inside the backend, new K/V written first, and matches float64."""
    heads, kv_heads, d, page_size = 9, 3, 64, 16
    suffix_lens = [1, 4, 17, 30, 2]
    q, k, v, tables, lens = _shared_prefix_case(4, 12, suffix_lens, heads, kv_heads, d, page_size)
    b = len(suffix_lens)
    new_k = torch.randn(b, kv_heads, d).bfloat16()
    new_v = torch.randn(b, kv_heads, d).bfloat16()
    batch = _decode_batch(tables, lens, page_size)
    backend = TorchNativeAttention(_Cache(k, v), heads, d)
    if backend.native is None or not backend.native.paged_decode_has_avx512_bf16():
        pytest.skip("needs the AVX-512 BF16 decode path")
    meta = backend.prepare(batch)
    assert meta.decode.prefix is not None and meta.decode.prefix.length == 12 * page_size
    out = backend.forward(0, q, new_k, new_v, meta).view(b, heads, d)
    ref = _dense_reference(q, k, v, tables, lens)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    backend.shared_prefix = False  # the one-pass kernel: the switch really changes the path
    assert backend.prepare(batch).decode.prefix is None


def test_shared_prefix_is_only_the_pages_every_row_holds_before_its_last_token():
    from radixserve.executor.native import shared_prefix_length

    tables = np.array([[4, 9, 2, 7, 1], [4, 9, 2, 7, 3], [4, 9, 2, 8, 5]])
    # rows share 3 pages (48 tokens at page size 16)
    assert shared_prefix_length(tables, np.array([80, 80, 80]), 16) == 48
    # a row whose last token lies in the third page keeps only 2 pages shared
    assert shared_prefix_length(tables, np.array([80, 40, 80]), 16) == 32
    # page size 4: 3 pages are 12 tokens, cut to a multiple of 16 -> 0
    assert shared_prefix_length(tables, np.array([80, 80, 80]), 4) == 0
    assert shared_prefix_length(tables[:, :0], np.array([1, 1, 1]), 16) == 0
    # one row: all of its full pages before the last token
    assert shared_prefix_length(tables[:1], np.array([66]), 16) == 64


def test_unsupported_shapes_take_the_torch_path():
    lib = load_paged_decode()
    if lib is None:
        pytest.skip("native kernel unavailable")
    q, k, v, tables, lens = _case(3, [4], 32, 1, 16, 4, torch.float32)  # group 32 > 16
    assert not paged_decode_supports(torch.float32, 32, 16, 4)
    assert not paged_decode_supports(torch.float16, 1, 64, 16)
    with pytest.raises(ValueError, match="group 32"):
        paged_decode(lib, q, k, v, tables.int(), lens.int(), 0.25)
    # the backend decides once, at construction, and then never calls the kernel
    assert TorchNativeAttention(_Cache(k, v), 32, 16).native is None
    assert TorchNativeAttention(_Cache(k, v), 1, 16).native is lib


def _dense_causal_reference(q, k_cache, v_cache, tables, seq_lens, q_lens):
    """Each query j of a request attends to kv positions 0 .. seq_len - q_len + j."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pages = tables[i, : -(-n // page_size)]
        keys = k_cache[pages].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].double()
        values = v_cache[pages].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].double()
        keys = keys.repeat_interleave(heads // kv_heads, dim=0)
        values = values.repeat_interleave(heads // kv_heads, dim=0)
        for j in range(ql):
            visible = n - ql + j + 1
            scores = q[row].double()[:, None, :] @ keys[:, :visible].transpose(1, 2) * d**-0.5
            out[row] = (torch.softmax(scores, dim=-1) @ values[:, :visible])[:, 0]
            row += 1
    return out


@pytest.mark.parametrize("path", ["explicit", "padded-sdpa", "native"])
def test_mixed_step_matches_dense_reference(path, monkeypatch):
    """One step with a fresh prompt, two chunks extending cached KV and a decode, through
    each implementation of the prompt paths (the two PyTorch ones and the C kernel)."""
    import radixserve.executor.attention as attention

    if path == "padded-sdpa":
        monkeypatch.setattr(attention, "_SMALL_CONTEXT", 0)
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, d, page_size = 6, 2, 32, 4
    seq_lens, q_lens = [7, 23, 30, 12], [7, 5, 9, 1]  # fresh, context, context, decode
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
    backend = TorchNativeAttention(_Cache(k_cache, v_cache), heads, d, use_native=path == "native")
    if path == "native" and backend.native_prefill is None:
        pytest.skip("native prefill kernel unavailable")
    meta = backend.prepare(batch)
    assert (len(meta.context_spans), meta.prefill is not None, meta.native_prefill is not None) == {
        "explicit": (2, False, False),
        "padded-sdpa": (0, True, False),
        "native": (0, False, True),
    }[path]
    out = backend.forward(0, q, new_k, new_v, meta).view(total, heads, d)
    # the caches now hold the new tokens too
    ref = _dense_causal_reference(q, k_cache, v_cache, tables, seq_lens, q_lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


PREFILL_CASES = [
    # seq_lens, q_lens, heads, kv_heads, head_dim, page_size: fresh prompts (q == seq),
    # prefixes ending mid-page, chunks across query blocks (96 rows) and key tiles (32)
    ([300, 77, 5], [100, 77, 1], 9, 3, 64, 16),
    ([50, 5, 33], [49, 3, 33], 4, 4, 32, 1),
    ([130, 64], [130, 31], 8, 1, 128, 7),
    ([99, 40], [33, 1], 6, 2, 48, 5),
    ([71, 200], [70, 97], 8, 2, 96, 3),
    ([257], [250], 16, 1, 16, 32),
]


@needs_compiler
@pytest.mark.parametrize("tier", cpu_tiers())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_kernel_matches_dense_reference(case, dtype, tier):
    """The C prefill kernel, both builds: this machine's (AVX-512, bf16 products where head
    sizes are multiples of 32) and the portable one, over shuffled pages, with q a strided
    view as the model hands it over (q and k of one fused projection)."""
    lib = load_paged_prefill(tier)
    assert lib is not None, "the prefill kernel did not build although a compiler exists"
    seq_lens, q_lens, heads, kv_heads, d, page_size = case
    assert paged_prefill_supports(dtype, heads // kv_heads, d)
    g = torch.Generator().manual_seed(7)
    b = len(seq_lens)
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = b * max_pages + 2
    k = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)
    v = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)
    tables = torch.randperm(num_pages, generator=g)[: b * max_pages].view(b, max_pages)
    total = sum(q_lens)
    qk = torch.randn(total, heads + kv_heads, d, generator=g).to(dtype)
    q = qk[:, :heads]  # token stride (heads + kv_heads) * d
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    out = torch.full((total, heads, d), float("nan"), dtype=dtype)
    paged_prefill(
        lib,
        q,
        k,
        v,
        tables.int(),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(q_lens, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        d**-0.5,
        out,
    )
    ref = _dense_causal_reference(q, k, v, tables, seq_lens, q_lens)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_prefill_kernel_refuses_unsupported_shapes():
    lib = load_paged_prefill()
    if lib is None:
        pytest.skip("native prefill kernel unavailable")
    assert not paged_prefill_supports(torch.float32, 32, 64)  # group > 16
    assert not paged_prefill_supports(torch.float32, 2, 33)  # odd head size
    assert not paged_prefill_supports(torch.float16, 1, 64)
    k = torch.zeros(2, 1, 4, 16)
    q = torch.zeros(3, 32, 16)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="group 32"):
        paged_prefill(lib, q, k, k, one.view(1, 1), one * 0, one * 3, one * 3, 0.25, q.clone())
    assert TorchNativeAttention(_Cache(k, k), 32, 16).native_prefill is None


@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_in_chunks_matches_dense_reference(use_native, dtype, monkeypatch):
    """One 300-token prompt through the backend in chunks that end anywhere (mid-page,
    across key tiles and query blocks), after a cached prefix that ends mid-page: each chunk
    writes its K/V, then attends over everything before it. The torch side runs with small
    explicit-path limits so its padded SDPA path is covered too."""
    import radixserve.executor.attention as attention

    if not use_native:
        monkeypatch.setattr(attention, "_SMALL_CONTEXT", 150)
    heads, kv_heads, d, page_size = 6, 2, 64, 5
    boundaries = [0, 37, 38, 141, 229, 300]  # [0, 37): the cached prefix
    length = boundaries[-1]
    g = torch.Generator().manual_seed(11)
    num_pages = -(-length // page_size)
    k_cache = torch.zeros(num_pages + 3, kv_heads, page_size, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_pages + 3, generator=g)[:num_pages]
    q_all = torch.randn(length, heads, d, generator=g).to(dtype)
    k_all = torch.randn(length, kv_heads, d, generator=g).to(dtype)
    v_all = torch.randn(length, kv_heads, d, generator=g).to(dtype)
    backend = TorchNativeAttention(_Cache(k_cache, v_cache), heads, d, use_native=use_native)
    if use_native and backend.native_prefill is None:
        pytest.skip("native prefill kernel unavailable")
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
        meta = backend.prepare(batch)
        sl = slice(start, end)
        outs.append(backend.forward(0, q_all[sl], k_all[sl], v_all[sl], meta))
    out = torch.cat(outs[1:]).view(-1, heads, d)
    # dense reference over the whole sequence, queries after the cached prefix
    pages = table[None]
    ref = _dense_causal_reference(
        q_all[boundaries[1] :], k_cache, v_cache, pages, [length], [length - boundaries[1]]
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


_KV_MEMORY_PROBE = """
import os, torch
from radixserve.executor.kv_cache import KVCache

def resident_mib():  # now, not the peak
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

before = resident_mib()
kv = KVCache(4, 4096, 16, 4, 64, torch.bfloat16)  # 2 x 128 MiB
allocated = resident_mib()
assert kv.k.data_ptr() % 64 == 0 and kv.v.data_ptr() % 64 == 0
assert kv.k.is_contiguous() and kv.k.shape == (4, 4096, 4, 16, 64)
assert not kv.k[:, ::97].any() and not kv.v[:, ::97].any()
kv.k.fill_(1.0)  # every page of k written (as torch.zeros writes them all)
print(allocated - before, resident_mib() - before)
"""


@pytest.mark.slow  # a fresh interpreter: a long-lived one reuses memory already resident
def test_kv_cache_memory_is_zero_aligned_and_untouched_until_written():
    """The CPU KV cache comes from calloc: zeros, 64-byte aligned (as PyTorch's allocator),
    and its pages are not written at allocation (2 x 128 MiB add next to nothing to a fresh
    process's resident memory until tokens are stored)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _KV_MEMORY_PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    allocated, written = float(out[0]), float(out[1])
    assert allocated < 32 and written > 100, (allocated, written)
    slots = torch.tensor([0, 17, 4095 * 16 + 15])
    from radixserve.executor.kv_cache import KVCache

    kv = KVCache(4, 4096, 16, 4, 64, torch.bfloat16)
    k = torch.randn(3, 4, 64).to(torch.bfloat16)
    kv.write(2, slots, k, -k)
    assert torch.equal(kv.k[2, 4095, :, 15], k[2]) and torch.equal(kv.v[2, 1, :, 1], -k[1])
