"""The KV tiers' page copies (executor/kv_tiers.copy_pages) against indexing: runs of
consecutive pages as slice copies, scattered pages by index, and both through
TierTransfer's demotion and promotion and its disk records, for bfloat16 and int8 caches
(whose scales move with their codes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.executor import kv_tiers
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.kv_tiers import (
    DiskKVStore,
    HostKVStore,
    TierTransfer,
    copy_pages,
    page_runs,
)


def test_page_runs_split_where_either_side_jumps():
    dst = np.array([3, 4, 5, 9, 10, 2])
    src = np.array([7, 8, 0, 1, 2, 3])
    assert page_runs(dst, src) == [(3, 7, 2), (5, 0, 1), (9, 1, 2), (2, 3, 1)]
    assert page_runs(np.zeros(0, np.int32), np.zeros(0, np.int32)) == []
    with pytest.raises(ValueError):
        page_runs(np.arange(3), np.arange(2))


@pytest.mark.parametrize("layout", ["runs", "scattered", "many runs"])
def test_copy_pages_equals_indexing(layout, monkeypatch):
    rng = np.random.default_rng(0)
    src_t = torch.randn(3, 40, 2, 4, 8).to(torch.bfloat16)
    dst_t = torch.randn(3, 30, 2, 4, 8).to(torch.bfloat16)
    n = 12
    if layout == "runs":
        src = np.concatenate([np.arange(5, 10), np.arange(20, 27)])
        dst = np.concatenate([np.arange(0, 8), np.arange(17, 21)])
    else:
        src = rng.permutation(40)[:n]
        dst = rng.permutation(30)[:n]
    if layout == "many runs":  # past the limit: one gather and one scatter
        monkeypatch.setattr(kv_tiers, "_MAX_RUNS", 2)
    expected = dst_t.clone()
    expected[:, torch.from_numpy(dst)] = src_t[:, torch.from_numpy(src)]
    copy_pages(dst_t, dst, src_t, src)
    assert torch.equal(dst_t, expected)


def _filled_cache(kv_cache_dtype: str) -> KVCache:
    kv = KVCache(
        num_layers=2,
        num_pages=10,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
    )
    for t in kv.page_tensors():  # codes, or values, and an int8 cache's scales
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    return kv


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_transfer_round_trip_through_host_slots(kv_cache_dtype):
    kv = _filled_cache(kv_cache_dtype)
    assert len(kv.page_tensors()) == (4 if kv_cache_dtype == "int8" else 2)
    before = [t.clone() for t in kv.page_tensors()]
    transfer = TierTransfer(kv, HostKVStore(kv, 16))
    pool_pages = np.array([1, 2, 3, 7, 0], dtype=np.int32)
    slots = np.array([9, 10, 4, 5, 15], dtype=np.int32)
    transfer.save(pool_pages, slots)
    for t in kv.page_tensors():
        t.zero_()
    back = np.array([6, 7, 8, 2, 3], dtype=np.int32)
    transfer.load(slots, back)
    for p, b in zip(pool_pages.tolist(), back.tolist(), strict=True):
        for t, old in zip(kv.page_tensors(), before, strict=True):
            assert torch.equal(t[:, b], old[:, p])
    assert transfer.stats.host_bytes_in == transfer.stats.host_bytes_out == 5 * transfer.page_bytes
    # an int8 page: a byte a value plus a float32 scale per token and head, K and V
    per_value = 1 + 4 / 8 if kv_cache_dtype == "int8" else 2
    assert kv.page_bytes == int(2 * 2 * 4 * 2 * 8 * per_value)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_disk_records_carry_every_page_tensor(kv_cache_dtype, tmp_path):
    """A page written to the disk tier (from the pool and from a host slot) comes back into
    another pool page with its keys, values and scales."""
    kv = _filled_cache(kv_cache_dtype)
    before = [t.clone() for t in kv.page_tensors()]
    disk = DiskKVStore(tmp_path, "test", 1 << 20, kv.page_bytes)
    host = HostKVStore(kv, 4)
    transfer = TierTransfer(kv, host, disk)
    transfer.spill(np.array([2, 5]), [b"a" * 16, b"b" * 16], from_pool=True)
    transfer.save(np.array([7]), np.array([3]))
    transfer.spill(np.array([3]), [b"c" * 16])
    disk.drain()
    for t in kv.page_tensors():
        t.zero_()
    keys = [b"a" * 16, b"b" * 16, b"c" * 16]
    assert transfer.disk_load(keys, np.array([0, 1, 9])) == 3
    for src, dst in ((2, 0), (5, 1), (7, 9)):
        for t, old in zip(kv.page_tensors(), before, strict=True):
            assert torch.equal(t[:, dst], old[:, src])
    transfer.close()
