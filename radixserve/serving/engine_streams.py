"""The request streams of one engine: send requests, route what the engine sends back to
the coroutine waiting for it, detokenize, answer queries. Where the engine runs and how it
is kept running (``engine_client.py``) is apart from this."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve.core.request import EngineRequest
from radixserve.engine.output_processor import RequestOutputProcessor
from radixserve.serving import protocol as p
from radixserve.serving.request_tracker import RequestTracker
from radixserve.serving.supervisor import ProgressWatch

# messages taken from the engine per wake-up beyond the awaited one (the loop's other work
# runs in between)
_DRAIN_MAX = 256

logger = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine cannot answer: it died, hangs, or is being restarted (``code`` says
    which, for the API's error body)."""

    def __init__(self, message: str, code: str = "engine_dead") -> None:
        super().__init__(message)
        self.code = code


class RequestRejected(ValueError):
    def __init__(self, message: str, overloaded: bool = False) -> None:
        super().__init__(message)
        self.overloaded = overloaded


class _Mailbox:
    """What the engine sent one request, for the one coroutine that reads it. Invariants:
    items come out in the order they were put; ``put_nowait`` never blocks; at most one
    reader waits at a time. (Lighter than ``asyncio.Queue``: a delta per token per request
    goes through it.)"""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Return once there is an item."""
        while not self._items:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def take_all(self) -> list[Any]:
        """Every item there is (maybe none), in order."""
        items = list(self._items)
        self._items.clear()
        return items


@dataclass
class _Pending:
    queue: _Mailbox = field(default_factory=_Mailbox)
    remaining: int = 1  # samples not finished yet (as the caller has consumed them)
    owed: int = 1  # samples the engine has not sent a finished delta for yet


class RequestStreams:
    """Every request and query in flight to one engine, and the engine's messages back.

    Invariants: every request sent gets exactly one terminal item on its mailbox — its
    samples' finished deltas, a ``Rejected``, or the ``EngineDead`` of ``_fail_all``;
    ``_owed`` is the number of samples the engine still owes a finished delta (the engine
    has work while it is above 0); everything ``_send`` queues in one event-loop turn
    leaves as one message on the current ``_push`` socket. The owner (``EngineProcessClient``)
    says whether the engine can take work (``alive``, ``_error``, ``_engine_up``) and sets
    ``_push`` for each engine it starts."""

    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: the model's (Rust) tokenizer, for detokenizing outputs here."""
        self.tokenizer = tokenizer
        self._push: zmq.Socket | None = None
        self._pending: dict[str, _Pending] = {}
        self._owed = 0  # sum of the pending requests' ``owed``: the engine has work
        self._outgoing: list[p.ToEngine] = []  # sent together at the end of this loop turn
        self._queries: dict[int, asyncio.Future] = {}  # radix summaries, cache flushes
        self._query_ids = itertools.count()
        self._fresh_ready: p.Ready | None = None
        self._watch = ProgressWatch()
        self.tracker = RequestTracker()  # recent requests' timings, for /v1/engine/stats
        self.stats: p.EngineStats | None = None

    # what the owner says about the engine
    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _error(self) -> Exception:
        """The error a request meets while the engine cannot take it."""
        raise NotImplementedError

    def _engine_up(self) -> bool:
        """Whether an engine is running that a send not yet connected will reach."""
        raise NotImplementedError

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[p.Delta]:
        """Yield the deltas of the request's samples, with their text, until all have
        finished (a pooling request: one finished delta with ``embedding``). Cancelling
        (client gone) aborts the request in the engine."""
        batches = self.generate_batches(request)
        try:
            async for batch in batches:
                for delta in batch:
                    yield delta
        finally:
            await batches.aclose()  # (left early: the request is aborted in the engine)

    async def generate_batches(self, request: EngineRequest) -> AsyncIterator[list[p.Delta]]:
        """As ``generate``, but each item is every delta that had arrived by the time the
        caller asked for more (one or more, in order): a caller slower than the engine (a
        gRPC stream waiting on its writes) takes them in one go instead of one per turn."""
        outputs, pending = self._start(request)
        finished = False
        try:
            while pending.remaining:
                batch, error = self._deltas(request.request_id, outputs, pending)
                if batch:
                    yield batch
                if error is not None:
                    finished = True
                    raise error
                if pending.remaining:
                    await pending.queue.wait()
            finished = True
        finally:
            self._end(request.request_id, finished)

    def _deltas(
        self, request_id: str, outputs: RequestOutputProcessor, pending: _Pending
    ) -> tuple[list[p.Delta], BaseException | None]:
        """The deltas made of everything the engine has sent the request so far, and the
        error that ended it, if one did."""
        batch: list[p.Delta] = []
        for item in pending.queue.take_all():
            if isinstance(item, BaseException):
                return batch, item
            delta, stopped_here = outputs.process(item)
            if delta is None:
                continue
            if stopped_here:  # a stop string ended this sample: the engine can let go
                self._send(p.AbortRequest(request_id, delta.index))
            self.tracker.observe(delta)
            if delta.finished:
                pending.remaining -= 1
            batch.append(delta)
        return batch, None

    def _end(self, request_id: str, finished: bool) -> None:
        """The caller is done with ``request_id``; unless it finished, the engine aborts it."""
        self.tracker.close(request_id)
        self._forget(request_id)
        if not finished and self.alive:
            self._send(p.AbortRequest(request_id))

    def _start(self, request: EngineRequest) -> tuple[RequestOutputProcessor, _Pending]:
        """Register the request (and with the tracker) and send it to the engine."""
        if not self.alive:
            raise self._error()
        request_id, prompt_token_ids, params = (
            request.request_id,
            request.prompt_token_ids,
            request.params,
        )
        n = params.n
        outputs = RequestOutputProcessor(self.tokenizer, prompt_token_ids, params, n)
        pending = _Pending(remaining=n, owed=n)
        if self._owed == 0 and not self._watch.engine_busy:
            self._watch.work_started()  # the hang clock starts with the engine's work
        self._owed += n
        self._pending[request_id] = pending
        self._send(p.GenerateRequest(request))
        self.tracker.start(request_id, len(prompt_token_ids), n)
        return outputs, pending

    def _forget(self, request_id: str) -> None:
        """The caller is done with ``request_id``: whatever the engine still owes it is
        no longer waited for."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._owed -= pending.owed
            pending.owed = 0

    def abort(self, request_id: str) -> bool:
        """Abort a running request in the engine: its samples end with reason "abort".
        False if no request of that id is running here."""
        if request_id not in self._pending or not self.alive:
            return False
        self._send(p.AbortRequest(request_id))
        return True

    async def radix_summary(
        self, max_nodes: int = 256, max_depth: int = 8, timeout_s: float = 10.0
    ) -> p.RadixSummary:
        """A bounded summary of the engine's radix tree (built between two engine steps)."""
        answer = await self._query(
            lambda qid: p.RadixQuery(qid, max_nodes, max_depth), "the radix query", timeout_s
        )
        assert isinstance(answer, p.RadixSummary)
        return answer

    async def flush_cache(self, timeout_s: float = 10.0) -> p.CacheFlushed:
        """If the engine is idle: check its page accounting, empty the radix tree, and say
        how many KV pages are free of how many (all of them, unless pages leaked)."""
        answer = await self._query(p.FlushCache, "the cache flush", timeout_s)
        assert isinstance(answer, p.CacheFlushed)
        return answer

    async def lora_control(
        self, name: str, path: str | None, timeout_s: float = 60.0
    ) -> p.LoRAAnswer:
        """Load adapter ``name`` from ``path`` in the engine (between two steps), or unload
        it (``path`` None)."""
        answer = await self._query(
            lambda qid: p.LoRAControl(qid, name, path), "the LoRA adapter change", timeout_s
        )
        assert isinstance(answer, p.LoRAAnswer)
        return answer

    async def _query(self, make: Any, what: str, timeout_s: float) -> Any:
        """Send ``make(query_id)`` and wait for the engine's answer with that id."""
        if not self.alive:
            raise self._error()
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        self._send(make(query_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise EngineDead(f"the engine did not answer {what} in time") from None
        finally:
            self._queries.pop(query_id, None)

    def _send(self, msg: p.ToEngine) -> None:
        """Queue ``msg``; everything queued in one event-loop turn leaves as one message."""
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(msg)

    def _flush(self) -> None:
        batch, self._outgoing = self._outgoing, []
        push = self._push
        if batch and push is not None and not push.closed:
            try:
                push.send(p.encoder.encode(batch), zmq.NOBLOCK)
            except zmq.Again:
                # No engine connected: one just starting (its end of the socket is still
                # connecting) gets the messages in a moment, in order; a dead one's requests
                # fail anyway.
                if self._engine_up():
                    self._outgoing[:0] = batch
                    asyncio.get_running_loop().call_later(0.005, self._flush)
                else:
                    logger.warning("no engine process to send %d messages to", len(batch))

    # -- background tasks -----------------------------------------------------------------
    async def _receive_loop(self, pull: zmq.asyncio.Socket) -> None:
        # One awaited receive per wake-up, then whatever else has already arrived is taken
        # through a plain (shadow) socket: an engine faster than the frontend sends many
        # small messages, and an awaited receive costs a future and several event-state
        # checks each. The next awaited receive checks the socket's events itself, so
        # draining it here loses no wake-up.
        drain = zmq.Socket.shadow(pull.underlying)
        decode = p.from_engine_decoder.decode
        while True:
            raw = await pull.recv()
            self._dispatch(decode(raw))
            for _ in range(_DRAIN_MAX):
                try:
                    raw = drain.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._dispatch(decode(raw))

    def _dispatch(self, msg: p.FromEngine) -> None:
        if isinstance(msg, p.Outputs):
            stats = msg.stats
            self.stats = stats or self.stats
            for delta in msg.deltas:
                pending = self._pending.get(delta.request_id)
                if pending is not None:
                    pending.queue.put_nowait(delta)
                    if delta.finished:
                        pending.owed -= 1
                        self._owed -= 1
            if stats is not None:
                self._watch.heard(stats.steps, bool(msg.deltas), stats.running + stats.waiting > 0)
            else:
                self._watch.heard(None, bool(msg.deltas), None)
        elif isinstance(msg, p.Heartbeat):
            stats = self.stats = msg.stats
            self._watch.heard(stats.steps, False, stats.running + stats.waiting > 0)
        elif isinstance(msg, p.Rejected):
            self._watch.heard(None, False, None)
            pending = self._pending.get(msg.request_id)
            if pending is not None:
                pending.queue.put_nowait(RequestRejected(msg.message, msg.overloaded))
                self._owed -= pending.owed
                pending.owed = 0
        elif isinstance(msg, p.RadixSummary | p.CacheFlushed | p.LoRAAnswer):
            self._watch.heard(None, False, None)
            future = self._queries.get(msg.query_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, p.Ready):
            self._fresh_ready = msg

    def _fail_all(self, error: EngineDead) -> None:
        """End every request and query in flight with ``error``."""
        for pending in self._pending.values():  # one exception each: raised in its own task
            pending.queue.put_nowait(EngineDead(str(error), error.code))
            pending.owed = 0
        self._pending.clear()
        self._owed = 0
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EngineDead(str(error), error.code))
