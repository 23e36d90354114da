"""radixserve as a Ray Serve application: N replicas, each a ``radixserve serve`` process
on its Ray node (so all of radixserve is served: OpenAI, Anthropic, Responses, metrics),
behind one ingress that routes by prompt prefix and retries a request whose replica could
not run it.

    serve run radixserve.api.ray.app:build_app replicas=2 serve_args="--model PATH"

Arguments (``build_app``'s, as ``serve run`` passes them, all strings): ``replicas``
(fixed count, default 2) or ``min_replicas``/``max_replicas`` (autoscaling on requests in
flight per replica, ``target_ongoing_requests``, default 16); ``serve_args`` (the
replicas' ``radixserve serve`` flags, shell-quoted); ``num_cpus`` per replica (default 1:
Ray places replicas by it); ``num_gpus`` (default 0); ``policy`` (``cache-aware``,
``round-robin``, ``least-load``) and ``prefix_cache_scope`` as the router's;
``retry_timeout_s`` and ``max_retries`` as the router's.

Pieces:
  * ``ServeReplica``: starts ``radixserve serve`` on 127.0.0.1 of its node (killed with the
    replica: ``PR_SET_PDEATHSIG``), answers Ray's health checks from the server's
    ``/live`` (a dead-for-good engine makes Ray replace the replica; a supervised engine
    restart does not), and streams each answer back through a Ray handle: first
    ``{"status", "content_type"}``, then the body's bytes.
  * ``PrefixAwareRouter``: Ray Serve's request router (``RequestRouter``) over
    ``serving/balancer.py``: the same cache-aware policy as ``radixserve router``, its
    per-replica prefix trees keyed by Ray's replica ids, the loads from Ray's queue
    lengths; it ranks the chosen replica first and the others after (Ray falls back to
    them when the first is full).
  * ``Ingress``: the HTTP entry (Ray's proxy hands it every request). As the router does
    (``api/router/answers.py``), it holds an answer back until its first output; one that
    failed before it (the replica's engine down or the replica full, its actor dead or
    restarting) is sent again, up to ``retry_timeout_s`` from the first failure and
    ``max_retries`` failures (refusals as full do not count).

``ray`` is imported here only: radixserve does not need it otherwise
(``pip install "ray[serve]"``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
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
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.api.asgi import APIError
from radixserve.api.ray import APP_ARGS
from radixserve.api.router.answers import PREAMBLE, Retry, failed_before_output
from radixserve.api.router.answers import retry_of_whole_answer as whole_retry
from radixserve.api.router.server import routing_key, routing_namespace
from radixserve.serving.balancer import BalanceConfig, Balancer, NoWorkerAvailable

log = logging.getLogger(__name__)

# request headers passed on to a replica (it checks API keys itself)
_FORWARDED = (
    "authorization",
    "content-type",
    "accept",
    "x-tenant",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
)
# backoffs before sending again (doubling): after a refusal as full, after a failure
_BUSY_BACKOFF_S = (0.05, 2.0)
_FAILED_BACKOFF_S = (0.5, 4.0)
# replica slots of the router's balancer (a replica gone frees its slot)
MAX_REPLICAS = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGTERM when the replica's process dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServeReplica:
    """One replica: a ``radixserve serve`` process on this node and the way to it.
    Invariant: ``forward`` yields the answer's head (status, content type) first, then its
    body as it comes; the server process lives exactly as long as this replica."""

    def __init__(self, serve_args: list[str], startup_timeout_s: float = 600.0) -> None:
        self.port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *serve_args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, start_new_session=False
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"radixserve serve exited during startup ({self.proc.returncode})"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("radixserve serve did not start in time")
            time.sleep(0.2)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=5))
        self.in_flight = 0

    async def forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> AsyncIterator[Any]:
        """The server's answer to one request: ``{"status", "content_type"}``, then bytes."""
        self.in_flight += 1
        try:
            request = self.client.build_request(method, path, headers=headers, content=body)
            answer = await self.client.send(request, stream=True)
            try:
                yield {
                    "status": answer.status_code,
                    "content_type": answer.headers.get("content-type"),
                }
                async for chunk in answer.aiter_raw():
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
        answer = await self.client.get("/live", timeout=10)
        if answer.status_code != 200:
            raise RuntimeError(f"radixserve serve is not live: {answer.text[:200]}")

    def record_routing_stats(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight}

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()  # (it drains what it runs)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """Ray Serve's replica choice by ``serving/balancer.py``'s policy. Invariant: a replica
    Ray no longer has frees its slot and its prefix tree; each request is inserted into the
    tree of the replica ranked first."""

    def initialize_state(
        self,
        policy: str = "cache-aware",
        prefix_cache_scope: str = "tenant",
        **balance: Any,
    ) -> None:
        self.balancer = Balancer(MAX_REPLICAS, policy, BalanceConfig(**balance))
        for i in range(MAX_REPLICAS):
            self.balancer.set_available(i, False)
        self.slots: dict[Any, int] = {}
        self.scope = prefix_cache_scope

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
        if not candidate_replicas:
            return []
        self._forget_gone()
        by_slot = {}
        for replica in candidate_replicas:
            slot = self._slot(replica.replica_id)
            if slot is not None:
                by_slot[slot] = replica
                queued = self.replica_queue_len_cache.get(replica.replica_id)
                if queued is None:
                    queued = replica.routing_stats.get("in_flight", 0)
                self.balancer.load[slot] = int(queued)
        key, namespace = "", ""
        if pending_request is not None and len(pending_request.args) == 4:
            _, path, headers, body = pending_request.args
            with contextlib.suppress(orjson.JSONDecodeError, TypeError):
                parsed = orjson.loads(body) if body else None
                key = routing_key(path, parsed)
                namespace = routing_namespace(self.scope, headers, parsed)
        exclude = frozenset(i for i in range(MAX_REPLICAS) if i not in by_slot)
        try:
            decision = self.balancer.choose(key, exclude, namespace)
        except NoWorkerAvailable:
            return [candidate_replicas]
        self.balancer.release(decision.worker)  # (the loads are Ray's, set each time)
        first = by_slot[decision.worker]
        return [[first], [r for r in candidate_replicas if r is not first]]


class Ingress:
    """The application's HTTP entry: every request to one replica (``PrefixAwareRouter``
    chooses), held back until its first output and sent again when it failed before any.
    Invariant: a client gets either an answer that began on one replica and is passed on
    whole, or, once the retry budget is spent, the last failure."""

    def __init__(
        self, replicas: DeploymentHandle, retry_timeout_s: float = 120.0, max_retries: int = 6
    ) -> None:
        self.replicas = replicas.options(stream=True)
        self.retry_timeout_s = retry_timeout_s
        self.max_retries = max_retries

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED}
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        failures, busy_tries = 0, 0
        last: Response | None = None
        while True:
            stream = self.replicas.forward.remote(request.method, path, headers, body)
            try:
                answer, retry = await self._first_output(stream)
            except RayError as exc:  # the replica died, or is not there yet
                answer, retry = None, Retry(f"replica failed: {type(exc).__name__}: {exc}")
            if retry is None:
                assert answer is not None
                return answer
            stream.cancel()
            if deadline is None:
                deadline = loop.time() + self.retry_timeout_s
            if isinstance(retry.failure, Response):
                last = retry.failure
            elif isinstance(retry.failure, APIError):
                last = _error(retry.failure)
            if retry.busy:
                first, most = _BUSY_BACKOFF_S
                wait, busy_tries = min(first * 2**busy_tries, most), busy_tries + 1
            else:
                failures += 1
                first, most = _FAILED_BACKOFF_S
                wait = min(first * 2 ** (failures - 1), most)
            if failures > self.max_retries or loop.time() + wait > deadline:
                log.warning("request failed after %d failures: %s", failures, retry.message)
                return last or _error(
                    APIError(502, retry.message, type_="worker_error", code="worker_failed")
                )
            await asyncio.sleep(wait)

    async def _first_output(self, stream: Any) -> tuple[Response | None, Retry | None]:
        """The replica's answer once its first output is in, or why to send it again."""
        chunks = stream.__aiter__()
        head = await chunks.__anext__()
        status, content_type = head["status"], head["content_type"] or "application/json"
        if not (status == 200 and content_type.startswith("text/event-stream")):
            whole = b"".join([c async for c in chunks])
            answer = Response(whole, status, media_type=content_type)
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
                return StreamingResponse(
                    _rest(buffer, chunks), status, media_type=content_type
                ), None
        return None, Retry("the stream ended before any output")


