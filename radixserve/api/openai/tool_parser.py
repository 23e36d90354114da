"""Tool calling at the OpenAI chat API: the request's tools and tool_choice checked, tool
calls parsed out of the generated text (whole or streamed) in each model family's own
format (``--tool-call-parser``), and chat messages with tool calls made ready for the
template.

The formats: ``hermes`` (Qwen2.5, Hermes: ``<tool_call>{"name", "arguments"}</tool_call>``),
``llama3_json`` (the whole output one JSON call, or several separated by ``;``),
``mistral`` (``[TOOL_CALLS]`` then a JSON list of calls, or the v11 form
``[TOOL_CALLS]name[ARGS]{...}``), ``qwen3_coder`` (``<tool_call><function=NAME>
<parameter=P>value</parameter></function></tool_call>``, values as text, typed by the
function's schema), ``pythonic`` (Llama 3.2/4: the output a Python list of calls,
``[f(a=1), g()]``), ``deepseek_v3`` (``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
<｜tool▁sep｜>NAME`` and its JSON arguments in a fenced block). Text that does not parse as
calls is content, never an error."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.api.asgi import APIError
from radixserve.serving.reasoning import partial_suffix

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "deepseek_v3")


@dataclass
class ToolContext:
    """What a chat request asked of tools. Invariant: ``functions`` maps each declared
    function's name to its parameters schema; ``mode`` is none, auto, required or named
    (``named`` then holds a declared name); ``parse`` is false only for mode none."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)
    mode: str = "none"
    named: str | None = None
    parallel: bool = True
    parser: str = "hermes"

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def grammar_spec(self) -> dict[str, Any] | None:
        """required / named: a JSON schema that every output satisfies, so the output is
        always a valid call (named: the function's arguments; required: a list of calls)."""
        if self.mode == "named":
            assert self.named is not None
            return {"json": self.functions[self.named]}
        if self.mode != "required":
            return None
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in self.functions.items()
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of},
            "minItems": 1,
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema}


_EMPTY_PARAMS = {"type": "object", "properties": {}}


def tool_context(body: Any, parser: str) -> ToolContext:
    """Validate ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request."""
    tools = body.tools
    choice = body.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise APIError(400, "parallel_tool_calls needs tools", param="parallel_tool_calls")
        return ToolContext()
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                400, "each tool must be {type: function, function: {...}}", param=f"tools.{i}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(
                400,
                "tool function names are 1-64 letters, digits, _ . -",
                param=f"tools.{i}.function.name",
            )
        params = fn.get("parameters", _EMPTY_PARAMS)
        if not isinstance(params, dict):
            raise APIError(
                400, "parameters must be a JSON schema object", param=f"tools.{i}.function"
            )
        if name in functions:
            raise APIError(400, f"tool {name!r} is declared twice", param=f"tools.{i}")
        functions[name] = params
    ctx = ToolContext(
        tools=tools,
        functions=functions,
        parallel=body.parallel_tool_calls is not False,
        parser=parser,
    )
    if choice is None or choice in ("auto", "none", "required"):
        ctx.mode = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise APIError(
                400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        ctx.mode, ctx.named = "named", name
    else:
        raise APIError(
            400,
            "tool_choice must be none, auto, required or {type: function, function: {name}}",
            param="tool_choice",
        )
    return ctx


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model (``--tool-call-parser
    auto``), or None when it shows none of the known ones."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if _HERMES_START in t:
        return "hermes"
    if _MISTRAL_START in t:
        return "mistral"
    if "tool▁calls▁begin" in t:
        return "deepseek_v3"
    if "func_name1(" in t or _PYTHONIC_START in t:  # Llama 3.2 / 4's pythonic prompt
        return "pythonic"
    if _LLAMA_START in t or '"parameters"' in t:
        return "llama3_json"
    return None


# formats whose markers are special tokens in their families' vocabularies: the text must
# keep them (``skip_special_tokens`` off) for the parser to find the calls, as vLLM does
_SPECIAL_MARKERS = ("mistral", "deepseek_v3")


def keep_markers(params: Any, ctx: ToolContext) -> Any:
    """``params`` with special tokens kept in the text when tool calls are parsed from a
    format whose markers are special tokens."""
    import dataclasses

    if ctx.active and ctx.parser in _SPECIAL_MARKERS and params.skip_special_tokens:
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_HERMES_START = "<tool_call>"
_LLAMA_START = "<|python_tag|>"
_MISTRAL_START = "[TOOL_CALLS]"
_DEEPSEEK_START = "<｜tool▁calls▁begin｜>"
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([^\n<]+?)\s*\n"
    r"\s*```(?:json)?\s*(.*?)\s*```\s*(?:<｜tool▁call▁end｜>|$)",
    re.DOTALL,
)
_QWEN3_CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_QWEN3_CODER_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|$)", re.DOTALL
)
_PYTHONIC_START = "<|python_start|>"
# where each marker family's calls begin (the content is what comes before)
_MARKERS = {
    "hermes": _HERMES_START,
    "qwen3_coder": _HERMES_START,
    "mistral": _MISTRAL_START,
    "deepseek_v3": _DEEPSEEK_START,
}


