"""The one place a request becomes prompt token ids + ``SamplingParams``.

Every entry point goes through ``InputProcessor``: the offline API (``LLM``), the HTTP
routes and gRPC (through the serving layer's frontend). So a request is templated, checked
and given the model's sampling defaults the same way wherever it comes from:

* one chat-template path: ``render_chat`` (text), then the tokenizer without special
  tokens (the template writes them), as ``transformers`` does with ``tokenize=True``;
* one prompt check: ``check_prompt`` (not empty, ids in the vocabulary, prompt plus
  completion within the context);
* one set of sampling defaults: fields a request leaves unset (``None``) take the model's
  ``generation_config.json`` values (``--generation-config auto``) or the neutral
  OpenAI-style ones (``neutral``: ``SamplingParams``'s own defaults).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from radixserve.core.errors import InputError
from radixserve.core.sampling_params import SamplingParams

__all__ = ["GENERATION_CONFIG_MODES", "InputError", "InputProcessor", "sampling_defaults"]

GENERATION_CONFIG_MODES = ("auto", "neutral")
# generation_config.json keys that are sampling defaults (the rest are not ours to apply)
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_defaults(generation_config: Mapping[str, Any], mode: str = "auto") -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` asks for (``auto``), or
    none at all (``neutral``: ``SamplingParams``'s own defaults apply)."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(
            f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}"
        )
    if mode == "neutral":
        return {}
    defaults = {k: generation_config[k] for k in SAMPLING_DEFAULT_KEYS if k in generation_config}
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


class InputProcessor:
    """Turns prompts, chats and sampling fields into what the engine takes.

    Invariants: ``sampling_params`` fills exactly the fields given as ``None`` or not
    given from ``defaults`` (then ``SamplingParams``'s own); every prompt that
    ``check_prompt`` accepts is non-empty, in the vocabulary and fits ``max_model_len``
    with its completion; errors are ``InputError`` (a ``ValueError``) naming the field.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.defaults = dict(defaults or {})

    # -- sampling -------------------------------------------------------------------------
    def sampling_params(self, **fields: Any) -> SamplingParams:
        """``SamplingParams`` of ``fields`` (``None``: the default), checked against the
        vocabulary. ``InputError`` naming the field when one is invalid or unknown."""
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            raise InputError(f"{unknown[0]}: not a sampling parameter", param=unknown[0])
        given = {k: v for k, v in fields.items() if v is not None}
        try:
            params = SamplingParams(**{**self.defaults, **given})
            params.check_vocab(self.vocab_size)
        except InputError:
            raise
        except (ValueError, TypeError) as exc:
            raise InputError(str(exc), param=_leading_field(str(exc))) from None
        return params

    # -- prompts --------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages``, as text (encode it without special
        tokens: the template wrote them)."""
        if not messages:
            raise InputError("messages must not be empty", param="messages")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InputError(
                "this model has no chat template; send a plain prompt (completions)",
                param="messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **dict(template_kwargs or {}),
            )
        except Exception as exc:  # a template error is the caller's input
            raise InputError(
                f"could not apply the chat template: {exc}", param="messages"
            ) from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InputError("the prompt must not be empty", param="prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def chat_ids(self, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        """Token ids of ``messages`` through the chat template (``render_chat``'s keywords)."""
        return self.encode(self.render_chat(messages, **template), add_special_tokens=False)

    def prompt_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of a text or token-id prompt, checked (``check_prompt``)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids, params.max_tokens)
        return ids

    def check_prompt(self, ids: list[int], max_tokens: int) -> list[int]:
        """``ids`` as plain ints, or ``InputError``: empty, out of the vocabulary, or too
        long for the context with ``max_tokens`` more."""
        if not ids:
            raise InputError("the prompt must not be empty", param="prompt")
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise InputError("prompt token ids must be integers", param="prompt") from None
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(
                f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param="prompt"
            )
        total = len(ids) + max_tokens
        if total > self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return ids


def _leading_field(message: str) -> str | None:
    """The field a ``SamplingParams`` error names first (``"top_p must be ..."``)."""
    head = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":")
    return head if head.replace("_", "").isalpha() and head.islower() else None
