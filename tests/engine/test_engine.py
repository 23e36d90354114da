"""The engine end to end on tiny random models (float32) and SmolLM2."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import LLM, SamplingParams
from tests.helpers import generate_ids, greedy


def _mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 120))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", page_size=4, kv_cache_memory_gb=0.02)


def test_batch_invariance_and_preemption(tiny_llama, llm):
    prompts = _mixed_prompts(16)
    params = greedy(24)
    alone = [generate_ids(llm, [p], params)[0] for p in prompts]
    assert generate_ids(llm, prompts, params) == alone
    # A pool too small for all 16 at once: preemption must happen and change nothing.
    small = LLM(
        str(tiny_llama),
        dtype="float32",
        page_size=4,
        kv_cache_memory_gb=0.0004,
        schedule_conservativeness=0.0,
    )
    assert small.engine.pool.num_pages < 16 * 36
    assert generate_ids(small, prompts, params) == alone
    assert small.engine.scheduler.stats.num_preemptions > 0


def test_seeded_sampling_is_batch_independent(llm):
    prompts = _mixed_prompts(6, seed=1)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=100 + i, ignore_eos=True)
        for i in range(6)
    ]
    alone = [generate_ids(llm, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    together = generate_ids(llm, prompts, params)
    assert together == alone
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=16, seed=999, ignore_eos=True
    )
    assert generate_ids(llm, [prompts[0]], other_seed)[0] != alone[0]


def test_n_samples_share_prefill_and_differ(llm):
    prompt = _mixed_prompts(1, seed=2)[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.engine.check_idle()
    assert len(out.outputs) == 4
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # greedy n=2: both samples equal the n=1 result (sharing the prefill changes nothing)
    g = greedy(10)
    single = generate_ids(llm, [prompt], g)[0]
    both = llm.generate(
        [prompt], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert [o.token_ids for o in both.outputs] == [single, single]


def test_sampling_filters_and_penalties_run(llm):
    prompt = _mixed_prompts(1, seed=3)[0]
    params = SamplingParams(
        temperature=0.8,
        top_k=5,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={7: 100.0},
        max_tokens=8,
        seed=1,
        ignore_eos=True,
    )
    out = generate_ids(llm, [prompt], params)[0]
    assert out == [7] * 8  # a +100 bias dominates every filter and penalty
    top1 = generate_ids(
        llm,
        [prompt],
        SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=3, ignore_eos=True),
    )[0]
    assert top1 == generate_ids(llm, [prompt], greedy(8))[0]


def test_logprobs_offline(llm):
    import math

    prompt = _mixed_prompts(1, seed=8)[0]
    out = llm.generate([prompt], greedy(5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the top token
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-5
    sampled = llm.generate(
        [prompt],
        SamplingParams(max_tokens=5, temperature=1.0, seed=1, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert [lp.top for lp in sampled.logprobs] == [[]] * 5
    plain = llm.generate([prompt], greedy(5), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs == []
    llm.engine.check_idle()


def test_min_tokens_and_stop_token_ids(llm):
    prompt = _mixed_prompts(1, seed=4)[0]
    free = generate_ids(llm, [prompt], greedy(12))[0]
    stop_at = free[3]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    first = free.index(stop_at)
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    blocked = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    assert len(blocked.token_ids) == 12 and stop_at not in blocked.token_ids


def test_stop_strings_across_tokens_never_leak(llm):
    prompt = _mixed_prompts(1, seed=5)[0]
    full = llm.generate([prompt], greedy(40), use_tqdm=False)[0]
    text = full.text
    assert len(text) > 12
    # a stop string spanning a token boundary: take characters around the middle token's start
    tokens_text = [
        llm.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))
    ]
    boundary = next(len(t) for t in tokens_text if len(t) > 6)
    stop = text[boundary - 2 : boundary + 2]
    cut = text.index(stop)
    out = llm.generate([prompt], greedy(40, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]
    streamed = "".join(llm.stream(prompt, greedy(40, stop=[stop])))
    assert streamed == text[:cut]
    kept = llm.generate(
        [prompt], greedy(40, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0]
    assert kept.text == text[: cut + len(stop)]
    llm.engine.check_idle()


def test_abort_mid_run_frees_everything(llm):
    engine = llm.engine
    prompts = _mixed_prompts(4, seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, greedy(30))
    finals = {}
    for _ in range(3):
        for d in engine.step():
            if d.finished:
                finals[d.request_id] = d.finish_reason
    engine.abort("a1")
    engine.abort("a3")
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                assert d.request_id not in finals
                finals[d.request_id] = d.finish_reason
    assert finals == {"a0": "length", "a1": "abort", "a2": "length", "a3": "abort"}
    engine.check_idle()


def test_error_in_a_batch_fails_that_batch_only(llm, monkeypatch):
    engine = llm.engine
    engine.add_request("boom", [5, 6, 7], greedy(4))
    real = engine.runner.run
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return real(step)

    monkeypatch.setattr(engine.runner, "run", flaky)
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("boom", "error")]
    assert "device fell over" in deltas[0].error
    engine.check_idle()
    assert generate_ids(llm, [[5, 6, 7]], greedy(4))  # the engine still works


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 99999], SamplingParams(), "token ids"),
        ([1, 2], SamplingParams(max_tokens=5000), "maximum context length"),
        ([1, 2], SamplingParams(logit_bias={99999: 1.0}), "logit_bias"),
    ],
)
def test_bad_input_is_a_value_error(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt] if prompt != [] else [[]], params, use_tqdm=False)
    llm.engine.check_idle()


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(4), use_tqdm=False)[0]
    expected = llm.tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert out.prompt_token_ids == expected
    assert out.num_completion_tokens == 4


def test_utf8_streaming_deltas_join_to_full_text(smollm2_llm):
    prompt = "Write the word café, then 東京 and an emoji 🙂, in French:"
    params = greedy(40)
    full = smollm2_llm.generate([prompt], params, use_tqdm=False)[0]
    deltas = list(smollm2_llm.stream(prompt, params))
    assert "".join(deltas) == full.text
    assert all("\ufffd" not in d for d in deltas)
    assert full.text == smollm2_llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)


def test_prompt_logprobs_match_transformers_across_chunks_and_cache(tiny_llama):
    """Prompt logprobs equal log_softmax of transformers' logits at every position, when the
    prompt is prefilled in several chunks and even when its prefix is already cached."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama), dtype="float32", page_size=4, max_num_batched_tokens=16)
    prompt = _mixed_prompts(1, seed=5)[0] + list(range(10, 50))  # > 1 chunk of 16
    llm.generate([prompt], greedy(2))  # the prompt is now in the prefix cache
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    out = llm.generate([prompt, prompt], [params, greedy(2)], use_tqdm=False)
    first, plain = out
    assert plain.prompt_logprobs is None
    lps = first.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    assert first.num_cached_tokens == 0  # prompt logprobs need every position computed

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for pos in range(1, len(prompt)):
        entry = lps[pos]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(logp[pos - 1, prompt[pos]].item(), abs=1e-4)
        top_ids = [t for t, _ in entry.top]
        assert top_ids == logp[pos - 1].topk(3).indices.tolist()
    llm.engine.check_page_accounting()


