"""SentencePiece GGUF vocabularies as Llama 2 and Mistral 7B v0.1 files carry them
(``tokenizer.ggml.model == "llama"``: BPE pieces with scores, byte fallback, a dummy prefix
space, BOS added) against the ``sentencepiece`` library itself, the tokenizer those models
were trained with and the one llama.cpp's tokenizer follows.

No such file can be downloaded here, so the test trains a small SentencePiece BPE model with
Llama 2's trainer settings (identity normalisation, extra whitespace kept, digits split, byte
fallback), writes its vocabulary into a GGUF file the way llama.cpp's converter does (pieces,
scores, token types, special ids, ``add_bos_token``, ``add_space_prefix``) and compares what
radixserve rebuilds from the file with the SentencePiece processor on a multilingual, code and
emoji corpus: ids on encode and text on decode."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,  double  spaces and a trailing one ",
    "Grüße aus München! 東京タワーは高い。Привет, мир. مرحبا بالعالم. नमस्ते दुनिया",
    "def fib(n: int) -> int:\n    if n < 2:\n\treturn n\n    return fib(n - 1) + fib(n - 2)  # ok",
    'print("x = %d" % (1 << 10)); // C++ { std::vector<int> v{1,2,3}; }',
    "emoji 🙂🚀👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 and ZWJ",
    "[INST] What is 2024 + 17? [/INST]",
    "tabs\tand\r\nCRLF\n\n\nnewlines",
    "1234567890 3.14159 1e-9 0xFF",
    " ",
    "rare bytes \x01\x7f",
]


def _training_lines(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = (  # noqa: SIM905 - a word list reads best as text
        "the of and to in is was for on that with as by at from his her it an are were "
        "which this be or has had not but one first new their also its after two other "
        "return def int vector print über straße München мир привет 東京 タワー"
    ).split()
    lines = [
        " ".join(rng.choice(words) for _ in range(rng.randint(3, 15)))
        + rng.choice([".", ",", "!", " 1234", " 2024-06-01", "  ", ":\n    "])
        for _ in range(4000)
    ]
    return lines + CORPUS[:3] * 5


@pytest.fixture(scope="module", params=[(400, 0), (650, 1)], ids=["v400", "v650"])
def sp_and_gguf(request, tmp_path_factory) -> tuple[object, Path]:
    """A SentencePiece processor trained as Llama 2's was, and a GGUF file of its vocab."""
    import gguf

    vocab_size, seed = request.param
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_lines(seed)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        character_coverage=0.9995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(_UNKNOWN)
        elif sp.is_control(i):
            types.append(_CONTROL)
        elif sp.is_byte(i):
            types.append(_BYTE)
        elif sp.is_unused(i):
            types.append(_USER_DEFINED)
        else:
            types.append(_NORMAL)
    path = tmp_path_factory.mktemp("spm") / f"llama2-style-{vocab_size}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, path


def _ours(path: Path):
    from radixserve.engine.tokenizer import tokenizer_from_gguf
    from radixserve.executor.loader.gguf_loader import read_metadata

    return tokenizer_from_gguf(read_metadata(path))


def test_encode_equals_sentencepiece(sp_and_gguf):
    sp, path = sp_and_gguf
    ours = _ours(path)
    for text in CORPUS:
        expected = [sp.bos_id(), *sp.encode(text)]
        assert ours(text)["input_ids"] == expected, text


def test_decode_equals_sentencepiece(sp_and_gguf):
    sp, path = sp_and_gguf
    ours = _ours(path)
    for text in CORPUS:
        ids = sp.encode(text)
        assert ours.decode(ids) == sp.decode(ids), text
        assert ours.decode([sp.bos_id(), *ids], skip_special_tokens=True) == sp.decode(ids)


def test_byte_fallback_spells_unseen_characters_as_bytes(sp_and_gguf):
    """A character the vocabulary never saw becomes its UTF-8 bytes (``<0xNN>`` pieces), not
    ``<unk>``: the same ids SentencePiece gives, and decoding gives the text back."""
    sp, path = sp_and_gguf
    ours = _ours(path)
    text = "\u16a0\u16a1 \U0001f9ea"  # runes and a test tube: not in the training lines
    ids = ours(text, add_special_tokens=False)["input_ids"]
    assert ids == sp.encode(text)
    assert sp.unk_id() not in ids
    assert all(sp.is_byte(i) for i in ids if sp.id_to_piece(i) != "\u2581")
    assert ours.decode(ids) == text


