"""Native CPU kernels: small C files built with the system C compiler at first use.

The build is cached under ``$RADIXSERVE_CACHE`` (default ``~/.cache/radixserve``), keyed by
the source, the flags and this CPU's feature flags. When there is no compiler or the build
fails, ``load_paged_decode()`` returns None and callers keep their PyTorch path; set
``RADIXSERVE_NATIVE=0`` to disable native kernels.

Every kernel is built for one instruction-set tier (``TIERS``), chosen once per process
from the CPU's features (``kernel_tier``): AVX-512 BF16 (``-march=native``: the hand-written
AVX-512 paths, AMX where present), AVX-512, AVX2 + FMA + F16C, ARM NEON, or scalar C. The
tiers below AVX-512 BF16 run each kernel's portable path (GCC vector extensions and plain C
loops, lowered by the tier's flags). ``RADIXSERVE_ISA`` forces a tier; one the CPU lacks is
refused (``ValueError``): a kernel is never built for instructions the CPU does not have.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import torch

from radixserve.core.cache_dir import cache_root

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
_FLAGS = [
    "-O3",
    "-ffp-contract=fast",
    # let float reductions (dot products) vectorise; no -ffast-math: -inf must stay -inf
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fno-math-errno",  # expf may vectorise (libmvec)
    "-fopenmp",
    "-shared",
    "-fPIC",
]


def _cpu_flags() -> str:
    """This CPU's feature flags: /proc/cpuinfo's ``flags`` (x86) or ``Features`` (ARM)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


X86_TIERS = ("avx512bf16", "avx512", "avx2", "scalar")
ARM_TIERS = ("neon", "scalar")
TIERS = ("avx512bf16", "avx512", "avx2", "neon", "scalar")
# What each x86 SIMD tier enables, spelled feature by feature rather than as an x86-64
# level (-march=x86-64-v3 needs GCC 11 or clang 12), over the baseline -march=x86-64:
# /proc/cpuinfo's name of each feature, and its compiler flag.
_AVX2_FEATURES = (
    ("ssse3", "-mssse3"),
    ("sse4_1", "-msse4.1"),
    ("sse4_2", "-msse4.2"),
    ("popcnt", "-mpopcnt"),
    ("avx", "-mavx"),
    ("avx2", "-mavx2"),
    ("fma", "-mfma"),
    ("f16c", "-mf16c"),
    ("bmi1", "-mbmi"),
    ("bmi2", "-mbmi2"),
)
_AVX512_FEATURES = (
    *_AVX2_FEATURES,
    ("avx512f", "-mavx512f"),
    ("avx512bw", "-mavx512bw"),
    ("avx512vl", "-mavx512vl"),
    ("avx512dq", "-mavx512dq"),
    ("avx512cd", "-mavx512cd"),
)
# what each tier needs of /proc/cpuinfo's flags (x86) or features (aarch64): every feature
# its flags let the compiler use
_TIER_NEEDS = {
    "avx512bf16": (*(f for f, _ in _AVX512_FEATURES), "avx512_bf16"),
    "avx512": tuple(f for f, _ in _AVX512_FEATURES),
    "avx2": tuple(f for f, _ in _AVX2_FEATURES),
    "neon": ("asimd",),
    "scalar": (),
}
_X86_MACHINES, _ARM_MACHINES = ("x86_64", "AMD64"), ("aarch64", "arm64")
_X86 = platform.machine() in _X86_MACHINES
_ARM = platform.machine() in _ARM_MACHINES
# the compiler flags of each tier: the AVX-512 BF16 tier is this CPU's own (-march=native:
# AMX where it has it), the other x86 tiers the baseline plus their features, tuned for this
# CPU; ARM's NEON tier this CPU's own, its scalar tier without Advanced SIMD; on any other
# machine the compiler's defaults
_TIER_FLAGS = {
    "avx512bf16": ("-march=native",),
    "avx512": ("-march=x86-64", "-mtune=native", *(f for _, f in _AVX512_FEATURES)),
    "avx2": ("-march=x86-64", "-mtune=native", *(f for _, f in _AVX2_FEATURES)),
    "neon": ("-mcpu=native",),
    "scalar": (
        ("-march=x86-64", "-mtune=generic", "-Wno-psabi")
        if _X86
        else ("-march=armv8-a+nosimd",)
        if _ARM
        else ()
    ),
}


