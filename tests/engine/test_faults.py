"""Fault injection (RADIXSERVE_FAULTS): parsing, and injected step failures in a real engine."""

from __future__ import annotations

import time

import pytest

from radixserve import LLM
from radixserve.engine.faults import FaultInjector, FaultSpec, InjectedFault, parse_faults
from tests.helpers import greedy


def test_parse_the_documented_example_and_defaults():
    spec = parse_faults("step_exception:0.01, engine_crash_after:500,slow_step_ms:2000")
    assert spec == FaultSpec(step_exception=0.01, engine_crash_after=500, slow_step_ms=2000.0)
    assert spec.active and spec.slow_step_p == 1.0 and spec.seed == 0
    assert parse_faults("hang_after:3,seed:7") == FaultSpec(hang_after=3, seed=7)
    assert not parse_faults("").active
    assert FaultInjector.from_env({}) is None
    assert FaultInjector.from_env({"RADIXSERVE_FAULTS": ""}) is None
    assert FaultInjector.from_env({"RADIXSERVE_FAULTS": "step_exception:0"}) is None


@pytest.mark.parametrize(
    "text, words",
    [
        ("step_exeption:0.1", "unknown fault 'step_exeption'"),
        ("step_exception", "expected key:value"),
        ("step_exception:", "expected key:value"),
        ("step_exception:1.5", "probability in [0, 1]"),
        ("slow_step_p:-0.1", "probability in [0, 1]"),
        ("engine_crash_after:2.5", "must be an integer"),
        ("slow_step_ms:fast", "must be a number"),
        ("slow_step_ms:-5", "finite number >= 0"),
        ("slow_step_ms:inf", "finite number >= 0"),
        ("hang_after:1,hang_after:2", "given twice"),
    ],
)
def test_malformed_specs_are_value_errors(text, words):
    with pytest.raises(ValueError) as info:
        parse_faults(text)
    assert words in str(info.value) and "RADIXSERVE_FAULTS" in str(info.value)


def test_injector_counts_steps_sleeps_and_raises():
    slow = FaultInjector(FaultSpec(slow_step_ms=30))
    t0 = time.monotonic()
    slow.on_step()
    slow.on_step()
    assert slow.steps == 2 and time.monotonic() - t0 >= 0.06
    always = FaultInjector(FaultSpec(step_exception=1.0))
    with pytest.raises(InjectedFault, match="injected fault: step_exception at step 1"):
        always.on_step()
    # seeded: the same spec fails the same steps
    draws = []
    for _ in range(2):
        f = FaultInjector(FaultSpec(step_exception=0.5, seed=3))
        fails = []
        for _ in range(40):
            try:
                f.on_step()
                fails.append(False)
            except InjectedFault:
                fails.append(True)
        draws.append(fails)
    assert draws[0] == draws[1] and 5 < sum(draws[0]) < 35


def test_step_exceptions_fail_their_batch_only_and_leak_no_pages(tiny_llama, monkeypatch):
    prompts = [[5 + i, 17, 23 + i, 42] for i in range(12)]
    params = greedy(6)
    clean = LLM(str(tiny_llama), dtype="float32")
    expected = [o.outputs[0].token_ids for o in clean.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("RADIXSERVE_FAULTS", "step_exception:0.3,seed:5")
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=4)
    assert llm.engine.faults is not None
    outs = llm.generate(prompts, params, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert "error" in reasons and "length" in reasons, reasons
    for out, want in zip(outs, expected, strict=True):
        c = out.outputs[0]
        if c.finish_reason == "error":
            assert "injected fault: step_exception" in (c.error or "")
        else:  # the requests that did not meet a fault are untouched by the others'
            assert c.token_ids == want
    llm.engine.check_idle()  # every page back once the tree lets go
    assert clean.engine.faults is None  # off: no hook at all
