"""The overlapped loop (the CPU model on a worker thread as the device) gives exactly the
serial loop's tokens, and ends every request once with every page accounted for."""

from __future__ import annotations

import random

import pytest

from radixserve import LLM, SamplingParams
from radixserve.engine.outputs import RequestOutput
from tests.helpers import greedy

ENGINE = dict(dtype="float32", page_size=4, kv_cache_memory_gb=0.02)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


@pytest.fixture(scope="module")
def pair(tiny_llama):
    """(serial, overlapped) engines on the same weights and settings."""
    serial = LLM(str(tiny_llama), enable_overlap=False, **ENGINE)
    overlapped = LLM(str(tiny_llama), enable_overlap=True, **ENGINE)
    assert not serial.engine.overlap and not serial.engine.device.is_async
    assert overlapped.engine.overlap and overlapped.engine.device.is_async
    yield serial, overlapped
    overlapped.engine.close()


def _run(llm: LLM, prompts, params) -> list[RequestOutput]:
    out = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_idle()
    return out


def _same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
        assert [o.finish_reason for o in x.outputs] == [o.finish_reason for o in y.outputs]
        assert x.num_completion_tokens == y.num_completion_tokens
        for ox, oy in zip(x.outputs, y.outputs, strict=True):
            assert [lp.token_id for lp in ox.logprobs] == [lp.token_id for lp in oy.logprobs]
            assert [lp.logprob for lp in ox.logprobs] == pytest.approx(
                [lp.logprob for lp in oy.logprobs], abs=1e-4
            )
            assert [[t for t, _ in lp.top] for lp in ox.logprobs] == [
                [t for t, _ in lp.top] for lp in oy.logprobs
            ]


def _stopping_params(serial: LLM, prompts) -> list[SamplingParams]:
    """Greedy params whose stop token appears early in each output, so that requests end
    mid-run (and the overlapped loop computes one discarded token for them)."""
    free = [o.token_ids for o in _run(serial, prompts, greedy(20))]
    return [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[(i * 3) % 12]])
        for i, ids in enumerate(free)
    ]


def test_greedy_with_stops_lengths_and_logprobs(pair):
    serial, overlapped = pair
    prompts = _prompts(12, seed=0)
    params = _stopping_params(serial, prompts)
    params[1] = greedy(9, logprobs=3)
    params[2] = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, logprobs=0)
    before = overlapped.engine.scheduler.stats.num_discarded_tokens
    expected = _run(serial, prompts, params)
    got = _run(overlapped, prompts, params)
    _same(expected, got)
    assert any(o.finish_reason == "stop" for o in expected)
    assert any(o.finish_reason == "length" for o in expected)
    # requests that stopped had one more token computed, and it never came out
    assert overlapped.engine.scheduler.stats.num_discarded_tokens > before
    assert serial.engine.scheduler.stats.num_discarded_tokens == 0


def test_seeds_penalties_and_n_samples(pair):
    serial, overlapped = pair
    prompts = _prompts(6, seed=1)
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            top_k=50,
            max_tokens=14,
            seed=10 + i,
            n=1 + i % 3,
            repetition_penalty=1.2,
            presence_penalty=0.3 * (i % 2),
            frequency_penalty=0.2,
            logprobs=2,
            ignore_eos=True,
        )
        for i in range(6)
    ]
    params[3] = SamplingParams(temperature=1.0, max_tokens=10, seed=5, n=3, min_tokens=4)
    _same(_run(serial, prompts, params), _run(overlapped, prompts, params))


def test_prompt_logprobs_and_chunked_prefill(tiny_llama, pair):
    serial, _ = pair
    chunked = LLM(
        str(tiny_llama),
        enable_overlap=True,
        max_num_batched_tokens=24,
        long_prefill_threshold=16,
        **ENGINE,
    )
    prompts = [p + list(range(10, 60)) for p in _prompts(5, seed=2)]  # several chunks each
    params = [greedy(8, prompt_logprobs=2 if i % 2 else None) for i in range(5)]
    expected = _run(serial, prompts, params)
    got = _run(chunked, prompts, params)
    _same(expected, got)
    for x, y in zip(expected, got, strict=True):
        if x.prompt_logprobs is None:
            assert y.prompt_logprobs is None
            continue
        assert [e and e.token_id for e in x.prompt_logprobs] == [
            e and e.token_id for e in y.prompt_logprobs
        ]
        assert [e.logprob for e in x.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in y.prompt_logprobs[1:]], abs=1e-4
        )
    # a second pass hits the prefix cache (chunks inserted by processed steps only)
    _same(expected, _run(chunked, prompts, params))
    chunked.engine.close()


def test_preemption_under_a_small_pool(tiny_llama, pair):
    serial, _ = pair
    small = LLM(
        str(tiny_llama),
        enable_overlap=True,
        dtype="float32",
        page_size=4,
        kv_cache_memory_gb=0.0004,
        schedule_conservativeness=0.0,
    )
    prompts = _prompts(16, seed=3)
    params = _stopping_params(serial, prompts)
    _same(_run(serial, prompts, params), _run(small, prompts, params))
    assert small.engine.scheduler.stats.num_preemptions > 0
    small.engine.close()


def test_aborts_end_once_and_emit_nothing_after(pair):
    serial, overlapped = pair
    prompts = _prompts(6, seed=4)
    expected = {f"r{i}": o.token_ids for i, o in enumerate(_run(serial, prompts, greedy(30)))}
    engine = overlapped.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(30))
    tokens: dict[str, list[int]] = {rid: [] for rid in expected}
    finals: dict[str, str | None] = {}
    aborted_after: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for d in engine.step():
            assert d.request_id not in finals, "a request ended twice or emitted after its end"
            tokens[d.request_id].extend(d.token_ids)
            if d.finished:
                finals[d.request_id] = d.finish_reason
        if steps == 4:  # abort two mid-decode, one of them with a step in flight
            for rid in ("r1", "r4"):
                aborted_after[rid] = len(tokens[rid])
                engine.abort(rid)
    assert finals == {f"r{i}": "abort" if i in (1, 4) else "length" for i in range(6)}
    for rid, ids in tokens.items():
        if rid in aborted_after:
            assert ids == expected[rid][: aborted_after[rid]]  # nothing after the abort
        else:
            assert ids == expected[rid]
    engine.check_idle()


def test_a_failing_step_fails_its_requests_only(pair, monkeypatch):
    _, overlapped = pair
    engine = overlapped.engine
    real = engine.runner.run
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real(step)

    monkeypatch.setattr(engine.runner, "run", flaky)
    engine.add_request("boom", [5, 6, 7], greedy(6))
    finals = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                finals[d.request_id] = (d.finish_reason, d.error)
    assert finals["boom"][0] == "error" and "device fell over" in finals["boom"][1]
    engine.check_idle()
    monkeypatch.undo()
    assert _run(overlapped, [[5, 6, 7]], greedy(4))[0].token_ids  # the engine still works