async def _rest(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in chunks:
        yield chunk


def _error(error: APIError) -> Response:
    return Response(orjson.dumps(error.body()), error.status, media_type="application/json")


def build_app(args: dict[str, str]) -> Any:
    """The application ``serve run radixserve.api.ray.app:build_app KEY=VALUE...`` runs
    (see the module's docstring for the keys)."""
    unknown = set(args) - APP_ARGS
    if unknown:
        raise ValueError(
            f"unknown argument(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(APP_ARGS))}"
        )
    serve_args = shlex.split(args.get("serve_args", ""))
    scaling: dict[str, Any]
    if "min_replicas" in args or "max_replicas" in args:
        scaling = {
            "autoscaling_config": {
                "min_replicas": int(args.get("min_replicas", 1)),
                "max_replicas": int(args.get("max_replicas", 4)),
                "target_ongoing_requests": float(args.get("target_ongoing_requests", 16)),
            }
        }
    else:
        scaling = {"num_replicas": int(args.get("replicas", 2))}
    router = RequestRouterConfig(
        request_router_class="radixserve.api.ray.app:PrefixAwareRouter",
        request_router_kwargs={
            "policy": args.get("policy", "cache-aware"),
            "prefix_cache_scope": args.get("prefix_cache_scope", "tenant"),
        },
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
        request_router_config=router,
        **scaling,
    )
    ingress = serve.deployment(Ingress).options(
        name="radixserve-ingress", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(
        replica.bind(serve_args),
        float(args.get("retry_timeout_s", 120.0)),
        int(args.get("max_retries", 6)),
    )
