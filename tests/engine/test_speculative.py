"""Speculative decoding (n-gram proposer): the same tokens as without it, pages accounted.

Random tiny models rarely repeat themselves, so proposals are seldom accepted on them; the
``loopy`` model is built to repeat (its LM head maps each token's embedding to a successor
in short cycles, its layers scaled down but not off, so context still moves the logits),
and every test that claims acceptance checks the counters."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.executor.spec.ngram import NgramProposer, ngram_propose
from tests.conftest import TINY_VOCAB, build_tokenizer
from tests.helpers import generate_ids, greedy

# spec_policy "always": these tests need every step that can speculate to do so (the
# default, measured, decides from timings; it has its own tests below)
_KW = dict(dtype="float32", page_size=4, kv_cache_memory_gb=0.02, spec_policy="always")


def build_loopy_model(folder: Path, layer_scale: float = 0.03, cycle: int = 6) -> Path:
    """A tiny llama whose greedy output falls into cycles of ``cycle`` tokens: the LM head
    row of ``succ[t]`` is token t's embedding; attention and MLP outputs are scaled by
    ``layer_scale`` (small: they shift the logits without overturning the cycle)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    perm = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(1))
    succ = torch.empty(TINY_VOCAB, dtype=torch.long)
    for c in range(0, TINY_VOCAB, cycle):
        ids = perm[c : c + cycle]
        succ[ids] = torch.roll(ids, -1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
        head = torch.empty_like(model.lm_head.weight)
        head[succ] = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(head)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def loopy(tmp_path_factory) -> Path:
    return build_loopy_model(tmp_path_factory.mktemp("loopy") / "m")


@pytest.fixture(scope="module")
def loopy_pair(loopy) -> tuple[LLM, LLM]:
    return LLM(str(loopy), **_KW), LLM(str(loopy), speculative_mode="ngram", **_KW)


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama) -> tuple[LLM, LLM]:
    return LLM(str(tiny_llama), **_KW), LLM(str(tiny_llama), speculative_mode="ngram", **_KW)


