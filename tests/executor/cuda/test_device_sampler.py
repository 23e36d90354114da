"""The device sampler against the CPU sampler: the same processed logits (bias, penalties,
blocked stop tokens, top-k/top-p/min-p) and greedy tokens, on CPU here and on the GPU with
the ``cuda`` marker."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.request import Request
from radixserve.core.sampling_params import SamplingParams
from radixserve.executor.cuda.sampler import DeviceSampler
from radixserve.executor.sampler import Sampler

VOCAB = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _requests() -> list[Request]:
    specs = [
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=8),
        SamplingParams(temperature=0, frequency_penalty=0.7, logit_bias={3: 5.0, 9: -2.0}),
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[7], max_tokens=8),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    reqs = []
    for i, p in enumerate(specs):
        r = Request(f"r{i}", [1, 2, 3, 4 + i], p)
        for t in (5, 5, 6 + i):
            r.append_token(t)
        reqs.append(r)
    return reqs


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_with_bias_penalties_and_min_tokens_matches_the_cpu_sampler(device):
    reqs = _requests()
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    cpu = Sampler(VOCAB, eos_token_ids=(2,))
    dev = DeviceSampler(VOCAB, eos_token_ids=(2,))
    cpu_batch, dev_batch = cpu.prepare(reqs), dev.prepare(reqs)
    assert dev_batch.needs_penalties and dev_batch.needs_bias and dev_batch.needs_min_tokens
    expected = cpu(logits.clone(), cpu_batch)
    got = dev(logits.to(device), dev_batch)
    assert got.cpu().tolist() == expected.tolist()
    # the processed logits themselves, row by row
    processed_cpu = cpu._block_stop_tokens(
        cpu._apply_penalties(cpu._apply_bias(logits, reqs), cpu_batch, None), cpu_batch
    )
    processed_dev = dev._device_block(
        dev._device_penalties(dev._device_bias(logits.to(device), reqs), dev_batch, None),
        dev_batch,
    )
    torch.testing.assert_close(processed_dev.cpu(), processed_cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_filter_matches_the_cpu_sampler(device):
    reqs = [
        Request("a", [1], SamplingParams(temperature=1.0, top_k=5)),
        Request("b", [1], SamplingParams(temperature=1.0, top_p=0.6)),
        Request("c", [1], SamplingParams(temperature=1.0, min_p=0.2)),
    ]
    probs = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    batch = DeviceSampler(VOCAB, ()).prepare(reqs)
    expected = Sampler._filter(probs, batch)
    got = DeviceSampler._device_filter(probs.to(device), batch)
    torch.testing.assert_close(got.cpu(), expected)
    assert (expected[0] > 0).sum() == 5


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_stay_in_the_filtered_set(device):
    reqs = [
        Request(f"r{i}", [1], SamplingParams(temperature=0.8, top_k=3, seed=i)) for i in range(4)
    ]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    sampler = DeviceSampler(VOCAB, ())
    allowed = logits.topk(3, dim=-1).indices
    for _ in range(5):
        tokens = sampler(logits.to(device), sampler.prepare(reqs)).cpu()
        assert all(int(t) in allowed[i].tolist() for i, t in enumerate(tokens))
