"""One request value at the engine's boundary (``core.request.EngineRequest``): its entry
point checks it once, and ``Engine.submit`` takes it as it is, re-validating nothing."""

from __future__ import annotations

import msgspec
import pytest

from radixserve import LLM
from radixserve.core.request import POOLING_PARAMS, EngineRequest, Tenant
from radixserve.serving import protocol as p
from tests.helpers import generate_ids, greedy


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", page_size=4, kv_cache_memory_gb=0.02)


def _run(engine, request: EngineRequest) -> dict:
    engine.submit(request)
    out: dict = {"tokens": []}
    while engine.has_unfinished():
        for d in engine.step():
            out["tokens"] += d.token_ids
            if d.finished:
                out["embedding"], out["error"] = d.embedding, d.error
    return out


def _counting(monkeypatch, inputs) -> dict[str, int]:
    """Count the input processor's checks (and the vocabulary check of the params)."""
    calls = {"check_prompt": 0, "encode": 0}
    for name in calls:
        real = getattr(inputs, name)

        def counted(*a, _name=name, _real=real, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(inputs, name, counted)
    return calls


def test_submit_validates_nothing_again(llm, monkeypatch):
    """What the serving frontend sends (a checked request, through the wire) runs with no
    check of the engine's: the same greedy tokens as the offline path, which checks it."""
    engine = llm.engine
    prompt, params = [5, 9, 17, 33, 2, 8], greedy(6)
    expected = generate_ids(llm, [prompt], params)[0]
    sent = EngineRequest("wire-1", prompt, params, "salt", 0, Tenant("alice"))
    received = msgspec.msgpack.decode(
        p.encoder.encode(p.GenerateRequest(sent)), type=p.ToEngine
    ).request
    assert received == sent
    calls = _counting(monkeypatch, engine.inputs)
    assert _run(engine, received)["tokens"] == expected
    assert calls == {"check_prompt": 0, "encode": 0}
    pooled = _run(engine, EngineRequest("wire-2", prompt, POOLING_PARAMS, pooling="mean"))
    assert pooled["embedding"] is not None and pooled["error"] is None
    assert calls == {"check_prompt": 0, "encode": 0}
    engine.check_idle()


def test_offline_entry_points_check_each_prompt_once(llm, monkeypatch):
    engine = llm.engine
    calls = _counting(monkeypatch, engine.inputs)
    llm.generate([[5, 9, 17], "a text prompt", [7, 7]], greedy(3), use_tqdm=False)
    assert calls == {"check_prompt": 3, "encode": 1}
    list(llm.stream([1, 2, 3], greedy(2)))
    assert calls["check_prompt"] == 4
    llm.embed([[1, 2, 3], [4, 5]])
    assert calls["check_prompt"] == 6
    engine.add_request("direct", [3, 4, 5], greedy(2))
    assert calls["check_prompt"] == 7
    while engine.has_unfinished():
        engine.step()
    engine.check_idle()


def test_what_only_the_engine_knows_is_still_refused(llm):
    engine = llm.engine
    engine.submit(EngineRequest("dup", [1, 2, 3], greedy(2)))
    with pytest.raises(ValueError, match="already in use"):
        engine.submit(EngineRequest("dup", [4, 5], greedy(2)))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="pooling must be"):
        llm.embed([[1, 2]], pooling="max")
    engine.check_idle()


def test_a_grammar_is_checked_once_in_the_frontend_and_compiled_once_in_the_engine(
    llm, monkeypatch
):
    """The serving path: the frontend's check parses the spec (no compile: it has no
    grammar compiler at all), the engine compiles it once for all the request's samples,
    and a later request with the same spec reuses it."""
    import asyncio

    from radixserve.core.sampling_params import SamplingParams
    from radixserve.executor import grammar as xg
    from radixserve.serving.grammar import GrammarChecker

    counts = {"parse": 0, "compile": 0}
    real_parse, real_compile = xg.parse_grammar, xg.GrammarService._compile

    def parse(key):
        counts["parse"] += 1
        return real_parse(key)

    def compile_(self, key):
        counts["compile"] += 1
        return real_compile(self, key)

    monkeypatch.setattr(xg, "parse_grammar", parse)
    monkeypatch.setattr(xg.GrammarService, "_compile", compile_)
    spec = {"regex": "(yes|no) [0-9]{2}"}
    asyncio.run(GrammarChecker().check(spec, "structured_outputs"))
    assert counts == {"parse": 1, "compile": 0}
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, structured_output=spec)
    engine = llm.engine
    calls = _counting(monkeypatch, engine.inputs)
    for rid in ("g-1", "g-2"):
        out = _run(engine, EngineRequest(rid, [5, 9, 17], params))
        assert out["error"] is None
    assert counts == {"parse": 2, "compile": 1}  # the engine's one compile parses too
    assert calls == {"check_prompt": 0, "encode": 0}
    engine.check_idle()
