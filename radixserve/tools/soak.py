"""Soak-and-chaos test of a live server (``radixserve soak``, ``benchmarks/soak.py``).

Drives ``radixserve serve`` on 127.0.0.1 (launched here, with ``--enable-debug-endpoints``
and the serve flags given after ``--``; or one already running, ``--url``) for a given time
with a mix of requests: streamed and non-streamed completions and chats, n > 1, seeds, stop
strings, logprobs, token-id prompts long enough for chunked prefill and preemption, clients
that disconnect mid-stream or give up, bad requests (malformed JSON, wrong types, a body
over the limit, an unknown model, a prompt too long) and bursts of short requests beyond
``--max-waiting-requests``. Every answer is checked against what it must be:

* ok: a 200 whose output is complete (``finish_reason`` stop/length, usage exact: token-id
  prompts count exactly, ``ignore_eos`` outputs are exactly ``max_tokens`` per choice,
  logprobs cover every token, streams end with ``[DONE]``);
* rejected: a 4xx with an OpenAI-shaped error, for the bad requests (and only those);
* overloaded: a 503 with code ``overloaded`` (bursts);
* abandoned: the client left on purpose (the engine must abort: checked at the end);
* fault: a 5xx an injected engine fault explains (an engine that died, hung or is
  restarting; a batch failed by ``step_exception``) — unexpected without ``--faults``;
* unexpected_5xx, wrong (a 200 with wrong content, or a status a request cannot get) and
  lost (no complete answer: connection dropped, timeout, a stream without ``[DONE]``).

At the end, once the engine is idle, ``POST /debug/flush_cache`` empties the radix tree and
reports the KV pages free of the total (``pages_leaked`` is the difference), and the RSS of
the server and engine processes at warm-up and at the end gives ``rss_growth_frac``. The last
line printed is JSON with ``requests``, ``lost``, ``unexpected_5xx``, ``rss_growth_frac``,
``pages_leaked`` and the rest; the exit code is 1 if any of lost, unexpected_5xx, wrong,
pages_leaked is non-zero or the RSS grew more than ``--max-rss-growth``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from radixserve.core.process_memory import rss_bytes

OUTCOMES = ("ok", "rejected", "overloaded", "abandoned", "fault", "unexpected_5xx", "wrong", "lost")
FAULT_CODES = {"engine_dead", "engine_hung", "engine_restarting"}
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "an",
    "be",
    "this",
    "are",
    "or",
]


class Lost(Exception):
    """No complete answer: the connection dropped, the time ran out, a stream was cut."""


@dataclass
class Answer:
    """One HTTP answer: status, body (non-streamed) or SSE data items with arrival times."""

    status: int
    body: bytes = b""
    events: list[tuple[float, bytes]] = field(default_factory=list)

    def json(self) -> Any:
        return orjson.loads(self.body)


async def http(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    stop_after_events: int | None = None,
) -> Answer:
    """One request on its own connection (``Connection: close``). Streams (SSE) are read
    event by event; ``stop_after_events``: hang up after that many (a client that leaves)."""
    writer = None

    async def exchange() -> Answer:
        nonlocal writer
        reader, writer = await asyncio.open_connection(host, port)
        return await _exchange(reader, writer, method, path, body, headers or {}, stop_after_events)

    try:
        return await asyncio.wait_for(exchange(), timeout_s)
    except TimeoutError:
        raise Lost(f"no complete answer in {timeout_s:g} s") from None
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise Lost(f"connection failed: {exc!r}") from None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _exchange(reader, writer, method, path, body, headers, stop_after_events) -> Answer:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
    with contextlib.suppress(ConnectionError):  # refused mid-body: the answer may be there
        await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip().lower()
    answer = Answer(status)
    chunks = _body_chunks(reader, fields)
    if not fields.get(b"content-type", b"").startswith(b"text/event-stream"):
        answer.body = b"".join([c async for c in chunks])
        return answer
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if event.startswith(b"data: "):
                answer.events.append((time.monotonic(), event[6:]))
            if stop_after_events is not None and len(answer.events) >= stop_after_events:
                return answer  # hang up mid-stream
    return answer


async def _body_chunks(reader, fields):
    if b"content-length" in fields:
        yield await reader.readexactly(int(fields[b"content-length"]))
        return
    if fields.get(b"transfer-encoding") != b"chunked":
        yield await reader.read()
        return
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


# -- the requests ---------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    outcome: str
    detail: str = ""
    started: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None


class Check(Exception):
    """A 200 whose content is wrong."""


class Soak:
    """The request mix against one server. Invariant: every request sent ends in exactly
    one ``Outcome`` (``OUTCOMES``), recorded in ``self.outcomes``."""

    def __init__(self, args: argparse.Namespace, host: str, port: int) -> None:
        self.args = args
        self.host, self.port = host, port
        self.rng = random.Random(args.seed)
        self.outcomes: list[Outcome] = []
        self.headers = {"Content-Type": "application/json"}
        if args.api_key:
            self.headers["Authorization"] = f"Bearer {args.api_key}"
        self.model = ""
        self.max_model_len = 0
        self.faults = bool(args.faults or args.expect_faults)

    async def get(self, path: str) -> Answer:
        return await http(self.host, self.port, "GET", path, headers=self.headers, timeout_s=30)

    async def post(self, path: str, body: Any, **kw: Any) -> Answer:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        return await http(self.host, self.port, "POST", path, raw, self.headers, **kw)

    async def setup(self) -> None:
        models = (await self.get("/v1/models")).json()["data"][0]
        self.model, self.max_model_len = models["id"], models["max_model_len"]

    # -- checking ---------------------------------------------------------------------------
    def classify_error(self, answer: Answer, allowed_4xx: bool, allow_overload: bool) -> str:
        """The outcome of a non-200 answer (its body must be OpenAI-shaped)."""
        try:
            error = answer.json()["error"]
            message, code = str(error["message"]), error.get("code")
            assert {"message", "type", "param", "code"} <= error.keys()
        except Exception:
            return "wrong" if answer.status < 500 else "unexpected_5xx"
        return self.classify_code(answer.status, message, code, allowed_4xx, allow_overload)

    def classify_code(
        self, status: int, message: str, code: Any, allowed_4xx: bool, allow_overload: bool
    ) -> str:
        if status == 503 and code == "overloaded":
            return "overloaded" if allow_overload else "wrong"
        if status >= 500:
            fault = code in FAULT_CODES or "injected fault" in message
            return "fault" if fault and self.faults else "unexpected_5xx"
        return "rejected" if allowed_4xx and 400 <= status < 500 else "wrong"

    def stream_error(self, events: list[tuple[float, bytes]]) -> str | None:
        """The outcome a stream's error event stands for, if it has one."""
        for _, data in events:
            if data.startswith(b'{"error"'):
                error = orjson.loads(data)["error"]
                status = 503 if error.get("type") in ("service_unavailable_error",) else 500
                if error.get("code") == "overloaded":
                    status = 503
                return self.classify_code(status, error["message"], error.get("code"), False, True)
        return None

    # -- request kinds ----------------------------------------------------------------------
    def token_prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, 200) for _ in range(length)]

    def text_prompt(self) -> str:
        return " ".join(self.rng.choices(WORDS, k=self.rng.randint(3, 40)))

    def sampling(self) -> dict:
        body: dict[str, Any] = {
            "max_tokens": self.rng.randint(1, self.args.max_tokens),
            "temperature": self.rng.choice([0.0, 0.7, 1.0]),
            "ignore_eos": True,
        }
        if self.rng.random() < 0.3:
            body["seed"] = self.rng.randrange(1 << 30)
        if self.rng.random() < 0.3:
            body["n"] = self.rng.randint(2, 3)
        if self.rng.random() < 0.2:
            body["stop"] = [self.rng.choice("aeiost ")]
        return body

    async def completion(self, stream: bool, long: bool = False) -> Outcome:
        body = {"model": self.model, **self.sampling(), "stream": stream}
        if long:  # past --max-num-batched-tokens: chunked prefill; several: preemption
            length = self.rng.randint(self.max_model_len // 4, self.max_model_len // 2)
            body["max_tokens"] = min(body["max_tokens"], self.max_model_len - length)
            body["prompt"] = self.token_prompt(length)
        else:
            body["prompt"] = self.token_prompt(self.rng.randint(1, 64))
        if self.rng.random() < 0.3:
            body["logprobs"] = self.rng.randint(0, 3)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return await self.generation("/v1/completions", body, len(body["prompt"]), chat=False)

    async def chat(self, stream: bool) -> Outcome:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.text_prompt()}],
            **self.sampling(),
            "stream": stream,
        }
        if self.rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = self.rng.randint(0, 3)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return await self.generation("/v1/chat/completions", body, None, chat=True)

    async def generation(
        self, path: str, body: dict, prompt_len: int | None, chat: bool
    ) -> Outcome:
        kind = ("chat" if chat else "completion") + ("_stream" if body["stream"] else "")
        if prompt_len is not None and prompt_len > self.max_model_len // 8:
            kind = "long_prompt" + ("_stream" if body["stream"] else "")
        started = time.monotonic()
        answer = await self.post(path, body, timeout_s=self.args.request_timeout)
        out = Outcome(kind, "ok", started=started)
        if answer.status != 200:
            out.outcome = self.classify_error(answer, False, True)
            out.detail = answer.body[:200].decode(errors="replace")
            return out
        try:
            if body["stream"]:
                error = self.stream_error(answer.events)
                if error is not None:
                    out.outcome, out.detail = error, "error event"
                    if not answer.events or answer.events[-1][1] != b"[DONE]":
                        out.outcome, out.detail = "lost", "stream error without [DONE]"
                    return out
                self.check_stream(answer, body, prompt_len, chat, out, started)
            else:
                self.check_complete(answer.json(), body, prompt_len, chat)
        except (Check, KeyError, TypeError, ValueError, IndexError) as exc:
            out.outcome, out.detail = "wrong", f"{type(exc).__name__}: {exc}"
        return out

    def expect_usage(self, usage: dict, body: dict, prompt_len: int | None) -> None:
        n = body.get("n", 1)
        if prompt_len is not None and usage["prompt_tokens"] != prompt_len:
            raise Check(f"prompt_tokens {usage['prompt_tokens']} != {prompt_len}")
        if usage["prompt_tokens"] <= 0:
            raise Check("prompt_tokens <= 0")
        if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
            raise Check("total_tokens != prompt + completion")
        limit = n * body["max_tokens"]
        if usage["completion_tokens"] > limit or (
            "stop" not in body and usage["completion_tokens"] != limit
        ):
            raise Check(f"completion_tokens {usage['completion_tokens']} vs {limit} (n={n})")

    def check_choice_end(self, reason: Any, text: str, body: dict) -> None:
        if "stop" not in body:
            if reason != "length":
                raise Check(f"finish_reason {reason!r} with ignore_eos and no stop")
        elif reason not in ("stop", "length"):
            raise Check(f"finish_reason {reason!r}")
        elif reason == "stop" and body["stop"][0] in text:
            raise Check("the stop string is in the output")

    def check_complete(self, data: dict, body: dict, prompt_len: int | None, chat: bool) -> None:
        choices = data["choices"]
        n = body.get("n", 1)
        if sorted(c["index"] for c in choices) != list(range(n)):
            raise Check(f"choice indexes {[c['index'] for c in choices]} for n={n}")
        counted = 0
        for c in choices:
            text = c["message"]["content"] if chat else c["text"]
            self.check_choice_end(c["finish_reason"], text, body)
            if body.get("logprobs") not in (None, False):
                lp = c["logprobs"]
                counted += len(lp["content"]) if chat else len(lp["tokens"])
        self.expect_usage(data["usage"], body, prompt_len)
        if (
            body.get("logprobs") not in (None, False)
            and counted != data["usage"]["completion_tokens"]
        ):
            raise Check(f"{counted} logprobs for {data['usage']['completion_tokens']} tokens")

    def check_stream(
        self, answer: Answer, body: dict, prompt_len: int | None, chat: bool, out, started
    ) -> None:
        events = answer.events
        if not events or events[-1][1] != b"[DONE]":
            raise Lost("the stream ended without [DONE]")
        n = body.get("n", 1)
        texts: dict[int, str] = {}
        reasons: dict[int, Any] = {}
        usage = None
        first = last = None
        # TTFT: a completions stream sends a chunk for every step that brings tokens, its
        # text empty while the detokenizer holds it back (as vLLM's, whose benchmark times
        # the first chunk with a choice, empty text or not): its first chunk is the first
        # token. A chat stream's role chunk comes before any token: there the first content.
        token_chunks = not chat and not body.get("echo")
        for t, data in events[:-1]:
            chunk = orjson.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                if piece or (token_chunks and c["finish_reason"] is None):
                    first = first or t
                    last = t
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c["finish_reason"] is not None:
                    if c["index"] in reasons:
                        raise Check(f"choice {c['index']} finished twice")
                    reasons[c["index"]] = c["finish_reason"]
        if sorted(reasons) != list(range(n)):
            raise Check(f"finished choices {sorted(reasons)} for n={n}")
        for i, reason in reasons.items():
            self.check_choice_end(reason, texts.get(i, ""), body)
        if usage is None:
            raise Check("no usage chunk")
        self.expect_usage(usage, body, prompt_len)
        if first is not None:
            out.ttft_s = first - started
            per_choice = usage["completion_tokens"] / n
            if last is not None and per_choice > 1:
                out.tpot_s = (last - first) / (per_choice - 1)

    async def leave_early(self, timeout: bool) -> Outcome:
        """A stream the client abandons: after a few events, or after a short timeout."""
        body = {
            "model": self.model,
            "prompt": self.token_prompt(self.rng.randint(1, 64)),
            "max_tokens": self.args.max_tokens * 4,
            "ignore_eos": True,
            "stream": True,
        }
        kind = "client_timeout" if timeout else "disconnect"
        out = Outcome(kind, "abandoned", started=time.monotonic())
        try:
            if timeout:
                answer = await self.post(
                    "/v1/completions", body, timeout_s=self.rng.uniform(0.05, 0.5)
                )
            else:
                answer = await self.post(
                    "/v1/completions", body, stop_after_events=self.rng.randint(1, 4)
                )
        except Lost:
            return out  # what a client that gives up sees
        if answer.status != 200:
            out.outcome = self.classify_error(answer, False, True)
            out.detail = answer.body[:200].decode(errors="replace")
        elif timeout:  # done within the timeout: it must be complete
            error = self.stream_error(answer.events)
            if error is not None:
                out.outcome = error
            elif not answer.events or answer.events[-1][1] != b"[DONE]":
                out.outcome = "lost"
        return out

    async def bad_request(self) -> Outcome:
        """A request that must be refused with a 4xx and an OpenAI-shaped body."""
        which = self.rng.choice(
            ["malformed", "types", "huge", "model", "too_long", "n", "field", "empty"]
        )
        p = self.token_prompt(4)
        bodies: dict[str, Any] = {
            "malformed": b'{"prompt": "hi", "max_tokens": ',
            "types": {"model": self.model, "prompt": p, "max_tokens": "many"},
            "huge": b'{"prompt": "' + b"a" * (self.args.huge_body_mb * 2**20) + b'"}',
            "model": {"model": "no-such-model", "prompt": p, "max_tokens": 2},
            "too_long": {"model": self.model, "prompt": p, "max_tokens": self.max_model_len},
            "n": {"model": self.model, "prompt": p, "max_tokens": 2, "n": 10_000},
            "field": {"model": self.model, "prompt": p, "max_tokens": 2, "no_such_field": 1},
            "empty": {"model": self.model, "prompt": "", "max_tokens": 2},
        }
        started = time.monotonic()
        answer = await self.post("/v1/completions", bodies[which], timeout_s=30)
        out = Outcome(f"bad_{which}", "rejected", started=started)
        if answer.status == 200 or answer.status >= 500:
            out.outcome = (
                "wrong" if answer.status == 200 else self.classify_error(answer, True, False)
            )
            out.detail = f"status {answer.status}: {answer.body[:200]!r}"
            return out
        out.outcome = self.classify_error(answer, True, False)
        if which == "too_long" and answer.json()["error"]["code"] != "context_length_exceeded":
            out.outcome, out.detail = "wrong", "too_long without context_length_exceeded"
        return out

    async def burst(self) -> list[Outcome]:
        """Many short requests at once: past --max-waiting-requests some get 503 overloaded."""

        async def one() -> Outcome:
            body = {
                "model": self.model,
                "prompt": self.token_prompt(8),
                "max_tokens": 4,
                "ignore_eos": True,
            }
            started = time.monotonic()
            answer = await self.post("/v1/completions", body, timeout_s=self.args.request_timeout)
            out = Outcome("burst", "ok", started=started)
            if answer.status != 200:
                out.outcome = self.classify_error(answer, False, True)
                out.detail = answer.body[:200].decode(errors="replace")
            else:
                try:
                    self.check_complete(answer.json(), body, 8, chat=False)
                except (Check, KeyError, TypeError, ValueError) as exc:
                    out.outcome, out.detail = "wrong", str(exc)
            return out

        return list(
            await asyncio.gather(*(self.guard("burst", one()) for _ in range(self.args.burst_size)))
        )

    async def guard(self, kind: str, coro) -> Outcome:
        """Run one request; an exception (no answer) makes it lost."""
        started = time.monotonic()
        try:
            return await coro
        except Lost as exc:
            return Outcome(kind, "lost", str(exc), started)

    async def one(self) -> Outcome:
        kinds = {
            "completion": 18,
            "completion_stream": 18,
            "chat": 10,
            "chat_stream": 14,
            "long": 10,
            "long_stream": 6,
            "disconnect": 8,
            "client_timeout": 4,
            "bad": 12,
        }
        kind = self.rng.choices(list(kinds), weights=list(kinds.values()))[0]
        coro = {
            "completion": lambda: self.completion(False),
            "completion_stream": lambda: self.completion(True),
            "chat": lambda: self.chat(False),
            "chat_stream": lambda: self.chat(True),
            "long": lambda: self.completion(False, long=True),
            "long_stream": lambda: self.completion(True, long=True),
            "disconnect": lambda: self.leave_early(False),
            "client_timeout": lambda: self.leave_early(True),
            "bad": self.bad_request,
        }[kind]()
        return await self.guard(kind, coro)

    async def run(self, deadline: float, on_warm: Any) -> None:
        """Load until ``deadline``, and past it (up to three durations more) until
        ``--min-requests`` have been made: a slow machine does the same work, not less."""
        hard_deadline = deadline + 3 * self.args.duration

        def going(margin: float = 0.0) -> bool:
            now = time.monotonic() + margin
            if now < deadline:
                return True
            return len(self.outcomes) < self.args.min_requests and now < hard_deadline

        async def worker() -> None:
            while going():
                self.outcomes.append(await self.one())

        async def bursts() -> None:
            while True:
                await asyncio.sleep(self.args.burst_every)
                if not going(margin=5):
                    return
                self.outcomes.extend(await self.burst())

        async def warm() -> None:
            await asyncio.sleep(self.args.warmup)
            on_warm()

        await asyncio.gather(bursts(), warm(), *(worker() for _ in range(self.args.concurrency)))

    # -- the end: idle, pages, metrics ------------------------------------------------------
    async def idle_flush(self, timeout_s: float = 60.0) -> dict:
        """Wait until the engine is idle, then flush the radix tree and count the pages."""
        deadline = time.monotonic() + timeout_s
        last: dict = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(Lost):
                answer = await self.post("/debug/flush_cache", b"", timeout_s=30)
                if answer.status == 200:
                    last = answer.json()
                    if last["idle"]:
                        return last
                else:
                    last = {"status": answer.status, "body": answer.body[:300].decode()}
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the engine did not become idle: {last}")

    async def metrics(self) -> dict[str, float]:
        text = (await self.get("/metrics")).body.decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                with contextlib.suppress(ValueError):
                    values[name] = float(value)
        return values


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(values)
    return {f"p{q}": round(s[min(len(s) - 1, int(q / 100 * len(s)))], 4) for q in (50, 90, 99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ)
    if args.faults:
        env["RADIXSERVE_FAULTS"] = args.faults
    cmd = [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-debug-endpoints",
        *args.serve_args,
    ]
    print(
        "soak: launching",
        " ".join(cmd),
        f"(RADIXSERVE_FAULTS={args.faults or ''})",
        file=sys.stderr,
    )
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during startup (code {proc.returncode})")
        with contextlib.suppress(Lost, OSError):
            answer = asyncio.run(http("127.0.0.1", port, "GET", "/health", timeout_s=2))
            if answer.status == 200:
                return proc, port
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not start in time")


async def soak_main(args: argparse.Namespace, host: str, port: int) -> dict:
    soak = Soak(args, host, port)
    await soak.setup()
    info = (await soak.get("/debug/engine")).json()
    server_pid, engine_pid = info["server_pid"], info["engine_pid"]
    rss: dict[str, dict[str, int | None]] = {
        "start": {"server": rss_bytes(server_pid), "engine": rss_bytes(engine_pid)}
    }
    engine_pid_now = [engine_pid]  # the engine pid changes on a restart
    warm_engine_pid = engine_pid

    def on_warm() -> None:
        nonlocal warm_engine_pid
        warm_engine_pid = engine_pid_now[0]
        rss["warm"] = {"server": rss_bytes(server_pid), "engine": rss_bytes(warm_engine_pid)}

    async def track_engine() -> None:
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(Lost, KeyError, ValueError):
                engine_pid_now[0] = (await soak.get("/debug/engine")).json()["engine_pid"]

    started = time.monotonic()
    tracker = asyncio.create_task(track_engine())
    await soak.run(started + args.duration, on_warm)
    wall = time.monotonic() - started
    tracker.cancel()
    flush = await soak.idle_flush()
    info = (await soak.get("/debug/engine")).json()
    metrics = await soak.metrics()
    rss["end"] = {"server": rss_bytes(server_pid), "engine": rss_bytes(info["engine_pid"])}
    warm = rss.get("warm", rss["start"])
    growth: dict[str, float | None] = {"server": None, "engine": None}
    if warm["server"] and rss["end"]["server"]:
        growth["server"] = rss["end"]["server"] / warm["server"] - 1
    if info["engine_pid"] == warm_engine_pid and warm["engine"] and rss["end"]["engine"]:
        growth["engine"] = rss["end"]["engine"] / warm["engine"] - 1
    measured = [g for g in growth.values() if g is not None]

    outcomes = soak.outcomes
    counts = Counter(o.outcome for o in outcomes)
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.outcome] += 1
    windows = []
    step = max(wall / args.windows, 1e-9)
    for w in range(args.windows):
        inside = [o for o in outcomes if w * step <= o.started - started < (w + 1) * step]
        windows.append(
            {
                "t_s": round((w + 1) * step, 1),
                "requests": len(inside),
                "ttft_s": percentiles([o.ttft_s for o in inside if o.ttft_s is not None]),
                "tpot_s": percentiles([o.tpot_s for o in inside if o.tpot_s is not None]),
            }
        )
    bad = [o for o in outcomes if o.outcome in ("lost", "unexpected_5xx", "wrong")]
    return {
        "requests": len(outcomes),
        "lost": counts["lost"],
        "unexpected_5xx": counts["unexpected_5xx"],
        "wrong": counts["wrong"],
        "rss_growth_frac": round(max(measured), 4) if measured else None,
        "pages_leaked": flush["pages_leaked"],
        "page_check_error": flush["error"],
        "kv_pages_total": flush["kv_pages_total"],
        "outcomes": {k: counts[k] for k in OUTCOMES},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "rss_bytes": rss,
        "rss_growth": {k: None if v is None else round(v, 4) for k, v in growth.items()},
        "engine_restarts": metrics.get("radixserve_engine_restarts_total", 0),
        "engine_hangs": metrics.get("radixserve_engine_hangs_total", 0),
        "preemptions": metrics.get("radixserve_num_preemptions_total", 0),
        "faults": args.faults or None,
        "duration_s": round(wall, 1),
        "ttft_s": percentiles([o.ttft_s for o in outcomes if o.ttft_s is not None]),
        "tpot_s": percentiles([o.tpot_s for o in outcomes if o.tpot_s is not None]),
        "windows": windows,
        "examples": [f"{o.kind}: {o.outcome}: {o.detail}" for o in bad[:10]],
    }


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server (else one is launched)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="go on past --duration (up to 3 durations more) until this many requests ran",
    )
    parser.add_argument("--quick", action="store_true", help="90 s (CI)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients in a loop")
    parser.add_argument("--max-tokens", type=int, default=24, help="most tokens per request")
    parser.add_argument("--burst-every", type=float, default=10.0, help="seconds between bursts")
    parser.add_argument("--burst-size", type=int, default=48, help="requests per burst")
    parser.add_argument("--huge-body-mb", type=int, default=9, help="a body over the limit")
    parser.add_argument("--warmup", type=float, default=None, help="seconds (default 1/3)")
    parser.add_argument("--windows", type=int, default=4, help="TTFT/TPOT time windows")
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--faults",
        default="",
        help="RADIXSERVE_FAULTS for the launched server (see radixserve/engine/faults.py)",
    )
    parser.add_argument(
        "--expect-faults",
        action="store_true",
        help="with --url: the server injects faults (their 5xx are expected)",
    )


