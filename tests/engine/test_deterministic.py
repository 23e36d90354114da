"""Deterministic mode (``LLM(deterministic=True)``, ``--deterministic``): a request's greedy
tokens and logprobs, and its embedding, are bitwise the ones it gets alone, inside batches of
up to 64 mixed requests, chunked differently, with and without prefix hits, with n-gram
and draft-model speculation, in bfloat16 with int4 / int8 / plain weights and in float32; the same in a fresh
process; and what the mode cannot keep yet is refused at start-up, naming it."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from radixserve import LLM, SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.executor import batch_invariant
from radixserve.executor.native import load_decode_program
from tests.conftest import TINY_VOCAB, build_tiny_model
from tests.engine.test_speculative import build_loopy_model

KW = {"page_size": 4, "kv_cache_memory_gb": 0.03, "max_num_batched_tokens": 48}


def _prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    """``n`` prompts of 1 to 100 tokens; the odd ones after a common ``shared``-token prefix
    (prefix hits once the first is cached)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(shared)]
    out = []
    for i in range(n):
        own = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(1, 100))]
        out.append(prefix + own if i % 2 else own)
    return out


def _answers(llm: LLM, prompts, params) -> list[tuple]:
    """Each request's tokens and, per token, its logprob and top alternatives."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            tuple(o.outputs[0].token_ids),
            tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in o.outputs[0].logprobs),
        )
        for o in outs
    ]


def _alone_equals_batched(llm: LLM, prompts, params) -> None:
    alone = [_answers(llm, [p], params)[0] for p in prompts]
    assert _answers(llm, prompts, params) == alone
    # again, in another order and with the prefixes cached: still the same answers
    order = list(range(len(prompts)))[::-1]
    again = _answers(llm, [prompts[i] for i in order], params)
    assert again == [alone[i] for i in order]
    llm.engine.check_page_accounting()


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize(
    ("dtype", "quantization", "kv"),
    [
        ("bfloat16", "int4", "auto"),
        ("bfloat16", "int8", "auto"),
        ("bfloat16", "none", "int8"),
        ("float32", "none", "auto"),
        ("float32", "int4", "auto"),
    ],
)
def test_a_request_answers_the_same_alone_and_in_any_batch(tiny_llama, dtype, quantization, kv):
    llm = LLM(
        str(tiny_llama),
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv,
        deterministic=True,
        **KW,
    )
    # 64 requests at once for int4 weights (the default model's kind), 24 for the others
    count = 64 if quantization == "int4" and dtype == "bfloat16" else 24
    prompts = _prompts(count, seed=len(quantization) + len(dtype), shared=30)
    _alone_equals_batched(llm, prompts, GREEDY)
    if (
        quantization == "int4"
        and dtype == "bfloat16"
        and load_decode_program() is not None
        and batch_invariant.whole_calls(count)
    ):
        # where this tier's panel GEMMs compute each row alone in a call of all the rows, the
        # one-call decode program ran the batched decode steps and answered as the layers do
        assert llm.engine.runner.model._program is not None
    # seeded sampling: a function of (request, seed)
    sampled = [
        SamplingParams(
            temperature=0.9, top_p=0.9, max_tokens=8, seed=i, ignore_eos=True, logprobs=1
        )
        for i in range(6)
    ]
    alone = [_answers(llm, [p], [sp])[0] for p, sp in zip(prompts[:6], sampled, strict=True)]
    assert _answers(llm, prompts[:6], sampled) == alone


def test_gemma3_windows_and_gqa(tiny_models):
    llm = LLM(str(tiny_models["gemma3"]), dtype="bfloat16", deterministic=True, **KW)
    _alone_equals_batched(llm, _prompts(16, seed=5, shared=20), GREEDY)


def test_ngram_speculation_verifies_what_decode_computes(tmp_path):
    loopy = build_loopy_model(tmp_path / "loopy")
    plain = LLM(str(loopy), dtype="bfloat16", deterministic=True, **KW)
    spec = LLM(str(loopy), dtype="bfloat16", deterministic=True, speculative_mode="ngram", **KW)
    rng = random.Random(3)
    prompts = []
    for _ in range(12):
        p = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 40))]
        prompts.append(p + p[: len(p) // 2])  # its continuation is in the prompt
    want = [_answers(plain, [p], GREEDY)[0] for p in prompts]
    assert _answers(spec, prompts, GREEDY) == want
    assert [_answers(spec, [p], GREEDY)[0] for p in prompts] == want
    assert spec.engine.stats().spec_accepted_tokens > 0  # it did speculate
    # a seeded sample: the same draws with speculation on (its request does not speculate)
    sampled = [
        SamplingParams(temperature=0.8, max_tokens=10, seed=i, ignore_eos=True, logprobs=1)
        for i in range(4)
    ]
    want = [_answers(plain, [p], [sp])[0] for p, sp in zip(prompts[:4], sampled, strict=True)]
    assert _answers(spec, prompts[:4], sampled) == want
    spec.engine.check_page_accounting()


def test_draft_speculation_verifies_what_decode_computes(tiny_models, tiny_llama):
    plain = LLM(str(tiny_llama), dtype="bfloat16", deterministic=True, **KW)
    spec = LLM(
        str(tiny_llama),
        dtype="bfloat16",
        deterministic=True,
        speculative_mode="draft",
        spec_draft_model=str(tiny_models["mistral"]),
        spec_policy="always",
        **KW,
    )
    prompts = _prompts(12, seed=13, shared=16)
    want = [_answers(plain, [p], GREEDY)[0] for p in prompts]
    assert _answers(spec, prompts, GREEDY) == want
    assert spec.engine.stats().spec_proposed_tokens > 0  # it did speculate
    spec.engine.check_page_accounting()


def test_embeddings_alone_equal_batched_bitwise(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="bfloat16", deterministic=True, **KW)
    prompts = _prompts(12, seed=9, shared=20)
    for pooling in ("mean", "last"):
        alone = [llm.embed([p], pooling=pooling)[0] for p in prompts]
        batched = llm.embed(prompts, pooling=pooling)
        for a, b in zip(alone, batched, strict=True):
            assert np.array_equal(a, b)
    llm.engine.check_page_accounting()


_SCRIPT = """
import json, sys
from radixserve import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", quantization="int4", deterministic=True,
          page_size=4, kv_cache_memory_gb=0.03)
prompts = json.loads(sys.argv[2])
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                   logprobs=1), use_tqdm=False)
print(json.dumps([[o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]]
                  for o in out]))
"""


@pytest.mark.slow
def test_the_same_answers_in_a_fresh_process(tiny_llama):
    prompts = _prompts(8, seed=11, shared=10)
    runs = []
    for order in (prompts, prompts[::-1]):
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(tiny_llama), json.dumps(order)],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1][::-1]


def test_what_it_cannot_keep_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(deterministic=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="LoRA"):
        EngineConfig(deterministic=True, lora_modules=("a=/nowhere",))
    moe = build_tiny_model(tmp_path / "moe", "qwen2moe")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(str(moe), deterministic=True, **KW)
