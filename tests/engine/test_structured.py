"""Constrained decoding (xgrammar) in the engine: random-weight models still emit output
that matches the schema / regex / grammar; free requests in the same batch are untouched;
serial, overlapped and preempted runs agree; a bad grammar fails its request only."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from radixserve import LLM, SamplingParams
from radixserve.core.request import FinishReason, Request, RequestState
from radixserve.engine.structured import GrammarWaitList
from tests.helpers import greedy

ENGINE = dict(dtype="float32", page_size=4, kv_cache_memory_gb=0.02)


# strings bounded by patterns: a random model would otherwise write until max_tokens
class Address(BaseModel):
    street: str = Field(pattern=r"^[a-z ]{1,16}$")
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    name: str = Field(pattern=r"^[A-Z][a-z]{0,10}$")
    age: int = Field(ge=0, le=120)
    score: float = Field(ge=-1.5, le=2.5)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["a", "b", "c"]] = Field(min_length=1, max_length=3)
    address: Address
    active: bool


SCHEMA = Person.model_json_schema()


@pytest.fixture(scope="module")
def pair(tiny_llama):
    serial = LLM(str(tiny_llama), enable_overlap=False, **ENGINE)
    overlapped = LLM(str(tiny_llama), enable_overlap=True, **ENGINE)
    yield serial, overlapped
    serial.engine.close()
    overlapped.engine.close()


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_idle()
    return outs


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def _json_params(i: int, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=i, max_tokens=max_tokens, structured_output={"json": SCHEMA}
    )


def test_random_model_output_validates_against_the_schema(pair):
    serial, overlapped = pair
    prompts = _prompts(8, seed=1)
    params = [_json_params(i) for i in range(8)]
    for llm in (serial, overlapped):
        for out in _run(llm, prompts, params):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            Person.model_validate_json(c.text)  # raises if it does not match
    # the same seeds give the same constrained tokens serial and overlapped
    a = [o.outputs[0].token_ids for o in _run(serial, prompts, params)]
    b = [o.outputs[0].token_ids for o in _run(overlapped, prompts, params)]
    assert a == b


def test_regex_choice_grammar_and_json_object(pair):
    _, llm = pair
    kinds = [
        ({"regex": r"[a-c]{3}-\d{2,4}"}, lambda t: re.fullmatch(r"[a-c]{3}-\d{2,4}", t)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        (
            {"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'},
            lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t),
        ),
    ]
    prompts, params, checks = [], [], []
    for seed in range(4):
        for spec, check in kinds:
            prompts.append([5 + seed, 6, 7])
            params.append(
                SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_output=spec)
            )
            checks.append(check)
    for out, check in zip(_run(llm, prompts, params), checks, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), c.text
    # json_object: some JSON object (greedy on a random model may run long: a prefix is ok)
    obj = _run(
        llm,
        [[9, 9, 9]],
        SamplingParams(temperature=0, max_tokens=300, structured_output={"json_object": True}),
    )
    text = obj[0].outputs[0].text
    assert text.startswith("{")
    if obj[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_free_requests_in_a_mixed_batch_get_the_same_tokens(pair):
    serial, overlapped = pair
    prompts = _prompts(6, seed=2)
    free = [greedy(16)] * len(prompts)
    alone = [o.outputs[0].token_ids for o in _run(serial, prompts, free)]
    mixed_prompts = prompts + _prompts(6, seed=3)
    mixed_params = free + [_json_params(i) for i in range(6)]
    for llm in (serial, overlapped):
        outs = _run(llm, mixed_prompts, mixed_params)
        assert [o.outputs[0].token_ids for o in outs[:6]] == alone
        for o in outs[6:]:
            Person.model_validate_json(o.outputs[0].text)


def test_preempted_constrained_requests_keep_their_grammar_state(tiny_llama, pair):
    serial, _ = pair
    small = LLM(
        str(tiny_llama),
        enable_overlap=True,
        dtype="float32",
        page_size=4,
        kv_cache_memory_gb=0.0004,
        schedule_conservativeness=0.0,
    )
    prompts = _prompts(12, seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=400, structured_output={"json": SCHEMA})
        if i % 2
        else greedy(60)
        for i in range(12)
    ]
    want = _run(serial, prompts, params)
    got = _run(small, prompts, params)
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for o in got[1::2]:
        Person.model_validate_json(o.outputs[0].text)
    small.engine.close()


def test_n_samples_each_have_their_own_matcher(pair):
    _, llm = pair
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=400, structured_output={"json": SCHEMA}
    )
    out = _run(llm, [[11, 12, 13]], params)[0]
    texts = [c.text for c in out.outputs]
    for t in texts:
        Person.model_validate_json(t)
    assert len(set(texts)) > 1


def test_bad_grammar_fails_its_request_only(pair):
    serial, _ = pair
    params = [
        SamplingParams(max_tokens=8, structured_output={"regex": "a(b"}),
        SamplingParams(max_tokens=8, structured_output={"json": {"type": "nonsense"}}),
        greedy(8),
    ]
    outs = _run(serial, [[5, 6]] * 3, params)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "structured_output.regex" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "error"
    assert "structured_output.json" in outs[1].outputs[0].error
    assert outs[2].outputs[0].finish_reason == "length"


def test_structured_output_shape_is_checked_at_construction():
    for bad, field in [
        ({}, "structured_output"),
        ({"json": {}, "regex": "a"}, "structured_output"),
        ({"choice": []}, "structured_output.choice"),
        ({"json": "{not json"}, "structured_output.json"),
        ({"regex": 3}, "structured_output.regex"),
        ({"json_object": False}, "structured_output.json_object"),
    ]:
        with pytest.raises(ValueError, match=re.escape(field)):
            SamplingParams(structured_output=bad)


class _Service:
    """Hands out futures the test resolves by hand."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, key):
        fut = concurrent.futures.Future()
        self.futures.append(fut)
        return fut

    def matcher(self, compiled):
        return ("matcher", compiled)

    def close(self) -> None:
        pass


