"""Reasoning output split from the answer: the ``<think> … </think>`` block that reasoning
models write before their reply, as each family writes it (``--reasoning-parser``).

``deepseek_r1``: DeepSeek-R1 and its distills. Their chat template ends the generation
prompt inside the thinking (``<think>\\n``), so the output usually starts with the thinking
itself and shows only the end marker; a leading ``<think>`` is dropped when the model
writes it anyway. Everything before ``</think>`` is reasoning; with no end marker (a
reply cut off by ``max_tokens`` or a stop string) all of it is.

``qwen3``: Qwen3's hybrid models write ``<think> … </think>`` themselves when they think;
with ``enable_thinking: false`` the template puts an empty block in the prompt and the
output has no marker at all: all of it is the answer. So reasoning is only what follows
a leading ``<think>``; a start marker with no end (cut off) makes all of it reasoning.

The split is the same whole (``split``) and streamed (``ReasoningStreamer``): a marker cut
across stream chunks is held back until it is known, and the streamed parts join to the
whole split's. Transport-independent: Chat Completions, Responses and Messages read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
AUTO = "auto"  # --reasoning-parser auto: chosen from the chat template (detect)
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """A reply split: ``reasoning`` (None: the model did not think) and ``content`` (None:
    nothing after the thinking, as OpenAI's message content)."""

    reasoning: str | None
    content: str | None
    closed: bool = False  # the thinking ended (its end marker came)


def _starts_open(parser: str) -> bool:
    """Whether the output begins inside the thinking without a start marker."""
    if parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {parser!r} (one of {', '.join(REASONING_PARSERS)})"
        )
    return parser == "deepseek_r1"


def split(text: str, parser: str) -> ReasoningSplit:
    """``text`` (a whole reply) as reasoning and content, as ``parser``'s family writes."""
    streamer = ReasoningStreamer(parser)
    _, content = streamer.feed(text)
    content += streamer.finish()[1]
    reply = streamer.reply()
    return ReasoningSplit(
        reply.reasoning, content if content or not streamer.thought else None, reply.closed
    )


