"""The frontend's handle on one engine: start it (a process, or a thread of this process),
keep it serving (``supervisor.py``), and carry its request streams (``engine_streams.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio

from radixserve.engine.config import EngineConfig
from radixserve.serving import protocol as p
from radixserve.serving.engine_host import EngineThread
from radixserve.serving.engine_streams import EngineDead, RequestStreams
from radixserve.serving.supervisor import (
    RestartBackoff,
    SupervisorConfig,
    describe_exit,
)

logger = logging.getLogger(__name__)


class EngineProcessClient(RequestStreams):
    """Owns the engine (a process, or with ``in_process`` a thread of this one) and its two
    ZMQ ``ipc://`` sockets in a private directory, and keeps the engine serving
    (``supervisor.py``): an engine that dies, or hangs with work in flight past the hang
    timeout, is replaced by a new one with the same config. The requests themselves are
    ``RequestStreams``'.

    Invariants: every request sent gets exactly one terminal item on its queue — its
    samples' finished deltas, a ``Rejected``, or ``EngineDead`` if the engine dies, hangs
    or is restarting; each engine gets fresh sockets (nothing of a dead one reaches its
    successor); ``alive`` exactly when ``unhealthy_reason()`` is None: state "running",
    the engine up, and not stalled (``ProgressWatch``).
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        startup_timeout_s: float = 600.0,
        supervision: SupervisorConfig | None = None,
        env: dict[str, str] | None = None,
        in_process: bool = False,
    ) -> None:
        """``tokenizer``: the model's (Rust) tokenizer, for detokenizing outputs here.
        ``env``: the engine process's environment (None: this process's). ``in_process``:
        the engine runs on a thread of this process (tests and embedding: no second
        interpreter to start; the same sockets and messages; a hung thread cannot be
        killed, only abandoned)."""
        super().__init__(tokenizer)
        self.config = config
        # the LoRA adapters its engine serves (name -> path): --lora-modules, then changes
        self._loras: dict[str, str] = config.lora_adapters
        self.env = env
        self.in_process = in_process
        self.startup_timeout_s = startup_timeout_s
        self.supervision = supervision or SupervisorConfig()
        self._dir = tempfile.mkdtemp(prefix="radixserve-")
        os.chmod(self._dir, 0o700)
        self._ctx = zmq.asyncio.Context()
        # Sending is a plain (synchronous) socket: a PUSH to an ipc peer queues and returns
        # at once, without the asyncio wrapper's per-call future bookkeeping.
        self._sync_ctx = zmq.Context()
        self._pull: zmq.asyncio.Socket | None = None  # made per engine, as _push (_spawn)
        self._receiver: asyncio.Task | None = None
        self._supervisor: asyncio.Task | None = None
        self._generation = 0  # engines started
        self._ready_at = 0.0
        self._closing = False
        self._backoff = RestartBackoff(self.supervision)
        self.process: subprocess.Popen | EngineThread | None = None
        self.ready: p.Ready | None = None
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
        if self.in_process:
            self.process = process = EngineThread(self.config, inbox, outbox)
        else:
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

    async def lora_control(
        self, name: str, path: str | None, timeout_s: float = 60.0
    ) -> p.LoRAAnswer:
        """As ``RequestStreams.lora_control``; once done, an engine restarted after a
        death is told the same change (``_replay_loras``)."""
        answer = await super().lora_control(name, path, timeout_s)
        if answer.error is None:
            if path is None:
                self._loras.pop(name, None)
            else:
                self._loras[name] = path
        return answer

    async def _replay_loras(self) -> None:
        """Bring a restarted engine (it loaded ``--lora-modules``) to the adapters served
        before it died; an adapter that cannot be loaded again is logged and left out."""
        started = self.config.lora_adapters
        changes = [(n, None) for n in started if n not in self._loras]
        changes += [(n, path) for n, path in self._loras.items() if started.get(n) != path]
        for name, path in changes:
            try:
                answer = await super().lora_control(name, path)
            except EngineDead as exc:
                answer = p.LoRAAnswer(0, str(exc))
            if answer.error is not None:
                logger.error(
                    "LoRA adapter %s not restored after the restart: %s", name, answer.error
                )
                self._loras.pop(name, None)

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
    async def _kill(process: subprocess.Popen | EngineThread) -> None:
        if process.poll() is None:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):  # a hung thread: abandoned
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

    def dead_reason(self) -> str | None:
        """Why the engine is gone for good (dead, no restart coming: ``/live``), or None
        while it runs, starts or is being restarted."""
        return (self.reason or "the engine is dead") if self.state == "dead" else None

    def _engine_up(self) -> bool:
        return self.state == "running" and self.process is not None and self.process.poll() is None

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
            await self._replay_loras()
            return
        self.state = "dead"
        self.reason = (
            f"{why}; gave up after {self.supervision.max_restart_attempts} failed restarts"
        )
        logger.error("%s", self.reason)
