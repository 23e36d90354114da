"""Pooling requests (embeddings): the final-norm hidden states pooled, against transformers;
batched, chunked, mixed with generation, with and without the prefix cache, overlapped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixserve import LLM
from radixserve.core.errors import InputError
from tests.helpers import greedy


def _llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_gb", 0.02)
    return LLM(str(path), dtype="float32", **kw)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _hf_pooled(path, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    """Sentence-transformers-style pooling of transformers' last hidden state (after the
    final norm), one prompt at a time, float32, not normalised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            res = model(torch.tensor([ids]), output_hidden_states=True)
            last = model.model(torch.tensor([ids])).last_hidden_state[0]
            # transformers' hidden_states[-1] is the final norm's output too
            torch.testing.assert_close(res.hidden_states[-1][0], last)
            out.append((last[-1] if pooling == "last" else last.mean(dim=0)).numpy())
    return out


def _embed(llm: LLM, prompts, pooling: str, normalize: bool = False) -> list[np.ndarray]:
    vecs = llm.embed(prompts, pooling=pooling, normalize=normalize)
    llm.engine.check_page_accounting()
    assert not llm.engine.has_unfinished()
    return vecs


def _close(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_match_transformers(tiny_models, arch, pooling):
    path = tiny_models[arch]
    prompts = _prompts(7, [1, 5, 23, 40])
    expected = _hf_pooled(path, prompts, pooling)
    # chunked (budget 16: the 23 and 40 token prompts take 2 and 3 chunks), batched
    llm = _llm(path, max_num_batched_tokens=16, page_size=4)
    got = _embed(llm, prompts, pooling)
    _close(got, expected)
    assert got[0].shape == (64,) and got[0].dtype == np.float32
    # normalised: the same direction, unit length
    for v, e in zip(_embed(llm, prompts, pooling, normalize=True), expected, strict=True):
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
        np.testing.assert_allclose(v, e / np.linalg.norm(e), rtol=1e-4, atol=1e-5)
    llm.engine.check_idle()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_and_mixed_with_generation_equal_single(tiny_llama, pooling):
    """Pooling requests batched with each other and with generation, chunked, give what
    each gives alone; the generations are unchanged by them."""
    prompts = _prompts(3, [9, 30, 17, 2, 45])
    gen_prompts = _prompts(4, [12, 33])
    single = _llm(tiny_llama, disable_radix_cache=True)
    alone = [_embed(single, [p], pooling)[0] for p in prompts]
    gen_alone = [single.generate([p], greedy(8), use_tqdm=False)[0].token_ids for p in gen_prompts]
    single.engine.check_idle()

    llm = _llm(tiny_llama, max_num_batched_tokens=24, page_size=4)
    _close(_embed(llm, prompts, pooling), alone)
    llm.engine.check_idle()
    # pooling and generation requests queued together: steps hold both kinds
    engine = llm.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", p, greedy(8))
    for i, p in enumerate(prompts):
        engine.add_pooling_request(f"e{i}", p, pooling)
    tokens: dict[str, list[int]] = {}
    embeddings: dict[str, np.ndarray] = {}
    mixed_steps = 0
    while engine.has_unfinished():
        kinds = {r.pooling is None for r in engine.scheduler.running}
        mixed_steps += kinds == {True, False}
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                assert d.finish_reason == "stop" if d.request_id[0] == "e" else True
                if d.request_id[0] == "e":
                    assert d.token_ids == [] and d.num_prompt_tokens > 0
                    embeddings[d.request_id] = d.embedding
        engine.check_page_accounting()
    assert mixed_steps > 0
    _close([embeddings[f"e{i}"] for i in range(len(prompts))], alone)
    assert [tokens[f"g{i}"] for i in range(len(gen_prompts))] == gen_alone
    engine.check_idle()


def test_prefix_cache_last_reuses_mean_recomputes(tiny_llama):
    """``last`` pooling reuses a cached prefix (same embedding); ``mean`` never does (it
    needs every token's hidden state) but still equals the uncached result."""
    base = _prompts(11, [37])[0]
    prompts = [base, [*base, 5, 6, 7]]
    off = _llm(tiny_llama, disable_radix_cache=True, page_size=4)
    want = {k: _embed(off, prompts, k) for k in ("last", "mean")}
    on = _llm(tiny_llama, page_size=4)
    cache = on.engine.prefix_cache
    _close(_embed(on, [base], "last"), want["last"][:1])  # fills the cache
    hits = cache.hit_tokens
    _close(_embed(on, prompts, "last"), want["last"])
    assert cache.hit_tokens - hits >= 2 * 36 - 8  # both reused most of the prompt
    hits = cache.hit_tokens
    _close(_embed(on, prompts, "mean"), want["mean"])
    assert cache.hit_tokens == hits  # mean pooling asked the cache for nothing
    # a generation after an embedding reuses the embedding's KV
    on.generate([[*base, 9]], greedy(2), use_tqdm=False)
    assert cache.hit_tokens > hits
    on.engine.check_idle()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_overlapped_and_preempted(tiny_llama, pooling):
    """The overlapped loop, and a KV pool so small that requests are preempted (a mean
    pooling request then computes its prompt again from the start)."""
    prompts = _prompts(5, [40, 41, 42, 43, 44, 45])
    single = _llm(tiny_llama, disable_radix_cache=True)
    alone = [_embed(single, [p], pooling)[0] for p in prompts]
    over = _llm(tiny_llama, enable_overlap=True, max_num_batched_tokens=32, page_size=4)
    _close(_embed(over, prompts, pooling), alone)
    over.engine.check_idle()
    over.engine.close()
    # 200 tokens of KV: generations that grow preempt a pooling request admitted later
    small = _llm(
        tiny_llama,
        kv_cache_memory_gb=512 * 200 / 2**30,
        page_size=4,
        max_num_batched_tokens=32,
        schedule_conservativeness=0.0,  # admit greedily: preemption must happen
    )
    engine = small.engine
    for i, p in enumerate(_prompts(6, [50, 50, 50])):
        engine.add_request(f"g{i}", p, greedy(40))
    pooled = []
    for i, p in enumerate(prompts):
        engine.add_pooling_request(f"e{i}", p, pooling)
        pooled.append(engine.scheduler.get(f"e{i}"))
    embeddings = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished and d.request_id[0] == "e":
                assert d.error is None
                embeddings[d.request_id] = d.embedding
        engine.check_page_accounting()
    assert sum(r.num_preemptions for r in pooled) > 0  # pooling requests among them
    _close([embeddings[f"e{i}"] for i in range(len(prompts))], alone)
    engine.check_idle()


def test_pooling_request_checks(tiny_llama):
    llm = _llm(tiny_llama, max_model_len=64)
    engine = llm.engine
    with pytest.raises(InputError, match="pooling must be one of"):
        engine.add_pooling_request("a", [5, 6], "cls")
    with pytest.raises(InputError, match="must not be empty"):
        engine.add_pooling_request("b", [], "last")
    with pytest.raises(InputError, match="token ids must be in"):
        engine.add_pooling_request("c", [5, 99999], "last")
    with pytest.raises(InputError, match="maximum context length"):
        engine.add_pooling_request("d", [5] * 65, "last")
    # the whole context is allowed: nothing is generated
    (vec,) = _embed(llm, [[5] * 64], "mean")
    assert vec.shape == (64,)
    # text prompts go through the tokenizer
    a, b = _embed(llm, ["The quick brown fox", "The quick brown fox"], "last")
    np.testing.assert_array_equal(a, b)
    engine.abort("nothing")  # an unknown id: nothing happens
    engine.check_idle()


def test_model_pooling_and_matryoshka_from_the_model_files(tmp_path):
    import json

    from radixserve.engine.model_source import ModelSource, model_matryoshka, model_pooling

    gguf = ModelSource("gguf", tmp_path / "m.gguf", "m")
    assert model_pooling(gguf, {"llama.pooling_type": 1}) == "mean"
    assert model_pooling(gguf, {"qwen3.pooling_type": 3}) == "last"
    assert model_pooling(gguf, {"bert.pooling_type": 2}) is None  # CLS: not implemented
    assert model_pooling(gguf, {"general.architecture": "llama"}) is None
    assert model_matryoshka(gguf) is None

    hf = ModelSource("hf", tmp_path, "st")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert model_pooling(hf) is None and model_matryoshka(hf) is None  # generative
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "st.models.Pooling"}
    (tmp_path / "modules.json").write_text(json.dumps([pooling]))
    (tmp_path / "1_Pooling").mkdir()
    for key, kind in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({key: True}))
        assert model_pooling(hf) == kind
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    assert model_pooling(hf) is None
    (tmp_path / "1_Pooling" / "config.json").write_text("not json")
    assert model_pooling(hf) is None
    (tmp_path / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    assert model_matryoshka(hf) == []
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 8]}))
    assert model_matryoshka(hf) == [8, 32]