def _prompts(n: int, seed: int = 0, repeat: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(2, 60))]
        if repeat:  # a passage then its start again: the continuation is in the prompt
            p = p + p[: max(2, len(p) // 2)]
        out.append(p)
    return out


def _accepted(llm: LLM) -> tuple[int, int]:
    s = llm.engine.stats()
    return s.spec_proposed_tokens, s.spec_accepted_tokens


# -- the proposer ----------------------------------------------------------------------------
def test_ngram_prefers_longest_then_latest_match():
    t = np.array([5, 1, 2, 9, 9, 7, 1, 2, 3, 4, 8, 2, 3, 1, 2, 3], dtype=np.int32)
    # suffix [1 2 3] occurs at 6..8 (then 4 8 2 ...); [2 3] alone also at 11..12 (then 1)
    assert ngram_propose(t, 3, 2, 3).tolist() == [4, 8, 2]
    assert ngram_propose(t, 2, 2, 3).tolist() == [1, 2, 3]  # latest [2 3]: at 11
    assert ngram_propose(t, 3, 2, 1).tolist() == [4]
    assert ngram_propose(t, 4, 4, 3).size == 0  # [2 1 2 3]... never seen before
    assert ngram_propose(t, 3, 2, 0).size == 0
    # the continuation may run to the end of the history (not past it)
    u = np.array([1, 2, 3, 1, 2], dtype=np.int32)
    assert ngram_propose(u, 2, 2, 5).tolist() == [3, 1, 2]
    assert ngram_propose(np.array([4], dtype=np.int32), 2, 1, 3).size == 0
    with pytest.raises(ValueError):
        NgramProposer(1, 2)


def test_ngram_agrees_with_a_plain_loop():
    rng = np.random.default_rng(0)

    def slow(t: list[int], max_n: int, min_n: int, limit: int) -> list[int]:
        for k in range(max_n, min_n - 1, -1):
            if len(t) < k + 1:
                continue
            suffix = t[-k:]
            for j in range(len(t) - k - 1, -1, -1):
                if t[j : j + k] == suffix:
                    return t[j + k : j + k + limit]
        return []

    for _ in range(300):
        t = rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.int32)
        got = ngram_propose(t, 3, 1, 4).tolist()
        assert got == slow(t.tolist(), 3, 1, 4)


def test_config_checks():
    with pytest.raises(ValueError, match="speculative_mode"):
        EngineConfig(speculative_mode="eagle")
    with pytest.raises(ValueError, match="num_spec_tokens"):
        EngineConfig(num_spec_tokens=0)
    with pytest.raises(ValueError, match="spec_ngram_min"):
        EngineConfig(spec_ngram_min=3, spec_ngram_max=2)
    with pytest.raises(ValueError, match="simulated"):
        EngineConfig(speculative_mode="ngram", simulated_device=True)


# -- greedy: the same tokens ---------------------------------------------------------------
def test_greedy_identical_random_model(tiny_pair):
    off, on = tiny_pair
    prompts = _prompts(8, seed=1) + _prompts(4, seed=2, repeat=True)
    assert generate_ids(on, prompts, greedy(48)) == generate_ids(off, prompts, greedy(48))
    proposed, _ = _accepted(on)
    assert proposed > 0


def test_greedy_identical_and_accepted_on_repeating_model(loopy_pair):
    off, on = loopy_pair
    prompts = _prompts(6, seed=3) + _prompts(4, seed=4, repeat=True)
    before = _accepted(on)
    steps_before = on.engine.num_steps
    ref = generate_ids(off, prompts, greedy(60))
    assert generate_ids(on, prompts, greedy(60)) == ref
    proposed, accepted = np.subtract(_accepted(on), before)
    assert accepted > 0.5 * proposed > 0
    assert on.engine.num_steps - steps_before < 40  # fewer steps than tokens
    # one at a time, too (no batching effects hide anything)
    for p, r in zip(prompts[:3], ref[:3], strict=True):
        assert generate_ids(on, [p], greedy(60))[0] == r


@pytest.mark.parametrize("k", [1, 3, 7])
def test_num_spec_tokens_and_max_tokens_boundaries(loopy, loopy_pair, k):
    off, _ = loopy_pair
    on = LLM(str(loopy), speculative_mode="ngram", num_spec_tokens=k, **_KW)
    prompts = _prompts(5, seed=5, repeat=True)
    for max_tokens in (1, 2, 5, 13):
        got = on.generate(prompts, greedy(max_tokens), use_tqdm=False)
        ref = off.generate(prompts, greedy(max_tokens), use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in got)
        on.engine.check_idle()
    assert _accepted(on)[1] > 0


def test_adaptive_length_same_tokens_grows_shrinks_and_shares(tmp_path, tiny_llama):
    """The n-gram proposer's adaptive length (the default; ``spec_max_tokens=0`` fixes it at
    ``num_spec_tokens``): the same greedy tokens as without speculation and as the fixed
    length, pages accounted; on a model that loops with a long cycle a lone request's
    length grows from 8 to the cap, 16, and the length above ``num_spec_tokens`` is shared
    by the batch; on a random model (proposals rejected) lengths shrink back to 4, never
    below."""
    long_loop = build_loopy_model(tmp_path / "loop24", cycle=24)
    off = LLM(str(long_loop), **_KW)
    on = LLM(str(long_loop), speculative_mode="ngram", **_KW)
    fixed = LLM(str(long_loop), speculative_mode="ngram", spec_max_tokens=0, **_KW)
    assert on.engine.spec_length is not None and fixed.engine.spec_length is None
    assert "8 proposals per step to start" in on.engine.startup_line
    limits: list[tuple[int, list[int]]] = []
    propose = on.engine.proposer.propose

    def spy(requests, lims):
        limits.append((len(requests), list(lims)))
        return propose(requests, lims)

    on.engine.proposer.propose = spy
    prompts = _prompts(4, seed=21, repeat=True)
    ref = generate_ids(off, prompts, greedy(80))
    assert generate_ids(fixed, prompts, greedy(80)) == ref
    for p, r in zip(prompts, ref, strict=True):  # one at a time
        assert generate_ids(on, [p], greedy(80))[0] == r
    lone = [max(lims) for n, lims in limits if n == 1]
    assert lone[0] == 8 and max(lone) == 16
    limits.clear()
    assert generate_ids(on, prompts, greedy(80)) == ref  # four at once
    for n, lims in limits:
        assert max(lims) <= max(4, 16 // n)
    assert any(n == 4 for n, _ in limits)
    s_on, s_fixed = on.engine.stats(), fixed.engine.stats()
    assert s_on.spec_proposed_tokens / s_on.spec_verify_rows > 4
    assert s_fixed.spec_proposed_tokens / s_fixed.spec_verify_rows <= 4
    assert s_on.spec_accepted_tokens > 0.5 * s_on.spec_proposed_tokens
    assert len(on.engine.spec_length) == 0  # finished requests are forgotten
    # a random model rejects most proposals: lengths halve back to num_spec_tokens
    rand = LLM(str(tiny_llama), speculative_mode="ngram", **_KW)
    shrunk: list[int] = []
    update = rand.engine.spec_length.update

    def record(rid, limit, verified, accepted):
        update(rid, limit, verified, accepted)
        shrunk.append(rand.engine.spec_length.length(rid))

    rand.engine.spec_length.update = record
    rprompts = _prompts(8, seed=1) + _prompts(4, seed=2, repeat=True)
    assert generate_ids(rand, rprompts, greedy(48)) == generate_ids(
        LLM(str(tiny_llama), **_KW), rprompts, greedy(48)
    )
    assert shrunk and min(shrunk) == 4 and max(shrunk) <= 16
    assert rand.engine.stats().spec_accepted_tokens < rand.engine.stats().spec_proposed_tokens


def test_chunked_prefill_prefix_hits_and_preemption(loopy, tiny_llama):
    for path in (loopy, tiny_llama):
        prompts = _prompts(10, seed=6, repeat=True)
        ref = generate_ids(LLM(str(path), **_KW), prompts, greedy(40))
        chunked = LLM(
            str(path),
            speculative_mode="ngram",
            max_num_batched_tokens=32,
            long_prefill_threshold=8,
            **_KW,
        )
        assert generate_ids(chunked, prompts, greedy(40)) == ref
        # prefix hits: the same prompts again while the tree still holds them
        for _ in range(2):
            got = chunked.generate(prompts, greedy(40), use_tqdm=False)
            assert [o.token_ids for o in got] == ref
        assert chunked.engine.prefix_cache.hit_tokens > 0
        chunked.engine.check_idle()
        small = LLM(
            str(path),
            speculative_mode="ngram",
            dtype="float32",
            page_size=4,
            kv_cache_memory_gb=0.0002,
            schedule_conservativeness=0.0,
            spec_policy="always",
        )
        # (a pool smaller than the batch's sequences: preemptions must happen)
        assert small.engine.pool.num_pages * 4 < sum(len(p) + 40 for p in prompts)
        assert generate_ids(small, prompts, greedy(40)) == ref
        assert small.engine.scheduler.stats.num_preemptions > 0
        if path == loopy:
            assert _accepted(chunked)[1] > 0 and _accepted(small)[1] > 0


def test_stops_inside_an_accepted_run(loopy_pair):
    off, on = loopy_pair
    prompt = _prompts(1, seed=7, repeat=True)[0]
    free = generate_ids(off, [prompt], greedy(40))[0]
    assert generate_ids(on, [prompt], greedy(40))[0] == free
    # a stop token in the middle of what a verify step accepts in one go
    before = _accepted(on)
    stop_at = free[9]
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at])
    got = on.generate([prompt], params, use_tqdm=False)[0]
    ref = off.generate([prompt], params, use_tqdm=False)[0]
    assert got.token_ids == ref.token_ids == free[: free.index(stop_at) + 1]
    assert got.finish_reason == ref.finish_reason == "stop"
    on.engine.check_idle()
    # a stop string (ids decode to text through the tiny tokenizer)
    text = off.generate([prompt], greedy(40), use_tqdm=False)[0].text
    assert len(text) > 20
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for include in (False, True):
        sp = greedy(40, stop=[stop], include_stop_str_in_output=include)
        got = on.generate([prompt], sp, use_tqdm=False)[0]
        ref = off.generate([prompt], sp, use_tqdm=False)[0]
        assert (got.text, got.token_ids, got.finish_reason) == (
            ref.text,
            ref.token_ids,
            ref.finish_reason,
        )
        assert "".join(on.stream(prompt, sp)) == ref.text
    on.engine.check_idle()
    # min_tokens keeps the stop token blocked inside accepted runs too
    sp = SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=[stop_at])
    assert generate_ids(on, [prompt], sp) == generate_ids(off, [prompt], sp)
    assert _accepted(on)[1] > before[1]


