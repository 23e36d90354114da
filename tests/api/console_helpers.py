"""A tiny llama whose greedy output we know: for the web console's browser tests.

Attention and MLP outputs are zeroed, so the next token depends on the current token only
(logits = lm_head(norm(embedding))). Five added tokens form a chain: a user message that
ends with ``TRIGGER`` is answered with ``PAYLOAD`` (HTML that would run script if the page
inserted it as markup) and then EOS. Every other token is followed by a token of the random
part of the vocabulary, never EOS, so ordinary answers run until ``max_tokens``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

TRIGGER = "!xss"
PAYLOAD_TOKENS = [
    "<script>",
    "window.__pwned=1",
    "</script>",
    '<img src=x onerror="window.__pwned=2">',
]
PAYLOAD = "".join(PAYLOAD_TOKENS)
# no generation prompt: the prompt ends with the last message's own tokens, so the token
# the model continues from is the user's last token
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not loop.last %}<|im_end|>\n{% endif %}{% endfor %}"
)
_EOS = 2
_RESERVED_DIMS = 8  # embedding dims used by the chain only


def build_chain_model(
    folder: Path, trigger: str = TRIGGER, payload: list[str] | None = None
) -> Path:
    """The chain model: ``trigger`` (an added token) is answered with ``payload`` (added
    tokens, at most four) and then EOS."""
    payload = PAYLOAD_TOKENS if payload is None else payload
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tests.conftest import TINY_VOCAB, build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok.add_tokens([trigger, *payload])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    chain = [tok.convert_tokens_to_ids(t) for t in [trigger, *payload]] + [_EOS]
    assert len(set(chain)) == len(chain) and all(t < TINY_VOCAB + 8 for t in chain)

    hidden = 64
    config = LlamaConfig(
        vocab_size=TINY_VOCAB + 8,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=_EOS,
        tie_word_embeddings=False,
    )
    gen = torch.Generator().manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.randn(config.vocab_size, hidden, generator=gen)
        head = torch.randn(config.vocab_size, hidden, generator=gen)
        embed[:, :_RESERVED_DIMS] = 0
        head[:, :_RESERVED_DIMS] = 0
        head[chain[1:]] = 0  # chain targets (and EOS) are reached from the chain only
        for k, (src, dst) in enumerate(itertools.pairwise(chain)):
            embed[src] = 0
            embed[src, k] = 1.0
            head[dst, k] = 10.0
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": _EOS}))
    return folder
