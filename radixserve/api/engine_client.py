"""The frontend's handle on the engine process: spawn it, send requests, route outputs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
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

from radixserve.api import protocol as p
from radixserve.api.output_processor import RequestOutputProcessor
from radixserve.api.request_tracker import RequestTracker
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig


class EngineDead(RuntimeError):
    pass


class RequestRejected(ValueError):
    def __init__(self, message: str, overloaded: bool = False) -> None:
        super().__init__(message)
        self.overloaded = overloaded


@dataclass
class _Pending:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    remaining: int = 1  # samples not finished yet


class EngineClient:
    """Owns the engine process and its two ZMQ ``ipc://`` sockets in a private directory.

    Invariants: every request sent gets exactly one terminal item on its queue — its
    samples' finished deltas, a ``Rejected``, or ``EngineDead`` if the process dies; the
    engine is "alive" while the process runs and its heartbeats are recent.
    """

    def __init__(
        self, config: EngineConfig, tokenizer: Any, startup_timeout_s: float = 600.0
    ) -> None:
        """``tokenizer``: the model's (Rust) tokenizer, for detokenizing outputs here."""
        self.config = config
        self.tokenizer = tokenizer
        self.startup_timeout_s = startup_timeout_s
        self._dir = tempfile.mkdtemp(prefix="radixserve-")
        os.chmod(self._dir, 0o700)
        self._inbox = f"ipc://{self._dir}/to-engine"
        self._outbox = f"ipc://{self._dir}/from-engine"
        self._ctx = zmq.asyncio.Context()
        # Sending is a plain (synchronous) socket: a PUSH to an ipc peer queues and returns
        # at once, without the asyncio wrapper's per-call future bookkeeping.
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.bind(self._inbox)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._outbox)
        self._pending: dict[str, _Pending] = {}
        self._outgoing: list[p.ToEngine] = []  # sent together at the end of this loop turn
        self._tasks: list[asyncio.Task] = []
        self._queries: dict[int, asyncio.Future] = {}  # radix summaries asked for
        self._query_ids = itertools.count()
        self.tracker = RequestTracker()  # recent requests' timings, for /v1/engine/stats
        self.process: subprocess.Popen | None = None
        self.ready: p.Ready | None = None
        self.stats: p.EngineStats | None = None
        self.last_heard = 0.0
        self.dead = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn ``python -m radixserve.api.engine_process`` (config as JSON: no pickle) and
        wait until it has loaded the model."""
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve.api.engine_process",
                json.dumps(dataclasses.asdict(self.config)),
                self._inbox,
                self._outbox,
            ],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while self.ready is None:
            if self.process.poll() is not None:
                raise EngineDead(
                    f"the engine process exited during startup (code {self.process.returncode})"
                )
            if time.monotonic() > deadline:
                raise EngineDead("the engine did not start in time")
            if await self._pull.poll(200):
                self._dispatch(p.from_engine_decoder.decode(await self._pull.recv()))
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_process()),
        ]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait, 5)
        self._fail_all()
        self._push.close(linger=0)
        self._sync_ctx.term()
        self._pull.close(linger=0)
        self._ctx.term()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)

    @property
    def alive(self) -> bool:
        return (
            not self.dead
            and self.process is not None
            and self.process.poll() is None
            and time.monotonic() - self.last_heard < 5.0
        )

    # -- requests -------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        n: int,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[p.Delta]:
        """Yield the deltas of ``n`` samples, with their text, until all have finished.
        Cancelling (client gone) aborts the request in the engine."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        outputs = RequestOutputProcessor(
            self.tokenizer, prompt_token_ids, SamplingParams(**params), n
        )
        pending = _Pending(remaining=n)
        self._pending[request_id] = pending
        self._send(p.GenerateRequest(request_id, prompt_token_ids, params, cache_salt, priority))
        tracker = self.tracker
        tracker.start(request_id, len(prompt_token_ids), n)
        finished = False
        try:
            while True:
                item = await pending.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                item, stopped_here = outputs.process(item)
                if item is None:
                    continue
                if stopped_here:  # a stop string ended this sample: the engine can let go
                    self._send(p.AbortRequest(request_id, item.index))
                tracker.observe(item)
                yield item
                if item.finished:
                    pending.remaining -= 1
                    if pending.remaining == 0:
                        finished = True
                        return
        finally:
            tracker.close(request_id)
            self._pending.pop(request_id, None)
            if not finished and self.alive:
                self._send(p.AbortRequest(request_id))

    async def radix_summary(
        self, max_nodes: int = 256, max_depth: int = 8, timeout_s: float = 10.0
    ) -> p.RadixSummary:
        """A bounded summary of the engine's radix tree (built between two engine steps)."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        self._send(p.RadixQuery(query_id, max_nodes, max_depth))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise EngineDead("the engine did not answer the radix query in time") from None
        finally:
            self._queries.pop(query_id, None)

    def _send(self, msg: p.ToEngine) -> None:
        """Queue ``msg``; everything queued in one event-loop turn leaves as one message."""
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(msg)

    def _flush(self) -> None:
        batch, self._outgoing = self._outgoing, []
        if batch and not self._push.closed:
            self._push.send(p.encoder.encode(batch))

    # -- background tasks -----------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            raw = await self._pull.recv()
            self._dispatch(p.from_engine_decoder.decode(raw))

    def _dispatch(self, msg: p.FromEngine) -> None:
        self.last_heard = time.monotonic()
        if isinstance(msg, p.Outputs):
            self.stats = msg.stats or self.stats
            for delta in msg.deltas:
                pending = self._pending.get(delta.request_id)
                if pending is not None:
                    pending.queue.put_nowait(delta)
        elif isinstance(msg, p.Heartbeat):
            self.stats = msg.stats
        elif isinstance(msg, p.Rejected):
            pending = self._pending.get(msg.request_id)
            if pending is not None:
                pending.queue.put_nowait(RequestRejected(msg.message, msg.overloaded))
        elif isinstance(msg, p.RadixSummary):
            future = self._queries.get(msg.query_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, p.Ready):
            self.ready = msg

    async def _watch_process(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if self.process is None or self.process.poll() is not None:
                self.dead = True
                self._fail_all()
                return

    def _fail_all(self) -> None:
        for pending in self._pending.values():
            pending.queue.put_nowait(EngineDead("the engine process died"))
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EngineDead("the engine process died"))