def test_fair_policy_with_tenants_gives_the_same_tokens(tiny_llama, llm):
    """Tenants reach the scheduler through the engine; policy fair changes the order of
    work, never the tokens (greedy, against the fcfs engine's outputs one by one)."""
    from radixserve.core.request import Tenant

    prompts = _mixed_prompts(10, seed=3)
    params = greedy(12)
    alone = [generate_ids(llm, [p], params)[0] for p in prompts]
    fair = LLM(str(tiny_llama), dtype="float32", page_size=4, kv_cache_memory_gb=0.002,
               schedule_policy="fair")  # fmt: skip
    engine = fair.engine
    tenants = [Tenant("heavy", max_running=2), Tenant("light", weight=2.0)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, tenant=tenants[i % 2])
    assert engine.scheduler.get("r1").tenant == tenants[1]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == alone
    counters = engine.scheduler.waiting.vtc.counters
    assert counters["heavy"] > 0 and counters["light"] > 0
    engine.check_page_accounting()


def test_int8_kv_cache_answers_as_the_float_cache_within_its_codes(tiny_llama, llm):
    """``kv_cache_dtype="int8"``: every token reads the int8 pages (a prompt's own keys too,
    through the C decode kernel; the chunks of a prompt that hit the prefix cache; decode
    steps) and keeps close logprobs and most greedy tokens; the cache holds ~1.9x the pages
    in the same memory; the refused combinations say why."""
    int8 = LLM(str(tiny_llama), dtype="float32", page_size=4, kv_cache_memory_gb=0.02,
               kv_cache_dtype="int8")  # fmt: skip
    assert int8.engine.runner.kv_cache.k.dtype == torch.int8
    assert int8.engine.pool.num_pages > 1.8 * llm.engine.pool.num_pages
    prefix = _mixed_prompts(1, seed=11)[0] + list(range(40, 90))
    prompts = [[*prefix, 7, 8, 9], [*prefix, 10, 11], _mixed_prompts(1, seed=12)[0]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    ref = llm.generate(prompts, params, use_tqdm=False)
    out = int8.generate(prompts, params, use_tqdm=False)
    assert out[1].num_cached_tokens > 0  # the second read the first's int8 pages
    agreeing = 0
    for r, o in zip(ref, out, strict=True):
        want, got = r.outputs[0], o.outputs[0]
        for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
            if a != b:
                break
            agreeing += 1
            # (this model's 16-wide heads: its codes' error moved them by up to 0.08)
            assert got.logprobs[i].logprob == pytest.approx(want.logprobs[i].logprob, abs=0.15)
    assert agreeing >= 32  # of 48 (41 here): most of the greedy tokens agree
    int8.engine.check_page_accounting()
    # (the KV tiers take an int8 cache: tests/engine/test_kv_tiers.py)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_llama), kv_cache_dtype="fp8")