def _call_from_object(obj: Any, functions: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return tool_call(obj["name"], args) if isinstance(args, dict) else None


def parse_tool_calls(
    text: str, ctx: ToolContext, truncated: bool = False
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished chat output. Text that does not parse as calls
    stays content. ``truncated`` (the output ran into max_tokens): the calls that were
    complete are returned, the one cut off is dropped. ``parallel_tool_calls: false``:
    at most the first call."""
    content, calls = _parse_calls(text, ctx, truncated)
    if calls and not ctx.parallel:
        calls = calls[:1]
    return content, calls


def _parse_calls(
    text: str, ctx: ToolContext, truncated: bool
) -> tuple[str | None, list[dict[str, Any]]]:
    if ctx.mode == "named":
        assert ctx.named is not None
        try:
            args = json.loads(text)
        except ValueError:
            return text, []
        return None, [tool_call(ctx.named, args)]
    if ctx.mode == "required":  # a JSON array of {name, parameters} (the grammar's shape)
        body = text.strip()
        if not body.startswith("["):
            return text, []
        objects, complete = _json_sequence(body, 1, ",]")
        if not complete and not truncated:
            return text, []
        calls = [_call_from_object(obj, ctx.functions) for obj in objects]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls  # type: ignore[return-value]
    if ctx.parser in ("mistral", "qwen3_coder", "deepseek_v3"):
        start = text.find(_MARKERS[ctx.parser])
        if start < 0:
            return text, []
        parse = {"mistral": _mistral, "qwen3_coder": _qwen3_coder, "deepseek_v3": _deepseek}
        found = parse[ctx.parser](text[start + len(_MARKERS[ctx.parser]) :], ctx, truncated)
        if not found:
            return text, []
        content = text[:start]
        return (content if content.strip() else None), found
    if ctx.parser == "pythonic":
        found = _pythonic(text, ctx, truncated)
        return (None, found) if found else (text, [])
    if ctx.parser == "hermes":
        start = text.find(_HERMES_START)
        if start < 0:
            return text, []
        calls = []
        matches = list(_HERMES.finditer(text, start))
        for k, m in enumerate(matches):
            try:
                call = _call_from_object(json.loads(m.group(1)), ctx.functions)
            except ValueError:
                call = None
            if call is None:
                cut_off = truncated and k == len(matches) - 1 and not m.group(0).endswith(">")
                if cut_off and calls:
                    break  # the last call was cut off by max_tokens: keep the others
                return text, []
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls
    # llama3_json: the whole output is one call object, or several separated by ';'
    body = text.strip()
    if body.startswith(_LLAMA_START):
        body = body[len(_LLAMA_START) :].strip()
    if not body.startswith("{"):
        return text, []
    objects, complete = _json_sequence(body, 0, " \n\t;")
    if not complete and not (truncated and objects):
        return text, []
    calls = [_call_from_object(obj, ctx.functions) for obj in objects]
    if any(c is None for c in calls):
        return text, []
    return None, calls  # type: ignore[return-value]


def _json_sequence(body: str, pos: int, separators: str) -> tuple[list[Any], bool]:
    """The JSON values of ``body`` from ``pos`` on, separated by any of ``separators``
    (a closing ``]`` ends the sequence); whether it parsed to its end (False: the values
    before the first one that did not parse)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    while True:
        while pos < len(body) and body[pos] in " \n\t" + separators.replace("]", ""):
            pos += 1
        if pos >= len(body):
            return values, "]" not in separators
        if body[pos] == "]" and "]" in separators:
            return values, not body[pos + 1 :].strip()
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return values, False
        values.append(value)


def _all_or_complete(calls: list[dict[str, Any] | None], truncated: bool) -> list[dict[str, Any]]:
    """Every call parsed, or (cut off by max_tokens) those before the last, which may be
    the cut one; any other failure: no calls (the text stays content)."""
    if calls and calls[-1] is None and truncated:
        calls = calls[:-1]
    if not calls or any(c is None for c in calls):
        return []
    return calls  # type: ignore[return-value]


def _mistral(rest: str, ctx: ToolContext, truncated: bool) -> list[dict[str, Any]]:
    body = rest.strip()
    if body.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        objects, complete = _json_sequence(body, 1, ",]")
        calls = [_call_from_object(obj, ctx.functions) for obj in objects]
        if not complete:
            if not truncated:
                return []
            calls.append(None)
        return _all_or_complete(calls, truncated)
    # v11: name[ARGS]{...} (repeated, each after its own [TOOL_CALLS])
    calls = []
    for part in body.split(_MISTRAL_START):
        name, sep, args = part.partition("[ARGS]")
        try:
            value = json.loads(args) if sep else None
        except ValueError:
            value = None
        calls.append(
            _call_from_object({"name": name.strip(), "arguments": value}, ctx.functions)
            if isinstance(value, dict)
            else None
        )
    return _all_or_complete(calls, truncated)


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as its schema's type (a string stays text)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _qwen3_coder(rest: str, ctx: ToolContext, truncated: bool) -> list[dict[str, Any]]:
    calls: list[dict[str, Any] | None] = []
    for m in _QWEN3_CODER_FUNCTION.finditer(rest):
        name = m.group(1).strip()
        closed = m.group(0).endswith("</function>")
        if name not in ctx.functions or not closed:
            calls.append(None)
            continue
        props = ctx.functions[name].get("properties", {})
        args = {
            p.group(1).strip(): _typed(p.group(2), props.get(p.group(1).strip()))
            for p in _QWEN3_CODER_PARAMETER.finditer(m.group(2))
        }
        calls.append(tool_call(name, args))
    return _all_or_complete(calls, truncated)


def _deepseek(rest: str, ctx: ToolContext, truncated: bool) -> list[dict[str, Any]]:
    calls: list[dict[str, Any] | None] = []
    for m in _DEEPSEEK_CALL.finditer(rest):
        try:
            args = json.loads(m.group(2))
        except ValueError:
            args = None
        calls.append(
            _call_from_object({"name": m.group(1), "arguments": args}, ctx.functions)
            if isinstance(args, dict)
            else None
        )
    begun = rest.count("<｜tool▁call▁begin｜>")
    calls += [None] * (begun - len(calls))  # begun, never matched: cut off or malformed
    return _all_or_complete(calls, truncated)


def _pythonic(text: str, ctx: ToolContext, truncated: bool) -> list[dict[str, Any]]:
    """``[f(a=1, b='x'), g()]``: a Python list of calls with literal keyword arguments
    (read with ``ast``, never evaluated)."""
    import ast

    body = text.strip()
    if body.startswith(_PYTHONIC_START):
        body = body[len(_PYTHONIC_START) :].removesuffix("<|python_end|>").strip()
    if not body.startswith("["):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List):
        return []
    calls: list[dict[str, Any] | None] = []
    for node in tree.elts:
        call = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                json.dumps(args)  # literals JSON has no word for (bytes, sets, ...): no call
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                args = None
            if args is not None and None not in args and node.func.id in ctx.functions:
                call = tool_call(node.func.id, args)
        calls.append(call)
    return _all_or_complete(calls, truncated)


