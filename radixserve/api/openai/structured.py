"""Structured output at the OpenAI API: request fields (response_format, vLLM's
structured_outputs, a tool choice that must call) → one grammar spec, parsed before the
engine sees the request (the engine compiles it); and the check that no unknown field is
silently ignored."""

from __future__ import annotations

from typing import Any

from radixserve.api.asgi import APIError
from radixserve.api.openai.tool_parser import ToolContext
from radixserve.core.errors import InputError
from radixserve.core.sampling_params import STRUCTURED_OUTPUT_KINDS
from radixserve.serving.grammar import GrammarChecker

# Fields a client may send that change nothing about the output: accepted and ignored.
# Every other field the models do not declare is a 400 naming it (never silently ignored).
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
)


def reject_unknown_fields(body: Any) -> None:
    """400 for the first field of ``body`` that its model does not declare and that is not
    harmless metadata (``IGNORED_FIELDS``)."""
    for name in body.model_extra or {}:
        if name not in IGNORED_FIELDS:
            raise APIError(400, f"{name}: this field is not supported by this server", param=name)


# -- structured output ----------------------------------------------------------------------
def response_format_spec(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as a ``structured_output`` spec (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError(
                400,
                "response_format.json_schema must be an object with a 'schema' object",
                param="response_format.json_schema",
            )
        return {"json": js.get("schema", {})}
    raise APIError(
        400,
        f"response_format.type must be one of text, json_object, json_schema; got {kind!r}",
        param="response_format.type",
    )


def structured_outputs_spec(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` extra ({json | regex | choice | grammar | json_object})."""
    if extra is None:
        return None
    unknown = [k for k in extra if k not in STRUCTURED_OUTPUT_KINDS]
    if unknown:
        raise APIError(
            400,
            f"structured_outputs.{unknown[0]} is not supported "
            f"(give one of {', '.join(STRUCTURED_OUTPUT_KINDS)})",
            param=f"structured_outputs.{unknown[0]}",
        )
    given = {k: v for k, v in extra.items() if v is not None and v is not False}
    if len(given) != 1:
        raise APIError(
            400,
            f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
            param="structured_outputs",
        )
    return given


# vLLM's older guided-decoding fields and SGLang's, which clients still send: each is one
# structured_output kind by itself
LEGACY_SPEC_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json",  # SGLang (a JSON schema, as text or object)
    "regex": "regex",  # SGLang
    "ebnf": "grammar",  # SGLang
}
GUIDED_BACKENDS = (None, "auto", "xgrammar")  # the one backend here


def legacy_specs(body: Any) -> list[tuple[str, dict[str, Any]]]:
    """(field, spec) for each legacy structured-output field the body sets."""
    backend = getattr(body, "guided_decoding_backend", None)
    if backend not in GUIDED_BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend {backend!r} is not available here (xgrammar is)",
            param="guided_decoding_backend",
        )
    return [
        (name, {kind: value})
        for name, kind in LEGACY_SPEC_FIELDS.items()
        if (value := getattr(body, name, None)) is not None
    ]


async def structured_spec(
    checker: GrammarChecker,
    body: Any,
    tools: ToolContext | None = None,
    reasoning: str | None = None,
) -> dict[str, Any] | None:
    """The request's grammar spec (response_format, structured_outputs, or a tool choice
    that must call), once it parsed (the engine compiles it); None for free text. 400
    naming the field otherwise."""
    specs = [
        (source, spec)
        for source, spec in (
            ("response_format", response_format_spec(body.response_format)),
            ("structured_outputs", structured_outputs_spec(body.structured_outputs)),
            ("tools", tools.grammar_spec() if tools is not None else None),
            *legacy_specs(body),
        )
        if spec is not None
    ]
    if len(specs) > 1:
        names = " and ".join("tool_choice" if s == "tools" else s for s, _ in specs)
        raise APIError(400, f"{names} cannot be combined", param=specs[1][0])
    if not specs:
        return None
    source, spec = specs[0]
    if reasoning is not None:  # the grammar starts after the family's thinking
        spec = {**spec, "reasoning": reasoning}
    try:
        await checker.check(spec, source)
    except InputError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return spec
