"""LoRA on the CUDA path: the Triton SGMV kernels (``lora_kernels``) against a float64
reference, and the CUDA runner serving adapters equal to the CPU path (float32, under
Triton's interpreter on CPU tensors in CI)."""

from __future__ import annotations

import pytest
import torch

from radixserve import LLM
from radixserve.executor.cuda.lora_kernels import lora_expand, lora_shrink
from tests.executor.cuda.test_runner import _swap_in_cuda_runner
from tests.helpers import greedy


def test_shrink_and_expand_equal_float64(device):
    """Rows on three stacked adapters (rank 5, zero-padded to 7) and on none, an output
    that is a column slice of a wider one, widths off the kernels' blocks."""
    g = torch.Generator().manual_seed(0)
    rows, k, n, rank = 9, 70, 45, 7
    x = torch.randn(rows, k, generator=g)
    a = torch.randn(3, rank, k, generator=g)
    a[1, 5:] = 0  # a rank-5 adapter in a rank-7 stack
    bt = torch.randn(3, rank, n, generator=g)
    row_adapter = torch.tensor([0, 0, -1, 1, 2, 2, 2, -1, 1], dtype=torch.int32)
    wide = torch.randn(rows, n + 10, generator=g)
    want = wide.double().clone()
    for r, s in enumerate(row_adapter.tolist()):
        if s >= 0:
            want[r, 10:] += (a[s].double() @ x[r].double()) @ bt[s].double()
    x_d, a_d, bt_d = (t.to(device) for t in (x, a, bt))
    ra, got = row_adapter.to(device), wide.to(device)
    h = lora_shrink(x_d, a_d, ra)
    lora_expand(h, bt_d, got[:, 10:], ra)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.cpu()[:, :10], wide[:, :10])  # other columns untouched


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_cuda_runner_serves_adapters_as_the_cpu_path(tiny_models, tmp_path, arch):
    """Base and two adapters in one batch (prefill and decode), through the CUDA runner's
    Triton kernels, give the CPU path's greedy tokens (float32)."""
    from tests.engine.test_lora import ALL, make_adapter

    folder = tiny_models[arch]
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if arch == "phi3" else ALL
    make_adapter(folder, tmp_path / "a", 1, target_modules=targets)
    make_adapter(folder, tmp_path / "b", 2, r=4, target_modules=targets[:2])
    kwargs = dict(
        dtype="float32",
        max_num_batched_tokens=64,
        max_model_len=64,
        lora_modules=(f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"),
    )
    prompts = [[5, 6, 7, 8], list(range(100, 121)), [9, 10, 11], [40, 41]]
    names = ["a", None, "b", "a"]
    cpu = LLM(str(folder), device="cpu", **kwargs)
    want = cpu.generate(prompts, greedy(6), use_tqdm=False, lora=names)
    base = cpu.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in want] != [o.outputs[0].token_ids for o in base]
    llm = LLM(str(folder), device="cpu", **kwargs)
    _swap_in_cuda_runner(llm, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    got = llm.generate(prompts, greedy(6), use_tqdm=False, lora=names)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    llm.engine.check_idle()


def test_stacks_follow_the_adapters_not_their_ids(device):
    """A set's stacks are its adapters': an adapter unloaded and another loaded (which
    may take the freed object's address) never gets the old one's weights."""
    from radixserve.executor.cuda.lora_step import LoRAStacks
    from radixserve.executor.lora import LoRAAdapter, LoRAModule

    def adapter(value: float) -> LoRAAdapter:
        m = LoRAModule(torch.full((2, 4), value), torch.full((2, 3), value), 0, 3)
        return LoRAAdapter(str(value), "", 2, str(value), [{"o_proj": m}])

    stacks = LoRAStacks(torch.device(device))
    for value in (1.0, 2.0, 3.0):
        got = stacks.get([adapter(value)])["o_proj"][0]
        assert got.device.type == torch.device(device).type
        assert torch.all(got == value)