def normalize_args(args: argparse.Namespace) -> argparse.Namespace:
    """What every soak (this one, ``tenant_soak``, ``router_soak``) reads the same way:
    ``--quick`` is 90 s, the ``--`` before the serve flags is dropped."""
    if args.quick:
        args.duration = 90.0
    if args.serve_args and args.serve_args[0] == "--":
        args.serve_args = args.serve_args[1:]
    return args


def run_soak(args: argparse.Namespace) -> int:
    """The soak-and-chaos run (``args`` through ``normalize_args``); ``radixserve soak``
    (``cli.py``) sends ``--tenants`` and ``--router`` to their own modules."""
    if args.warmup is None:
        args.warmup = args.duration / 3
    if args.faults:
        from radixserve.engine.faults import parse_faults

        parse_faults(args.faults)  # ValueError: a clear message before anything starts
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so a launched server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc = None
    if args.url is None:
        proc, port = launch(args)
        host = "127.0.0.1"
    else:
        from urllib.parse import urlsplit

        parts = urlsplit(args.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
    try:
        report = asyncio.run(soak_main(args, host, port))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    for name, value in report["outcomes"].items():
        print(f"{name:>16}  {value}")
    for w in report["windows"]:
        print(
            f"t<={w['t_s']:>7}s  {w['requests']:>5} requests  ttft {w['ttft_s']}  tpot {w['tpot_s']}"
        )
    for line in report["examples"]:
        print("  !", line)
    print(json.dumps(report))
    growth = report["rss_growth_frac"]
    failed = (
        report["lost"]
        or report["unexpected_5xx"]
        or report["wrong"]
        or report["pages_leaked"]
        or report["page_check_error"]
        or (growth is not None and growth > args.max_rss_growth)
    )
    return 1 if failed else 0
