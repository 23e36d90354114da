"""Greedy tokens equal Hugging Face transformers token for token (float32)."""

from __future__ import annotations

import random
import zlib

import pytest

from radixserve import LLM
from tests.conftest import build_tiny_model
from tests.helpers import generate_ids, greedy, hf_greedy

NEW_TOKENS = 32


def _prompts(seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 33, 90)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_models_match_transformers(tiny_models, arch, page_size):
    path = tiny_models[arch]
    prompts = _prompts(zlib.crc32(arch.encode()) % 97)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", page_size=page_size, kv_cache_memory_gb=0.01)
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected


def test_chunked_prefill_matches_transformers(tiny_llama):
    """A prompt split over several steps (budget 16 tokens) gives the same tokens."""
    prompts = _prompts(5)
    expected = hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=16, page_size=4)
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected


WINDOWED = {
    # every layer slides (Mistral); only layers from max_window_layers on (Qwen2)
    "mistral": {"sliding_window": 12},
    "qwen2": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    "phi3": {"sliding_window": 12},  # every layer, with LongRoPE and fused weights
}


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("windowed")
    return {arch: build_tiny_model(root / arch, arch, **kw) for arch, kw in WINDOWED.items()}


def assert_window_runs_match_transformers(path) -> None:
    """Greedy tokens of prompts longer than a 12-token window equal transformers': whole
    prompts (page size 16), chunked prefill (16-token budget, page size 4), and a prompt
    extending a cached one (a radix hit reaching far past the window)."""
    prompts = _prompts(zlib.crc32(str(path).encode()) % 97)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", page_size=16, kv_cache_memory_gb=0.01)
    # the full context, not the window
    assert llm.engine.max_model_len == llm.engine.model_config.max_position_embeddings > 1000
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected
    chunked = LLM(str(path), dtype="float32", max_num_batched_tokens=16, page_size=4)
    assert generate_ids(chunked, prompts, greedy(NEW_TOKENS)) == expected
    chunked.generate([prompts[3]], greedy(1), use_tqdm=False)  # caches its 90 tokens
    longer = [prompts[3] + prompts[2]]  # 90 cached tokens, then 33 new ones
    out = chunked.generate(longer, greedy(NEW_TOKENS), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 80
    assert out.token_ids == hf_greedy(path, longer, NEW_TOKENS)[0]
    chunked.engine.check_idle()


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_sliding_window_models_match_transformers(windowed_models, arch):
    assert_window_runs_match_transformers(windowed_models[arch])


@pytest.mark.slow  # the real model against transformers
def test_smollm2_gguf_matches_transformers(smollm2_path):
    llm = LLM(str(smollm2_path), dtype="float32")
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ]
    prompts = [llm.engine.tokenize(t) for t in texts]
    expected = hf_greedy(smollm2_path.parent, prompts, NEW_TOKENS, gguf_file=smollm2_path.name)
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected
