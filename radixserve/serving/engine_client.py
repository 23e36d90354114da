"""The frontend's handle on one engine process: spawn it, send requests, route outputs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve.core.request import EngineRequest
from radixserve.engine.config import EngineConfig
from radixserve.serving import protocol as p
from radixserve.serving.output_processor import RequestOutputProcessor
from radixserve.serving.request_tracker import RequestTracker
from radixserve.serving.supervisor import (
    ProgressWatch,
    RestartBackoff,
    SupervisorConfig,
    describe_exit,
)

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


class EngineProcessClient:
    """Owns the engine process and its two ZMQ ``ipc://`` sockets in a private directory,
    and keeps the engine serving (``supervisor.py``): a process that dies, or hangs with
    work in flight past the hang timeout, is replaced by a new one with the same config.

    Invariants: every request sent gets exactly one terminal item on its queue — its
    samples' finished deltas, a ``Rejected``, or ``EngineDead`` if the engine dies, hangs
    or is restarting; each engine process gets fresh sockets (nothing of a dead one reaches
    its successor); ``alive`` exactly when ``unhealthy_reason()`` is None: state
    "running", the process up, and not stalled (``ProgressWatch``).
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        startup_timeout_s: float = 600.0,
        supervision: SupervisorConfig | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``tokenizer``: the model's (Rust) tokenizer, for detokenizing outputs here.
        ``env``: the engine process's environment (None: this process's)."""
        self.config = config
        self.env = env
        self.tokenizer = tokenizer
        self.startup_timeout_s = startup_timeout_s
        self.supervision = supervision or SupervisorConfig()
        self._dir = tempfile.mkdtemp(prefix="radixserve-")
        os.chmod(self._dir, 0o700)
        self._ctx = zmq.asyncio.Context()
        # Sending is a plain (synchronous) socket: a PUSH to an ipc peer queues and returns
        # at once, without the asyncio wrapper's per-call future bookkeeping.
        self._sync_ctx = zmq.Context()
        self._push: zmq.Socket | None = None  # both made per engine process (_spawn)
        self._pull: zmq.asyncio.Socket | None = None
        self._pending: dict[str, _Pending] = {}
        self._owed = 0  # sum of the pending requests' ``owed``: the engine has work
        self._outgoing: list[p.ToEngine] = []  # sent together at the end of this loop turn
        self._queries: dict[int, asyncio.Future] = {}  # radix summaries, cache flushes
        self._query_ids = itertools.count()
        self._receiver: asyncio.Task | None = None
        self._supervisor: asyncio.Task | None = None
        self._generation = 0  # engine processes started
        self._fresh_ready: p.Ready | None = None
        self._ready_at = 0.0
        self._closing = False
        self._watch = ProgressWatch()
        self._backoff = RestartBackoff(self.supervision)
        self.tracker = RequestTracker()  # recent requests' timings, for /v1/engine/stats
        self.process: subprocess.Popen | None = None
        self.ready: p.Ready | None = None
        self.stats: p.EngineStats | None = None
        self.state = "stopped"  # starting | running | hung | restarting | dead
        self.reason: str | None = None  # why it is not running
        self.restarts = self.deaths = self.hangs = 0

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process, wait until it has loaded the model, and watch it."""
        self.state = "starting"
        try:
            await self._spawn()
        except EngineDead as exc:
            self.state, self.reason = "dead", str(exc)
            raise
        self.state = "running"
        self._supervisor = asyncio.create_task(self._supervise())

    async def _spawn(self) -> None:
        """Fresh sockets, then ``python -m radixserve.serving.engine_process`` (config as JSON:
        no pickle); returns once it is ready. ``EngineDead`` if it exits or takes longer
        than the startup timeout (then it is killed)."""
        await self._stop_receiver()
        self._close_sockets()
        self._generation += 1
        inbox = f"ipc://{self._dir}/to-engine-{self._generation}"
        outbox = f"ipc://{self._dir}/from-engine-{self._generation}"
        self._push = self._sync_ctx.socket(zmq.PUSH)
        # no high-water mark: a send fails (zmq.Again) only when no engine is connected
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.bind(inbox)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(outbox)
        self._outgoing.clear()
        self._fresh_ready = None
        self.process = process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve.serving.engine_process",
                json.dumps(dataclasses.asdict(self.config)),
                inbox,
                outbox,
            ],
            stdin=subprocess.DEVNULL,
            env=self.env,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while self._fresh_ready is None:
            if process.poll() is not None:
                raise EngineDead(
                    "the engine process exited during startup "
                    f"({describe_exit(process.returncode)})"
                )
            if time.monotonic() > deadline:
                await self._kill(process)
                raise EngineDead("the engine did not start in time")
            if await self._pull.poll(200):
                self._dispatch(p.from_engine_decoder.decode(await self._pull.recv()))
        self.ready = self._fresh_ready
        self._watch.reset()
        self._ready_at = time.monotonic()
        self._receiver = asyncio.create_task(self._receive_loop(self._pull))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        await self._stop_receiver()
        if self.state == "hung" and self.process is not None:
            await self._kill(self.process)  # a hung loop would not see SIGTERM
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, timeout_s)
            except subprocess.TimeoutExpired:
                await self._kill(self.process)
        self.state, self.reason = "stopped", "the server is shutting down"
        self._fail_all(EngineDead("the engine was stopped (server shutdown)"))
        self._close_sockets()
        self._sync_ctx.term()
        self._ctx.term()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)

    async def _stop_receiver(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
            self._receiver = None

    def _close_sockets(self) -> None:
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._push = self._pull = None

    @staticmethod
    async def _kill(process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait, 10)

    @property
    def alive(self) -> bool:
        return self.unhealthy_reason() is None

    @property
    def dead(self) -> bool:
        """Given up on: stopped, or not restartable after a death."""
        return self.state in ("dead", "stopped")

    def unhealthy_reason(self) -> str | None:
        """Why the engine cannot take requests now (for ``/health``), or None."""
        if self.state != "running":
            return self.reason or f"the engine is {self.state}"
        if self.process is None or self.process.poll() is not None:
            return "the engine process has exited"
        return self._watch.hang_reason(self._owed > 0, self.supervision.hang_timeout_s)

    def _error(self) -> EngineDead:
        """The error a request meets while the engine is not running."""
        reason = self.unhealthy_reason() or "the engine is not running"
        code = {"restarting": "engine_restarting", "hung": "engine_hung"}.get(
            self.state, "engine_dead"
        )
        if self.state == "running":  # not yet acted on: exited, or stalled
            exited = self.process is None or self.process.poll() is not None
            code = "engine_dead" if exited else "engine_hung"
        return EngineDead(reason, code)

    # -- supervision ----------------------------------------------------------------------
    async def _supervise(self) -> None:
        """Every 0.1 s: a dead process is replaced; a hung one (no progress with work in
        flight past the hang timeout) fails its requests and is killed and replaced (or,
        without restarts, stays "hung" until it makes progress again)."""
        while self.state != "dead":
            before = time.monotonic()
            await asyncio.sleep(0.1)
            # this loop was held up (the frontend was busy): what the engine sent meanwhile
            # has not been read yet, so its silence proves nothing this round
            lagging = time.monotonic() - before > 1.0
            try:
                await self._check(lagging)
            except Exception:  # keep watching whatever one check ran into
                logger.exception("engine supervision check failed")

    async def _check(self, lagging: bool = False) -> None:
        process = self.process
        assert process is not None
        if process.poll() is not None:
            if self.state in ("running", "hung"):
                self.deaths += 1
                why = f"the engine process died ({describe_exit(process.returncode)})"
                await self._recover(why, "engine_dead")
            return
        timeout = self.supervision.hang_timeout_s
        reason = self._watch.hang_reason(self._owed > 0, timeout) if timeout else None
        if reason is not None and self.state == "running":
            pull = self._pull
            if lagging or (pull is not None and await pull.poll(0)):
                return  # messages are waiting to be read: the engine is not silent
        if self.state == "hung" and reason is None:
            logger.warning("the engine makes progress again")
            self.state, self.reason = "running", None
        elif self.state == "running" and reason is not None:
            self.hangs += 1
            if self.supervision.restart:
                await self._recover(reason, "engine_hung")
            else:
                logger.error("%s; failing its requests (not restarting it)", reason)
                self.state, self.reason = "hung", reason
                for request_id in self._pending:  # let the engine drop them if it recovers
                    self._send(p.AbortRequest(request_id))
                self._fail_all(EngineDead(reason, "engine_hung"))

    async def _recover(self, why: str, code: str) -> None:
        """Fail what is in flight, make sure the old process is gone, start a new one
        (after the backoff; up to ``max_restart_attempts`` failed starts in a row)."""
        uptime: float | None = time.monotonic() - self._ready_at
        restart = self.supervision.restart and not self._closing
        self.reason = why
        self.state = "restarting" if restart else "dead"
        logger.error("%s; %s", why, "restarting it" if restart else "not restarting it")
        self._fail_all(EngineDead(f"{why}; {'restarting it' if restart else 'it is down'}", code))
        assert self.process is not None
        await self._kill(self.process)
        if not restart:
            return
        for attempt in range(1, self.supervision.max_restart_attempts + 1):
            await asyncio.sleep(self._backoff.next_delay(uptime))
            uptime = None
            try:
                await self._spawn()
            except EngineDead as exc:
                self.reason = f"{why}; restart attempt {attempt} failed: {exc}"
                logger.error("%s", self.reason)
                continue
            self.restarts += 1
            self.state, self.reason = "running", None
            logger.warning("engine restarted (restart %d)", self.restarts)
            return
        self.state = "dead"
        self.reason = (
            f"{why}; gave up after {self.supervision.max_restart_attempts} failed restarts"
        )
        logger.error("%s", self.reason)

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[p.Delta]:
        """Yield the deltas of the request's samples, with their text, until all have
        finished (a pooling request: one finished delta with ``embedding``). Cancelling
        (client gone) aborts the request in the engine."""
        outputs, pending = self._start(request)
        finished = False
        try:
            while pending.remaining:
                batch, error = self._deltas(request.request_id, outputs, pending)
                for delta in batch:
                    yield delta
                if error is not None:
                    finished = True
                    raise error
                if pending.remaining:
                    await pending.queue.wait()
            finished = True
        finally:
            self._end(request.request_id, finished)

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
                if self.state == "running" and self.process and self.process.poll() is None:
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
        elif isinstance(msg, p.RadixSummary | p.CacheFlushed):
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
