"""Log-probabilities in OpenAI's shapes: completions (tokens, token_logprobs, top_logprobs,
text_offset) and chat (content entries with bytes). Engine logprobs arrive per token as
(token id, logprob, [(top id, top logprob), ...])."""

from __future__ import annotations

from collections.abc import Callable

TokenText = Callable[[int], str]


def completion_logprobs(token_text: TokenText, lps: list, offset: int) -> dict:
    """OpenAI's completions shape; ``text_offset`` counts from ``offset``."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, logprob, top_pairs in lps:
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        top.append({token_text(t): lp for t, lp in top_pairs})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_logprobs(token_text: TokenText, prompt: list[int], lps: list | None) -> dict:
    """Completions-shaped logprobs of the prompt itself (echo): the first token has none,
    as in OpenAI's API; ``lps`` covers tokens 1.. (None: not computed)."""
    first = token_text(prompt[0])
    rest = completion_logprobs(token_text, lps or [], len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def join_logprobs(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def chat_logprobs(token_text: TokenText, lps: list) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
            for t, lp, top in lps
        ]
    }
