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
from radixserve.executor.native import cpu_tiers
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


@pytest.mark.parametrize("native", [True, False])
def test_bit_unpacking_paths_agree_with_xgrammar(service, native, monkeypatch):
    import xgrammar as xgr

    import radixserve.executor.grammar as grammar

    if not native:  # the numpy unpacking path
        monkeypatch.setattr(grammar, "load_token_mask", lambda: None)
    elif grammar.load_token_mask() is None:
        pytest.skip("native kernels unavailable")
    reqs = [_constrained(service, "a", "[a-f]+"), _constrained(service, "b", "[0-9]+")]
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    ours = GrammarBatch.of(reqs).apply(logits)
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


@pytest.mark.parametrize("tier", cpu_tiers())  # AVX-512 masked stores / scalar loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 1024, 49152])
def test_native_mask_kernel_matches_the_bit_definition(tier, dtype, vocab):
    from radixserve.executor.native import apply_token_bitmask, load_token_mask

    lib = load_token_mask(tier)
    if lib is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = -1  # everything allowed
    bitmask[2] = 0  # nothing allowed
    # a row stride wider than the vocabulary: the kernel must not touch the padding
    storage = torch.randn(5, vocab + 7, generator=g).to(dtype)
    logits = storage[:, :vocab]
    before = storage.clone()
    rows = torch.tensor([0, 1, 2, 4])
    assert apply_token_bitmask(lib, logits, bitmask, rows)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab].astype(bool))
    expected = before.clone()
    for r in rows.tolist():
        expected[r, :vocab] = before[r, :vocab].masked_fill(~allowed[r], float("-inf"))
    assert torch.equal(storage, expected)  # row 3 (not listed) and the padding untouched
    assert apply_token_bitmask(lib, logits.half(), bitmask, rows) is False  # other dtypes
