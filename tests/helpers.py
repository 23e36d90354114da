"""Test helpers shared across test modules."""

from __future__ import annotations

import torch

from radixserve import LLM, SamplingParams

# True under the fast loop (pytest -m "not slow"; set by conftest.py): the property tests'
# state machines run a third of their examples there, all of them in the full run
FAST_LOOP = False


def examples(n: int) -> int:
    """How many examples a property test runs: ``n``, or a third in the fast loop."""
    return max(10, n // 3) if FAST_LOOP else n


_HF_OUTPUTS: dict[tuple, list[int]] = {}  # (model, gguf file, max new tokens, prompt)
_HF_MODEL: dict[tuple, object] = {}  # the last model loaded (tests ask for one many times)


def hf_model(model_path, gguf_file=None):
    """The Hugging Face transformers model (float32) at ``model_path`` (a GGUF file in it
    when ``gguf_file``), kept for the session while it is the last one asked for: loading
    a GGUF file through transformers dequantizes every tensor in numpy (tens of seconds
    for a 262k vocabulary)."""
    from transformers import AutoModelForCausalLM

    where = (str(model_path), str(gguf_file) if gguf_file else None)
    model = _HF_MODEL.get(where)
    if model is None:
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, **kwargs)
        model.eval()
        # No early stop and no EOS masking: radixserve runs these with ignore_eos.
        model.generation_config.eos_token_id = None
        _HF_MODEL.clear()
        _HF_MODEL[where] = model
    return model


def hf_greedy(
    model_path, prompts: list[list[int]], max_new_tokens: int, gguf_file=None
) -> list[list[int]]:
    """Greedy continuations from Hugging Face transformers (float32), one prompt at a time.
    Memoised for the session: the tiny models are built once, so a reference output asked
    for again (the same model, prompt and length) is the one computed before."""
    where = (str(model_path), str(gguf_file) if gguf_file else None)
    keys = [(*where, max_new_tokens, tuple(ids)) for ids in prompts]
    missing = [ids for ids, key in zip(prompts, keys, strict=True) if key not in _HF_OUTPUTS]
    if missing:
        model = hf_model(model_path, gguf_file)
        with torch.inference_mode():
            for ids in missing:
                out = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                _HF_OUTPUTS[(*where, max_new_tokens, tuple(ids))] = out[0, len(ids) :].tolist()
    return [list(_HF_OUTPUTS[key]) for key in keys]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_idle()
    return [o.token_ids for o in outs]


def write_gguf_vocab(writer, tok) -> None:
    """Write a tiny test model's byte-level BPE tokenizer into a GGUF writer as llama.cpp's
    converter does (``gpt2`` model, merges, ``<|...|>`` tokens as control, BOS 1, EOS 2)."""
    import json

    vocab = tok.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