class ToolStreamer:
    """Splits a streamed chat output into content that can go out now and text held back
    because it is (or may become) a tool call. Invariant: the content streamed plus the
    content of ``finish`` equals the content ``parse_tool_calls`` gives for the whole text,
    and the calls equal its calls (ids aside)."""

    def __init__(self, ctx: ToolContext) -> None:
        self.ctx = ctx
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.holding = ctx.mode in ("named", "required")  # all JSON: nothing streams

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if self.ctx.parser in _MARKERS:
            marker = _MARKERS[self.ctx.parser]
            at = self.text.find(marker, max(0, self.sent - len(marker)))
            if at >= 0:
                self.holding = True
                end = at
            else:  # hold back a tail that could be the start of the marker
                end = len(self.text) - partial_suffix(self.text, marker)
        else:  # llama3_json / pythonic: an output that starts like a call may be one
            head = self.text.lstrip()
            opener, tag = (
                ("[", _PYTHONIC_START)
                if self.ctx.parser == "pythonic"
                else (
                    "{",
                    _LLAMA_START,
                )
            )
            if not head or tag.startswith(head) or head[0] == opener or head.startswith(tag):
                self.holding = head.startswith((opener, tag))
                return ""
            end = len(self.text)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content not streamed yet, tool calls) once the output is complete
        (``truncated``: it ran into max_tokens; see ``parse_tool_calls``)."""
        content, calls = parse_tool_calls(self.text, self.ctx, truncated)
        if calls:
            return (content or "")[self.sent :], calls
        return self.text[self.sent :], []


def template_message(m: Any, i: int, content: str) -> dict[str, Any]:
    """Chat message ``i`` for the template: assistant ``tool_calls`` with their arguments
    as objects (what templates iterate over), ``tool`` messages with their call id."""
    msg: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(
                    400, "tool_calls entries need function.name", param=f"messages.{i}.tool_calls"
                )
            args = fn.get("arguments") or "{}"
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    raise APIError(
                        400,
                        "function.arguments must be JSON",
                        param=f"messages.{i}.tool_calls.{j}.function.arguments",
                    ) from None
            calls.append(
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": args},
                }
            )
        msg["tool_calls"] = calls
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        msg["name"] = m.name
    return msg
