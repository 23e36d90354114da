"""Sampling parameters of one request, validated once at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# structured_output kinds (vLLM's ``structured_outputs`` names) and the type of their value
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "grammar", "choice")
# structured_output's optional "reasoning": whose thinking the grammar lets pass first
# (serving/reasoning.py's parsers)
REASONING_FORMATS = ("deepseek_r1", "qwen3")


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    """How to draw the completion of one prompt.

    Invariant: every field is within its allowed range once the object exists
    (``__post_init__`` raises ``ValueError`` naming the field otherwise), and
    ``stop`` / ``stop_token_ids`` are lists.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # return the chosen token's logprob and this many top ones
    # the same for every prompt token but the first (computed, so never a prefix-cache hit)
    prompt_logprobs: int | None = None
    # constrained decoding: exactly one of {"json": schema (dict or JSON text),
    # "json_object": True, "regex": str, "grammar": EBNF str, "choice": [str, ...]}
    structured_output: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _require(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an integer in [0, max_tokens={self.max_tokens}]",
            self.min_tokens,
        )
        _require(
            _is_finite(self.temperature) and self.temperature >= 0,
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        _require(
            _is_finite(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            "a number in (0, 1]",
            self.top_p,
        )
        _require(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            "an integer >= -1 (-1 or 0 disables it)",
            self.top_k,
        )
        _require(
            _is_finite(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            "a number in [0, 1]",
            self.min_p,
        )
        _require(
            _is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "a finite number > 0",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_finite(value) and -2 <= value <= 2, name, "a number in [-2, 2]", value)
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _require(
                    _is_finite(bias) and -100 <= bias <= 100,
                    f"logit_bias[{token}]",
                    "a number in [-100, 100]",
                    bias,
                )
        _require(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and 0 <= value <= 20),
                name,
                "an integer in [0, 20] or None",
                value,
            )
        for s in self.stop:
            _require(isinstance(s, str) and s != "", "stop", "a list of non-empty strings", s)
        if self.structured_output is not None:
            self.grammar_key()  # raises ValueError naming the field

    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, text) of ``structured_output`` (the compile cache key), or None when free.
        ``ValueError`` naming the field when its shape is wrong (the grammar itself is
        checked when it compiles)."""
        so = self.structured_output
        if so is None:
            return None
        name = "structured_output"
        given = (
            [k for k in STRUCTURED_OUTPUT_KINDS if so.get(k) is not None]
            if isinstance(so, dict)
            else []
        )
        after = so.get("reasoning") if isinstance(so, dict) else None
        _require(
            isinstance(so, dict) and len(given) == 1 and len(so) == 1 + ("reasoning" in so),
            name,
            f"a dict with exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} (and "
            "optionally reasoning)",
            so,
        )
        _require(
            after is None or after in REASONING_FORMATS,
            f"{name}.reasoning",
            f"one of {', '.join(REASONING_FORMATS)}",
            after,
        )
        key = self._spec_key(so, given[0], name)
        # with "reasoning": the grammar starts after that family's thinking (its own kind
        # in the compile cache: "json@qwen3")
        return (f"{key[0]}@{after}", key[1]) if after else key

    @staticmethod
    def _spec_key(so: dict, kind: str, name: str) -> tuple[str, str]:
        value = so[kind]
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ValueError(f"{name}.json: not valid JSON: {value[:200]!r}") from None
            _require(isinstance(value, dict | bool), f"{name}.json", "a JSON schema object", value)
            return kind, json.dumps(value)
        if kind == "json_object":
            _require(value is True, f"{name}.json_object", "true", value)
            return kind, ""
        if kind == "choice":
            _require(
                isinstance(value, list)
                and bool(value)
                and all(isinstance(c, str) and c for c in value),
                f"{name}.choice",
                "a non-empty list of non-empty strings",
                value,
            )
            return kind, json.dumps(value)
        _require(
            isinstance(value, str) and bool(value), f"{name}.{kind}", "a non-empty string", value
        )
        return kind, value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a token id named by these parameters is outside the vocabulary."""
        for token in self.logit_bias or {}:
            _require(0 <= token < vocab_size, "logit_bias key", f"in [0, {vocab_size})", token)
        for token in self.stop_token_ids:
            _require(0 <= token < vocab_size, "stop_token_ids", f"in [0, {vocab_size})", token)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
