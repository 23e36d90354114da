"""Frontend detokenization (the server's path) gives what the engine's own gives (the
offline path): same text, token ids, finish reasons, with stop strings and n > 1."""

from __future__ import annotations

import pytest

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.engine.output_processor import RequestOutputProcessor
from radixserve.serving.engine_process import wire_delta


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams, frontend: bool):
    """Final (text, token ids, finish reason) per (prompt, sample)."""
    processors = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        processors[f"r{i}"] = RequestOutputProcessor(
            engine.tokenizer.backend_tokenizer, ids, params, params.n
        )
    results: dict[tuple[str, int], list] = {}
    while engine.has_unfinished():
        for raw in engine.step():
            d = wire_delta(raw)  # what the engine process sends
            if frontend:
                d, stopped_here = processors[d.request_id].process(d)
                if d is None:
                    continue
                if stopped_here:
                    engine.abort(d.request_id, d.index)
            out = results.setdefault((d.request_id, d.index), ["", [], None])
            out[0] += d.text
            out[1] += d.token_ids
            if d.finished:
                out[2] = d.finish_reason
    engine.check_page_accounting()
    return results


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_path):
    """SmolLM2 twice: detokenizing in the engine, and not (the frontend's side)."""
    return Engine(_config(smollm2_path), detokenize=True), Engine(
        _config(smollm2_path), detokenize=False
    )


@pytest.mark.slow  # runs SmolLM2 twice over a long output
@pytest.mark.parametrize("n", [1, 3])
def test_frontend_detokenization_equals_engine_detokenization(smollm2_engines, n):
    texts = ["The capital of France is", "Écris un poème sur la mer:", "1, 2, 3, 4,"]
    offline, split = smollm2_engines
    prompts = [offline.tokenize(t) for t in texts]
    probe = _run(offline, prompts, SamplingParams(max_tokens=24, temperature=0), False)
    # stop strings that occur mid-output (and one that never does), across token boundaries
    stops = [probe[("r0", 0)][0][5:8], probe[("r1", 0)][0][3:5], "never-seen-stop"]
    params = SamplingParams(
        n=n, max_tokens=24, temperature=0.8, seed=7, stop=stops, ignore_eos=False
    )
    expected = _run(offline, prompts, params, frontend=False)
    got = _run(split, prompts, params, frontend=True)
    assert got == expected
    assert any(reason == "stop" for _, _, reason in expected.values())


def _config(path):
    from radixserve.engine.config import EngineConfig

    # deterministic: the two engines' samples the same although their prefix caches differ
    # (the first also ran the probe); each loaded once for both tests
    return EngineConfig(model=str(path), kv_cache_memory_gb=0.05, deterministic=True)