def test_n_samples_and_logprobs(loopy_pair, tiny_pair):
    for off, on in (loopy_pair, tiny_pair):
        prompt = _prompts(1, seed=8, repeat=True)[0]
        sp = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
        got = on.generate([prompt], sp, use_tqdm=False)[0]
        ref = off.generate([prompt], sp, use_tqdm=False)[0]
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs]
        on.engine.check_idle()
        lp = greedy(24, logprobs=3)
        got1 = on.generate([prompt], lp, use_tqdm=False)[0].outputs[0]
        ref1 = off.generate([prompt], lp, use_tqdm=False)[0].outputs[0]
        assert got1.token_ids == ref1.token_ids
        assert len(got1.logprobs) == len(ref1.logprobs) == 24
        for a, b in zip(got1.logprobs, ref1.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
        on.engine.check_idle()
    assert _accepted(loopy_pair[1])[1] > 0


def test_abort_mid_run_and_overlap(loopy):
    on = LLM(str(loopy), speculative_mode="ngram", **_KW)
    engine = on.engine
    prompts = _prompts(4, seed=9, repeat=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, greedy(50))
    finals: dict[str, str] = {}
    counts = {f"a{i}": 0 for i in range(4)}
    for _ in range(8):
        for d in engine.step():
            counts[d.request_id] += len(d.token_ids)
            if d.finished:
                finals[d.request_id] = d.finish_reason
        engine.check_page_accounting()
    assert min(counts.values()) > 8  # several tokens per step: runs were accepted
    assert max(counts.values()) < 50
    engine.abort("a1")
    while engine.has_unfinished():
        for d in engine.step():
            counts[d.request_id] += len(d.token_ids)
            if d.finished:
                finals[d.request_id] = d.finish_reason
    assert finals == {"a0": "length", "a1": "abort", "a2": "length", "a3": "length"}
    assert counts["a0"] == counts["a2"] == 50
    engine.check_idle()
    # the overlapped loop: speculative steps run serially inside it, others overlap
    ref = generate_ids(LLM(str(loopy), **_KW), prompts, greedy(40))
    for mode in ("ngram", "auto"):
        lap = LLM(str(loopy), speculative_mode=mode, enable_overlap=True, **_KW)
        assert lap.engine.overlap
        assert generate_ids(lap, prompts, greedy(40)) == ref
        assert _accepted(lap)[1] > 0


def test_threshold_policy_turns_off_for_large_batches(loopy):
    kw = {**_KW, "spec_policy": "threshold"}
    on = LLM(str(loopy), speculative_mode="auto", spec_auto_max_batch=2, **kw)
    prompts = _prompts(6, seed=10, repeat=True)
    ref = generate_ids(LLM(str(loopy), **_KW), prompts, greedy(30))
    assert generate_ids(on, prompts, greedy(30)) == ref
    assert _accepted(on)[0] == 0  # six decodes all along: never speculated
    assert on.engine.stats().spec_declined_steps > 0
    assert generate_ids(on, prompts[:2], greedy(30)) == ref[:2]
    assert _accepted(on)[1] > 0


def test_measured_policy_same_tokens_and_decisions_wired(loopy):
    """The measured policy (the default): outputs are the plain engine's whatever it
    decides; it measures both sides of a bucket it runs in (the cold choice and the
    exploration steps); a controller that says no never speculates, one that says yes
    does."""
    from radixserve.engine.spec_control import SpecController

    kw = {**_KW, "spec_policy": "measured"}
    prompts = _prompts(6, seed=13, repeat=True)
    ref = generate_ids(LLM(str(loopy), **_KW), prompts, greedy(40))
    on = LLM(str(loopy), speculative_mode="ngram", spec_auto_max_batch=2, **kw)
    assert "measured tokens/s" in on.engine.startup_line
    ctl = on.engine.spec_control
    assert ctl is not None
    assert generate_ids(on, prompts, greedy(40)) == ref
    for p, r in zip(prompts[:2], ref[:2], strict=True):  # one at a time: bucket 1
        assert generate_ids(on, [p], greedy(40))[0] == r
    one = ctl.buckets[1]
    assert one.spec.samples > 0 and one.plain.samples > 0  # cold choice + exploration
    stats = on.engine.stats()
    assert stats.spec_steps > 0 and stats.spec_declined_steps > 0
    assert ctl.decisions[False] == stats.spec_declined_steps
    on.engine.check_idle()
    for cold, speculates in ((0, False), (64, True)):
        on.engine.spec_control = SpecController(cold, explore_min=10_000, explore_max=10_000)
        before = _accepted(on)[0]
        assert generate_ids(on, prompts, greedy(40)) == ref
        assert (_accepted(on)[0] > before) == speculates
        on.engine.check_idle()


def test_constrained_requests_turn_speculation_off(loopy_pair):
    off, on = loopy_pair
    prompts = _prompts(3, seed=11, repeat=True)
    regex = SamplingParams(temperature=0, max_tokens=40, structured_output={"regex": "[a-z]{1,30}"})
    params = [greedy(40), greedy(40), regex]
    before = _accepted(on)
    got = on.generate(prompts, params, use_tqdm=False)
    ref = off.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert got[2].text == ref[2].text and len(got[2].text) > 0
    on.engine.check_idle()
    assert not on.engine._constrained
    # while the constrained request ran, nothing speculated; the free ones ran longer
    assert _accepted(on) >= before


@pytest.mark.slow  # two SmolLM2 engines
def test_smollm2_grounded_prompt(smollm2_path):
    off = LLM(str(smollm2_path), dtype="float32")
    on = LLM(str(smollm2_path), dtype="float32", speculative_mode="ngram")
    passage = (
        "The lighthouse keeper climbed the stairs every evening at dusk, lit the lamp, "
        "and wrote the weather in a small leather book that had belonged to his father."
    )
    prompts = [
        f"Repeat this sentence exactly.\nSentence: {passage}\nRepeated: ",
        "def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n    return",
    ]
    params = SamplingParams(temperature=0, max_tokens=40)
    got = on.generate(prompts, params, use_tqdm=False)
    ref = off.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.text for o in got] == [o.text for o in ref]
    on.engine.check_idle()
    assert _accepted(on)[1] > 0