def cpu_tiers(flags: str | None = None, machine: str | None = None) -> tuple[str, ...]:
    """The tiers this CPU can run, best first (``flags``: a /proc/cpuinfo flags or
    Features line; ``machine``: ``platform.machine()``; both default to this machine's)."""
    machine = machine or platform.machine()
    have = set((_cpu_flags() if flags is None else flags).split())
    if machine in _X86_MACHINES:
        names = X86_TIERS
    elif machine in _ARM_MACHINES and sys.platform == "linux":  # /proc/cpuinfo
        names = ARM_TIERS
    else:
        return ("scalar",)
    return tuple(t for t in names if all(f in have for f in _TIER_NEEDS[t]))


@cache
def kernel_tier() -> str:
    """The tier every native kernel of this process is built for: ``RADIXSERVE_ISA`` where
    set (``ValueError`` naming the tiers this CPU has when it lacks that one), else the best
    this CPU runs. A CPU with none of the SIMD tiers gets ``scalar`` and a warning."""
    tiers = cpu_tiers()
    forced = os.environ.get("RADIXSERVE_ISA")
    if forced:
        if forced not in TIERS:
            raise ValueError(f"RADIXSERVE_ISA={forced}: not a kernel tier ({', '.join(TIERS)})")
        if forced not in tiers:
            raise ValueError(
                f"RADIXSERVE_ISA={forced}: this CPU lacks it (it runs {', '.join(tiers)})"
            )
        return forced
    if tiers[0] == "scalar":
        log.warning(
            "no AVX2, AVX-512 or NEON found on this CPU (%s): native kernels run their scalar C "
            "tier",
            platform.machine(),
        )
    return tiers[0]


def _cache_dir() -> Path:
    return cache_root() / "native"


# per-source extras: -ffast-math lets expf vectorise through glibc's libmvec; the
# elementwise kernels need no inf/NaN semantics beyond what the hardware gives, except the
# argmax, which finds NaN by compare instructions and bit tests that fast-math keeps
_EXTRA_FLAGS = {"elementwise.c": ["-ffast-math"]}
if _X86:
    # the LoRA products' loops in full AVX-512 vectors where the CPU has them (gcc's default
    # for -march=native is 256 bits): 1.4x at 16 rows here
    _EXTRA_FLAGS["lora.c"] = ["-mprefer-vector-width=512"]


# changes whenever the way a library is built changes (not only its flags)
_RECIPE = "compile-then-link-2"


def _build(source: Path, tier: str | None = None) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: native kernels disabled")
        return None
    tier = tier or kernel_tier()
    flags = [*_FLAGS, *_TIER_FLAGS[tier], *_EXTRA_FLAGS.get(source.name, [])]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes()
        + headers
        + " ".join([compiler, *flags, _RECIPE]).encode()
        + _cpu_flags().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build into a temporary name, then rename: concurrent builders never see half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    # Compiled and linked in two steps: linking with -ffast-math would add crtfastmath.o,
    # whose constructor turns on flush-to-zero for the whole process when the library is
    # loaded (denormals would vanish in torch and numpy too).
    compile_flags = [f for f in flags if f != "-shared"]
    link_flags = [f for f in flags if f in ("-shared", "-fopenmp", "-fPIC")]
    obj = tmp[: -len(".so")] + ".o"
    cmds = [
        [compiler, *compile_flags, "-c", "-o", obj, str(source)],
        [compiler, *link_flags, "-o", tmp, obj, "-lm"],
    ]
    # a first run on a new machine (or after an upgrade) pays about a second per kernel
    print(
        f"radixserve: building native CPU kernel {source.name} for {tier} (first run only)",
        file=sys.stderr,
        flush=True,
    )
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        log.warning("building %s failed (%s): %s", source.name, exc, stderr.decode()[-2000:])
        Path(tmp).unlink(missing_ok=True)
        return None
    finally:
        Path(obj).unlink(missing_ok=True)
    os.replace(tmp, target)
    return target


