"""The verify rule of speculative decoding on synthetic logits: each emitted token is
distributed as the target's next token (many draws, a stated tolerance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.core.request import Request
from radixserve.core.sampling_params import SamplingParams
from radixserve.executor.sampler import Sampler
from radixserve.executor.spec.verify import plan, verify

V = 8
N = 40_000
# E[TV(empirical, p)] <= 1/2 * sum_i sqrt(p_i (1 - p_i) / N) <= 1/2 * sqrt(V / N) = 0.0071 for
# N = 40k draws over V = 8 tokens; conditional checks see fewer draws (n_cond), so each
# bound is 4 x 1/2 * sqrt(V / n): a correct rule passes with a wide margin, while a rule
# that, say, always kept the proposal or resampled from p instead of the residual is off by
# 0.1 to 0.5 here.


def _tv(samples: np.ndarray, p: np.ndarray) -> float:
    emp = np.bincount(samples, minlength=V) / max(1, samples.size)
    return 0.5 * float(np.abs(emp - p).sum())


def _bound(n: int) -> float:
    return 4 * 0.5 * np.sqrt(V / n)


def _probs(logits: torch.Tensor, t: float, top_k: int = 0) -> np.ndarray:
    p = torch.softmax(logits / t, dim=-1)
    if top_k:
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[p.topk(top_k).indices] = True
        p = p * keep
    return (p / p.sum()).numpy().astype(np.float64)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, presence_penalty=1.5),
    ],
)
def test_emitted_tokens_follow_the_target(params):
    torch.manual_seed(0)
    rows = torch.randn(3, V) * 1.5  # p_0, p_1, p_2: after the last token, d1, d2
    drafts = np.array([int(rows[0].argmax()), int(rows[1].argsort()[-2])], dtype=np.int32)
    sp = SamplingParams(max_tokens=16, ignore_eos=True, **params)
    reqs = [Request(f"r{i}", [3, 4, 5], sp) for i in range(N)]
    for r in reqs:
        r.append_token(6)  # one output so far
    sampler = Sampler(V, ())
    batch = sampler.prepare(reqs)
    spec = plan(sampler, batch, [drafts] * N)
    logits = rows.repeat(N, 1)
    emitted, _ = verify(sampler, logits, spec)
    lengths = np.array([e.size for e in emitted])
    assert lengths.min() >= 1 and lengths.max() <= 3
    t, top_k = params["temperature"], params.get("top_k", 0)
    pen = params.get("presence_penalty", 0.0)
    seen = torch.zeros(V)
    seen[6] = 1.0  # the output so far
    expect = []
    for j in range(3):
        if j:
            seen[drafts[j - 1]] = 1.0  # row j sees d_1..d_j as outputs
        expect.append(_probs(rows[j] - pen * seen, t, top_k))
    first = np.array([e[0] for e in emitted])
    assert _tv(first, expect[0]) < _bound(N)
    kept1 = lengths >= 2
    assert 0.05 < kept1.mean() < 0.95  # both branches are exercised
    np.testing.assert_allclose(kept1.mean(), expect[0][drafts[0]], atol=4 * np.sqrt(0.25 / N))
    second = np.array([e[1] for e in emitted if e.size >= 2])
    assert _tv(second, expect[1]) < _bound(second.size)
    third = np.array([e[2] for e in emitted if e.size == 3])
    assert third.size > 1000
    assert _tv(third, expect[2]) < _bound(third.size)


def test_greedy_rows_keep_the_argmax_prefix():
    rows = torch.tensor([[0.0, 3.0, 1.0, 0.0], [2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    sampler = Sampler(4, ())
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    cases = {(1, 0): [1, 0, 3], (1, 2): [1, 0], (2, 0): [1], (): [1]}
    for drafts, want in cases.items():
        req = Request("g", [1, 2], sp)
        d = np.array(drafts, dtype=np.int32)
        spec = plan(sampler, sampler.prepare([req]), [d])
        emitted, lps = verify(sampler, rows[: d.size + 1], spec)
        assert emitted[0].tolist() == want
        assert lps[0] is not None and [lp.token_id for lp in lps[0]] == want
        logp = torch.log_softmax(rows, dim=-1)
        for j, lp in enumerate(lps[0]):
            assert lp.logprob == pytest.approx(float(logp[j, want[j]]))


def test_seeded_rows_repeat_their_draws():
    torch.manual_seed(1)
    rows = torch.randn(3, V)
    sampler = Sampler(V, ())
    drafts = np.array([int(rows[0].argmax()), int(rows[1].argmax())], dtype=np.int32)

    def run() -> list[list[int]]:
        sampler.forget("s")
        req = Request("s", [1, 2], SamplingParams(temperature=1.0, seed=42, max_tokens=8))
        spec = plan(sampler, sampler.prepare([req]), [drafts])
        return [verify(sampler, rows, spec)[0][0].tolist() for _ in range(20)]

    assert run() == run()
