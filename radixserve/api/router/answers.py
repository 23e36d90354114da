"""What a worker's answer says before it reaches the client: whether the request failed
before any output (its engine down, or the worker full), so it may go to another worker.
Shared by ``radixserve router`` and the Ray Serve application (``api/ray``), which both
hold an answer back until its first output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.api.asgi import APIError

# request headers passed on to a worker (it checks API keys itself; Anthropic's clients
# send theirs as x-api-key)
FORWARDED_HEADERS = (
    "authorization",
    "content-type",
    "accept",
    "x-tenant",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
)
# a stream's first event saying the worker's engine cannot answer (nothing generated yet)
ENGINE_DOWN = (b'"engine_dead"', b'"engine_restarting"', b'"engine_hung"')
# a stream's events that come before any output (a chat's role chunk, Messages' and
# Responses' opening events): held back until output or a failure follows, so a request
# whose worker fails before generating anything can still go elsewhere
PREAMBLE = (
    b'"delta":{"role":"assistant","content":""}',
    b"event: message_start\n",
    b"event: ping\n",
    b"event: content_block_start\n",
    b"event: response.created\n",
    b"event: response.in_progress\n",
    b"event: response.output_item.added\n",
    b"event: response.content_part.added\n",
)


# a worker's 503 (Messages: 529) that says "not now" rather than "broken": the request
# waits and is sent again (to it or another), without counting as a failure
BUSY_CODES = (b'"overloaded"', b'"model_loading"', b'"overloaded_error"')


@dataclass
class Retry:
    """A worker failed before its answer had any output: try another. ``failure``: its
    own answer (a 503), returned if no worker takes the request in time; ``busy``: it
    refused the request as overloaded (or still loading its model), which is waited out
    rather than counted as a failure."""

    message: str
    refused: bool = False
    failure: Any = None
    busy: bool = False


def failed_before_output(event: bytes) -> Retry | None:
    """A stream's first event after its preamble, when it says the request failed before
    any output because its worker could not run it (its engine down, or it is full): a
    ``Retry``; else None (output, or an error of the request's own: passed on)."""
    error = event.startswith((b'data: {"error"', b"event: error\n", b"event: response.failed\n"))
    if not error:
        return None
    text = event[6:300].decode(errors="replace")
    if any(code in event for code in BUSY_CODES):
        message = f"every worker is full; the last said: {text}"
        overloaded = APIError(503, message, type_="overloaded_error", code="overloaded")
        return Retry(message, busy=True, failure=overloaded)
    anthropic_down = event.startswith(b"event: error\n") and b'"api_error"' in event
    if anthropic_down or any(code in event for code in ENGINE_DOWN):
        return Retry(f"the worker's engine failed: {text}")
    return None


def retry_of_whole_answer(status: int, body: bytes) -> Retry | None:
    """A whole (not streamed) answer that says the worker could not run the request now:
    503 (its engine down or restarting, or it is full) or Messages' 529 (full)."""
    if status not in (503, 529):
        return None
    busy = status == 529 or any(code in body[:400] for code in BUSY_CODES)
    return Retry(f"worker answered {status}", failure=None, busy=busy)