def _load(source: Path, tier: str | None = None) -> ctypes.CDLL | None:
    """The library built from ``source`` for ``tier`` (default: ``kernel_tier()``; one this
    CPU lacks is a ValueError), or None when native kernels are off or it cannot be built or
    loaded."""
    if os.environ.get("RADIXSERVE_NATIVE", "1") == "0":
        return None
    if tier is not None and tier not in cpu_tiers():
        raise ValueError(
            f"kernel tier {tier}: this CPU lacks it (it runs {', '.join(cpu_tiers())})"
        )
    try:
        path = _build(source, tier)
    except OSError as exc:  # e.g. an unwritable cache directory
        log.warning("native kernels unavailable: %s", exc)
        return None
    if path is None:
        return None
    # torch is loaded first, so the library's libgomp.so.1 resolves to torch's own OpenMP
    # runtime: one thread pool for both.
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:  # e.g. a damaged cache entry: rebuild next time, fall back now
        log.warning("loading %s failed: %s", path, exc)
        path.unlink(missing_ok=True)
        return None
    return lib


@cache
def load_paged_decode(tier: str | None = None) -> ctypes.CDLL | None:
    """The paged-decode library (None: use the PyTorch path)."""
    lib = _load(_SOURCE, tier=tier)
    if lib is None:
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    for name in ("paged_decode_bf16", "paged_decode_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [p, p, p, p, p, i, i, i, i, i, i, f, i, f, i, p, p, i]
        fn.restype = i
    for name in _INT8_ENTRY.values():
        fn = getattr(lib, name)
        fn.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i, f, i, f, i, p]
        fn.restype = i
    lib.paged_decode_has_avx512_bf16.argtypes = []
    lib.paged_decode_has_avx512_bf16.restype = i
    if lib.paged_decode_has_avx512_bf16():
        fn = lib.paged_decode_prefix_bf16
        fn.argtypes = [p, p, p, p, i, i, i, i, i, i, f, f, i, p, p]
        fn.restype = i
    return lib


