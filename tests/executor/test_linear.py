"""``Linear``: the oneDNN-reordered path keeps one copy of a weight and computes F.linear."""

import pytest
import torch
import torch.nn.functional as F

from radixserve.executor.linear import Linear, _can_pack
from radixserve.executor.quant import weight_memory

needs_pack = pytest.mark.skipif(
    not _can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)), reason="no oneDNN reorder here"
)


@needs_pack
def test_a_reordered_layer_keeps_one_copy_and_computes_f_linear():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    layer = Linear(w.clone(), b)
    assert layer.packed is not None and layer.plain_weight is None
    assert torch.equal(layer.weight, w)  # rebuilt from the reordered copy, exactly
    for rows in (1, 7, 300):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        ref = x.double() @ w.double().T + b.double()
        assert torch.allclose(layer(x).double(), ref, atol=0.05 * ref.abs().max().item())
    layer.weight, layer.bias = w.float(), b.float()  # a float32 weight is not reordered
    assert layer.packed is None and layer.plain_weight is not None
    assert torch.allclose(layer(x.float()), F.linear(x.float(), w.float(), b.float()))


@needs_pack
def test_a_shared_weight_stays_referenced_and_its_copy_is_counted_as_such():
    embed = torch.randn(50, 32).to(torch.bfloat16)
    head = Linear(embed, shared=True)
    assert head.packed is not None and head.plain_weight is embed

    class Model:
        pass

    model = Model()
    model.embed, model.norm, model.lm_head, model.layers = embed, None, head, []
    sizes = weight_memory(model)
    assert sizes == {"bfloat16": embed.nbytes, "onednn_copy": head.packed.nbytes}
    model.lm_head = Linear(embed.clone())  # untied: the reordered weight is its only copy
    sizes = weight_memory(model)
    assert set(sizes) == {"bfloat16"}
    assert sizes["bfloat16"] == embed.nbytes + model.lm_head.packed.nbytes
