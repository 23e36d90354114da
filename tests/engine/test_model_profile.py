"""A model's request limits read from its files (``engine.model_profile``) are those its
engine serves with: a several-model server checks a request for a model not loaded
against them before it loads the model."""

from __future__ import annotations

import json
import shutil

import pytest

from radixserve import LLM
from radixserve.engine.config import EngineConfig
from radixserve.engine.model_profile import model_profile


def _served(engine) -> tuple:
    return engine.vocab_size, engine.max_model_len, engine.default_sampling


def test_a_gguf_files_profile_is_what_its_engine_serves_with(smollm2_path, smollm2_llm):
    profile = model_profile(EngineConfig(model=str(smollm2_path), dtype="float32"))
    assert (profile.vocab_size, profile.max_model_len, profile.sampling_defaults) == _served(
        smollm2_llm.engine
    )


@pytest.mark.parametrize("max_model_len", [None, 48])
def test_a_folders_profile_is_what_its_engine_serves_with(tiny_llama, tmp_path, max_model_len):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    generation = {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=max_model_len)
    profile = model_profile(config)
    assert profile.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}
    engine = LLM(str(folder), dtype="float32", max_model_len=max_model_len).engine
    try:
        served = _served(engine)
    finally:
        engine.close()
    assert (profile.vocab_size, profile.max_model_len, profile.sampling_defaults) == served
    if max_model_len is not None:
        assert profile.max_model_len == max_model_len


def test_a_file_that_is_not_a_model_is_a_value_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError):
        model_profile(EngineConfig(model=str(bad)))
