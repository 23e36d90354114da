"""glibc malloc tuning for the CPU model: keep freed step buffers for reuse.

A prefill step of 2,048 tokens allocates and frees megabyte-sized activations hundreds of
times (matmul outputs, norms, attention outputs). By default glibc serves blocks of that
size with fresh ``mmap`` calls and unmaps them on free, so every step page-faults (and the
kernel zeroes) the same memory again; measured on SmolLM2's W1 prefill step: 582 → 531 ms
with the settings below (``RADIXSERVE_MALLOC_TUNING=0`` turns them off, to compare). They
raise the size served from the heap to glibc's maximum (32 MiB) and stop the heap from
being trimmed, so the process keeps its peak activation memory — a fixed amount per step
size, not a growth. Before that, the heap is trimmed once, giving back what loading freed
(`python benchmarks/load_memory.py`: resident set after loading SmolLM2 with a 0.1 GiB KV
cache, 0.907 → 0.566 GiB with int4 weights, 0.904 → 0.699 GiB in bfloat16).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)
_TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Apply the tuning once per process (glibc only; ``RADIXSERVE_MALLOC_TUNING=0`` turns it
    off). Returns whether it is in effect."""
    global _done
    if _done:
        return True
    if os.environ.get("RADIXSERVE_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith(
        "linux"
    ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.info("mallopt refused the step-buffer tuning")
    # Called once the model is loaded: give back what loading freed (plain weights that
    # were reordered or quantized, conversion buffers) before the heap stops being trimmed.
    with contextlib.suppress(AttributeError):
        libc.malloc_trim(0)
    _done = ok
    return ok