class ReasoningStreamer:
    """Splits a reply's text as it streams.

    Invariants: ``feed`` returns (reasoning, content) text that is final (never taken
    back); what it holds back is at most a possible marker's prefix (fewer characters than
    the longest marker), returned by the next ``feed`` or by ``finish``; the reasoning and
    content of all calls joined equal ``split``'s of the whole text (markers and the
    whitespace right after ``</think>`` dropped)."""

    def __init__(self, parser: str) -> None:
        # "start": before anything is known; "think": inside the thinking; "answer": after
        self._state = "think" if _starts_open(parser) else "start"
        self._open_start = self._state == "think"  # deepseek: a leading <think> is dropped
        self._held = ""
        self._strip_lead = False  # the whitespace after </think> (templates write "\n\n")
        self.thought = self._state == "think"  # whether any reasoning was opened
        self.closed = False  # whether the thinking ended (its end marker came)
        self.reasoning = ""  # all the reasoning given out so far

    def reply(self) -> ReasoningSplit:
        """The thinking so far (its content is the caller's: not kept here)."""
        return ReasoningSplit(self.reasoning if self.thought else None, None, self.closed)

    @property
    def thinking(self) -> bool:
        """Inside the thinking now (opened, not closed)."""
        return self._state == "think"

    def feed(self, text: str) -> tuple[str, str]:
        held = self._held + text
        self._held = ""
        reasoning, content = "", ""
        while held:
            if self._state == "start":
                lead = held.lstrip()
                if not lead:  # only whitespace so far: not known yet
                    self._held = held
                    break
                if lead.startswith(START):
                    self._state, self.thought = "think", True
                    held = lead[len(START) :]
                    continue
                if START.startswith(lead):  # a cut marker: wait
                    self._held = held
                    break
                self._state = "answer"  # no marker: all of it is the answer
                continue
            if self._state == "think":
                if self._open_start:  # deepseek: a leading <think> written anyway
                    lead = held.lstrip()
                    if lead.startswith(START):
                        held = lead[len(START) :]
                        self._open_start = False
                        continue
                    if START.startswith(lead) and lead != START:  # maybe that marker: wait
                        self._held = held  # (also whitespace alone: it may come next)
                        break
                    if lead:
                        self._open_start = False
                at = held.find(END)
                if at >= 0:
                    reasoning += held[:at]
                    held = held[at + len(END) :]
                    self._state, self._strip_lead = "answer", True
                    self.closed = True
                    continue
                keep = partial_suffix(held, END)
                reasoning += held[: len(held) - keep]
                self._held = held[len(held) - keep :]
                break
            # answer
            if self._strip_lead:
                held = held.lstrip()
                if not held:
                    break
                self._strip_lead = False
            content += held
            held = ""
        self.reasoning += reasoning
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the reply."""
        held, self._held = self._held, ""
        if self._state == "think":
            self.reasoning += held
            return held, ""
        if self._state == "start":  # only whitespace, or a cut start marker: the answer
            return "", held
        return "", held.lstrip() if self._strip_lead else held


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0: none): what a
    streamed parser holds back until it knows whether the marker comes."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def reasoning_tokens(tokenizer: Any, token_ids: list[int], reply: ReasoningSplit) -> int:
    """How many of a reply's tokens were thinking (usage's ``reasoning_tokens``): up to and
    including the end marker's token; all of them when the reply was cut inside the
    thinking; 0 when it did not think. ``tokenizer`` (the model's): where its vocabulary
    has no one-token end marker, the reasoning text's own encoding estimates it."""
    if reply.reasoning is None:
        return 0
    if not reply.closed:
        return len(token_ids)
    end = tokenizer.encode(END, add_special_tokens=False)
    if len(end) == 1 and end[0] in token_ids:
        return token_ids.index(end[0]) + 1
    encoded = tokenizer.encode(reply.reasoning + END, add_special_tokens=False)
    return min(len(token_ids), len(encoded))


def detect(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template implies, where that is unambiguous: Qwen3's
    hybrid template (it reads ``enable_thinking``) is qwen3; a template that opens the
    thinking in the generation prompt (``<think>`` after the assistant turn's start, as
    DeepSeek-R1's distills do) is deepseek_r1; otherwise None (no thinking to split)."""
    if not chat_template or START not in chat_template:
        return None
    if "enable_thinking" in chat_template:
        return "qwen3"
    if END in chat_template:
        return "deepseek_r1"
    return None


async def run_with_thinking_budget(
    frontend: Any, ids: list[int], params: Any, routing: Any, parser: str, budget: int
) -> Any:
    """The deltas of one sample whose thinking may take at most ``budget`` tokens (the
    Messages API's ``thinking.budget_tokens``): past it, the generation is stopped, the end
    marker (``</think>``) is appended as if the model had written it, and a second
    request continues from there (the prompt plus everything so far: its KV is found in
    the radix cache) for the tokens ``max_tokens`` leaves. A reply that ends its thinking
    in time is the one request, untouched. Yields ``(0, delta)`` as ``Frontend.run``."""
    import dataclasses

    from radixserve.serving.protocol import Delta

    watch = ReasoningStreamer(parser)
    thinking_tokens = 0
    produced: list[int] = []
    stream = frontend.run([ids], params, routing)
    cut = False
    first_cached = 0
    try:
        async for _, d in stream:
            was_thinking = not watch.closed  # (or not yet known)
            first_cached = max(first_cached, d.num_cached_tokens)
            watch.feed(d.text)
            produced.extend(d.token_ids)
            if was_thinking and watch.thought:
                thinking_tokens += len(d.token_ids)
            if not d.finished and watch.thinking and thinking_tokens >= budget:
                cut = True
                yield 0, d  # the last thinking it did
                break
            yield 0, d
            if d.finished:
                return
    finally:
        await stream.aclose()  # (cut: aborts the request in the engine)
    if not cut:
        return
    marker = END  # the model writes its own separator after it, as it would have
    end_ids = await frontend.encode(marker, add_special_tokens=False)
    left = params.max_tokens - len(produced) - len(end_ids)
    rid = d.request_id
    yield 0, Delta(rid, 0, end_ids, marker, False, None, None, len(ids), 0)
    if left < 1:  # nothing left for the answer: ended at the length limit
        yield 0, Delta(rid, 0, [], "", True, "length", None, len(ids), 0)
        return
    spec = params.structured_output
    if spec is not None and "reasoning" in spec:  # the thinking is over: the answer's alone
        spec = {k: v for k, v in spec.items() if k != "reasoning"}
    rest = dataclasses.replace(params, max_tokens=left, structured_output=spec)
    async for _, d2 in frontend.run([ids + produced + end_ids], rest, routing):
        # the continuation finds the first request's thinking cached: report the prompt's
        # own cached tokens, as the first request saw them
        d2.num_cached_tokens = first_cached
        d2.num_prompt_tokens = len(ids)
        yield 0, d2
