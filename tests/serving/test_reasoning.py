"""The reasoning split (serving/reasoning.py), whole and streamed in every cut."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.serving.reasoning import ReasoningSplit, ReasoningStreamer, reasoning_tokens, split

# what each family writes (the chat templates' own markers and spacing)
R1 = "Okay, the user asks for 2+2.\nThat is 4.\n</think>\n\nThe answer is 4."
QWEN3 = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        ("deepseek_r1", R1, ("Okay, the user asks for 2+2.\nThat is 4.\n", "The answer is 4.")),
        ("deepseek_r1", "<think>\n" + R1, ("\nOkay, the user asks for 2+2.\nThat is 4.\n", "The answer is 4.")),
        ("deepseek_r1", "still thinking when cut", ("still thinking when cut", None)),
        ("deepseek_r1", "done</think>", ("done", None)),
        ("qwen3", QWEN3, ("\nThe user greets me.\n", "Hello! How can I help?")),
        ("qwen3", "Hello there.", (None, "Hello there.")),  # enable_thinking false
        ("qwen3", "<think>\ncut inside", ("\ncut inside", None)),
        ("qwen3", "\n\n<think>a</think>b", ("a", "b")),
        ("qwen3", "", (None, "")),
        ("qwen3", "a <think> b </think> c", (None, "a <think> b </think> c")),  # not leading
    ],
)  # fmt: skip
def test_whole_replies_split_as_each_family_writes(parser, text, expected):
    got = split(text, parser)
    assert (got.reasoning, got.content) == expected
    assert got.closed == (expected[0] is not None and "</think>" in text)


def _streamed(text: str, cuts: list[int], parser: str) -> tuple[str, str, bool]:
    streamer = ReasoningStreamer(parser)
    reasoning = content = ""
    last = 0
    for cut in [*sorted(set(cuts)), len(text)]:
        r, c = streamer.feed(text[last:cut])
        reasoning, content, last = reasoning + r, content + c, cut
    r, c = streamer.finish()
    return reasoning + r, content + c, streamer.thought


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@given(
    text=st.sampled_from(
        [R1, QWEN3, "<think>x</th", "Hi", " <thi", "a</think>", "<think></think>", "\n<think>ab"]
    )
    | st.text(alphabet="<>/thinkab \n", max_size=30),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streamed_in_any_cut_equals_whole(parser, text, cuts):
    """Markers cut anywhere across chunks: the streamed parts join to the whole split."""
    whole = split(text, parser)
    reasoning, content, thought = _streamed(text, [c for c in cuts if c <= len(text)], parser)
    assert (reasoning if thought else None) == whole.reasoning
    assert content == (whole.content or "")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        split("x", "nope")


def test_reasoning_tokens_count_to_the_end_marker():
    class Vocab:  # "</think>" one token (99) or, without it, one token a character
        def __init__(self, one_token_end: bool) -> None:
            self.one = one_token_end

        def encode(self, text, add_special_tokens=False):
            return [99] if self.one and text == "</think>" else [0] * len(text)

    closed = ReasoningSplit("abc", "x", closed=True)
    assert reasoning_tokens(Vocab(True), [1, 2, 3, 99, 5, 6], closed) == 4
    assert reasoning_tokens(Vocab(True), [1, 2, 3], ReasoningSplit("abc", None)) == 3  # cut
    assert reasoning_tokens(Vocab(True), [1, 2], ReasoningSplit(None, "hi")) == 0
    # no one-token marker: the reasoning text's own encoding, at most the reply
    assert reasoning_tokens(Vocab(False), [1, 2, 3, 4, 5], closed) == 5
    assert reasoning_tokens(Vocab(False), list(range(20)), closed) == 11


# the families' chat templates, reduced to the lines that tell them apart
QWEN3_TEMPLATE = (
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
R1_TEMPLATE = "{{'<｜Assistant｜>'}}{% if add_generation_prompt %}{{'<think>\\n'}}{% endif %}"
R1_TEMPLATE += "{% set content = content.split('</think>')[-1] %}"


def test_auto_picks_the_family_from_the_template():
    from radixserve.serving.reasoning import detect

    assert detect(QWEN3_TEMPLATE) == "qwen3"
    assert detect(R1_TEMPLATE) == "deepseek_r1"
    assert detect("{{ messages }}") is None and detect(None) is None
