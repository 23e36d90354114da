"""TokenizeBatcher: same ids as the tokenizer itself, one encode call per loop turn."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from radixserve.engine.tokenizer import tokenizer_from_gguf
from radixserve.executor.loader.gguf_loader import read_metadata
from radixserve.serving.tokenize_batcher import TokenizeBatcher

TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnewlines  ",
    "Ünïcödé: café, 東京, Привет 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "x",
]


def _with_bos(tokenizer):
    """The same tokenizer, but adding BOS when add_special_tokens is set (as Llama's do)."""
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    return tokenizer


async def _encode_all(batcher: TokenizeBatcher, special: bool) -> list[list[int]]:
    return list(await asyncio.gather(*(batcher.encode(t, special) for t in TEXTS)))


@pytest.mark.parametrize("kind", ["tiny", "tiny-bos", "smollm2-gguf"])
def test_batcher_matches_the_tokenizer(kind, tiny_llama, smollm2_path):
    if kind == "smollm2-gguf":
        tokenizer = tokenizer_from_gguf(read_metadata(smollm2_path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
        if kind == "tiny-bos":
            tokenizer = _with_bos(tokenizer)
    batcher = TokenizeBatcher(tokenizer)
    for special in (True, False):
        expected = [tokenizer(t, add_special_tokens=special)["input_ids"] for t in TEXTS]
        before = batcher.num_batches
        got = asyncio.run(_encode_all(batcher, special))
        assert got == expected
        assert batcher.num_batches == before + 1  # all five texts in one call
    if kind == "tiny-bos":
        assert got[0][0] != tokenizer.bos_token_id and expected[0][0] != tokenizer.bos_token_id
        with_bos = asyncio.run(_encode_all(batcher, True))
        assert all(ids[0] == tokenizer.bos_token_id for ids in with_bos)


def test_mixed_flags_in_one_turn_and_cancelled_callers(tiny_llama):
    tokenizer = _with_bos(AutoTokenizer.from_pretrained(str(tiny_llama)))
    batcher = TokenizeBatcher(tokenizer)

    async def scenario():
        a = batcher.encode("alpha", True)
        b = batcher.encode("alpha", False)
        gone = batcher.encode("beta", True)
        gone.cancel()  # a request that went away before its turn came
        return await a, await b

    with_bos, without = asyncio.run(scenario())
    assert with_bos == [tokenizer.bos_token_id, *without]
    assert batcher.num_batches == 2  # one call per add_special_tokens value
