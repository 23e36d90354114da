"""Tokenizers: a Hugging Face folder's, or one rebuilt from GGUF metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


class MissingTokenizer:
    """Stands in for the tokenizer of a model folder that has none (a config.json alone, for
    ``load_format="dummy"``). Invariant: token-id prompts work; every text operation raises
    ``ValueError`` naming the folder."""

    eos_token_id = None
    backend_tokenizer = None

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @property
    def chat_template(self) -> str:
        return self._no_text()

    def _no_text(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"the model folder {self.folder} has no tokenizer: pass prompts as token ids"
        )

    __call__ = encode = decode = apply_chat_template = _no_text


def load_hf_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from None


def _byte_level_pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    if pre in ("gpt2", "default", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre == "smollm":  # digits split one by one, then GPT-2's regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
            ]
        )
    regex = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if regex is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (gpt2, smollm, llama3, qwen2)"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )


def tokenizer_from_gguf(meta: dict[str, Any]) -> PreTrainedTokenizerFast:
    """Rebuild a byte-level BPE tokenizer from ``tokenizer.ggml.*`` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use the model's Hugging Face folder instead"
        )
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    merges_raw: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens or not merges_raw:
        raise ValueError("GGUF metadata has no tokenizer vocabulary or merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tk.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"), add_prefix)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = token("bos")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def load_model_tokenizer(model: str | Path | None) -> tuple[str, Any]:
    """(model name, tokenizer) of a model as ``EngineConfig.model`` names it: an HF folder's
    tokenizer, or one rebuilt from a GGUF file's metadata (what a frontend needs without
    loading the weights)."""
    from radixserve.engine.model_source import resolve_model
    from radixserve.executor.loader.gguf_loader import read_metadata

    source = resolve_model(model)
    if source.kind == "gguf":
        return source.name, tokenizer_from_gguf(read_metadata(source.path))
    return source.name, load_hf_tokenizer(source.path)
