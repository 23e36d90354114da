"""The grammar bitmask in the batched samplers: only constrained rows change, the CPU
kernel and the tensor-op path (any device, any dtype) mask the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import SamplingParams
from radixserve.core.request import Request
from radixserve.engine.tokenizer import load_hf_tokenizer
from radixserve.executor.cuda.sampler import DeviceSampler
from radixserve.executor.grammar import GrammarBatch, GrammarService, unpack_bitmask
from radixserve.executor.sampler import Sampler

VOCAB = 512


@pytest.fixture(scope="module")
def service(tiny_llama):
    svc = GrammarService(load_hf_tokenizer(tiny_llama), VOCAB, [2])
    yield svc
    svc.close()


def _constrained(service, rid: str, regex: str) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    req.grammar = service.matcher(service.compile(("regex", regex), timeout_s=30))
    return req


def _allowed(service, regex: str) -> torch.Tensor:
    """[VOCAB] bool: tokens the grammar allows first, from one matcher's own bitmask."""
    import xgrammar as xgr

    state = service.matcher(service.compile(("regex", regex), timeout_s=30))
    bm = xgr.allocate_token_bitmask(1, VOCAB)
    state.matcher.fill_next_token_bitmask(bm)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, bm, vocab_size=VOCAB)
    return torch.isfinite(logits[0])


@pytest.mark.parametrize("sampler_cls", [Sampler, DeviceSampler])
def test_only_constrained_rows_are_masked(service, sampler_cls):
    free = Request("free", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    reqs = [free, _constrained(service, "a", "x[0-9]+"), _constrained(service, "b", "[0-9]{2}")]
    sampler = sampler_cls(VOCAB, (2,))
    batch = sampler.prepare(reqs)
    assert batch.grammar is not None and batch.grammar.rows == [1, 2]
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    raw = logits.clone()
    tokens = sampler(logits, batch).numpy()
    assert tokens[0] == int(raw[0].argmax())  # the free row pays nothing and changes nothing
    for row, regex in ((1, "x[0-9]+"), (2, "[0-9]{2}")):
        allowed = _allowed(service, regex)
        assert allowed[tokens[row]]
        assert tokens[row] == int(raw[row].masked_fill(~allowed, float("-inf")).argmax())
    batch.grammar.accept(tokens)
    assert [s.num_accepted for s in batch.grammar.states] == [1, 1]


def test_bit_unpacking_paths_agree_with_xgrammar(service):
    import xgrammar as xgr

    reqs = [_constrained(service, "a", "[a-f]+"), _constrained(service, "b", "[0-9]+")]
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    ours = GrammarBatch.of(reqs).apply(logits)  # numpy unpacking (CPU)
    bf16 = GrammarBatch.of(reqs).apply(logits.to(torch.bfloat16))
    bm = xgr.allocate_token_bitmask(2, VOCAB)
    for i, r in enumerate(reqs):
        r.grammar.matcher.fill_next_token_bitmask(bm, i)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bm, vocab_size=VOCAB)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.isfinite(bf16.float()), torch.isfinite(theirs))
    assert torch.equal(unpack_bitmask(bm, VOCAB), torch.isfinite(theirs))  # the device path
    assert 0 < int(torch.isfinite(theirs).sum()) < 2 * VOCAB


def test_refused_and_stop_tokens_mark_where_the_grammar_ended(service):
    req = _constrained(service, "a", "ab")
    batch = GrammarBatch.of([req])
    a, b = (service.tokenizer_info.decoded_vocab.index(t.encode()) for t in ("a", "b"))
    batch.accept(np.array([a]))
    batch.accept(np.array([b]))
    assert not req.grammar.done
    batch.accept(np.array([2]))  # EOS, now allowed: the grammar ends at output token 3
    assert req.grammar.ends_at(3) and not req.grammar.failed
    bad = _constrained(service, "c", "ab")
    GrammarBatch.of([bad]).accept(np.array([b]))
    assert bad.grammar.failed and bad.grammar.ends_at(1)
