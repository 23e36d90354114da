"""A 7,000-token prompt: greedy tokens equal transformers (float32), cold and with a
5,000-token cached prefix that ends mid-page, through the C prefill kernel and through the
PyTorch fallback, with prefill chunks that end mid-page."""

from __future__ import annotations

import random

import pytest

from radixserve import LLM
from tests.conftest import build_tiny_model
from tests.helpers import greedy, hf_greedy

pytestmark = pytest.mark.slow  # compares long contexts (pytest -m "not slow" leaves it out)

PROMPT_LEN, PREFIX_LEN, NEW_TOKENS = 7000, 5000, 8
PAGE_SIZE, BUDGET = 16, 1500  # 5,000 = 312.5 pages; chunks of 1,500 end mid-page


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("long") / "llama", "llama", max_position_embeddings=8192
    )


@pytest.fixture(scope="module")
def prompt_and_expected(long_model):
    rng = random.Random(7000)
    prompt = [rng.randrange(3, 512) for _ in range(PROMPT_LEN)]
    return prompt, hf_greedy(long_model, [prompt], NEW_TOKENS)[0]


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_long_prompt_matches_transformers_cold_and_with_cached_prefix(
    long_model, prompt_and_expected, kernel
):
    prompt, expected = prompt_and_expected
    llm = LLM(
        str(long_model),
        dtype="float32",
        page_size=PAGE_SIZE,
        max_num_batched_tokens=BUDGET,
        kv_cache_memory_gb=0.05,
    )
    attention = llm.engine.runner.attention
    if kernel == "torch":
        attention.native_prefill = None  # the fallback: explicit scores / padded SDPA
    elif attention.native_prefill is None:
        pytest.skip("native prefill kernel unavailable")

    cold = llm.generate([prompt], greedy(NEW_TOKENS), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert cold.token_ids == expected
    llm.engine.check_idle()  # empties the tree

    llm.generate([prompt[:PREFIX_LEN]], greedy(1), use_tqdm=False)  # caches the prefix
    warm = llm.generate([prompt], greedy(NEW_TOKENS), use_tqdm=False)[0]
    assert warm.num_cached_tokens == PREFIX_LEN  # ends mid-page: the partial page is reused
    assert warm.token_ids == expected
    llm.engine.check_idle()
