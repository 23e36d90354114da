"""radixserve as a Ray Serve application: N replicas, each a ``radixserve serve`` process
on its Ray node (so all of radixserve is served: OpenAI, Anthropic, Responses, metrics),
behind one ingress that routes by prompt prefix and retries a request whose replica could
not run it.

    serve run radixserve.api.ray.app:build_app replicas=2 serve_args="--model PATH"

Arguments (``build_app``'s, as ``serve run`` passes them, all strings): ``replicas``
(fixed count, default 2) or ``min_replicas``/``max_replicas`` (autoscaling on the requests
the replicas' servers hold, ``target_ongoing_requests`` per replica, default 16); ``serve_args`` (the
replicas' ``radixserve serve`` flags, shell-quoted); ``num_cpus`` per replica (default 1:
Ray places replicas by it); ``num_gpus`` (default 0); ``policy`` (``cache-aware``,
``round-robin``, ``least-load``) and ``prefix_cache_scope`` as the router's;
``retry_timeout_s`` and ``max_retries`` as the router's; ``transport`` (``loopback``, the
default: the ingress reads an answer straight from a replica's server when both are on one
node, through Ray's handle otherwise; ``ray``: always through the handle).

Pieces:
  * ``ServeReplica``: starts ``radixserve serve`` on 127.0.0.1 of its node (killed with the
    replica: ``PR_SET_PDEATHSIG``), answers Ray's health checks from the server's
    ``/live`` (a dead-for-good engine makes Ray replace the replica; a supervised engine
    restart does not), says where its server listens (``address``), reports the requests
    its server holds for autoscaling, and streams an answer back through a Ray handle
    (``forward``: first ``{"status", "headers", "replica"}``, then the body's bytes) for an
    ingress on another node.
  * ``PrefixAwareRouter``: Ray Serve's request router (``RequestRouter``) over
    ``serving/balancer.py``: the same cache-aware policy as ``radixserve router``, its
    per-replica prefix trees keyed by Ray's replica ids, the loads from Ray's queue
    lengths and the ingress's own count of answers it reads over loopback; it ranks the chosen replica first and the others after (Ray falls back to
    them when the first is full).
  * ``Ingress``: the HTTP entry (Ray's proxy hands it every request). It asks Ray's
    handle for a replica (``address``, routed by ``PrefixAwareRouter``), then reads the
    answer from that replica's server over loopback HTTP when it runs on the ingress's
    node, or through the handle (``forward``, pinned to that replica) when not: an answer
    through the handle costs a Ray object per chunk in three processes (with tokens nearly
    free, reading over loopback took Ray from 0.42 to 0.6 of ``radixserve router``'s
    throughput: docs/benchmarks.md). As the router does
    (``api/router/answers.py``), it holds an answer back until its first output; one that
    failed before it (the replica's engine down or the replica full, its actor dead or
    restarting) is sent again, up to ``retry_timeout_s`` from the first failure and
    ``max_retries`` failures (refusals as full do not count).
  * ``queue_depth_policy``: Ray's autoscaling on the requests the replicas' servers hold
    (answers read over loopback never pass through Ray's counts).

``ray`` is imported here only: radixserve does not need it otherwise
(``pip install "ray[serve]"``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.api.anthropic.errors import PREFIX as MESSAGES_PATH
from radixserve.api.anthropic.errors import anthropic_error
from radixserve.api.asgi import APIError
from radixserve.api.auth import ADMIN_KEY_ENV
from radixserve.api.ray import APP_ARGS
from radixserve.api.router.answers import (
    FORWARDED_HEADERS,
    PREAMBLE,
    Retry,
    failed_before_output,
)
from radixserve.api.router.answers import retry_of_whole_answer as whole_retry
from radixserve.api.router.server import routing_key, routing_namespace
from radixserve.core.request import PREFIX_CACHE_SCOPES
from radixserve.serving.balancer import POLICIES, BalanceConfig, Balancer, NoWorkerAvailable

log = logging.getLogger(__name__)

# response headers passed back to the client
_RETURNED = ("content-type", "retry-after", "cache-control", "allow")
# what the application serves: inference and the read-only routes (the replicas' admin
# routes, console and debug views act on one replica of many: not offered through it)
_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/v1/models",
    "/generate",
    "/tokenize",
    "/detokenize",
    "/health",
    "/live",
    "/version",
)
# backoffs before sending again (doubling): after a refusal as full, after a failure (as
# the router's)
_BUSY_BACKOFF_S = (0.05, 2.0)
_FAILED_BACKOFF_S = (1.0, 8.0)
# replica slots of the router's balancer (a replica gone frees its slot)
MAX_REPLICAS = 256
# requests the ingress in this process reads from each replica's server over loopback (by
# replica id): its router adds them to Ray's queue lengths, which never see them
_LOCAL_LOADS: dict[str, int] = {}
_HELD_GAUGES = ("radixserve_num_requests_running", "radixserve_num_requests_waiting")
# longest a stopping replica's server may take to finish its answers
_DRAIN_S = 45.0
TRANSPORTS = ("loopback", "ray")
# the ingress's own settings of Ray Serve (those RAY_SERVE_THROUGHPUT_OPTIMIZED sets for a
# replica): its code, all async, runs on the replica's event loop, and so does its request
# router, rather than each on a thread of its own that every request and chunk hops to and
# from; its access log is written in batches of 1,000 lines, not a write per request
INGRESS_ENV = (
    ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0"),
    ("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "0"),
    ("RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE", "1000"),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # (resolved here, not in the forked child: nothing to load or allocate there)
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child: SIGTERM when the replica's thread that started it ends (it lives as
    long as the replica), however the replica dies (PR_SET_PDEATHSIG)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


class ServeReplica:
    """One replica: a ``radixserve serve`` process on this node and the way to it.
    Invariant: ``forward`` yields the answer's head (status, headers, replica) first, then
    its body as it comes; the server process lives as long as this replica, and after it
    only to finish its answers; its admin key (for the load it reports) is known to this
    process and, through its environment, to the server alone."""

    def __init__(self, serve_args: list[str], startup_timeout_s: float = 600.0) -> None:
        self.port = _free_port()
        # the server's /metrics, behind the proxy, needs an admin key: one of its own
        self._admin_key = secrets.token_urlsafe(24)
        cmd = [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--behind-proxy",  # its clients are the network's, through the ingress
            *serve_args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            env={**os.environ, ADMIN_KEY_ENV: self._admin_key},  # (not in the process list)
            preexec_fn=_die_with_parent,
            start_new_session=False,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"radixserve serve exited during startup ({self.proc.returncode})"
                )
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(self.url + "/health", timeout=2).status_code == 200
                if ready and self.proc.poll() is None:  # (ours, not another on the port)
                    break
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("radixserve serve did not start in time")
            time.sleep(0.2)
        # as many connections as requests may run (a pool wait would be a silent queue)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(None, connect=5), limits=limits
        )
        self.probe = httpx.AsyncClient(base_url=self.url, timeout=10)  # (never queued)
        self._admin = {"authorization": f"Bearer {self._admin_key}"}
        self.in_flight = 0
        self.replica_id = str(serve.get_replica_context().replica_id)
        self.node_id = ray.get_runtime_context().get_node_id()

    async def address(
        self, routing: tuple[str, str] = ("", ""), avoid: tuple[str, ...] = ()
    ) -> dict[str, str]:
        """Where this replica's server listens (``routing`` and ``avoid`` are for
        ``PrefixAwareRouter``, which chose this replica)."""
        return {"url": self.url, "node": self.node_id, "replica": self.replica_id}

    async def forward(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        routing: tuple[str, str] = ("", ""),
        avoid: tuple[str, ...] = (),
        pin: str | None = None,
    ) -> AsyncIterator[Any]:
        """The server's answer to one request: ``{"status", "headers", "replica"}``, then
        bytes (``routing``, ``avoid`` and ``pin`` are for ``PrefixAwareRouter``)."""
        self.in_flight += 1
        try:
            request = self.client.build_request(method, path, headers=headers, content=body)
            answer = await self.client.send(request, stream=True)
            try:
                headers = {k: answer.headers[k] for k in _RETURNED if k in answer.headers}
                yield {"status": answer.status_code, "headers": headers, "replica": self.replica_id}
                async for chunk in coalesced(answer.aiter_raw()):
                    yield chunk
            finally:
                await answer.aclose()
        finally:
            self.in_flight -= 1

    async def check_health(self) -> None:
        """Ray's health check: fails (so Ray replaces the replica) when the server process
        is gone or its engine is dead for good; a supervised engine restart passes."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"radixserve serve exited ({self.proc.returncode})")
        answer = await self.probe.get("/live")
        if answer.status_code != 200:
            raise RuntimeError(f"radixserve serve is not live: {answer.text[:200]}")

    def record_routing_stats(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray's custom autoscaling metric (``queue_depth_policy``): the requests this
        replica's server runs and queues, read from its /metrics (answers the ingress reads
        over loopback pass by Ray's own counts)."""
        answer = await self.probe.get("/metrics", headers=self._admin)
        answer.raise_for_status()
        return {"requests": held_requests(answer.text)}

    def __del__(self) -> None:
        """Stop the server: it refuses new requests (the ingress sends them elsewhere) and
        finishes what it runs, as its ``--shutdown-timeout`` allows (30 s by default), then
        is killed after ``_DRAIN_S``. Ray waits only for the answers that came through its
        handle before it calls this; those read over loopback are finished here (Ray gives
        the replica ``graceful_shutdown_timeout_s``, set by ``build_app`` above that)."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(_DRAIN_S)
            if proc.poll() is None:
                proc.kill()


def held_requests(metrics: str) -> float:
    """Requests running and waiting in a server's Prometheus text (every model's)."""
    held = 0.0
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _HELD_GAUGES:
            held += float(line.rsplit(" ", 1)[1])
    return held


def queue_depth_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Ray's autoscaling policy for the replicas (Ray applies the bounds, delays and
    factors of ``autoscaling_config`` around it): as many replicas as the requests their
    servers hold, plus those Ray still queues for one, over ``target_ongoing_requests``."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    held = sum((ctx.aggregated_metrics or {}).get("requests", {}).values())
    queued = ctx.total_queued_requests or 0.0
    return (held + queued) / ctx.config.get_target_ongoing_requests(), {}


class PrefixAwareRouter(RequestRouter):
    """Ray Serve's replica choice by ``serving/balancer.py``'s policy (no FIFO mixin: a
    replica chosen for one request's prefix is not handed to another). A replica's load is
    Ray's queue length for it plus the answers this process's ingress reads from it over
    loopback. Invariants: a replica Ray no longer has frees its slot and its prefix tree;
    a replica the request's ``avoid`` names (those that failed it) is ranked last; each
    request is inserted into the tree of the replica ranked first; a request ``pin``
    names a replica for (chosen before) goes to it first, the tree untouched."""

    def initialize_state(self, policy: str = "cache-aware", **balance: Any) -> None:
        self.balancer = Balancer(MAX_REPLICAS, policy, BalanceConfig(**balance))
        for i in range(MAX_REPLICAS):
            self.balancer.set_available(i, False)
        self.slots: dict[Any, int] = {}

    def _slot(self, replica_id: Any) -> int | None:
        slot = self.slots.get(replica_id)
        if slot is None:
            used = set(self.slots.values())
            slot = next((i for i in range(MAX_REPLICAS) if i not in used), None)
            if slot is None:
                return None
            self.slots[replica_id] = slot
            self.balancer.set_available(slot, True)
        return slot

    def _forget_gone(self) -> None:
        current = set(self.curr_replicas)
        for replica_id in [r for r in self.slots if r not in current]:
            self.balancer.set_available(self.slots.pop(replica_id), False)  # (tree emptied)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # all full: Ray waits before asking again
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        avoid = set(kwargs.get("avoid", ()))
        pinned = kwargs.get("pin")
        if pinned is not None:  # (chosen already, by an ``address`` call)
            first = [r for r in candidate_replicas if str(r.replica_id) == pinned]
            return _ranked(first, candidate_replicas, avoid)
        self._forget_gone()
        by_slot = {}
        for replica in candidate_replicas:
            slot = self._slot(replica.replica_id)
            if slot is not None:
                by_slot[slot] = replica
                queued = self.replica_queue_len_cache.get(replica.replica_id)
                if queued is None:
                    queued = replica.routing_stats.get("in_flight", 0)
                local = _LOCAL_LOADS.get(str(replica.replica_id), 0)
                self.balancer.load[slot] = int(queued) + local
        key, namespace = kwargs.get("routing", ("", ""))
        fresh = [s for s, r in by_slot.items() if str(r.replica_id) not in avoid]
        exclude = frozenset(i for i in range(MAX_REPLICAS) if i not in (fresh or by_slot))
        try:
            decision = self.balancer.choose(key, exclude, namespace)
        except NoWorkerAvailable:
            return [candidate_replicas]
        self.balancer.release(decision.worker)  # (the loads are Ray's, set each time)
        return _ranked([by_slot[decision.worker]], candidate_replicas, avoid)


def _ranked(
    first: list[RunningReplica], candidates: list[RunningReplica], avoid: set[str]
) -> list[list[RunningReplica]]:
    """Ray's ranks: ``first``, then the other candidates, those in ``avoid`` last."""
    rest = [r for r in candidates if r not in first]
    others = [r for r in rest if str(r.replica_id) not in avoid]
    failed = [r for r in rest if str(r.replica_id) in avoid]
    return [ranks for ranks in (first, others, failed) if ranks]


class Ingress:
    """The application's HTTP entry: every request to one replica (``PrefixAwareRouter``
    chooses, away from replicas that failed it), held back until its first output and sent
    again when it failed before any. Invariant: a client gets either an answer that began
    on one replica and is passed on (a stream cut by its replica's death ends with an error
    event), or, once the retry budget is spent, the last failure."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        retry_timeout_s: float = 120.0,
        max_retries: int = 6,
        prefix_cache_scope: str = "tenant",
        transport: str = "loopback",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        self.replicas = replicas.options(stream=True)
        self.addresses = replicas.options(stream=False)
        self.transport = transport
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        # as many connections as requests may run (a pool wait would be a silent queue)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5), limits=limits)
        self.scope = prefix_cache_scope  # (the routing key's namespace, as the router's)
        self.retry_timeout_s = retry_timeout_s
        self.max_retries = max_retries

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        # (the path as it came, not decoded: a %2F in a model's name stays one)
        raw = request.scope.get("raw_path") or request.scope.get("path", path).encode()
        target = raw.decode("latin-1") + (f"?{request.url.query}" if request.url.query else "")
        if not _routable(path, target):
            return _error(APIError(404, f"no route {path!r} here", code="not_found"), path)
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        routing = ("", "")
        with contextlib.suppress(orjson.JSONDecodeError, TypeError):
            parsed = orjson.loads(body) if body else None
            routing = (routing_key(path, parsed), routing_namespace(self.scope, headers, parsed))
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        failures, busy_tries = 0, 0
        avoid: list[str] = []
        last: Response | None = None
        while True:
            head: dict[str, Any] = {}
            budget = self.retry_timeout_s if deadline is None else deadline - loop.time()
            stream: Any = None
            try:
                stream = await self._open(
                    request.method, target, headers, body, routing, avoid, head, budget
                )
                if stream is None:  # no replica took it in the budget
                    return last or _no_replica(self.retry_timeout_s, path)
                answer, retry = await self._first_output(stream, head, path)
            except (RayError, RayServeException, httpx.HTTPError) as exc:  # the replica died
                answer, retry = None, Retry(f"replica failed: {type(exc).__name__}: {exc}")
            except BaseException:  # (the client gone while its answer was held: let it go)
                await _close(stream)
                raise
            if retry is None:
                assert answer is not None
                return answer
            await _close(stream)
            if head.get("replica") and head["replica"] not in avoid:
                avoid.append(head["replica"])
            if deadline is None:
                deadline = loop.time() + self.retry_timeout_s
            if isinstance(retry.failure, Response):
                last = retry.failure
            else:
                failure = retry.failure or APIError(
                    502, retry.message, type_="worker_error", code="worker_failed"
                )
                last = _error(failure, path)
            if retry.busy:
                first, most = _BUSY_BACKOFF_S
                wait, busy_tries = min(first * 2**busy_tries, most), busy_tries + 1
            else:
                failures += 1
                first, most = _FAILED_BACKOFF_S
                wait = min(first * 2 ** (failures - 1), most)
            now = loop.time()
            if failures > self.max_retries or now >= deadline:
                log.warning("request failed after %d failures: %s", failures, retry.message)
                return last
            await asyncio.sleep(min(wait, deadline - now))

    async def _open(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        routing: tuple[str, str],
        avoid: list[str],
        head: dict[str, Any],
        budget: float,
    ) -> Any:
        """The answer of the replica ``PrefixAwareRouter`` chooses (its id put in
        ``head``): its head, then its body's chunks; None when no replica took the request
        within ``budget`` seconds."""
        start = time.monotonic()
        call = self.addresses.address.remote(routing=routing, avoid=tuple(avoid))
        if not await _assigned(call, budget):
            await _close(call)
            return None
        where = await call
        head["replica"] = where["replica"]
        if self.transport == "loopback" and where["node"] == self.node_id:
            return self._read(where, method, target, headers, body)
        stream = self.replicas.forward.remote(
            method, target, headers, body, avoid=tuple(avoid), pin=where["replica"]
        )
        if not await _assigned(stream, budget - (time.monotonic() - start)):
            await _close(stream)
            return None
        return stream

    async def _read(
        self, where: dict[str, str], method: str, target: str, headers: dict[str, str], body: bytes
    ) -> AsyncIterator[Any]:
        """A replica's answer read from its server over loopback, as ``forward`` yields it
        (counted in this process's ``_LOCAL_LOADS`` while it runs)."""
        replica = where["replica"]
        _LOCAL_LOADS[replica] = _LOCAL_LOADS.get(replica, 0) + 1
        try:
            sent = self.client.build_request(
                method, where["url"] + target, headers=headers, content=body
            )
            answer = await self.client.send(sent, stream=True)
            try:
                kept = {k: answer.headers[k] for k in _RETURNED if k in answer.headers}
                yield {"status": answer.status_code, "headers": kept, "replica": replica}
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()
        finally:
            _LOCAL_LOADS[replica] -= 1
            if not _LOCAL_LOADS[replica]:
                del _LOCAL_LOADS[replica]

    async def _first_output(
        self, stream: Any, head: dict[str, Any], path: str
    ) -> tuple[Response | None, Retry | None]:
        """The replica's answer once its first output is in, or why to send it again
        (``head``: filled with the answer's head when it came)."""
        chunks = stream.__aiter__()
        head.update(await chunks.__anext__())
        status, headers = head["status"], head["headers"]
        content_type = headers.get("content-type", "application/json")
        if not (status == 200 and content_type.startswith("text/event-stream")):
            whole = b"".join([c async for c in chunks])
            answer = Response(whole, status, headers=headers)
            retry = whole_retry(status, whole)
            if retry is not None:
                retry.failure = answer
                return None, retry
            return answer, None
        buffer, start = b"", 0
        async for chunk in chunks:
            buffer += chunk
            while (cut := buffer.find(b"\n\n", start)) >= 0:
                event, start = buffer[start : cut + 2], cut + 2
                if any(mark in event for mark in PREAMBLE):
                    continue
                failed = failed_before_output(event)
                if failed is not None:
                    return None, failed
                rest = _rest(buffer, chunks, path)
                return _PassedOn(rest, status, headers=headers), None
        return None, Retry("the stream ended before any output")


async def _assigned(stream: Any, timeout_s: float) -> bool:
    """Whether Ray assigned ``stream``'s request to a replica within ``timeout_s`` (it waits
    while none is up, or all are full). An assignment that fails (the handle's own error)
    counts as assigned: the first output's wait raises it, and the request is retried. A
    Ray without the handle's assignment future is not bounded here (True at once)."""
    fetch = getattr(stream, "_fetch_future_result_async", None)
    if fetch is None:
        return True
    try:
        await asyncio.wait_for(fetch(), max(timeout_s, 0.0))
    except TimeoutError:
        return False
    except Exception:  # (raised again where the answer is awaited)
        pass
    return True


async def coalesced(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` as they come, but those that arrived while the last was being passed on
    as one: each item costs a Ray object, so under load a stream's tokens travel in
    batches, while one alone is not held back."""
    arrived: list[bytes] = []
    ready = asyncio.Event()
    ended: list[BaseException | None] = []

    async def pump() -> None:
        try:
            async for chunk in chunks:
                arrived.append(chunk)
                ready.set()
            ended.append(None)
        except BaseException as exc:  # (passed on to the reader below)
            ended.append(exc)
        ready.set()

    task = asyncio.create_task(pump())
    try:
        while True:
            await ready.wait()
            ready.clear()
            if arrived:
                batch = b"".join(arrived)
                arrived.clear()
                yield batch
            if ended and not arrived:
                if ended[0] is not None:
                    raise ended[0]
                return
    finally:
        task.cancel()


async def _rest(first: bytes, chunks: AsyncIterator[bytes], path: str) -> AsyncIterator[bytes]:
    """A stream's bytes on from its first output; a replica dying under it ends it with an
    error event (Anthropic's on Messages) and, but on Messages, ``[DONE]``, as the router
    ends it. Stopped early (the client gone), it stops the answer too."""
    ended = False
    try:
        yield first
        async for chunk in chunks:
            yield chunk
        ended = True
    except (RayError, RayServeException, httpx.HTTPError) as exc:
        ended = True
        error = APIError(502, f"the replica failed: {type(exc).__name__}", code="worker_failed")
        if path.startswith(MESSAGES_PATH):
            yield b"event: error\ndata: " + anthropic_error(error).body + b"\n\n"
        else:
            yield b"\n\ndata: " + orjson.dumps(error.body()) + b"\n\ndata: [DONE]\n\n"
    finally:
        if not ended or hasattr(chunks, "aclose"):  # (a loopback read: its connection freed)
            await _close(chunks)


class _PassedOn(StreamingResponse):
    """A replica's stream passed on to the client. Invariant: its source is closed however
    the response ends (Starlette leaves an iterator it stopped reading to the garbage
    collector, and with it the replica's work and the ingress's count of it)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _routable(path: str, target: str) -> bool:
    """Whether the ingress passes ``path`` on: one of its routes, with no dot segment (an
    HTTP client would resolve it to another route) and nothing an URL cannot carry."""
    # (``path`` is decoded: an encoded dot segment shows here as a dot)
    if not path.startswith(_ROUTES) or any(s in (".", "..") for s in path.split("/")):
        return False
    return target.isascii() and target.isprintable() and " " not in target


async def _close(stream: Any) -> None:
    """Stop reading ``stream`` (an answer read over loopback, or Ray's: cancelled)."""
    if stream is None:
        return
    with contextlib.suppress(Exception):
        if hasattr(stream, "aclose"):
            await stream.aclose()
        else:
            stream.cancel()


def _no_replica(timeout_s: float, path: str) -> Response:
    log.warning("no replica took a request in %.0f s", timeout_s)
    error = APIError(
        503,
        f"no replica could take the request in {timeout_s:.0f} s",
        type_="service_unavailable_error",
        code="no_replica",
        retry_after_s=5,
    )
    return _error(error, path)


def _error(error: APIError, path: str) -> Response:
    """``error`` as a replica would answer it on ``path`` (Anthropic's shape on Messages)."""
    if path.startswith(MESSAGES_PATH):
        shaped = anthropic_error(error)
        return Response(shaped.body, shaped.status, media_type="application/json")
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    return Response(
        orjson.dumps(error.body()), error.status, headers=headers, media_type="application/json"
    )


def build_app(args: dict[str, str]) -> Any:
    """The application ``serve run radixserve.api.ray.app:build_app KEY=VALUE...`` runs
    (see the module's docstring for the keys)."""
    unknown = set(args) - APP_ARGS
    if unknown:
        raise ValueError(
            f"unknown argument(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(APP_ARGS))}"
        )
    serve_args = shlex.split(args.get("serve_args", ""))
    if args.get("policy", "cache-aware") not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    if args.get("transport", "loopback") not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
    if args.get("prefix_cache_scope", "tenant") not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}")
    scaling: dict[str, Any]
    if "min_replicas" in args or "max_replicas" in args:
        scaling = {
            "autoscaling_config": {
                "min_replicas": int(args.get("min_replicas", 1)),
                "max_replicas": int(args.get("max_replicas", 4)),
                "target_ongoing_requests": float(args.get("target_ongoing_requests", 16)),
                "policy": {"policy_function": "radixserve.api.ray.app:queue_depth_policy"},
            }
        }
    else:
        scaling = {"num_replicas": int(args.get("replicas", 2))}
    router = RequestRouterConfig(
        request_router_class="radixserve.api.ray.app:PrefixAwareRouter",
        request_router_kwargs={"policy": args.get("policy", "cache-aware")},
    )
    replica = serve.deployment(ServeReplica).options(
        name="radixserve-replica",
        ray_actor_options={
            "num_cpus": float(args.get("num_cpus", 1)),
            "num_gpus": float(args.get("num_gpus", 0)),
        },
        max_ongoing_requests=int(args.get("max_ongoing_requests", 256)),
        health_check_period_s=2,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=_DRAIN_S + 15,  # (the server's drain: see __del__)
        request_router_config=router,
        **scaling,
    )
    ingress = serve.deployment(Ingress).options(
        name="radixserve-ingress",
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": dict(INGRESS_ENV)}},
    )
    return ingress.bind(
        replica.bind(serve_args),
        float(args.get("retry_timeout_s", 120.0)),
        int(args.get("max_retries", 6)),
        args.get("prefix_cache_scope", "tenant"),
        args.get("transport", "loopback"),
    )