def _requests(n: int, group: str) -> list[Request]:
    return [Request(f"{group}-{i}", [1, 2], SamplingParams(max_tokens=2)) for i in range(n)]


def test_grammar_wait_list_transitions():
    now = [0.0]
    service = _Service()
    waits = GrammarWaitList(lambda: service, timeout_s=5.0, clock=lambda: now[0])
    ok, bad, slow, gone = (_requests(2, g) for g in ("ok", "bad", "slow", "gone"))
    for group in (ok, bad, slow, gone):
        waits.add(group, ("regex", "x"))
        assert all(r.state is RequestState.WAITING_FOR_GRAMMAR for r in group)
    assert len(waits) == 8
    admitted: list[list[Request]] = []
    failed: list[tuple[str, str]] = []

    def fail(req, message):
        req.finish(FinishReason.ERROR, message)
        failed.append((req.request_id, message))

    waits.poll(admitted.append, fail)
    assert not admitted and not failed  # nothing compiled yet: nobody moves
    service.futures[0].set_result("compiled")
    service.futures[1].set_exception(ValueError("structured_output.regex: invalid"))
    removed = waits.remove("gone-1")
    assert removed is gone[1]
    waits.poll(admitted.append, fail)
    assert admitted == [ok]
    assert all(r.state is RequestState.NEW and r.grammar == ("matcher", "compiled") for r in ok)
    assert ok[0].grammar is not ok[1].grammar  # one matcher per sample
    assert [rid for rid, _ in failed] == ["bad-0", "bad-1"]
    assert all(r.state is RequestState.FINISHED for r in bad)
    now[0] = 6.0  # past the compile deadline
    waits.poll(admitted.append, fail)
    assert {rid for rid, _ in failed[2:]} == {"slow-0", "slow-1", "gone-0"}
    assert all("did not compile within 5 s" in m for _, m in failed[2:])
    assert len(waits) == 0


def test_abort_while_waiting_for_grammar(pair):
    serial, _ = pair
    engine = serial.engine
    engine.add_request("w", [5, 6, 7], _json_params(0))
    assert engine.has_unfinished() and engine.num_unfinished == 1
    engine.abort("w")
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [(d.request_id, d.finished, d.finish_reason) for d in outs] == [("w", True, "abort")]
    engine.check_idle()


@pytest.mark.parametrize("family", ["qwen3", "deepseek_r1"])
def test_a_grammar_after_the_thinking_lets_any_thinking_pass_and_no_end_marker_in_it(
    tiny_llama, family
):
    """``structured_output.reasoning``: the family's thinking block first (any text, even
    with "<", "</", "</thin" in it), then the answer's grammar; the end marker cannot hide
    inside the thinking, and an answer that breaks the grammar is refused."""
    from radixserve.engine.tokenizer import load_hf_tokenizer
    from radixserve.executor.grammar import GrammarService

    tokenizer = load_hf_tokenizer(tiny_llama)
    service = GrammarService(tokenizer, 512)
    params = SamplingParams(structured_output={"regex": "(yes|no)", "reasoning": family})
    assert params.grammar_key() == (f"regex@{family}", "(yes|no)")
    compiled = service.compile(params.grammar_key(), 30)

    def accepts(text: str) -> bool:
        matcher = service.matcher(compiled).matcher
        return all(
            matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)
        )

    thinking = "a < b, x </ y, </thin ok <<</thi"
    assert accepts(f"<think>{thinking}</think>\n\nyes")
    assert not accepts(f"<think>{thinking}</think>\n\nmaybe")
    if family == "qwen3":
        assert accepts("no")  # the block is optional: no thinking, the answer at once
    else:
        assert accepts(f"{thinking}</think>no")  # R1 starts inside the thinking
        assert not accepts(f"{thinking}</think>maybe")
    service.close()


def test_structured_output_reasoning_is_checked():
    with pytest.raises(ValueError, match=r"structured_output\.reasoning"):
        SamplingParams(structured_output={"regex": "a", "reasoning": "nope"}).grammar_key()
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_output={"reasoning": "qwen3"}).grammar_key()
