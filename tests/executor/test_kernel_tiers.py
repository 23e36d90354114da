"""Kernel tiers (native/__init__.py: kernel_tier): chosen from the CPU's features, forced by
RADIXSERVE_ISA only where the CPU has the tier, and every tier this machine runs checked
against float64: the panel GEMMs (int4 and int8, from the codes) and their dequantizers."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from radixserve.executor import native
from radixserve.executor.native import cpu_tiers, load_int4_panels, load_int8_panels
from radixserve.executor.quant import (
    Int4Linear,
    Int8GroupLinear,
    dequantize_int4,
    quantize_int4,
)

# AVX2, no AVX-512
ZEN3 = "flags : fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe"
SKYLAKE_X = ZEN3 + " avx512f avx512bw avx512vl avx512dq avx512cd"
ZEN4 = SKYLAKE_X + " avx512_bf16"


def test_tiers_follow_the_cpu_features():
    assert cpu_tiers(ZEN4, "x86_64") == ("avx512bf16", "avx512", "avx2", "scalar")
    assert cpu_tiers(SKYLAKE_X, "x86_64") == ("avx512", "avx2", "scalar")
    assert cpu_tiers(ZEN3, "x86_64") == ("avx2", "scalar")
    assert cpu_tiers("flags : fpu sse sse2 avx", "x86_64") == ("scalar",)
    assert cpu_tiers("Features : fp asimd asimddp i8mm bf16", "aarch64") == ("neon", "scalar")
    assert cpu_tiers("", "riscv64") == ("scalar",)
    # AVX2 without a feature its flags let the compiler use (a VM masking BMI) is not the
    # AVX2 tier
    assert "avx2" not in cpu_tiers("flags : avx2", "x86_64")
    assert cpu_tiers(ZEN3.replace(" bmi1", ""), "x86_64") == ("scalar",)


@pytest.fixture
def fresh_tier(monkeypatch):
    """kernel_tier() read again under a RADIXSERVE_ISA the test sets (its cache cleared
    before and after, so later tests see this process's own tier)."""

    def choose(isa: str) -> str:
        monkeypatch.setenv("RADIXSERVE_ISA", isa)
        native.kernel_tier.cache_clear()
        return native.kernel_tier()

    yield choose
    monkeypatch.delenv("RADIXSERVE_ISA", raising=False)
    native.kernel_tier.cache_clear()


def test_forced_tier_is_taken_and_one_the_cpu_lacks_is_refused(fresh_tier):
    have = cpu_tiers()
    for tier in (have[0], "scalar"):  # the best this CPU runs, and the one every CPU runs
        assert fresh_tier(tier) == tier
    with pytest.raises(ValueError, match="not a kernel tier"):
        fresh_tier("avx1024")
    # never a build for instructions this CPU does not have (SIGILL): neon on x86, the x86
    # tiers on ARM, and whatever this CPU lacks of its own family
    lacking = [t for t in native.TIERS if t not in have]
    with pytest.raises(ValueError, match=f"RADIXSERVE_ISA={lacking[0]}: this CPU lacks it"):
        fresh_tier(lacking[0])
    with pytest.raises(ValueError, match="lacks"):
        native._load(native._SOURCE.with_name("int4_panels.c"), tier=lacking[0])


@pytest.mark.parametrize("tier", cpu_tiers())
def test_panel_builds_name_their_path(tier):
    """The AVX-512 BF16 tier runs the hand-written AVX-512 BF16 GEMMs (1), every other tier
    the portable path (2): no other tier's build is compiled with AVX-512 BF16."""
    want = 1 if tier == "avx512bf16" else 2
    l4, l8 = load_int4_panels(tier), load_int8_panels(tier)
    if l4 is None or l8 is None:
        pytest.skip("native kernels off or not built here")
    assert l4.int4_panels_has_gemm() == want
    assert l8.int8_panels_has_gemm() == want


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Each output within bfloat16's rounding of itself plus float32 sums' error."""
    err = (y.double() - ref).abs()
    allowed = 2.0**-8 * ref.abs() + 2.0**-12 * ref.abs().max()
    assert torch.all(err <= allowed), (err - allowed).max().item()


# rows: one row (two accumulator sets), tiles of 2-4, several tiles (9 = 3 + 3 + 3, 31)
@pytest.mark.parametrize("tier", cpu_tiers())
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 31])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_panels_match_float64_in_every_tier(tier, rows, group):
    lib = load_int4_panels(tier)
    gen = torch.Generator().manual_seed(rows * 1000 + group)
    n, k = 100, 512  # a partial last block of 16 outputs
    q, scale, zero = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, group, False)
    layer = Int4Linear(q, scale, zero, group)
    if layer.panels is None:
        pytest.skip("no panel layout where the native int4 kernel is not built")
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    ref = x.double() @ dequantize_int4(q, scale, zero, group).double().T
    _close(layer._panel_gemm(lib, x), ref)
    # the dequantizer: bfloat16 W^T, each weight rounded once
    deq = layer._panel_dequant_gemm(lib, torch.eye(k, dtype=torch.bfloat16))
    want = dequantize_int4(q, scale, zero, group).T.to(torch.bfloat16)
    assert torch.equal(deq, want)


@pytest.mark.parametrize("tier", cpu_tiers())
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("zeros", [False, True])
def test_int8_panels_match_float64_in_every_tier(tier, rows, zeros):
    lib = load_int8_panels(tier)
    gen = torch.Generator().manual_seed(rows * 10 + zeros)
    n, k, group = 100, 256, 32
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    # scales as float16 holds them, a few subnormal (tiny blocks of a GGUF file)
    scale = (torch.rand(n, k // group, generator=gen) * 0.01).half()
    scale[0, 0] = 2.0**-20
    zero = (torch.randn(n, k // group, generator=gen) * 0.1).half() if zeros else None
    layer = Int8GroupLinear(q, scale.float(), None if zero is None else zero.float(), group)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = layer.dequantized().double()
    ref = x.double() @ w.T
    _close(layer._panel_gemm(lib, x), ref)
    wt = torch.empty(k, 16 * layer.panels.shape[0], dtype=torch.bfloat16)
    layer.dequant_blocks(lib, 0, layer.panels.shape[0], wt)
    assert torch.equal(wt[:, :n], w.T.to(torch.bfloat16))


def test_every_tier_gives_the_same_numbers_up_to_summation_order():
    """One int4 layer's decode row in every tier this CPU has: equal up to float32
    summation order (the same products in every tier)."""
    gen = torch.Generator().manual_seed(7)
    q, scale, zero = quantize_int4(torch.randn(64, 1024, generator=gen), 32, False)
    layer = Int4Linear(q, scale, zero, 32)
    if layer.panels is None:
        pytest.skip("no panel layout where the native int4 kernel is not built")
    x = torch.randn(1, 1024, generator=gen).to(torch.bfloat16)
    outs = [layer._panel_gemm(load_int4_panels(t), x).float() for t in cpu_tiers()]
    for out in outs[1:]:
        assert torch.allclose(out, outs[0], rtol=2.0**-7, atol=1e-3)


# -- the stand-alone check (tests/native/panels_check.c), per tier, x86 and ARM ---------------
NATIVE = Path(native.__file__).parent
CHECK = Path(__file__).parent.parent / "native" / "panels_check.c"
PANELS = [NATIVE / "int4_panels.c", NATIVE / "int8_panels.c"]
# the aarch64 tiers as a cross compiler builds them: NEON with the dot-product extension
# (Graviton 2 and later, Ampere Altra; -mcpu=native on an ARM machine itself), and the
# scalar tier without Advanced SIMD
ARM_FLAGS = {"neon": ("-march=armv8.2-a+dotprod",), "scalar": ("-march=armv8-a+nosimd",)}


def _build_check(compiler: str, tier_flags: tuple[str, ...], out: Path) -> None:
    flags = [f for f in native._FLAGS if f not in ("-shared", "-fPIC")]
    cmd = [compiler, *flags, *tier_flags, "-o", str(out), str(CHECK), *map(str, PANELS), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    "tier, sanitize",
    [(t, False) for t in cpu_tiers()] + [(cpu_tiers()[0], True)],
    ids=[*cpu_tiers(), f"{cpu_tiers()[0]}-asan"],
)
def test_stand_alone_check_passes_in_every_tier_of_this_cpu(tier, sanitize, tmp_path):
    """Every tier against float64; the best one also under AddressSanitizer (a partial last
    block of outputs, 100 = 6 x 16 + 4, read or written past its end fails there)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    extra = ("-fsanitize=address", "-fno-omit-frame-pointer") if sanitize else ()
    _build_check(compiler, (*native._TIER_FLAGS[tier], *extra), tmp_path / "check")
    done = subprocess.run([tmp_path / "check"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("all ok\n"), done.stdout
    path = "AVX-512 BF16" if tier == "avx512bf16" else "portable"
    assert done.stdout.startswith(f"panel GEMMs: {path} path")


def _arm_tools() -> tuple[str, str]:
    gcc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if platform.machine() != "x86_64" or gcc is None or qemu is None:
        pytest.skip(
            "no aarch64 cross compiler or qemu-aarch64-static (apt-get install "
            "gcc-aarch64-linux-gnu qemu-user-static; .ci/run installs them)"
        )
    return gcc, qemu


@pytest.mark.slow
@pytest.mark.parametrize("tier", list(ARM_FLAGS))
def test_arm_tiers_pass_the_check_under_qemu(tier, tmp_path):
    """The NEON tier (and ARM's scalar one), cross-compiled and run under qemu: correct
    before anyone runs it on ARM hardware."""
    gcc, qemu = _arm_tools()
    _build_check(gcc, ARM_FLAGS[tier], tmp_path / "check")
    done = subprocess.run(
        [qemu, "-L", "/usr/aarch64-linux-gnu", tmp_path / "check"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.endswith("all ok\n"), done.stdout + done.stderr
    assert done.stdout.startswith("panel GEMMs: portable path")


@pytest.mark.slow
def test_every_kernel_builds_for_arm(tmp_path):
    """Every native kernel compiles for the NEON tier (their portable paths), as a shared
    library the loader would load on an ARM machine (ARM's scalar tier: the panel check
    above)."""
    gcc, _ = _arm_tools()
    for source in sorted(NATIVE.glob("*.c")):
        flags = [*native._FLAGS, *ARM_FLAGS["neon"], *native._EXTRA_FLAGS.get(source.name, [])]
        flags = [f for f in flags if not f.startswith("-mprefer-vector-width")]  # x86 only
        out = tmp_path / f"{source.stem}.so"
        done = subprocess.run(
            [gcc, *flags, "-o", str(out), str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"{source.name}: {done.stderr[-3000:]}"


# -- many-row bfloat16 products in float32 below the AVX-512 tiers (executor/gemm.py) --------


@pytest.mark.parametrize("wide", [False, True], ids=["bfloat16-products", "float32-products"])
@pytest.mark.parametrize("rows", [1, 3, 4, 37])
def test_bf16_products_in_either_precision_match_float64(monkeypatch, wide, rows):
    """Linear (a bias, outputs over several widening chunks) and gemm.mm, with the
    float32 path forced on or off: each output rounded once to bfloat16 (a product in
    float32 rounds as the bfloat16 GEMM does, up to summation order)."""
    from radixserve.executor import gemm
    from radixserve.executor.linear import Linear

    monkeypatch.setattr(gemm, "float32_products", lambda: wide)
    monkeypatch.setattr(gemm, "_CHUNK", 64 * 96)  # 64 output rows per chunk
    seen: list[torch.dtype] = []  # the dtypes torch.mm multiplied in
    real_mm = torch.mm

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(a.dtype)
        return real_mm(a, b)

    monkeypatch.setattr(gemm.torch, "mm", spy)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(300, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    ref = x.double() @ w.double().T + bias.double()
    _close(gemm.linear(x, w, bias), ref)
    _close(gemm.mm(x, w.T), ref - bias.double())
    layer = Linear(w, bias)
    _close(layer(x), ref)
    in_float32 = wide and rows >= gemm.FLOAT32_ROWS
    assert seen and all(d == (torch.float32 if in_float32 else torch.bfloat16) for d in seen)
    if wide:  # the plain weight only: no oneDNN reorder below AVX-512
        assert layer.packed is None
