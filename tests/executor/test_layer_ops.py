"""Fused SiLU-and-multiply, GeGLU, add+RMSNorm and per-head RMSNorm: native kernels and the PyTorch path against
float64 references, including the in-place residual update."""

from __future__ import annotations

import pytest
import torch

from radixserve.executor.layer_ops import LayerOps

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=["native", "torch"])
def ops(request) -> LayerOps:
    ops = LayerOps(use_native=request.param == "native")
    if request.param == "native" and ops.native is None:
        pytest.skip("native kernels unavailable")
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 8), (7, 100), (130, 1536)])
def test_silu_and_mul(ops, dtype, rows, width):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    x[0, 0] = -200.0  # exp overflow on the way: silu -> -0, not NaN
    gate, up = x.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    out = ops.silu_and_mul(x)
    assert out.shape == (rows, width) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 8), (7, 100), (16, 2048)])
def test_gelu_tanh_and_mul(ops, dtype, rows, width):
    """GeGLU (Gemma): the bfloat16 kernel and the PyTorch path against float64; in bfloat16
    the kernel rounds as PyTorch's two ops do (gelu, then the product)."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    x[0, 0], x[0, 1] = -200.0, 200.0  # exp under- and overflow: gelu -> -0 and g, not NaN
    gate, up = x.double().chunk(2, dim=-1)
    c = (2 / torch.pi) ** 0.5
    expected = 0.5 * gate * (1 + torch.tanh(c * (gate + 0.044715 * gate**3))) * up
    out = ops.gelu_tanh_and_mul(x)
    assert out.shape == (rows, width) and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.bfloat16 and ops.native is not None:
        # the kernel rounds as the unfused model does, gelu to bfloat16, then the product:
        # equal to that, correctly rounded, but where the value vanishes (below -6 tanh
        # reaches -1 in float64: 0 there, ~1e-16 here). (PyTorch's own bfloat16 gelu is
        # not correctly rounded: 2-3 % of these differ.)
        twice = (expected / up).to(dtype).double() * up
        twice = twice.to(dtype)
        differ = (out != twice) & (twice.abs() > 1e-6)
        assert differ.float().mean() < 0.002, differ.float().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_heads_on_a_fused_qkv_view(ops, dtype):
    """Per-head RMSNorm of q inside a fused qkv row (a strided view), against float64; the
    qkv rows are not touched."""
    g = torch.Generator().manual_seed(5)
    tokens, heads, d, eps = 9, 4, 256, 1e-6
    qkv = torch.randn(tokens, (heads + 2) * d, generator=g).to(dtype)
    before = qkv.clone()
    q = qkv[:, : heads * d].view(tokens, heads, d)
    weight = (1 + torch.randn(d, generator=g) * 0.1).to(dtype)
    s = q.double()
    expected = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    out = ops.rms_norm_heads(q, weight, eps)
    assert out.shape == (tokens, heads, d) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(qkv, before)
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_add", [True, False])
@pytest.mark.parametrize("width", [576, 100])  # 100: a masked tail in the vector kernel
def test_add_rms_norm_updates_the_residual_in_place(ops, dtype, with_add, width):
    g = torch.Generator().manual_seed(3)
    rows, eps = 33, 1e-5
    residual = torch.randn(rows, width, generator=g).to(dtype)
    add = torch.randn(rows, width, generator=g).to(dtype) if with_add else None
    weight = torch.randn(width, generator=g).to(dtype)
    expected_sum = residual.clone()
    if add is not None:
        expected_sum += add  # stored in dtype, as the model's unfused add would
    s = expected_sum.double()
    expected = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    out = ops.add_rms_norm(add, residual, weight, eps)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_non_contiguous_or_other_dtypes_take_the_torch_path():
    ops = LayerOps()
    if ops.native is None:
        pytest.skip("native kernels unavailable")
    x = torch.randn(4, 16)[:, ::2].t()  # non-contiguous [8, 4]
    assert not x.is_contiguous() and ops._kernel("silu_and_mul", x) is None
    assert ops._kernel("silu_and_mul", x.contiguous()) is not None
    assert ops._kernel("silu_and_mul", torch.randn(3, 8).half()) is None
    residual, weight = torch.randn(3, 8), torch.randn(8)
    assert ops._kernel("add_rms_norm", residual, weight, torch.randn(3, 8).bfloat16()) is None
    # and the PyTorch path still computes the function
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


def test_unusable_cache_directory_falls_back_to_torch(tmp_path, monkeypatch):
    from radixserve.executor import native

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache "directory" is a file: building must fail cleanly
    monkeypatch.setenv("RADIXSERVE_CACHE", str(blocker))
    assert native._load(native._SOURCE.with_name("elementwise.c")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_on_a_fused_qkv_view(ops, dtype, head_dim):
    """q and k rotated as one strided view into a fused [T, (q + k + v) heads * d] row, as the
    model does; v (the rest of the row) must be left alone. Against float64 rotate-half."""
    from radixserve.executor.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(head_dim)
    tokens, q_heads, kv_heads = 37, 6, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    original = qkv.clone()
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    cos, sin = rope.tables(positions)
    qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    out = ops.rotary(qk, cos, sin)

    x = original[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim).double()
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    c = cos.double()
    s = torch.cat((sin[..., half:], sin[..., half:]), dim=-1).double()  # +sin, full width
    expected = x * c + rotated * s
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    # v untouched; the native kernel works in place on the view, the torch path copies
    assert torch.equal(
        qkv[:, (q_heads + kv_heads) * head_dim :], original[:, (q_heads + kv_heads) * head_dim :]
    )
    if ops.native is not None:
        assert out.data_ptr() == qk.data_ptr()


def test_mlp_in_row_blocks_equals_the_whole_chunk():
    """LlamaForCausalLM._mlp over row blocks (the CPU runner's setting for long chunks)
    computes exactly what one pass over all rows does, including a ragged last block."""
    from radixserve.executor.linear import Linear
    from radixserve.executor.models.llama import DecoderLayerWeights, LlamaForCausalLM

    g = torch.Generator().manual_seed(5)
    hidden, inter, rows = 64, 96, 600
    w = DecoderLayerWeights(
        input_norm=torch.ones(hidden),
        qkv=Linear(torch.randn(3 * hidden, hidden, generator=g)),
        q_norm=None,
        k_norm=None,
        o=Linear(torch.randn(hidden, hidden, generator=g)),
        post_norm=torch.ones(hidden),
        gate_up=Linear(torch.randn(2 * inter, hidden, generator=g) / 8),
        down=Linear(torch.randn(hidden, inter, generator=g) / 8),
    )
    model = LlamaForCausalLM.__new__(LlamaForCausalLM)  # only _mlp's state
    model.ops = LayerOps()
    x = torch.randn(rows, hidden, generator=g)
    model.mlp_block_rows = None
    whole = model._mlp(w, x)
    model.mlp_block_rows = 256
    blocked = model._mlp(w, x)
    gate, up = (x.double() @ w.gate_up.weight.double().T).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ w.down.weight.double().T
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(blocked.double(), expected, atol=1e-4, rtol=1e-4)