def test_sampled_distribution_matches_without_speculation(loopy_pair):
    """Many seeded draws of the next tokens, with and without speculation: the marginal
    of each position agrees within a stated total-variation tolerance."""
    off, on = loopy_pair
    cycle = generate_ids(off, [[7, 8, 9]], greedy(30))[0][-12:]
    prompt = [7, 8, 9, *cycle]  # ends in a repeat: the proposer has a continuation at once
    n, max_tokens = 1500, 4
    params = [
        SamplingParams(
            temperature=2.5,
            top_k=3,
            presence_penalty=0.3,
            max_tokens=max_tokens,
            seed=1000 + i,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    before = _accepted(on)
    a = np.array(generate_ids(off, [prompt] * n, params))
    b = np.array(generate_ids(on, [prompt] * n, params))
    proposed, accepted = np.subtract(_accepted(on), before)
    assert 0.1 * proposed < accepted < 0.9 * proposed  # accept and reject both happen
    # top_k=3: three values per position. E[TV(empirical, p)] <= 1/2 sqrt(3 / n) = 0.022,
    # so two empirical marginals differ by 0.045 at most in expectation; 0.08 is that
    # bound with margin. A verify rule that always kept proposals, or drew from p instead
    # of the residual after a rejection, moves these marginals by 0.2 or more here.
    for j in range(1, max_tokens):
        values = np.union1d(a[:, j], b[:, j])
        pa = np.array([(a[:, j] == v).mean() for v in values])
        pb = np.array([(b[:, j] == v).mean() for v in values])
        assert 0.5 * np.abs(pa - pb).sum() < 0.08, j
    # the joint of the first verified pair too (nine values: a looser 0.15)
    ja = a[:, 1] * TINY_VOCAB + a[:, 2]
    jb = b[:, 1] * TINY_VOCAB + b[:, 2]
    values = np.union1d(ja, jb)
    tv = 0.5 * sum(abs((ja == v).mean() - (jb == v).mean()) for v in values)
    assert tv < 0.15
    # the same seeds, with speculation, give the same tokens again (reproducible)
    assert generate_ids(on, [prompt] * 50, params[:50]) == b[:50].tolist()


def test_flags_stats_and_metrics(loopy_pair):
    from prometheus_client.parser import text_string_to_metric_families

    from radixserve.cli import build_parser, engine_kwargs
    from radixserve.serving.metrics import Metrics

    args = build_parser().parse_args(
        ["serve", "--speculative-mode", "auto", "--num-spec-tokens", "6", "--spec-ngram-min", "3"]
    )
    c = EngineConfig(**engine_kwargs(args))
    assert (c.speculative_mode, c.num_spec_tokens, c.spec_ngram_min, c.spec_ngram_max) == (
        "auto",
        6,
        3,
        4,
    )
    default = EngineConfig(**engine_kwargs(build_parser().parse_args(["serve"])))
    assert (default.speculative_mode, default.spec_policy) == ("off", "measured")
    assert (default.spec_max_tokens, default.spec_length_cap) == (None, 16)
    for flag, cap in (("0", 0), ("24", 24)):
        args = build_parser().parse_args(
            ["serve", "--speculative-mode", "ngram", "--spec-max-tokens", flag]
        )
        assert EngineConfig(**engine_kwargs(args)).spec_length_cap == cap
    args = build_parser().parse_args(
        ["serve", "--speculative-mode", "ngram", "--spec-policy", "always"]
    )
    assert EngineConfig(**engine_kwargs(args)).spec_policy == "always"
    with pytest.raises(ValueError, match="spec_policy"):
        EngineConfig(spec_policy="sometimes")
    args = build_parser().parse_args(
        ["generate", "hi", "--speculative-mode", "draft", "--spec-draft-model", "/x"]
    )
    c = EngineConfig(**engine_kwargs(args))
    assert (c.speculative_mode, c.spec_draft_model) == ("draft", "/x")
    _, on = loopy_pair
    assert "speculative decoding: ngram" in on.engine.startup_line
    generate_ids(on, _prompts(2, seed=12, repeat=True), greedy(30))
    stats = on.engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_verify_rows > 0
    text = Metrics(lambda: stats).render().decode()
    values = {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }
    assert values["radixserve_spec_accepted_tokens_total"] == stats.spec_accepted_tokens
    assert values["radixserve_spec_proposed_tokens_total"] == stats.spec_proposed_tokens
    decided = {
        s.labels["decision"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "radixserve_spec_policy_steps_total"
    }
    assert decided == {"speculate": stats.spec_steps, "plain": stats.spec_declined_steps}
    assert values["radixserve_spec_mean_accepted_length"] == pytest.approx(
        1 + stats.spec_accepted_tokens / stats.spec_verify_rows
    )


# -- the draft-model proposer ----------------------------------------------------------------
def test_draft_model_as_its_own_draft_is_always_accepted(tiny_llama, tiny_pair):
    off, _ = tiny_pair
    on = LLM(str(tiny_llama), speculative_mode="draft", spec_draft_model=str(tiny_llama), **_KW)
    assert "draft model" in on.engine.startup_line
    prompts = _prompts(6, seed=13) + _prompts(2, seed=14, repeat=True)
    ref = generate_ids(off, prompts, greedy(30))
    assert generate_ids(on, prompts, greedy(30)) == ref
    proposed, accepted = _accepted(on)
    assert proposed > 100 and accepted == proposed  # the target agrees with itself
    # prefix hits (pages from the tree carry the draft's KV too), n > 1
    for _ in range(2):
        assert [o.token_ids for o in on.generate(prompts, greedy(30), use_tqdm=False)] == ref
    assert on.engine.prefix_cache.hit_tokens > 0
    on.engine.check_idle()
    sp = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    got = on.generate(prompts[:2], sp, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in got] == [[x, x] for x in ref[:2]]
    on.engine.check_idle()
    assert _accepted(on)[1] == _accepted(on)[0]


def test_draft_model_other_model_chunked_and_preempted(tiny_models, tiny_llama, tiny_pair):
    off, _ = tiny_pair
    prompts = _prompts(10, seed=15, repeat=True)
    ref = generate_ids(off, prompts, greedy(32))
    for kw in (
        dict(max_num_batched_tokens=32, long_prefill_threshold=8, **_KW),
        dict(
            dtype="float32",
            page_size=4,
            kv_cache_memory_gb=0.0002,
            schedule_conservativeness=0.0,
            spec_policy="always",
        ),
    ):
        on = LLM(
            str(tiny_llama),
            speculative_mode="draft",
            spec_draft_model=str(tiny_models["mistral"]),
            **kw,
        )
        assert generate_ids(on, prompts, greedy(32)) == ref
        assert _accepted(on)[0] > 0
    assert on.engine.scheduler.stats.num_preemptions > 0
    # the draft proposes, the target decides: with itself as the draft under preemption
    own = LLM(
        str(tiny_llama),
        speculative_mode="draft",
        spec_draft_model=str(tiny_llama),
        dtype="float32",
        page_size=4,
        kv_cache_memory_gb=0.0002,
        schedule_conservativeness=0.0,
        spec_policy="always",
    )
    assert generate_ids(own, prompts, greedy(32)) == ref
    assert own.engine.scheduler.stats.num_preemptions > 0
    proposed, accepted = _accepted(own)
    assert accepted == proposed > 0


def test_draft_skips_plain_steps_and_catches_up(tiny_llama, tiny_pair):
    """Steps that verify nothing (prompts, plain decodes) do not run the draft (their pages
    are marked stale); a request that speculates first recomputes its draft KV from its
    first stale page, also over pages it found in the radix tree: with the target as its own draft every proposal
    is still accepted, so the draft's KV is exactly what running it every step gives."""
    from radixserve.engine.spec_control import SpecController

    def policy(cold: int, every: int) -> SpecController:
        # the cold choice, and the other side every ``every`` steps; never changes its mind
        return SpecController(cold, explore_min=every, explore_max=every, hysteresis=1e9)

    off, _ = tiny_pair
    on = LLM(str(tiny_llama), speculative_mode="draft", spec_draft_model=str(tiny_llama), **_KW)
    draft = on.engine.draft
    prompts = _prompts(5, seed=21) + _prompts(2, seed=22, repeat=True)
    ref = generate_ids(off, prompts, greedy(30))
    on.engine.spec_control = policy(64, 3)  # speculate, but every third step plain
    assert generate_ids(on, prompts, greedy(30)) == ref
    proposed, accepted = _accepted(on)
    assert draft.skipped_steps > 0 and draft.caught_up_tokens > 0
    assert accepted == proposed > 0
    on.engine.check_idle()
    # second turns: prompt + first answer, whose decode pages (from the tree) the draft
    # never saw (nothing speculated in the first turn); then speculation all along
    first_turn = [p + r for p, r in zip(prompts, ref, strict=True)]
    on.engine.spec_control = policy(0, 10_000)  # never speculates
    answers = generate_ids(off, first_turn, greedy(20))
    got = on.generate(first_turn, greedy(20), use_tqdm=False)  # (the tree keeps them)
    assert [o.token_ids for o in got] == answers
    assert _accepted(on) == (proposed, accepted)
    second = [[*t, *a, 5, 6, 7] for t, a in zip(first_turn, answers, strict=True)]
    want = generate_ids(off, second, greedy(20))
    on.engine.spec_control = policy(64, 10_000)  # always speculates
    caught = draft.caught_up_tokens
    hits = on.engine.prefix_cache.hit_tokens
    got = on.generate(second, greedy(20), use_tqdm=False)
    assert [o.token_ids for o in got] == want
    assert on.engine.prefix_cache.hit_tokens - hits > sum(len(t) for t in first_turn)
    assert draft.caught_up_tokens > caught
    proposed2, accepted2 = _accepted(on)
    assert accepted2 == proposed2 > proposed
    on.engine.check_idle()


def test_int4_copy_of_the_target_as_its_draft(tiny_llama, tiny_pair):
    """``spec_draft_quantization="int4"``: the target's own weights in int4 (bfloat16
    activations) propose for the float32 target; the output stays the target's, token for
    token. (On this tiny random model int4 g32 is coarse: about one proposal in five is
    accepted, against nine in ten for an int8 copy and all for an exact one.)"""
    off, _ = tiny_pair
    on = LLM(
        str(tiny_llama),
        speculative_mode="draft",
        spec_draft_model=str(tiny_llama),
        spec_draft_quantization="int4",
        **_KW,
    )
    assert on.engine.draft.scheme is not None and on.engine.draft.scheme.kind == "int4"
    assert on.engine.draft.dtype == torch.bfloat16
    assert "(int4 g32" in on.engine.startup_line
    prompts = _prompts(6, seed=18) + _prompts(2, seed=19, repeat=True)
    assert generate_ids(on, prompts, greedy(30)) == generate_ids(off, prompts, greedy(30))
    proposed, accepted = _accepted(on)
    assert proposed > 100 and 0 < accepted < proposed
    on.engine.check_idle()
    with pytest.raises(ValueError, match="spec_draft_quantization"):
        EngineConfig(spec_draft_quantization="int3")


def test_draft_model_sampled_and_checks(tiny_llama, tiny_models):
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(speculative_mode="draft")
    on = LLM(str(tiny_llama), speculative_mode="draft", spec_draft_model=str(tiny_llama), **_KW)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True)
    a = generate_ids(on, _prompts(3, seed=16), sp)
    assert a == generate_ids(on, _prompts(3, seed=16), sp)  # seeded: reproducible
    assert all(len(x) == 20 for x in a)


def test_priority_preemption_takes_a_speculating_request_out(loopy):
    """Policy priority: a high-priority arrival preempts running (speculating) requests that
    were already in this step's batch; the batch's proposals stay aligned."""
    kw = dict(
        dtype="float32",
        page_size=4,
        kv_cache_memory_gb=0.00015,
        schedule_policy="priority",
        schedule_conservativeness=0.0,
        spec_policy="always",
    )
    prompts = _prompts(8, seed=17, repeat=True)
    results = []
    for mode in ("off", "ngram"):
        engine = LLM(str(loopy), speculative_mode=mode, **kw).engine
        out: dict[str, list[int]] = {}
        for i, p in enumerate(prompts[:4]):
            engine.add_request(f"low{i}", p, greedy(40), priority=5)
        for _ in range(6):
            for d in engine.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        for i, p in enumerate(prompts[4:]):
            engine.add_request(f"high{i}", p, greedy(40), priority=0)
        while engine.has_unfinished():
            for d in engine.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
            engine.check_page_accounting()
        engine.check_idle()
        results.append((out, engine.scheduler.stats.num_preemptions, engine.stats()))
    (off_out, _, _), (on_out, preempted, stats) = results
    assert on_out == off_out and all(len(v) == 40 for v in on_out.values())
    assert preempted > 0 and stats.spec_accepted_tokens > 0


@pytest.mark.slow  # 12 s on the loaded machine
def test_pooling_requests_in_speculative_steps(loopy_pair):
    """Pooling requests admitted while others verify proposals: the generations keep their
    tokens and the embeddings equal the plain engine's."""
    off, on = loopy_pair
    gen = _prompts(3, seed=9, repeat=True)
    pool = _prompts(4, seed=10)
    want_tokens = generate_ids(off, gen, greedy(24))
    want = off.embed(pool, "mean", normalize=False)
    eng = on.engine
    proposed_before = _accepted(on)[0]
    for i, p in enumerate(gen):
        eng.add_request(f"g{i}", p, greedy(24))
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # the generations decode (and speculate) before the pooling arrives
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    for i, p in enumerate(pool):
        eng.add_pooling_request(f"e{i}", p, "mean")
    vecs = {}
    spec_steps_with_pooling = 0
    while eng.has_unfinished():
        queued = [*eng.scheduler.running, *eng.scheduler.waiting]
        pooling = any(r.pooling is not None for r in queued)
        steps = eng.spec_steps
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished and d.request_id[0] == "e":
                vecs[d.request_id] = d.embedding
        spec_steps_with_pooling += pooling and eng.spec_steps > steps
        eng.check_page_accounting()
    eng.check_idle()
    assert _accepted(on)[0] > proposed_before and spec_steps_with_pooling > 0
    assert [tokens[f"g{i}"] for i in range(len(gen))] == want_tokens
    for i, w in enumerate(want):
        np.testing.assert_allclose(vecs[f"e{i}"], w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_string_and_the_length_limit_in_one_accepted_run(loopy, loopy_pair, overlap):
    """A verify step accepts several tokens at once: a stop string that completes at one
    of them ends the sample there even when a later token of the same run reaches
    max_tokens (the engine has then ended the sample itself), in the serial and the
    overlapped loop (where proposing drains the step in flight: its text is made once)."""
    off, _ = loopy_pair
    on = LLM(str(loopy), speculative_mode="ngram", enable_overlap=overlap, **_KW)
    prompt = _prompts(1, seed=7, repeat=True)[0]
    text = off.generate([prompt], greedy(40), use_tqdm=False)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    ref_full = off.generate([prompt], greedy(40, stop=[stop]), use_tqdm=False)[0]
    for extra in range(4):  # max_tokens just past where the stop string completes
        sp = greedy(len(ref_full.token_ids) + extra, stop=[stop])
        got = on.generate([prompt], sp, use_tqdm=False)[0]
        ref = off.generate([prompt], sp, use_tqdm=False)[0]
        assert (got.text, got.token_ids, got.finish_reason) == (
            ref.text,
            ref.token_ids,
            ref.finish_reason,
        )
        on.engine.check_idle()
    on.engine.close()