@cache
def load_elementwise(tier: str | None = None) -> ctypes.CDLL | None:
    """The fused row-wise kernels (None: use the PyTorch path)."""
    lib = _load(_SOURCE.with_name("elementwise.c"), tier=tier)
    if lib is None:
        return None
    p, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for suffix in ("bf16", "f32"):
        silu = getattr(lib, f"silu_and_mul_{suffix}")
        silu.argtypes = [p, p, i64, i64, i]
        silu.restype = None
        norm = getattr(lib, f"add_rms_norm_{suffix}")
        norm.argtypes = [p, p, p, p, i64, i64, f, i]
        norm.restype = None
        rotary = getattr(lib, f"rotary_{suffix}")
        rotary.argtypes = [p, i64, i64, i64, i64, p, p, i]
        rotary.restype = None
    lib.kv_write.argtypes = [p, p, i64, i64, p, p, p, i64, i64, i64, i64, i]
    lib.kv_write.restype = None
    for name in ("kv_write_int8_bf16", "kv_write_int8_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [p, p, i64, i64, p, p, p, p, p, i64, i64, i64, i64, i]
        fn.restype = None
    lib.argmax_rows_bf16.argtypes = [p, i64, i64, p, i]
    lib.argmax_rows_bf16.restype = None
    lib.has_gelu_tanh_and_mul.argtypes = []
    lib.has_gelu_tanh_and_mul.restype = i
    if lib.has_gelu_tanh_and_mul():
        lib.gelu_tanh_and_mul_bf16.argtypes = [p, p, i64, i64, i]
        lib.gelu_tanh_and_mul_bf16.restype = None
    return lib


_ENTRY = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
# over an int8 cache (codes and per-token-head scales), by the queries' dtype
_INT8_ENTRY = {torch.bfloat16: "paged_decode_i8_bf16", torch.float32: "paged_decode_i8_f32"}
# the kernel's fixed per-task buffers (MAX_GROUP, MAX_HEAD_DIM, MAX_PAGE in paged_decode.c)
_MAX_GROUP, _MAX_HEAD_DIM, _MAX_PAGE = 16, 256, 256


def paged_decode_supports(dtype: torch.dtype, group: int, head_dim: int, page_size: int) -> bool:
    """Whether ``paged_decode`` handles caches of this dtype and these shapes."""
    return (
        dtype in _ENTRY
        and group <= _MAX_GROUP
        and head_dim <= _MAX_HEAD_DIM
        and page_size <= _MAX_PAGE
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    prefix: SharedPrefix | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its pages (the last ``window`` of
    them when set; scores soft-capped at ``softcap`` when set).

    q [b, heads, d] and the caches [num_pages, kv_heads, page_size, d] share a dtype and
    are contiguous CPU tensors; page_tables [b, max_pages] and seq_lens [b] are int32.
    Returns [b, heads, d]. Shapes must pass ``paged_decode_supports`` (ValueError
    otherwise).

    ``prefix``: the first ``prefix.length`` keys of every sequence are the same pages
    (``shared_prefix_length`` finds them); they are attended once for all sequences
    (``paged_decode_prefix_bf16``) and each sequence's own kernel continues from there;
    with a ``window``, only when every sequence is no longer than it (ValueError else)."""
    b, heads, d = q.shape
    _, kv_heads, page_size, _ = k_cache.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("q and the caches must share a dtype")
    if not paged_decode_supports(q.dtype, heads // kv_heads, d, page_size):
        raise ValueError(
            f"paged_decode does not handle {q.dtype}, group {heads // kv_heads}, head_dim "
            f"{d}, page_size {page_size}"
        )
    for t in (q, k_cache, v_cache, page_tables, seq_lens):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert page_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    entry = _ENTRY[q.dtype]
    out = torch.empty_like(q)
    state, skip = None, 0
    if prefix is not None:
        if window is not None and int(seq_lens.max()) > window:
            raise ValueError("a shared prefix outside a sequence's window")
        state = _prefix_state(lib, q, k_cache, v_cache, page_tables, prefix, scale, softcap)
        skip = prefix.length
    rc = getattr(lib, entry)(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        page_tables.data_ptr(),
        seq_lens.data_ptr(),
        b,
        page_tables.shape[1],
        kv_heads,
        heads // kv_heads,
        page_size,
        d,
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
        out.data_ptr(),
        None if state is None else state.data_ptr(),
        skip,
    )
    if rc != 0:  # the checks above mirror the kernel's, so this is a bug
        raise RuntimeError(f"{entry} refused its arguments ({rc})")
    return out


def paged_decode_int8(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    page_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``paged_decode`` over an int8 cache: the codes [num_pages, kv_heads, page_size, d]
    (int8) and their scales [num_pages, kv_heads, page_size] (float32), as
    ``KVCache(kv_cache_dtype="int8")`` holds them; q [b, heads, d] bfloat16 or float32.
    Each key's score is its scale times q · codes, each value weighted by its softmax
    weight times its scale, in float32. No shared-prefix pass."""
    b, heads, d = q.shape
    _, kv_heads, page_size, _ = k_codes.shape
    if q.dtype not in _INT8_ENTRY or k_codes.dtype != torch.int8 or v_codes.dtype != torch.int8:
        raise ValueError("paged_decode_int8: int8 codes, and bfloat16 or float32 queries")
    if not paged_decode_supports(q.dtype, heads // kv_heads, d, page_size):
        raise ValueError(
            f"paged_decode_int8 does not handle group {heads // kv_heads}, head_dim {d}, "
            f"page_size {page_size}"
        )
    for t in (q, k_codes, v_codes, k_scale, v_scale, page_tables, seq_lens):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32
    assert page_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    entry = _INT8_ENTRY[q.dtype]
    out = torch.empty_like(q)
    rc = getattr(lib, entry)(
        q.data_ptr(),
        k_codes.data_ptr(),
        v_codes.data_ptr(),
        k_scale.data_ptr(),
        v_scale.data_ptr(),
        page_tables.data_ptr(),
        seq_lens.data_ptr(),
        b,
        page_tables.shape[1],
        kv_heads,
        heads // kv_heads,
        page_size,
        d,
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
        out.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"{entry} refused its arguments ({rc})")
    return out


# a shared prefix shorter than this is attended by each sequence's own kernel: below it the
# second pass costs more than the shared reads save
MIN_SHARED_PREFIX = 128
MIN_SHARED_BATCH = 4


class SharedPrefix:
    """The keys every sequence of a decode batch holds in the same pages. Invariant:
    ``length`` is a positive multiple of 16 and of the page size, and strictly below every
    sequence's length (each sequence has at least its own last key after it); ``scratch``
    holds the repacked keys and values of one layer (reused layer after layer)."""

    __slots__ = ("length", "pages", "scratch")

    def __init__(self, length: int, pages: torch.Tensor, scratch: torch.Tensor) -> None:
        self.length = length
        self.pages = pages
        self.scratch = scratch


def shared_prefix_length(page_tables: np.ndarray, seq_lens: np.ndarray, page_size: int) -> int:
    """The longest run of leading pages that every row shares, in tokens, cut to full pages
    before each row's last token and to a multiple of 16 and of the page size (0: none)."""
    if page_tables.shape[0] == 0 or page_tables.shape[1] == 0:
        return 0
    differs = (page_tables != page_tables[0]).any(axis=0)
    common = int(np.argmax(differs)) if differs.any() else page_tables.shape[1]
    common = min(common, int((seq_lens.min() - 1) // page_size))
    unit = math.lcm(16, page_size)
    return max(0, common * page_size // unit * unit)


def make_shared_prefix(
    lib: ctypes.CDLL | None,
    page_tables: np.ndarray,
    seq_lens: np.ndarray,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
) -> SharedPrefix | None:
    """A SharedPrefix for this decode batch when the two-pass kernel applies and pays off."""
    if (
        lib is None
        or dtype != torch.bfloat16
        or head_dim not in (64, 128)
        or group > _MAX_GROUP
        or page_tables.shape[0] < MIN_SHARED_BATCH
        or not lib.paged_decode_has_avx512_bf16()
    ):
        return None
    length = shared_prefix_length(page_tables, seq_lens, page_size)
    if length < MIN_SHARED_PREFIX:
        return None
    pages = torch.from_numpy(np.ascontiguousarray(page_tables[0, : length // page_size]))
    # 64-byte aligned scratch for the repacked K and V of every kv head
    raw = torch.empty(kv_heads * length * head_dim * 2 + 32, dtype=torch.bfloat16)
    offset = (-raw.data_ptr() % 64) // 2
    scratch = raw[offset : offset + kv_heads * length * head_dim * 2]
    return SharedPrefix(length, pages.to(torch.int32), scratch)


def _prefix_state(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    prefix: SharedPrefix,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    b, heads, d = q.shape
    _, kv_heads, page_size, _ = k_cache.shape
    if q.dtype != torch.bfloat16 or not lib.paged_decode_has_avx512_bf16():
        raise ValueError("the shared-prefix decode runs on the AVX-512 BF16 path only")
    state = torch.empty(b, heads, d + 2, dtype=torch.float32)
    rc = lib.paged_decode_prefix_bf16(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        prefix.pages.data_ptr(),
        prefix.length,
        b,
        kv_heads,
        heads // kv_heads,
        page_size,
        d,
        scale,
        softcap or 0.0,
        torch.get_num_threads(),
        state.data_ptr(),
        prefix.scratch.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"paged_decode_prefix_bf16 refused its arguments ({rc})")
    return state


@cache
def load_paged_prefill(tier: str | None = None) -> ctypes.CDLL | None:
    """The chunked-prefill attention library (None: use the PyTorch path); below the AVX-512
    tiers, float32 products everywhere."""
    lib = _load(_SOURCE.with_name("paged_prefill.c"), tier=tier)
    if lib is None:
        return None
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for name in ("paged_prefill_bf16", "paged_prefill_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, p, p, i, p, p, p, i, i, i, i, i, f, i, f, i, p, i64]
        fn.restype = i
    lib.paged_prefill_has_fast_bf16.argtypes = []
    lib.paged_prefill_has_fast_bf16.restype = i
    return lib


_PREFILL_ENTRY = {torch.bfloat16: "paged_prefill_bf16", torch.float32: "paged_prefill_f32"}
# MAX_GROUP and MAX_HEAD_DIM in paged_prefill.c; head sizes must be even (bf16 pairs)
_PREFILL_MAX_GROUP, _PREFILL_MAX_HEAD_DIM = 16, 256


def paged_prefill_supports(dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """Whether ``paged_prefill`` handles caches of this dtype and these shapes (any page
    size)."""
    return (
        dtype in _PREFILL_ENTRY
        and 1 <= group <= _PREFILL_MAX_GROUP
        and head_dim <= _PREFILL_MAX_HEAD_DIM
        and head_dim % 2 == 0
    )


def paged_prefill(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of prefill chunks over their pages, written into ``out`` (a query
    at position p attends keys ``p - window + 1 .. p`` when ``window`` is set; scores
    soft-capped at ``softcap`` when set).

    Request r's queries are rows ``q_starts[r] .. q_starts[r] + q_lens[r] - 1`` of q
    [T, heads, d] (any token stride; heads and d contiguous), at positions
    ``seq_lens[r] - q_lens[r] ..``; its keys ``0 .. seq_lens[r] - 1`` are already in the
    caches [num_pages, kv_heads, page_size, d] at pages ``page_tables[r]``. Those rows of
    ``out`` [T, heads, d] (contiguous) get the result; other rows are left alone.
    page_tables [b, max_pages], q_starts, q_lens, seq_lens [b] are int32."""
    _, heads, d = q.shape
    _, kv_heads, page_size, _ = k_cache.shape
    if not (k_cache.dtype == v_cache.dtype == q.dtype == out.dtype):
        raise ValueError("q, out and the caches must share a dtype")
    if not paged_prefill_supports(q.dtype, heads // kv_heads, d):
        raise ValueError(
            f"paged_prefill does not handle {q.dtype}, group {heads // kv_heads}, head_dim {d}"
        )
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    for t in (k_cache, v_cache, page_tables, q_starts, q_lens, seq_lens, out):
        assert t.is_contiguous() and t.device.type == "cpu"
    for t in (page_tables, q_starts, q_lens, seq_lens):
        assert t.dtype == torch.int32
    entry = _PREFILL_ENTRY[q.dtype]
    rc = getattr(lib, entry)(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        page_tables.data_ptr(),
        page_tables.shape[1],
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        seq_lens.data_ptr(),
        q_lens.shape[0],
        kv_heads,
        heads // kv_heads,
        page_size,
        d,
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
        out.data_ptr(),
        out.stride(0),
    )
    if rc == -2:
        raise MemoryError(f"{entry}: no memory for its scratch buffers")
    if rc != 0:  # the checks above mirror the kernel's, so this is a bug
        raise RuntimeError(f"{entry} refused its arguments ({rc})")


@cache
def load_qlinear(tier: str | None = None) -> ctypes.CDLL | None:
    """The int8 / int4 weight dequantizers (None: quantized layers use PyTorch's kernels
    at every row count)."""
    lib = _load(_SOURCE.with_name("qlinear.c"), tier=tier)
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.qdequant_int8_bf16.argtypes = [p, p, i64, i64, i, p]
    lib.qdequant_int8_bf16.restype = i
    lib.qdequant_int4pack_bf16.argtypes = [p, p, i64, i64, i, i64, i64, i, p]
    lib.qdequant_int4pack_bf16.restype = i
    return lib


@cache
def load_token_mask(tier: str | None = None) -> ctypes.CDLL | None:
    """The grammar-mask kernels (None: ``GrammarBatch.apply`` unpacks bits with numpy).
    Below the AVX-512 tiers, the scalar loop instead of AVX-512 masked stores."""
    lib = _load(_SOURCE.with_name("token_mask.c"), tier=tier)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for suffix in ("bf16", "f32"):
        fn = getattr(lib, f"apply_token_bitmask_{suffix}")
        fn.argtypes = [p, i64, p, i64, p, i64, i64]
        fn.restype = None
    return lib


def apply_token_bitmask(
    lib: ctypes.CDLL, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> bool:
    """Sets ``logits[r, t] = -inf`` wherever bit t of ``bitmask[r]`` is clear, for r in
    ``rows`` (int64); logits [n, vocab] bfloat16/float32 on the CPU with unit column stride,
    bitmask [n, words] int32 contiguous. Returns False (nothing done) when the tensors do not
    fit those rules."""
    suffix = {torch.bfloat16: "bf16", torch.float32: "f32"}.get(logits.dtype)
    if (
        suffix is None
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.stride(1) != 1
        or bitmask.dtype != torch.int32
        or not bitmask.is_contiguous()
        or bitmask.shape[0] != logits.shape[0]
        or rows.dtype != torch.int64
        or not rows.is_contiguous()
    ):
        return False
    getattr(lib, f"apply_token_bitmask_{suffix}")(
        logits.data_ptr(),
        logits.stride(0),
        bitmask.data_ptr(),
        bitmask.shape[1],
        rows.data_ptr(),
        rows.numel(),
        logits.shape[1],
    )
    return True


# From these many rows the int4 and int8 panel GEMMs multiply in AMX tiles where the CPU
# has them (amx_tiles.h; benchmarks/quant_matmul.py, int4_panel against int4_avx). Against
# their AVX-512 paths, on SmolLM2's and Gemma 3's layer shapes (2 threads, the Xeon of
# docs/benchmarks): int4 0.8-0.9x at 2 rows, 1.0-1.2x at 4, 1.7-1.8x at 8; int8 0.8-1.3x
# at 8 rows, 1.5-1.7x at 12.
INT4_AMX_ROWS = 8
INT8_AMX_ROWS = 12


def int8_pair_rows() -> int:
    """From how many rows the int8 panel GEMM multiplies bfloat16 pairs of codes
    (vdpbf16ps; int8_panels.c: dp_rows) instead of float32 multiply-adds; 0: never.

    Only on AMD CPUs: there one vdpbf16ps issues like one multiply-add, so its two products
    a lane halve a tile's multiply-adds (Zen 5, 2 threads, Gemma 3's int8 shapes: 0.90x the
    float32 loop's time at 2 rows, 0.61x at 16; benchmarks/int8_panels.py); on the Xeon of
    docs/benchmarks it costs two, and was 0.58-0.85x as fast at 4-31 rows.
    ``RADIXSERVE_INT8_PAIR_ROWS`` overrides."""
    forced = os.environ.get("RADIXSERVE_INT8_PAIR_ROWS")
    if forced is not None:
        return max(0, int(forced))
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return 0
    return 2 if "AuthenticAMD" in vendor else 0


_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@cache
def amx_permission() -> bool:
    """Whether this process may use AMX tiles: Linux hands out their 8 KB of register state
    only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, once per
    process, for all its threads). False without the CPU flags, on another OS, when the
    kernel refuses, or with ``RADIXSERVE_AMX=0``."""
    if os.environ.get("RADIXSERVE_AMX", "1") == "0":
        return False
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    flags = _cpu_flags().split()
    if "amx_tile" not in flags or "amx_bf16" not in flags:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(
            ctypes.c_long(_SYS_ARCH_PRCTL),
            ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
            ctypes.c_long(_XFEATURE_XTILEDATA),
        )
    except (OSError, AttributeError):
        return False
    return rc == 0


def _amx_controls(lib: ctypes.CDLL, prefix: str, rows: int) -> None:
    """Declare a panel library's AMX controls (amx_tiles.h: AMX_CONTROLS) and turn its
    tiles on from ``rows`` rows where they are built and granted."""
    i, i64 = ctypes.c_int, ctypes.c_int64
    for name, args, res in (
        ("has_amx", [], i),
        ("set_amx_rows", [i], None),
        ("amx_rows", [], i),
        ("amx_calls", [], i64),
    ):
        fn = getattr(lib, f"{prefix}_{name}")
        fn.argtypes, fn.restype = args, res
    if getattr(lib, f"{prefix}_has_amx")() and amx_permission():
        getattr(lib, f"{prefix}_set_amx_rows")(rows)


@cache
def load_int4_panels(tier: str | None = None) -> ctypes.CDLL | None:
    """The int4 "panels" GEMM (a few rows) and dequantizer (None: Int4Linear keeps
    PyTorch's int4 layout and kernels): the AVX-512 BF16 code on that tier, the portable
    path on the others (``int4_panels_has_gemm()``: 1 or 2)."""
    lib = _load(_SOURCE.with_name("int4_panels.c"), tier=tier)
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.int4_panels_has_gemm.argtypes = []
    lib.int4_panels_has_gemm.restype = i
    if not lib.int4_panels_has_gemm():
        return None
    for entry in (lib.int4_panels_gemm_bf16, lib.int4_panels_gemm_bf16_invariant):
        entry.argtypes = [p, i64, i64, p, p, i64, i64, p, p, p, i64, i]
        entry.restype = i
    lib.int4_panels_dequant_bf16.argtypes = [p, p, i64, i64, i64, i64, i, p]
    lib.int4_panels_dequant_bf16.restype = i
    lib.int4_panels_invariant_rows.argtypes = [p, p]
    lib.int4_panels_invariant_rows.restype = i
    _amx_controls(lib, "int4_panels", INT4_AMX_ROWS)
    return lib


@cache
def load_int8_panels(tier: str | None = None) -> ctypes.CDLL | None:
    """The group-wise int8 "panels" GEMM (a few rows) and dequantizer (None: native kernels
    off or not built; Int8GroupLinear then runs its plain-torch fallback): AVX-512 BF16 code
    on that tier, the portable path on the others."""
    lib = _load(_SOURCE.with_name("int8_panels.c"), tier=tier)
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.int8_panels_has_gemm.argtypes = []
    lib.int8_panels_has_gemm.restype = i
    if not lib.int8_panels_has_gemm():
        return None
    lib.int8_panels_gemm_bf16.argtypes = [p, i64, i64, p, p, p, i64, i64, p, p, p, i64, i]
    lib.int8_panels_gemm_bf16.restype = i
    lib.int8_panels_dequant_bf16.argtypes = [p, p, p, i64, i64, i64, i64, i, p]
    lib.int8_panels_dequant_bf16.restype = i
    lib.int8_panels_set_dp_rows.argtypes = [i]
    lib.int8_panels_set_dp_rows.restype = None
    lib.int8_panels_dp_rows.argtypes = []
    lib.int8_panels_dp_rows.restype = i
    lib.int8_panels_invariant_rows.argtypes = [p, p]
    lib.int8_panels_invariant_rows.restype = i
    lib.int8_panels_set_dp_rows(int8_pair_rows())
    _amx_controls(lib, "int8_panels", INT8_AMX_ROWS)
    return lib


def invariant_rows(lib: ctypes.CDLL, prefix: str) -> tuple[int, int | None] | None:
    """The row counts (lo, hi; hi None: no bound) of a panel library's calls in which each row
    is computed by the same operations in the same order whatever the other rows
    (``PREFIX_invariant_rows``: deterministic mode), or None where no count qualifies (its
    AMX tiles from too few rows)."""
    lo, hi = ctypes.c_int64(), ctypes.c_int64()
    if getattr(lib, f"{prefix}_invariant_rows")(ctypes.byref(lo), ctypes.byref(hi)) != 0:
        return None
    return lo.value, hi.value or None


@cache
def load_dense_panels(tier: str | None = None) -> ctypes.CDLL | None:
    """Products of plain bfloat16 or float32 weights in panels, each row's result a function
    of that row alone (``dense_panels.c``: deterministic mode; None: native kernels off or not
    built)."""
    lib = _load(_SOURCE.with_name("dense_panels.c"), tier=tier)
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("dense_panels_bf16", "dense_panels_f32", "dense_panels_bf16_f32w"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [p, i64, i64, p, i64, p, i64, i], i
    return lib


@cache
def load_decode_program(tier: str | None = None) -> ctypes.CDLL | None:
    """The one-call decode step (``decode_program.c``: a list of kernel calls run in order;
    None: the op-by-op path)."""
    lib = _load(_SOURCE.with_name("decode_program.c"), tier=tier)
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.decode_program_run.argtypes = [p, i64, p]
    lib.decode_program_run.restype = i
    return lib


@cache
def load_lora(tier: str | None = None) -> ctypes.CDLL | None:
    """LoRA adapters' segmented low-rank products (``lora.c``; None: the PyTorch path).
    Below AVX-512 BF16, its plain C loops."""
    lib = _load(_SOURCE.with_name("lora.c"), tier=tier)
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.lora_apply_bf16.argtypes = [p, i64, p, i64, i64, i64, i64, p, i64, i64, i]
    lib.lora_apply_bf16.restype = i
    return lib


def address(fn: ctypes._CFuncPtr) -> int:
    """The address of a loaded library's function (to put in a decode program)."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value is not None
    return value
