"""The speculation cost controller, with no model: synthetic step times in, decisions out."""

from __future__ import annotations

import random

import pytest

from radixserve.engine.spec_control import SpecController, bucket_label, bucket_of


def _run(
    ctl: SpecController,
    batch: int,
    steps: int,
    plain_s: float,
    spec_s: float,
    spec_tokens_per_row: float,
    noise: float = 0.0,
    seed: int = 0,
) -> list[bool]:
    """Drive ``steps`` decisions at ``batch``: a plain step takes ``plain_s`` and emits one
    token per row, a speculative one ``spec_s`` and ``spec_tokens_per_row`` per row
    (times jittered by +-``noise``, relative)."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        spec = ctl.decide(batch)
        jitter = 1.0 + noise * (2 * rng.random() - 1)
        if spec:
            ctl.record(batch, True, spec_s * jitter, round(batch * spec_tokens_per_row))
        else:
            ctl.record(batch, False, plain_s * jitter, batch)
        out.append(spec)
    return out


def test_buckets():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 256, 257, 600)] == [
        1, 2, 3, 4, 6, 6, 8, 8, 12, 16, 24, 256, 512, 1024,
    ]  # fmt: skip
    assert [bucket_label(e) for e in (1, 4, 6, 12, 512)] == ["1", "4", "5-6", "9-12", "257-512"]
    with pytest.raises(ValueError):
        bucket_of(0)


def test_cold_start_follows_the_crossover_until_measured():
    ctl = SpecController(cold_max_batch=4, explore_min=8)
    # the first 7 decisions of a bucket are the cold default; the 8th explores
    assert [ctl.decide(3) for _ in range(8)] == [True] * 7 + [False]
    assert [ctl.decide(6) for _ in range(8)] == [False] * 7 + [True]
    assert ctl.explorations == 2


@pytest.mark.parametrize("cold", [0, 64])
def test_switches_to_the_faster_side_whatever_the_cold_start(cold):
    # speculation pays: 3 tokens per row for 1.5x the time of a plain step
    ctl = SpecController(cold_max_batch=cold)
    decisions = _run(ctl, 2, 300, plain_s=0.010, spec_s=0.015, spec_tokens_per_row=3.0)
    assert sum(decisions[-100:]) >= 97  # on, bar an exploration step now and then
    # speculation costs: 1.2 tokens per row for 2x the time
    ctl = SpecController(cold_max_batch=cold)
    decisions = _run(ctl, 16, 300, plain_s=0.020, spec_s=0.040, spec_tokens_per_row=1.2)
    assert sum(decisions[-100:]) <= 2  # off, bar an exploration step now and then
    assert ctl.table()[0]["speculate"] is False


def test_exploration_backs_off_and_the_choice_follows_a_change():
    ctl = SpecController(cold_max_batch=0, explore_min=4, explore_max=64)
    _run(ctl, 8, 400, plain_s=0.010, spec_s=0.030, spec_tokens_per_row=1.5)
    assert ctl.buckets[8].speculate is False
    assert ctl.buckets[8].interval == 64  # confirmed again and again: explores rarely
    # the requests change: proposals now mostly accepted, speculation pays
    # (it notices within a few explorations: up to a few hundred steps at the longest
    # interval)
    decisions = _run(ctl, 8, 600, plain_s=0.010, spec_s=0.012, spec_tokens_per_row=3.5)
    assert ctl.buckets[8].speculate is True
    assert sum(decisions[-100:]) >= 97


def test_buckets_decide_apart_and_noise_does_not_flip_a_clear_choice():
    ctl = SpecController(cold_max_batch=4)
    small = _run(ctl, 1, 300, 0.010, 0.012, 3.0, noise=0.3, seed=1)
    large = _run(ctl, 16, 300, 0.030, 0.060, 1.3, noise=0.3, seed=2)
    assert sum(small[-200:]) >= 190 and sum(large[-200:]) <= 10
    assert [row["speculate"] for row in ctl.table()] == [True, False]
    assert ctl.decisions[True] + ctl.decisions[False] == 600


def test_near_ties_keep_the_choice_within_the_margin():
    ctl = SpecController(cold_max_batch=4, hysteresis=0.05)
    # speculation 2 % faster: inside the margin, the cold choice (off at 8) stays
    decisions = _run(ctl, 8, 200, plain_s=0.010, spec_s=0.0196, spec_tokens_per_row=2.0)
    assert ctl.buckets[8].speculate is False
    assert sum(decisions) < 10


def test_one_slow_step_does_not_decide():
    """A step that met a new shape (or a burst of other load) takes 10x as long: the
    median over the window ignores it; the choice stays with the faster side."""
    ctl = SpecController(cold_max_batch=0, explore_min=2, explore_max=2)
    ctl.record(16, False, 0.5, 16)  # the first plain step: 25x slower than the rest
    for _ in range(40):
        spec = ctl.decide(16)
        ctl.record(16, spec, 0.030 if spec else 0.020, 20 if spec else 16)  # plain wins
    assert ctl.buckets[16].speculate is False
    assert ctl.decisions[True] == ctl.explorations  # it never chose to speculate


def test_bimodal_acceptance_counts_by_its_mean():
    """A proposer right 40 % of the time: a speculative step emits 5 tokens or 1, at 1.3x
    the time of a plain step; on average 2.6 tokens, a 2x gain, which the controller takes
    (a median of per-step rates would see 1 / 1.3 and call it a loss)."""
    ctl = SpecController(cold_max_batch=0)
    rng = random.Random(3)
    for _ in range(300):
        spec = ctl.decide(1)
        if spec:
            ctl.record(1, True, 0.013, 5 if rng.random() < 0.4 else 1)
        else:
            ctl.record(1, False, 0.010, 1)
    assert ctl.buckets[1].speculate is True
    assert (
        ctl.decisions[True] > 200
    )  # (a window of 8 steps with no 5 in it can turn it off a while)


def test_bad_samples_are_ignored_and_arguments_checked():
    ctl = SpecController(cold_max_batch=1)
    ctl.record(1, True, 0.0, 3)
    ctl.record(1, False, 0.01, 0)
    assert not ctl.buckets  # nothing recorded, no bucket made
    for kw in ({"window": 0}, {"explore_min": 0}, {"explore_min": 9, "explore_max": 8}):
        with pytest.raises(ValueError):
            SpecController(4, **kw)
    with pytest.raises(ValueError):
        SpecController(-1)


def test_exploring_a_far_slower_side_is_rarer():
    """Once measured, a side five times slower is explored at most about every
    (5 - 1) / budget steps: its explorations cost about ``explore_budget`` of the time,
    where the plain doubling alone would stop at ``explore_max``."""
    ctl = SpecController(16, explore_budget=0.02, explore_cap=512)
    # speculating: 5 s a step for 16 tokens against plain 1 s for 16 (5x slower)
    decisions = _run(ctl, 16, 2000, plain_s=1.0, spec_s=5.0, spec_tokens_per_row=1.0)
    assert not ctl.buckets[16].speculate
    assert ctl.buckets[16].interval == 200  # ceil((5 - 1) / 0.02)
    late = decisions[1000:]
    assert 0 < sum(late) <= len(late) // 200 + 1
    # a near tie keeps the ordinary doubling: at most explore_max
    tie = SpecController(16)
    _run(tie, 16, 2000, plain_s=1.0, spec_s=1.1, spec_tokens_per_row=1.0)
    assert tie.buckets[16].interval == tie.explore_max
    with pytest.raises(ValueError):
        SpecController(4, explore_cap=8)  # below explore_max


def test_cold_start_defaults_per_proposer():
    from radixserve.engine.config import EngineConfig

    assert EngineConfig(speculative_mode="ngram").spec_crossover == 16
    assert EngineConfig(speculative_mode="auto", spec_auto_max_batch=3).spec_crossover == 3
    draft = EngineConfig(speculative_mode="draft", spec_draft_model="some/draft")
    assert draft.spec_crossover == 1
    with pytest.raises(ValueError):
        EngineConfig(speculative_mode="ngram", spec_auto_max_batch=0)


def test_one_costly_exploration_is_enough_to_back_off():
    """A side whose first sample is five times slower is not tried again within the
    priced interval, although the choice itself waits for ``min_samples``."""
    ctl = SpecController(0, explore_min=8, min_samples=3)  # cold: plain
    decisions = _run(ctl, 16, 100, plain_s=1.0, spec_s=5.0, spec_tokens_per_row=1.0)
    assert decisions.index(True) == 7  # the first exploration, at the 8th step
    assert sum(decisions) == 1  # the next one would be 200 steps later
    assert ctl.buckets[16].interval == 200 and not ctl.buckets[16].speculate


def test_variable_verify_lengths_are_priced_by_their_sums():
    """With the adaptive proposal length a speculative step's seconds vary with its rows:
    here, in a repeating pattern, 5 of 8 are short verifies rejected at once (2 rows, 13 ms,
    1 token: 77 tok/s) and 3 of 8 long ones (13 rows, 40 ms, 4 tokens: 100 tok/s): 17
    tokens in 185 ms, 92 tok/s, against 100 tok/s plain, so speculating loses. A mean of
    tokens over a median of seconds would pair the long steps' tokens with the short steps'
    time (2.1 tokens / 13 ms = 163 tok/s) and speculate."""
    ctl = SpecController(cold_max_batch=1)
    pattern = [False, True, False, False, True, False, True, False]  # True: a long verify
    decisions = []
    spec_steps = 0
    for _ in range(400):
        spec = ctl.decide(1)
        if spec:
            if pattern[spec_steps % len(pattern)]:
                ctl.record(1, True, 0.040, 4, rows=13)
            else:
                ctl.record(1, True, 0.013, 1, rows=2)
            spec_steps += 1
        else:
            ctl.record(1, False, 0.010, 1)
        decisions.append(spec)
    b = ctl.buckets[1]
    assert b.speculate is False
    assert sum(decisions[-200:]) <= 10
    assert b.spec.rate == pytest.approx(17 / 0.185)
    # a burst (30x the time per row) among the long steps is left out, not averaged in
    side = ctl.buckets[1].spec
    side.steps.clear()
    for _ in range(7):
        side.add(0.040, 13, 13)
    side.add(1.2, 13, 13)
    assert side.rate == pytest.approx(13 / 0.040)


# -- the adaptive proposal length (executor/spec/length.py) --------------------------------
def test_adaptive_length_doubles_when_all_kept_and_halves_on_a_rejection():
    from radixserve.executor.spec.length import AdaptiveLength

    lengths = AdaptiveLength(base=2, max_len=12, start=4)
    assert lengths.limit("a", 1) == 4  # not seen yet: the start
    lengths.update("a", 4, 4, 4)  # a full proposal, all kept: doubles
    assert lengths.limit("a", 1) == 8
    lengths.update("a", 8, 8, 8)
    assert lengths.limit("a", 1) == 12  # capped
    lengths.update("a", 12, 12, 12)
    assert lengths.length("a") == 12
    lengths.update("a", 12, 12, 7)  # a rejection after 7 kept: halves
    assert lengths.length("a") == 6
    lengths.update("a", 6, 6, 0)
    assert lengths.length("a") == 3
    lengths.update("a", 3, 3, 2)
    assert lengths.length("a") == 2  # never below the base
    lengths.update("a", 2, 2, 0)
    assert lengths.length("a") == 2
    # a proposal cut short (the continuation ended, the budget or max_tokens cut it) and
    # kept says nothing about longer runs: no change; a rejection in it still halves
    lengths.update("b", 4, 3, 3)
    assert lengths.length("b") == 4
    lengths.update("b", 4, 1, 0)
    assert lengths.length("b") == 2
    lengths.update("c", 4, 0, 0)  # nothing verified: nothing learnt
    assert lengths.length("c") == 4 and len(lengths) == 2
    lengths.forget("a")
    lengths.forget("zzz")
    assert lengths.length("a") == 4 and len(lengths) == 1
    with pytest.raises(ValueError):
        lengths.update("b", 4, 5, 1)  # more verified than the limit allowed
    with pytest.raises(ValueError):
        lengths.update("b", 4, 2, 3)
    with pytest.raises(ValueError):
        AdaptiveLength(base=5, max_len=4)
    with pytest.raises(ValueError):
        AdaptiveLength(base=0, max_len=4)
    with pytest.raises(ValueError):
        AdaptiveLength(base=4, max_len=8, start=9)
    with pytest.raises(ValueError):
        AdaptiveLength(base=4, max_len=8, start=3)
    # the default start: half the cap (one doubling below it), at least the base
    assert AdaptiveLength(base=4, max_len=16).start == 8
    assert AdaptiveLength(base=4, max_len=6).start == 4


def test_adaptive_length_growth_is_shared_by_the_batch():
    from radixserve.executor.spec.length import AdaptiveLength

    lengths = AdaptiveLength(base=4, max_len=16)
    assert [lengths.limit("r", n) for n in (1, 2, 3, 4)] == [8, 8, 5, 4]  # the start, 8
    lengths.update("r", 8, 8, 8)
    assert lengths.length("r") == 16
    # above the base the cap is max_len // batch; never below the base
    assert [lengths.limit("r", n) for n in (1, 2, 3, 4, 5, 16, 64)] == [16, 8, 5, 4, 4, 4, 4]
    # from max_len // base requests on the limit is the base, whatever the length
    lengths.update("r", 4, 4, 1)
    assert lengths.length("r") == 4
    assert [lengths.limit("r", n) for n in (1, 4, 16)] == [4, 4, 4]
    lengths.update("r", 4, 4, 4)
    assert lengths.limit("r", 1) == 8 and lengths.limit("r", 16) == 4


def test_adaptive_length_config():
    from radixserve.engine.config import DEFAULT_SPEC_MAX_TOKENS, EngineConfig

    assert EngineConfig(speculative_mode="ngram").spec_length_cap == DEFAULT_SPEC_MAX_TOKENS
    assert DEFAULT_SPEC_MAX_TOKENS == 16
    assert EngineConfig(speculative_mode="ngram", num_spec_tokens=20).spec_length_cap == 20
    assert EngineConfig(speculative_mode="ngram", spec_max_tokens=0).spec_length_cap == 0
    assert EngineConfig(speculative_mode="ngram", spec_max_tokens=6).spec_length_cap == 6
    draft = EngineConfig(speculative_mode="draft", spec_draft_model="some/draft")
    assert draft.spec_length_cap == 0  # a draft model keeps num_spec_tokens
    with pytest.raises(ValueError, match="spec_max_tokens"):
        EngineConfig(speculative_mode="ngram", num_spec_tokens=4, spec_max_tokens=3)
