"""The KV tiers' storage: a host copy of evicted pages and page records on disk.

``TierTransfer`` implements ``core.kv_tiers.KVTransfer`` for one ``KVCache``: demotions copy
pool pages into ``HostKVStore`` slots, promotions copy them back, and host slots leaving
the host tier are written (by a background thread) as one file per page under the disk
tier's folder, found again by the hash of the token prefix up to and including that page.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixserve.executor.kv_cache import KVCache, zeroed

logger = logging.getLogger(__name__)

_MAGIC = b"RSKVPAGE"
_VERSION = 1
# magic, version, identity digest, record key, payload bytes, payload crc32
_HEADER = struct.Struct("<8sI16s16sQI")
_HEADER_BYTES = 4096  # the payload starts on an OS page: the mmap'd bytes are aligned
_SUFFIX = ".kv"
_MAX_QUEUED_BYTES = 256 << 20  # writes waiting beyond this are dropped (a cache, not a log)


def model_identity(
    weights: Path | None,
    dtype: torch.dtype,
    page_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    extra: str = "",
) -> str:
    """A string that changes whenever the KV of a prefix could differ: the weights (each
    file's path, size and mtime: not a hash of gigabytes), the dtype, the page size and the
    cache shapes (plus ``extra``: e.g. the quantization)."""
    parts = [
        f"dtype={str(dtype).removeprefix('torch.')}",
        f"page_size={page_size}",
        f"layers={num_layers}",
        f"kv_heads={num_kv_heads}",
        f"head_dim={head_dim}",
        f"extra={extra}",
    ]
    if weights is not None:
        files = sorted(weights.rglob("*")) if weights.is_dir() else [weights]
        for f in files:
            if f.is_file() and f.suffix in (".gguf", ".safetensors", ".bin", ".json", ""):
                st = f.stat()
                parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


class HostKVStore:
    """Every page tensor of a ``KVCache`` (keys, values, an int8 cache's scales) for
    ``num_slots`` pages, in the same dtypes and page layout. Invariant: allocated once;
    ``tensors[i]`` mirrors ``kv.page_tensors()[i]``; slot ids come from the radix cache's
    ``TierSlots`` (this class only holds the bytes). ``pin``: page-locked memory, for
    asynchronous copies to and from a GPU."""

    def __init__(self, kv: KVCache, num_slots: int, pin: bool = False) -> None:
        self.tensors: list[torch.Tensor] = []
        for t in kv.page_tensors():
            shape = (t.shape[0], num_slots, *t.shape[2:])
            if pin:
                self.tensors.append(torch.zeros(shape, dtype=t.dtype, pin_memory=True))
            else:  # untouched pages cost nothing until a page is demoted into them
                self.tensors.append(zeroed(shape, t.dtype, "cpu"))
        self.num_slots = num_slots
        self.page_bytes = kv.page_bytes


class DiskKVStore:
    """Page records in ``folder/<identity digest>/<key hex>.kv``: a 4 KiB header (magic,
    version, model identity digest, record key, payload size, CRC32 of the payload), then
    the page's slice of each ``KVCache.page_tensors`` tensor in turn (keys, values, an int8
    cache's scales), every layer, in the cache's dtypes.

    Invariants: ``_index`` (key → bytes, least recently used first) lists the records
    written or being written, and ``used_bytes`` is their sum, at most ``limit_bytes``
    (the least recently used are deleted to make room); a record is written to a temporary
    name and renamed, so a reader sees a whole file or none; a record whose header names
    another identity, or whose checksum fails, is never used (it is deleted: a miss).
    """

    def __init__(self, folder: Path, identity: str, limit_bytes: int, payload_bytes: int) -> None:
        self.identity = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self.folder = Path(folder) / self.identity.hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        ident_file = self.folder / "identity.txt"
        if not ident_file.exists():
            ident_file.write_text(identity + "\n")
        self.payload_bytes = payload_bytes
        self.record_bytes = _HEADER_BYTES + payload_bytes
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: dict[bytes, bytes] = {}  # queued, not yet on disk: key -> payload
        self._queued_bytes = 0
        self.used_bytes = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.write_seconds = 0.0
        self.read_seconds = 0.0
        self.num_corrupt = 0
        self.num_dropped_writes = 0
        self._scan()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # -- index ----------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + _SUFFIX)

    def _scan(self) -> None:
        """Index the records a previous run left (oldest first); remove unfinished writes."""
        found: list[tuple[int, bytes, int]] = []
        for f in self.folder.iterdir():
            if f.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    f.unlink()
                continue
            if not f.name.endswith(_SUFFIX):
                continue
            try:
                key = bytes.fromhex(f.name[: -len(_SUFFIX)])
                st = f.stat()
            except (ValueError, OSError):
                continue
            if len(key) == 16:
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        with self._lock:
            self._make_room(0)

    def _make_room(self, size: int) -> bool:
        """Delete least-recently-used records until ``size`` more bytes fit (lock held)."""
        if size > self.limit_bytes:
            return False
        while self.used_bytes + size > self.limit_bytes and self._index:
            key, old = self._index.popitem(last=False)
            self.used_bytes -= old
            if self._pending.pop(key, None) is not None:
                self._queued_bytes -= old
            with contextlib.suppress(OSError):
                self._path(key).unlink()
        return True

    def lookup(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are indexed."""
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._index:
                    break
                n += 1
            return n

    def touch(self, key: bytes) -> bool:
        """Whether ``key`` is indexed (then it becomes the most recently used)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            return False

    @property
    def num_records(self) -> int:
        return len(self._index)

    # -- write ----------------------------------------------------------------------------
    def put(self, key: bytes, payload: bytes, block: bool = False) -> None:
        """Queue a record (``payload``: the page's bytes, owned by the store from now on).
        When the queue is full the record is dropped (a cache), or with ``block`` written
        after the queue drains (a shutdown's ``persist``)."""
        size = self.record_bytes
        if block and self._queued_bytes + size > _MAX_QUEUED_BYTES:
            self.drain()
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            if self._queued_bytes + size > _MAX_QUEUED_BYTES or not self._make_room(size):
                self.num_dropped_writes += 1
                return
            self._index[key] = size
            self.used_bytes += size
            self._pending[key] = payload
            self._queued_bytes += size
        self._queue.put(key)

    def _writer(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                self._queue.task_done()
                return
            try:
                self._write(key)
            except Exception:  # a cache: a failed write is a record we do not have
                logger.exception("writing a KV record failed")
                with self._lock:
                    if self._pending.pop(key, None) is not None:
                        self._queued_bytes -= self.record_bytes
                    size = self._index.pop(key, None)
                    if size is not None:
                        self.used_bytes -= size
            finally:
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            payload = self._pending.get(key)
        if payload is None:
            return  # deleted to make room before it was written
        t0 = time.perf_counter()
        header = _HEADER.pack(
            _MAGIC, _VERSION, self.identity, key, len(payload), zlib.crc32(payload)
        ).ljust(_HEADER_BYTES, b"\0")
        path = self._path(key)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        with self._lock:
            if self._pending.pop(key, None) is not None:
                self._queued_bytes -= self.record_bytes
            if key not in self._index:  # deleted meanwhile
                with contextlib.suppress(OSError):
                    path.unlink()
            self.bytes_written += len(header) + len(payload)
            self.write_seconds += time.perf_counter() - t0

    def drain(self) -> None:
        """Wait until every queued record is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._thread.join(timeout=10)

    # -- read -----------------------------------------------------------------------------
    def read_into(self, key: bytes, out: np.ndarray) -> bool:
        """Copy record ``key``'s verified payload into ``out`` (uint8, payload-sized);
        False — and the record forgotten — if it is missing, truncated, corrupt or another
        model's."""
        t0 = time.perf_counter()
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                out[:] = np.frombuffer(pending, dtype=np.uint8)
                self._index.move_to_end(key)
                return True
        ok = False
        try:
            with (
                open(self._path(key), "rb") as f,
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
            ):
                ok = self._verify_copy(mm, key, out)
        except (OSError, ValueError):
            ok = False
        with self._lock:
            if ok:
                if key in self._index:
                    self._index.move_to_end(key)
                self.bytes_read += self.record_bytes
                self.read_seconds += time.perf_counter() - t0
            else:
                self.num_corrupt += 1
                size = self._index.pop(key, None)
                if size is not None:
                    self.used_bytes -= size
                with contextlib.suppress(OSError):
                    self._path(key).unlink()
        if not ok:
            logger.warning("KV record %s missing or corrupt: a cache miss", key.hex())
        return ok

    def _verify_copy(self, mm: mmap.mmap, key: bytes, out: np.ndarray) -> bool:
        if len(mm) != self.record_bytes:
            return False
        magic, version, identity, rec_key, size, crc = _HEADER.unpack_from(mm, 0)
        if (
            magic != _MAGIC
            or version != _VERSION
            or identity != self.identity
            or rec_key != key
            or size != self.payload_bytes
        ):
            return False
        payload = np.frombuffer(mm, dtype=np.uint8, count=size, offset=_HEADER_BYTES)
        try:
            if zlib.crc32(payload) != crc:
                return False
            out[:] = payload
        finally:
            del payload  # the mmap closes only once no view of it is left
        return True

    def check(self) -> None:
        """Raise AssertionError unless the index agrees with the folder (call after
        ``drain``): every indexed record is a file of its size, no other record file, the
        total within the limit."""
        with self._lock:
            assert sum(self._index.values()) == self.used_bytes, "disk bytes != index"
            assert self.used_bytes <= self.limit_bytes, "disk tier over its limit"
            assert not self._pending, "records still queued (drain first)"
            files = {
                bytes.fromhex(f.name[: -len(_SUFFIX)]): f.stat().st_size
                for f in self.folder.iterdir()
                if f.name.endswith(_SUFFIX)
            }
            assert files == dict(self._index), "disk records != index"


# Above this many runs a copy gathers and scatters by index instead (one call per tensor).
_MAX_RUNS = 64


def page_runs(dst: np.ndarray, src: np.ndarray) -> list[tuple[int, int, int]]:
    """``(dst start, src start, length)`` of the maximal runs in which both ``dst`` and
    ``src`` go up by one page at a time (in order: page ``dst[i]`` gets ``src[i]``)."""
    if dst.size != src.size:
        raise ValueError(f"{dst.size} destination pages for {src.size} source pages")
    if dst.size == 0:
        return []
    d = np.asarray(dst, dtype=np.int64)
    s = np.asarray(src, dtype=np.int64)
    cut = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [d.size]))
    return list(zip(d[starts].tolist(), s[starts].tolist(), (ends - starts).tolist(), strict=True))


def copy_pages(
    dst: torch.Tensor, dst_pages: np.ndarray, src: torch.Tensor, src_pages: np.ndarray
) -> None:
    """``dst[:, dst_pages[i]] = src[:, src_pages[i]]`` for every i (tensors [layers, pages,
    ...], possibly on different devices): one strided slice copy per run of consecutive
    pages on both sides — no gathered temporary, the bytes are read and written once —, or
    a gather and scatter by index when the pages are too scattered for that."""
    runs = page_runs(dst_pages, src_pages)
    if len(runs) <= _MAX_RUNS:
        for d0, s0, n in runs:
            dst[:, d0 : d0 + n].copy_(src[:, s0 : s0 + n])
        return
    d_idx = torch.from_numpy(np.ascontiguousarray(dst_pages, dtype=np.int64)).to(dst.device)
    s_idx = torch.from_numpy(np.ascontiguousarray(src_pages, dtype=np.int64)).to(src.device)
    dst.index_copy_(1, d_idx, src.index_select(1, s_idx).to(dst.device))


@dataclass
class TransferStats:
    """Bytes and seconds moved between tiers (counters only increase)."""

    host_bytes_in: int = 0  # pool -> host
    host_bytes_out: int = 0  # host -> pool
    host_seconds: float = 0.0
    disk_bytes_in: int = 0  # queued host -> disk
    disk_bytes_out: int = 0  # disk -> pool
    disk_seconds: float = 0.0  # reading records (writing is on the writer thread)


class TierTransfer:
    """``core.kv_tiers.KVTransfer`` over one ``KVCache``, a ``HostKVStore`` and an optional
    ``DiskKVStore``. Invariant: every method has finished with the pool's pages when it
    returns (disk writes carry their own copy of the bytes)."""

    def __init__(self, kv: KVCache, host: HostKVStore, disk: DiskKVStore | None = None) -> None:
        self.kv = kv
        self.host = host
        self.disk = disk
        self.page_bytes = host.page_bytes
        self.stats = TransferStats()

    @property
    def has_disk(self) -> bool:
        return self.disk is not None

    def save(self, pool_pages: np.ndarray, slots: np.ndarray) -> None:
        t0 = time.perf_counter()
        for host, pool in zip(self.host.tensors, self.kv.page_tensors(), strict=True):
            copy_pages(host, slots, pool, pool_pages)
        self.stats.host_bytes_in += slots.size * self.page_bytes
        self.stats.host_seconds += time.perf_counter() - t0

    def load(self, slots: np.ndarray, pool_pages: np.ndarray) -> None:
        t0 = time.perf_counter()
        for host, pool in zip(self.host.tensors, self.kv.page_tensors(), strict=True):
            copy_pages(pool, pool_pages, host, slots)
        self.stats.host_bytes_out += slots.size * self.page_bytes
        self.stats.host_seconds += time.perf_counter() - t0

    def copy(self, src: int, dst: int) -> None:
        self.kv.copy_pages(torch.tensor([src]), torch.tensor([dst]))

    def _pages_bytes(self, tensors: list[torch.Tensor], ids: list[int]) -> np.ndarray:
        """Pages ``ids`` of ``tensors`` (a cache's or the host store's page tensors) as rows
        of raw bytes: each row the page's slice of every tensor in turn (``DiskKVStore``'s
        payload): each tensor gathered page-major in one copy, then written into its columns."""
        idx = torch.tensor(ids, dtype=torch.int64, device=tensors[0].device)
        rows = np.empty((len(ids), self.page_bytes), dtype=np.uint8)
        start = 0
        for t in tensors:
            part = t.transpose(0, 1)[idx].cpu()  # [n, layers, ...], contiguous
            width = part[0].numel() * part.element_size()
            rows[:, start : start + width] = part.view(torch.uint8).reshape(len(ids), width).numpy()
            start += width
        assert start == self.page_bytes
        return rows

    def spill(self, slots: np.ndarray, keys: list[bytes], from_pool: bool = False) -> None:
        disk = self.disk
        if disk is None:
            return
        todo = [(slot, key) for slot, key in zip(slots.tolist(), keys, strict=True)]
        todo = [(slot, key) for slot, key in todo if not disk.touch(key)]
        if not todo:
            return
        tensors = self.kv.page_tensors() if from_pool else self.host.tensors
        rows = self._pages_bytes(tensors, [s for s, _ in todo])
        for row, (_, key) in zip(rows, todo, strict=True):
            disk.put(key, row.tobytes(), block=from_pool)
        self.stats.disk_bytes_in += len(todo) * self.page_bytes

    def disk_lookup(self, keys: list[bytes]) -> int:
        return 0 if self.disk is None else self.disk.lookup(keys)

    def disk_load(self, keys: list[bytes], pool_pages: np.ndarray) -> int:
        disk = self.disk
        if disk is None:
            return 0
        t0 = time.perf_counter()
        n = min(len(keys), pool_pages.size)
        buf = np.empty((n, self.page_bytes), dtype=np.uint8)
        loaded = 0
        while loaded < n and disk.read_into(keys[loaded], buf[loaded]):
            loaded += 1
        if loaded:
            rows, start = np.arange(loaded), 0
            for t in self.kv.page_tensors():
                width = t[:, 0].numel() * t.element_size()
                part = np.ascontiguousarray(buf[:loaded, start : start + width])
                data = (
                    torch.from_numpy(part).view(t.dtype).reshape(loaded, t.shape[0], *t.shape[2:])
                )
                copy_pages(t, pool_pages[:loaded], data.transpose(0, 1), rows)
                start += width
        self.stats.disk_bytes_out += loaded * self.page_bytes
        self.stats.disk_seconds += time.perf_counter() - t0
        return loaded

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