def test_special_tokens_and_bos(sp_and_gguf):
    sp, path = sp_and_gguf
    ours = _ours(path)
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")
    assert ours("hi")["input_ids"][0] == 1
    assert ours("hi", add_special_tokens=False)["input_ids"] == sp.encode("hi")
    # control tokens in the text are the special tokens, as llama.cpp parses them
    assert ours("<s>hi</s>", add_special_tokens=False)["input_ids"][0] == 1
    assert ours("<s>hi</s>", add_special_tokens=False)["input_ids"][-1] == 2


def test_unknown_tokenizer_model_is_a_clear_error(sp_and_gguf):
    from radixserve.engine.tokenizer import tokenizer_from_gguf
    from radixserve.executor.loader.gguf_loader import read_metadata

    meta = read_metadata(sp_and_gguf[1])
    meta["tokenizer.ggml.model"] = "rwkv"
    with pytest.raises(ValueError, match="'rwkv' is not supported"):
        tokenizer_from_gguf(meta)


def _encode_all(tok) -> list[list[int]]:
    return [tok(text)["input_ids"] for text in CORPUS]


def test_rebuilt_tokenizer_is_cached_and_read_back(sp_and_gguf, tmp_path, monkeypatch, caplog):
    """The first start writes the rebuilt tokenizer to the cache folder; the next reads it
    (not rebuilt: the builder is made to fail) and tokenizes as SentencePiece does; a
    damaged file is rebuilt and written again; other metadata, another file; caching
    off or an unwritable folder: built each time, never an error."""
    from radixserve.engine import tokenizer as tokenizer_module
    from radixserve.executor.loader.gguf_loader import read_metadata

    sp, path = sp_and_gguf
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    meta = read_metadata(path)
    folder = tmp_path / "cache" / "tokenizers"
    first = tokenizer_module.tokenizer_from_gguf(meta)
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and not list(folder.glob("*.tmp"))
    expected = [[sp.bos_id(), *sp.encode(text)] for text in CORPUS]
    assert _encode_all(first) == expected

    build = tokenizer_module._backend_from_gguf

    def refuse(*args, **kwargs):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(tokenizer_module, "_backend_from_gguf", refuse)
    again = tokenizer_module.tokenizer_from_gguf(meta)
    assert _encode_all(again) == expected
    assert (again.bos_token, again.eos_token, again.unk_token) == ("<s>", "</s>", "<unk>")
    assert again.decode(expected[2], skip_special_tokens=True) == sp.decode(expected[2][1:])
    monkeypatch.setattr(tokenizer_module, "_backend_from_gguf", build)

    files[0].write_text("{ not a tokenizer")
    with caplog.at_level("WARNING", logger="radixserve.engine.tokenizer"):
        mended = tokenizer_module.tokenizer_from_gguf(meta)
    assert "unreadable" in caplog.text
    assert _encode_all(mended) == expected
    assert _encode_all(tokenizer_module.tokenizer_from_gguf(meta)) == expected  # valid again

    other = dict(meta, **{"tokenizer.ggml.add_bos_token": False})
    assert tokenizer_module._cache_path(other) != tokenizer_module._cache_path(meta)
    no_bos = tokenizer_module.tokenizer_from_gguf(other)
    assert no_bos("hi")["input_ids"] == sp.encode("hi")
    assert len(list(folder.glob("*.json"))) == 2

    monkeypatch.setenv("RADIXSERVE_TOKENIZER_CACHE", "0")
    assert tokenizer_module._cache_path(meta) is None
    assert _encode_all(tokenizer_module.tokenizer_from_gguf(meta)) == expected
    monkeypatch.delenv("RADIXSERVE_TOKENIZER_CACHE")

    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    monkeypatch.setenv("RADIXSERVE_CACHE", str(blocked))
    with caplog.at_level("WARNING", logger="radixserve.engine.tokenizer"):
        assert _encode_all(tokenizer_module.tokenizer_from_gguf(meta)) == expected
    assert "not written" in caplog.text
