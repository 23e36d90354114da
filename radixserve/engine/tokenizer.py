"""Tokenizers: a Hugging Face folder's, or one rebuilt from GGUF metadata."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from radixserve.core.cache_dir import cache_root

log = logging.getLogger(__name__)

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
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex llama.cpp applies before byte-level BPE (the names
# llama.cpp's converter writes for these vocabularies)
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe", "pixtral"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}

# Gemma's chat template, for Gemma GGUF files that carry none (llama.cpp picks its built-in
# Gemma template for them the same way)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    '{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_DEFAULT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE, "gemma2": GEMMA_CHAT_TEMPLATE}


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
    regex = _PRE_SPLITS.get(pre)
    if regex is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"gpt2, default, smollm, {', '.join(sorted(_PRE_SPLITS))}"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )


def tokenizer_from_gguf(meta: dict[str, Any]) -> PreTrainedTokenizerFast:
    """Rebuild the tokenizer ``tokenizer.ggml.*`` metadata describes: byte-level BPE
    (``gpt2``, with the ``tokenizer.ggml.pre`` split) or SentencePiece BPE (``llama``: byte
    fallback, merges recovered from the vocabulary). Control tokens are special, user-defined
    ones whole; BOS is added when the file says so (SentencePiece files: unless they say not
    to); the chat template is the file's, or the family's where the file has none.

    The rebuilt backend tokenizer is kept in the cache folder (``core.cache_dir``), named by
    a digest of the metadata it was built from and of ``_BUILD_VERSION``, and read from
    there at the next start (Gemma 3's 262,144 pieces: 0.8 s against 2.7 s to rebuild,
    most of it recovering the merges); a cache that cannot be read or written is rebuilt
    or skipped, never an error."""
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer vocabulary")
    arch = meta.get("general.architecture", "")
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', "
            "SentencePiece 'llama'); use the model's Hugging Face folder instead"
        )

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    kwargs: dict[str, Any] = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "chat_template": meta.get("tokenizer.chat_template") or _DEFAULT_TEMPLATES.get(arch),
        "clean_up_tokenization_spaces": False,
    }
    cached = _cache_path(meta)
    if cached is not None and cached.is_file():
        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(cached), **kwargs)
        except Exception as exc:  # a damaged file: rebuilt below and written again
            log.warning("tokenizer cache %s unreadable (%s): rebuilding", cached, exc)
    backend = _backend_from_gguf(meta, tokens, arch, kind, token("bos"))
    if cached is not None:
        _write_cache(backend, cached)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


# bump when _backend_from_gguf (or what it calls) builds a different tokenizer from the same
# metadata: the cached ones of the old build are then never read
_BUILD_VERSION = 1


def _cache_path(meta: dict[str, Any]) -> Path | None:
    """The cache file of the backend tokenizer ``meta`` describes (None: caching is off,
    ``RADIXSERVE_TOKENIZER_CACHE=0``)."""
    if os.environ.get("RADIXSERVE_TOKENIZER_CACHE", "1") == "0":
        return None
    h = hashlib.sha256(f"radixserve tokenizer {_BUILD_VERSION}".encode())
    keys = sorted(k for k in meta if k.startswith("tokenizer.ggml."))
    for key in [*keys, "general.architecture"]:
        value = meta.get(key)
        h.update(key.encode() + b"\0")
        if isinstance(value, list | tuple) and value and isinstance(value[0], str):
            h.update(b"\0".join(v.encode("utf-8", "surrogatepass") for v in value))
        elif isinstance(value, list | tuple | np.ndarray):
            h.update(np.asarray(value, dtype=np.float64).tobytes())
        else:
            h.update(repr(value).encode())
        h.update(b"\1")
    return cache_root() / "tokenizers" / f"{h.hexdigest()[:32]}.json"


def _write_cache(backend: Tokenizer, path: Path) -> None:
    """``backend`` saved at ``path`` through a temporary file and a rename (a reader never
    sees half a file); a failure is logged and forgotten."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
        try:
            backend.save(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("tokenizer cache %s not written (%s)", path, exc)


def _backend_from_gguf(
    meta: dict[str, Any], tokens: list[str], arch: str, kind: str, bos: str | None
) -> Tokenizer:
    """The ``tokenizers`` object of ``tokenizer_from_gguf``."""
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tk, vocab = _byte_level_from_gguf(meta, tokens)
        add_bos_default = False
    else:
        tk, vocab = _sentencepiece_from_gguf(meta, tokens, arch)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    # only pieces of the vocabulary as the model spells it (never a new id past it)
    tk.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL and vocab.get(tokens[i]) == i
        ]
    )
    user_defined = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _USER_DEFINED and vocab.get(tokens[i]) == i
    ]
    if user_defined:
        tk.add_tokens(user_defined)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos_default)
    if add_bos and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return tk


def _byte_level_from_gguf(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict]:
    merges_raw: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if not merges_raw:
        raise ValueError("GGUF metadata has no tokenizer merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tk.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"), add_prefix)
    tk.decoder = decoders.ByteLevel()
    return tk, vocab


def _sentencepiece_from_gguf(
    meta: dict[str, Any], tokens: list[str], arch: str
) -> tuple[Tokenizer, dict]:
    """SentencePiece BPE as llama.cpp runs it: pieces spell spaces as U+2581, unknown bytes
    fall back to ``<0xNN>`` tokens, merges rank by piece score (Gemma: by file order, which
    is its merge order where the scores are not)."""
    gemma = arch.startswith("gemma")
    if gemma:  # pieces of several spaces are stored as spaces: spell them as U+2581
        tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if gemma:
        priority = [float(i) for i in range(len(tokens))]
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        priority = [-float(x) for x in scores]
    merges = _merges_from_vocab(tokens, vocab, priority)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tk = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[unk] if unk is not None else None,
        )
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    if add_prefix or arch == "phi3":
        # SentencePiece's dummy prefix: one space before every text, even one that starts
        # with spaces (a Metaspace pre-tokenizer skips those, and so splits "  x" unlike
        # SentencePiece and llama.cpp); after a special token too, as llama.cpp does
        tk.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPM_SPACE), normalizers.Replace(" ", _SPM_SPACE)]
        )
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        tk.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    tk.decoder = decoders.Sequence(steps)
    return tk, vocab


_SPM_SPACE = "\u2581"


def _merges_from_vocab(
    tokens: list[str], vocab: dict[str, int], priority: list[float]
) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces
    of the vocabulary, ordered by the merged piece's priority (lower first), then longer
    left and right parts first, then file order -- the order transformers derives for the
    same files (``generate_merges``)."""
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for index, piece in enumerate(tokens):
        if vocab.get(piece) != index:
            continue  # a duplicate spelling: the first one is the piece
        p = priority[index]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                found.append((p, -cut, cut - len(piece), index, li, ri, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


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
