"""``radixserve router``: an OpenAI-compatible HTTP proxy in front of several ``radixserve
serve`` replicas, routing each request with a ``Balancer`` and passing answers through
(server-sent events as they come)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.api.anthropic.errors import PREFIX as MESSAGES_PATH
from radixserve.api.anthropic.errors import anthropic_error
from radixserve.api.asgi import (
    APIError,
    ASGIApp,
    HTTPRequest,
    Response,
    StreamResponse,
    json_response,
)
from radixserve.api.router.answers import (
    FORWARDED_HEADERS,
    PREAMBLE,
    Retry,
    failed_before_output,
    retry_of_whole_answer,
)
from radixserve.core.request import PREFIX_CACHE_SCOPES
from radixserve.core.settings import setting
from radixserve.serving.balancer import (
    POLICIES,
    BalanceConfig,
    Balancer,
    Decision,
    NoWorkerAvailable,
    token_key,
)

log = logging.getLogger(__name__)

# the routes that run a model, and so are routed by their prompt
GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    MESSAGES_PATH,
    "/v1/embeddings",
)
RESPONSES_PATH = "/v1/responses"
# how many response ids the router remembers the replica of (the oldest forgotten first;
# a forgotten one is found again by asking the replicas)
MAX_RESPONSE_OWNERS = 100_000
# a Responses answer's own id: the first "id" of its JSON (or of its response.created event)
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[A-Za-z0-9]+)"')
_DONE = b"data: [DONE]\n\n"
# a worker taken out while the body of a whole answer is on its way: how long it may still
# take to arrive (a non-streamed answer's body is written with its head, all at once)
_WHOLE_ANSWER_GRACE_S = 2.0


@dataclass(frozen=True)
class RouterConfig:
    """``radixserve router``'s settings, each a flag (``core.settings``)."""

    workers: tuple[str, ...] = setting(
        (),
        name="--worker",
        repeat=True,
        required=True,
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeatable)",
    )
    policy: str = setting("cache-aware", choices=POLICIES)
    balance: BalanceConfig = field(default_factory=BalanceConfig)  # its own flags
    health_check_interval_s: float = setting(5.0, name="--health-check-interval", help="seconds")
    health_check_timeout_s: float = setting(5.0, name="--health-check-timeout", help="seconds")
    health_failure_threshold: int = setting(
        2, help="consecutive failed checks before a worker is taken out"
    )
    max_body_bytes: int = setting(
        8 * 2**20,
        name="--max-body-mb",
        parse=lambda text: int(float(text) * 2**20),
        help="request body size limit (MiB; 8)",
    )
    connect_timeout_s: float = 5.0
    retry_timeout_s: float = setting(
        120.0,
        name="--retry-timeout",
        help="seconds a request that has sent nothing to its client may wait for a replica "
        "that takes it (its replica died or refused it as overloaded, or none is healthy) "
        "before the last failure is answered",
    )
    max_retries: int = setting(
        6,
        help="replica failures a request may meet before its answer is that failure (a "
        "replica refusing it as overloaded does not count: that is waited out, up to "
        "--retry-timeout)",
    )
    # tenant = a prompt is matched only against the prompts sent with the same credentials
    # (the replicas cache per tenant); global = all
    worker_api_key: str | None = setting(
        None,
        help="the key the router reads each replica's /v1/models with, to learn which "
        "models it serves (needed where the replicas take keys; without it a replica "
        "that asks for one is taken to serve every model)",
    )
    prefix_cache_scope: str = setting(
        "tenant",
        choices=PREFIX_CACHE_SCOPES,
        help="as the workers' flag: tenant = a prompt is matched against the prompts sent "
        "with the same key (and X-Tenant) only; global = against all",
    )

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("give at least one --worker URL")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(
                f"prefix_cache_scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}; "
                f"got {self.prefix_cache_scope!r}"
            )
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a worker URL must start with http:// or https://; got {url!r}")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("a worker URL is given twice")
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health check interval and timeout must be positive")
        if self.health_failure_threshold < 1:
            raise ValueError("health_failure_threshold must be at least 1")
        if self.retry_timeout_s < 0 or self.max_retries < 0:
            raise ValueError("retry_timeout_s and max_retries must not be negative")


def routing_key(path: str, body: Any) -> str:
    """What the cache-aware policy matches on: the prompt as the worker will see it,
    approximately (text prompts as text, token prompts one character per token, chat as
    its messages in order). Malformed bodies give "" (the worker answers them 400)."""
    if not isinstance(body, dict):
        return ""
    if path in ("/v1/chat/completions", MESSAGES_PATH):
        parts = []
        system = body.get("system") if path == MESSAGES_PATH else None
        if isinstance(system, list):
            system = "".join(x.get("text", "") for x in system if isinstance(x, dict))
        if isinstance(system, str):
            parts.append(f"<system>{system}")
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(x.get("text", "") for x in content if isinstance(x, dict))
                parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    if path == RESPONSES_PATH:
        parts = (
            [f"<system>{body['instructions']}"] if isinstance(body.get("instructions"), str) else []
        )
        items = body.get("input")
        for item in [items] if isinstance(items, str) else items if isinstance(items, list) else ():
            content = item.get("content") if isinstance(item, dict) else item
            if isinstance(content, list):
                content = "".join(x.get("text", "") for x in content if isinstance(x, dict))
            role = item.get("role", "user") if isinstance(item, dict) else "user"
            parts.append(f"<{role}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    field_name = {"/v1/completions": "prompt", "/v1/embeddings": "input"}.get(path, "text")
    prompt = body.get(field_name)
    if path == "/generate" and prompt is None:
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 0x110000 for t in prompt):
        return token_key(prompt)
    return ""


def requester(headers: Mapping[str, str]) -> str:
    """Who sent a request, as far as the router can tell without the keys (the replicas
    check them): a digest of its credentials and sub-tenant header (``authorization``,
    ``x-api-key``, ``x-tenant``, as sent). Requests sent alike share it; requests of
    different tenants never do. Sub-tenants a gateway key names by the body's ``user``
    share their key's digest: the replicas tell them apart, and the gateway that holds the
    key may speak for any of them anyway."""
    parts = [headers.get(k, "") for k in ("authorization", "x-api-key", "x-tenant")]
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(4, "little") + part.encode("utf-8", "replace"))
    return digest.hexdigest()


def routing_namespace(scope: str, headers: Mapping[str, str], body: Any) -> str:
    """The cache namespace a prompt will be matched in on the replicas, for the balancer:
    its tenant's (under scope ``tenant``, told by the credentials and ``x-tenant``; a
    sub-tenant named by ``user`` alone shares its key's here, which costs routing, not
    isolation: the replicas keep them apart), its ``cache_salt`` and its ``model`` (a LoRA
    adapter computes pages of its own; the base model's name, or none, is one namespace
    more than needed, which also costs routing only)."""
    parts = [requester(headers)] if scope == "tenant" else []
    for name in ("cache_salt", "model"):
        value = body.get(name) if isinstance(body, dict) else None
        if isinstance(value, str) and value:
            parts.append(f"{name}={value!r}")  # (repr: no NUL, the balancer's separator)
    return " ".join(parts)


def _unavailable(url: str) -> APIError:
    return APIError(
        503,
        f"the replica holding this conversation ({url}) is not available; try again later",
        type_="service_unavailable_error",
        code="worker_unavailable",
    )


# backoff before a worker that refused a request as busy is asked again (doubling)
_BUSY_BACKOFF_S = (0.05, 2.0)
# a worker that failed a request is tried again when it has come back (been taken out and
# passed a health check), or after this long if the router never saw it go (doubling)
_FAILED_BACKOFF_S = (1.0, 8.0)


class _Avoid:
    """The workers one request should not be sent to yet. Invariant: a worker is avoided
    only while it has not come back since it failed or refused the request (its health
    ``epoch`` is the one recorded) and its backoff has not passed."""

    def __init__(self) -> None:
        self.until: dict[int, tuple[int, float]] = {}  # worker -> (epoch, monotonic time)
        self.tries: dict[int, int] = {}

    def add(self, worker: int, epoch: int, backoff: tuple[float, float], now: float) -> None:
        n = self.tries.get(worker, 0)
        self.tries[worker] = n + 1
        first, most = backoff
        self.until[worker] = (epoch, now + min(first * 2**n, most))

    def excluded(self, workers: list[Worker], now: float) -> frozenset[int]:
        return frozenset(
            i
            for i, (epoch, until) in self.until.items()
            if workers[i].epoch == epoch and now < until
        )

    def next_change(self, workers: list[Worker], now: float) -> float | None:
        """Seconds until the first avoided worker's backoff passes (None: none is
        avoided now; one coming back is what to wait for)."""
        live = [
            until
            for i, (epoch, until) in self.until.items()
            if workers[i].epoch == epoch and until > now
        ]
        return min(live) - now if live else None


@dataclass(eq=False)
class _Flight:
    """One request on its way through a worker: the pump task reading the worker's answer
    puts ``(kind, value)`` items on ``queue``; a worker taken out puts a failure there."""

    worker: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pump: asyncio.Task | None = None
    # the worker has begun sending a whole (not event-stream) answer: its body follows at
    # once, so a take-out gives it ``_WHOLE_ANSWER_GRACE_S`` to arrive
    whole: bool = False


# a worker's models as its /v1/models tells them: a name (or alias) -> its status there
# ("loaded", "loading", "unloaded"; a LoRA adapter takes its base model's)
WARM_STATES = frozenset({"loaded", "loading"})


def served_models(listing: Any) -> dict[str, str] | None:
    """What a replica's ``/v1/models`` answer says it serves (None: not such an answer):
    each model's id and aliases with its status (a single-model server's card has none:
    loaded), each adapter with its base model's."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
    status = {c["id"]: str(c.get("status", "loaded")) for c in cards if "parent" not in c}
    out: dict[str, str] = {}
    for card in cards:
        parent = card.get("parent")
        if "parent" in card:
            state = status.get(parent, "loaded") if isinstance(parent, str) else "loaded"
        else:
            state = status[card["id"]]
        aliases = card.get("aliases")
        for name in [card["id"], *(aliases if isinstance(aliases, list) else ())]:
            if isinstance(name, str):
                out[name] = state
    return out


class Worker:
    """One replica as the router sees it."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = False
        self.failures = 0  # consecutive failed health checks
        self.flights: set[_Flight] = set()
        self.epoch = 0  # times it came back (passed a health check after being out)
        # the models it serves (``served_models``), learned at each health check; None
        # while not known (not asked yet, or it would not say): taken to serve any
        self.models: dict[str, str] | None = None


class Router:
    """The router's state and routes. Invariants: a request is routed only to a healthy
    worker; every routed request is released from the balancer's load exactly once (when
    its answer is complete, fails or the client leaves); when a worker is taken out, all
    its in-flight requests end at once — a plain request with a 502, a stream with an
    error event then ``[DONE]`` — and it gets no new ones until a health check passes. A
    Responses request that continues a stored response (``previous_response_id``), and a
    GET or DELETE of one, goes to the replica that stored it, and nowhere else. A request
    naming a model some replica lists goes only to replicas that list it
    (``model_excluded``)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers = [Worker(url) for url in config.workers]
        self.balancer = Balancer(len(self.workers), config.policy, config.balance)
        for i in range(len(self.workers)):
            self.balancer.set_available(i, False)  # until the first health check passes
        self.http: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self._rr = 0  # for requests that any worker can answer
        self._back = asyncio.Event()  # set (and replaced) when a worker comes back
        self.queued = 0  # requests waiting for a worker to take them
        # a stored Responses answer lives in the replica that made it: id -> (worker, the
        # requester digest of the request that made it)
        self.response_owner: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self.registry = CollectorRegistry()
        self.registry.register(_RouterCollector(self))
        self.requests = Counter(
            "radixserve_router_requests",
            "Requests routed, by worker",
            ["worker"],
            registry=self.registry,
        )
        self.routing = Counter(
            "radixserve_router_routing",
            "Routing decisions by worker and outcome (cache_hit: the longest prefix match "
            "decided; cache_miss: no worker matched enough, the one with the most room got "
            "it; load_balance: load was unbalanced; round_robin; least_load)",
            ["worker", "outcome"],
            registry=self.registry,
        )
        self.failed = Counter(
            "radixserve_router_worker_failures",
            "Requests that failed because their worker failed",
            ["worker"],
            registry=self.registry,
        )
        self.retried = Counter(
            "radixserve_router_retries",
            "Requests sent again because their worker failed or refused them before any output",
            ["worker"],
            registry=self.registry,
        )
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s),
            # idle connections are dropped well before uvicorn's 5 s keep-alive ends them,
            # so a request never races the replica closing its connection
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0
            ),
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.http is not None:
            await self.http.aclose()

    # -- health -----------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self.check_health()
            except Exception:  # keep checking whatever happened
                log.exception("health check round failed")

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(i) for i in range(len(self.workers))))

    async def _check(self, i: int) -> None:
        worker = self.workers[i]
        assert self.http is not None
        try:
            answer = await self.http.get(
                worker.url + "/health", timeout=self.config.health_check_timeout_s
            )
            ok = answer.status_code == 200
        except httpx.ConnectError:  # nothing listens there: out at once
            worker.failures += 1
            if worker.healthy:
                self.take_out(i, "refused a connection")
            return
        except httpx.HTTPError:
            ok = False
        if ok:
            worker.failures = 0
            if not worker.healthy:
                log.info("worker %s is healthy", worker.url)
                worker.healthy = True
                self.balancer.set_available(i, True)
                self._worker_back(i)
            await self._learn_models(worker)  # (what it knew stands meanwhile)
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= self.config.health_failure_threshold:
            self.take_out(i, "failed its health check")

    async def _learn_models(self, worker: Worker) -> None:
        """Ask a healthy worker which models it serves and in what state (its answer
        replaces what the router knew; no answer leaves it)."""
        assert self.http is not None
        key = self.config.worker_api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            answer = await self.http.get(
                worker.url + "/v1/models",
                headers=headers,
                timeout=self.config.health_check_timeout_s,
            )
            models = served_models(answer.json()) if answer.status_code == 200 else None
        except Exception:  # (an answer it cannot read says nothing: what it knew stands)
            return
        if models is not None:
            worker.models = models

    def model_excluded(self, name: Any, excluded: frozenset[int]) -> frozenset[int]:
        """The workers a request for model ``name`` is not sent to: those whose lists do
        not have it, and, while some worker that may take it (healthy, not in
        ``excluded``) has it loaded or loading, those where it is not (a load takes
        seconds) — unless those are unbalanced as the cache-aware policy counts it. None
        when no worker lists the name (the default model, an adapter a key alone sees, or
        no such model: a worker answers that)."""
        if not isinstance(name, str) or not any(
            w.models is not None and name in w.models for w in self.workers
        ):
            return frozenset()
        serving = {i for i, w in enumerate(self.workers) if w.models is None or name in w.models}
        out = set(range(len(self.workers))) - serving
        open_ = [i for i in serving if self.workers[i].healthy and i not in excluded]
        warm = [
            i for i in open_ if (self.workers[i].models or {}).get(name, "loaded") in WARM_STATES
        ]
        cold = [i for i in open_ if i not in warm]
        if warm and cold:
            c = self.balancer.config
            busy = min(self.balancer.load[i] for i in warm)
            idle = min(self.balancer.load[i] for i in cold)
            if not (
                busy - idle > c.balance_abs_threshold and busy > idle * c.balance_rel_threshold
            ):
                out.update(cold)
        return frozenset(out)

    def take_out(self, i: int, reason: str) -> None:
        """Stop routing to worker ``i`` and end its in-flight requests with an error."""
        worker = self.workers[i]
        if worker.healthy:
            log.warning("worker %s taken out: %s", worker.url, reason)
        worker.healthy = False
        self.balancer.set_available(i, False)
        message = f"worker {worker.url} failed: {reason}"
        for flight in list(worker.flights):
            if flight.whole and flight.pump is not None and not flight.pump.done():
                # the answer was complete at the worker (its head came): let it arrive, as
                # long as it does so soon (a worker hung mid-body still fails the request)
                loop = asyncio.get_running_loop()
                loop.call_later(_WHOLE_ANSWER_GRACE_S, self._fail_flight, flight, message)
                continue
            self._fail_flight(flight, message)

    @staticmethod
    def _fail_flight(flight: _Flight, message: str) -> None:
        if flight.pump is not None and flight.pump.done():
            return  # it ended meanwhile: its answer (or its own failure) is on the queue
        flight.queue.put_nowait(("failed", message))
        if flight.pump is not None:
            flight.pump.cancel()

    # -- proxying -------------------------------------------------------------------------
    def _headers(self, request: HTTPRequest) -> dict[str, str]:
        return {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}

    async def _pump(self, flight: _Flight, method: str, path: str, request: HTTPRequest):
        """Send the request to the worker and put its answer on the flight's queue."""
        assert self.http is not None
        url = self.workers[flight.worker].url + path
        q = flight.queue
        try:
            async with self.http.stream(
                method, url, content=request.body, headers=self._headers(request)
            ) as answer:
                content_type = answer.headers.get("content-type")
                flight.whole = not (content_type or "").startswith("text/event-stream")
                q.put_nowait(("head", (answer.status_code, content_type)))
                async for chunk in answer.aiter_raw():
                    q.put_nowait(("data", chunk))
            q.put_nowait(("end", None))
        except httpx.ConnectError as exc:
            q.put_nowait(("connect", f"could not connect to {url}: {exc}"))
        except httpx.HTTPError as exc:
            q.put_nowait(("failed", f"worker {url} failed: {type(exc).__name__}: {exc}"))

    def _launch(self, worker: int, method: str, path: str, request: HTTPRequest) -> _Flight:
        flight = _Flight(worker)
        self.workers[worker].flights.add(flight)
        flight.pump = asyncio.create_task(self._pump(flight, method, path, request))
        return flight

    def _finish(self, flight: _Flight) -> None:
        """The flight is over: stop reading the worker, drop it from the load."""
        if flight.pump is not None and not flight.pump.done():
            flight.pump.cancel()
        worker = self.workers[flight.worker]
        if flight in worker.flights:
            worker.flights.discard(flight)
            self.balancer.release(flight.worker)

    def _failure(self, flight: _Flight, message: str, count: bool = True) -> APIError:
        """The error for a request whose worker failed; ``count``: it fails the client's
        request (``radixserve_router_worker_failures_total``), rather than being retried."""
        if count:
            self.failed.labels(self.workers[flight.worker].url).inc()
        # an unanswered connection error may be a worker that just died: check it now
        asyncio.get_running_loop().create_task(self._check(flight.worker))
        return APIError(502, message, type_="worker_error", code="worker_failed")

    async def proxy_generation(self, request: HTTPRequest) -> Response | StreamResponse:
        """Route a generation request. A worker that fails before its answer has sent a
        byte of output (it refused the connection, broke it, answered 503, or its stream's
        first event is an engine failure) is left out and the request goes to another
        healthy worker, transparently; once output has flowed, a failure ends the answer
        with an error as before."""
        answer, _ = await self._route(request)
        return answer

    async def _route(
        self, request: HTTPRequest, pinned: int | None = None
    ) -> tuple[Response | StreamResponse, int]:
        """``proxy_generation``'s work; the answer and the worker that gave it. ``pinned``:
        only that worker may answer. A request that has sent nothing to its client is never
        failed while a worker may still take it: when its worker dies under it, or every
        worker refuses it as overloaded, or none is healthy, it waits (backpressure, up to
        ``retry_timeout_s``) for one that can, and is sent again; after ``max_retries``
        worker failures, or past the timeout, its answer is the last failure (a 503 with
        Retry-After when no worker was left at all)."""
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None  # the worker answers it (400)
        key = routing_key(request.path, body)
        namespace = routing_namespace(self.config.prefix_cache_scope, request.headers, body)
        model = body.get("model") if isinstance(body, dict) else None
        loop = asyncio.get_running_loop()
        deadline: float | None = None  # set when the request first fails or waits
        avoid = _Avoid()
        failures = 0
        last_failure: APIError | Response | None = None
        last_worker = -1
        while True:
            now = loop.time()
            if last_failure is not None and failures > self.config.max_retries:
                return self._give_up(last_failure, last_worker)
            excluded = avoid.excluded(self.workers, now)
            try:
                if pinned is None:
                    excluded |= self.model_excluded(model, excluded)
                    decision = self.balancer.choose(key, excluded, namespace)
                elif pinned in excluded or not self.workers[pinned].healthy:
                    raise NoWorkerAvailable(self.workers[pinned].url)
                else:
                    decision = Decision(pinned, "pinned", 0)
                    self.balancer.load[pinned] += 1  # released by _finish
            except NoWorkerAvailable:
                if deadline is None:
                    deadline = now + self.config.retry_timeout_s
                if now < deadline:
                    wait = deadline - now
                    backoff = avoid.next_change(self.workers, now)
                    if backoff is not None:  # (else: one coming back wakes it)
                        wait = min(wait, backoff)
                    await self._wait_for_worker(wait)
                    continue
                if last_failure is not None:
                    return self._give_up(last_failure, last_worker)
                if pinned is not None:
                    raise _unavailable(self.workers[pinned].url) from None
                raise APIError(
                    503,
                    "no healthy worker to send the request to",
                    type_="service_unavailable_error",
                    code="no_healthy_worker",
                    retry_after_s=self.config.health_check_interval_s,
                ) from None
            worker = decision.worker
            url = self.workers[worker].url
            self.requests.labels(url).inc()
            self.routing.labels(url, decision.outcome).inc()
            epoch = self.workers[worker].epoch
            flight = self._launch(worker, "POST", request.path, request)
            try:
                answer = await self._first_output(flight, request.path)
            except BaseException:
                self._finish(flight)
                raise
            if not isinstance(answer, Retry):
                known = self.workers[worker].models
                if (
                    getattr(answer, "status", 200) == 200
                    and isinstance(model, str)
                    and known is not None
                    and known.get(model) == "unloaded"
                ):
                    known[model] = "loaded"  # (it answered: the next ones go there too)
                return answer, worker
            self._finish(flight)
            if deadline is None:  # the budget counts from the first failure
                deadline = loop.time() + self.config.retry_timeout_s
            if answer.refused:  # nothing listens there: out at once
                self.take_out(worker, "refused a connection")
            else:
                if answer.failure is None:
                    answer.failure = self._failure(flight, answer.message, count=False)
                last_failure, last_worker = answer.failure, worker
            if answer.busy:
                avoid.add(worker, epoch, _BUSY_BACKOFF_S, loop.time())
            else:
                failures += 1
                avoid.add(worker, epoch, _FAILED_BACKOFF_S, loop.time())
            self.retried.labels(url).inc()

    def _give_up(
        self, failure: APIError | Response, worker: int
    ) -> tuple[Response | StreamResponse, int]:
        """No worker took the request in time, or too many failed it: its answer is the
        last failure (a worker's own 503 as it came, or the router's error)."""
        self.failed.labels(self.workers[worker].url).inc()
        if isinstance(failure, Response):
            return failure, worker
        raise failure from None

    async def _wait_for_worker(self, timeout: float) -> None:
        """Wait until a worker comes back (passes a health check after being out) or
        ``timeout`` seconds pass (a backoff ends), counted as queued in the metrics."""
        self.queued += 1
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._back.wait(), timeout=max(timeout, 0.01))
        finally:
            self.queued -= 1

    def _worker_back(self, i: int) -> None:
        """Worker ``i`` passed a health check after being out: requests waiting for a
        worker look again."""
        self.workers[i].epoch += 1
        self._back.set()
        self._back = asyncio.Event()

    # -- Responses: a stored response lives in the replica that made it ---------------------
    async def proxy_responses(self, request: HTTPRequest) -> Response | StreamResponse:
        """``POST /v1/responses``: one that continues a stored response goes to the replica
        holding it (its prefix is cached there too); any other is routed by its prompt. The
        new response's id is remembered with the replica that answered."""
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        user = body.get("user") if isinstance(body, dict) else None
        who = requester(request.headers)
        pinned = None
        if isinstance(previous, str):
            pinned = await self._owner(previous, request, who, user)
            if pinned is None:
                raise APIError(
                    404,
                    f"Previous response with id '{previous}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        answer, worker = await self._route(request, pinned)
        if isinstance(answer, StreamResponse):
            first = answer.frames.buffer if isinstance(answer.frames, _Frames) else b""
        else:
            first = answer.body if answer.status == 200 else b""
        found = _RESPONSE_ID.search(first)
        if found:
            self._remember(found.group(1).decode(), worker, who)
        return answer

    async def proxy_stored(self, request: HTTPRequest) -> Response:
        """``GET`` or ``DELETE /v1/responses/{id}``: to the replica holding it."""
        response_id = request.path_params["response_id"]
        worker = await self._owner(response_id, request, requester(request.headers))
        if worker is None:
            raise APIError(
                404,
                f"No response with id '{response_id}' found (never stored, deleted or evicted).",
                param="response_id",
                code="response_not_found",
            )
        flight, kind, value = await self._ask(worker, request)
        if kind != "head":
            self._finish(flight)
            raise self._failure(flight, value)
        answer = await self._whole(flight, *value)
        if request.method == "DELETE" and answer.status in (200, 404):
            self.response_owner.pop(response_id, None)
        return answer

    def _remember(self, response_id: str, worker: int, who: str) -> None:
        self.response_owner[response_id] = (worker, who)
        self.response_owner.move_to_end(response_id)
        while len(self.response_owner) > MAX_RESPONSE_OWNERS:
            self.response_owner.popitem(last=False)

    async def _owner(
        self, response_id: str, request: HTTPRequest, who: str, user: Any = None
    ) -> int | None:
        """The worker holding a stored response for the requester ``who``: the one
        remembered when a request sent alike (``requester``) made it, else the first
        healthy one that answers this request's credentials with it (the router restarted
        or forgot it, or another key, such as the admin's, asks; ``user``: the body's, a
        sub-tenant, asked as ``x-tenant``); None if none does. Only to a requester like its
        maker is a remembered worker that is out a 503 (its store may come back with it):
        anyone else learns nothing the replicas would not tell them. An id found by asking
        is not remembered: who asked is not known to be who made it."""
        remembered = self.response_owner.get(response_id)
        if remembered is not None and remembered[1] == who:
            worker = remembered[0]
            if not self.workers[worker].healthy:
                raise _unavailable(self.workers[worker].url)
            self.response_owner.move_to_end(response_id)
            return worker
        assert self.http is not None
        headers = self._headers(request)
        if isinstance(user, str) and user and "x-tenant" not in headers:
            headers["x-tenant"] = user  # (the replica reads it as the body's user)

        async def has_it(i: int) -> bool:
            url = f"{self.workers[i].url}{RESPONSES_PATH}/{response_id}"
            try:
                answer = await self.http.get(
                    url, headers=headers, timeout=self.config.health_check_timeout_s
                )
            except httpx.HTTPError:  # a hung or dead replica does not hold it up
                return False
            return answer.status_code == 200

        healthy = [i for i, w in enumerate(self.workers) if w.healthy]
        found = await asyncio.gather(*(has_it(i) for i in healthy))
        for i, yes in zip(healthy, found, strict=True):
            if yes:
                return i
        return None

    async def _first_output(self, flight: _Flight, path: str) -> Response | StreamResponse | Retry:
        """The worker's answer once its first output is in: a whole response, or a stream
        whose first complete event is there; ``Retry`` if it failed before any."""
        kind, value = await flight.queue.get()
        if kind == "connect":
            return Retry(value, refused=True)
        if kind != "head":
            return Retry(value)
        status, content_type = value
        if not (status == 200 and content_type and content_type.startswith("text/event-stream")):
            whole = await self._whole(flight, status, content_type)
            retry = retry_of_whole_answer(status, whole.body)
            if retry is not None:
                retry.failure = whole  # (answered as it came if no worker takes it)
                return retry
            return whole
        buffer = b""
        start = 0  # where the next event not yet looked at begins
        while True:
            kind, value = await flight.queue.get()
            if kind != "data":
                return Retry(value if kind != "end" else "the stream ended before any output")
            buffer += value
            while (cut := buffer.find(b"\n\n", start)) >= 0:
                event, start = buffer[start : cut + 2], cut + 2
                if any(mark in event for mark in PREAMBLE):
                    continue  # nothing generated yet: hold it back
                failed = failed_before_output(event)
                if failed is not None:
                    return failed
                return StreamResponse(_Frames(self, flight, buffer, path == MESSAGES_PATH))

    async def _whole(self, flight: _Flight, status: int, content_type: str | None) -> Response:
        chunks: list[bytes] = []
        try:
            while True:
                kind, value = await flight.queue.get()
                if kind == "data":
                    chunks.append(value)
                elif kind == "end":
                    break
                else:
                    raise self._failure(flight, value)
        finally:
            self._finish(flight)
        headers = [(b"content-type", (content_type or "application/json").encode("latin-1"))]
        return Response(b"".join(chunks), status, headers)

    async def _ask(self, worker: int, request: HTTPRequest) -> tuple[_Flight, str, Any]:
        """Send ``request`` as it came to ``worker`` (counted in its load until ``_finish``)
        and wait for the first item of its answer: ``head`` or a failure."""
        self.balancer.load[worker] += 1  # released by _finish
        flight = self._launch(worker, request.method, request.path, request)
        try:
            kind, value = await flight.queue.get()
        except BaseException:
            self._finish(flight)
            raise
        return flight, kind, value

    async def forward_any(self, request: HTTPRequest) -> Response:
        """A request any worker serving its model can answer (tokenization, rendering):
        the next healthy one.
        These requests change nothing, so one whose worker failed before answering (it
        refused the connection, or was taken out while the request was on its way) goes
        to another healthy worker."""
        tried: set[int] = set()
        last_failure: APIError | None = None
        last_worker = -1
        try:
            body = orjson.loads(request.body) if request.body else None
        except orjson.JSONDecodeError:
            body = None  # (the worker answers it)
        model = body.get("model") if isinstance(body, dict) else None
        while True:
            elsewhere = self.model_excluded(model, frozenset(tried))
            healthy = [
                i
                for i, w in enumerate(self.workers)
                if w.healthy and i not in tried and i not in elsewhere
            ]
            if not healthy:
                if last_failure is not None:  # no worker left to ask: it fails now
                    self.failed.labels(self.workers[last_worker].url).inc()
                    raise last_failure
                raise APIError(
                    503, "no healthy worker", "service_unavailable_error", code="no_healthy_worker"
                )
            self._rr += 1
            i = healthy[self._rr % len(healthy)]
            tried.add(i)
            flight, kind, value = await self._ask(i, request)
            if kind == "head":
                return await self._whole(flight, *value)
            self._finish(flight)
            if kind == "connect":  # nothing reached it: take it out, ask another
                self.take_out(i, "refused a connection")
            else:  # failed before its answer began (not a failed request yet): ask another
                last_failure, last_worker = self._failure(flight, value, count=False), i
            self.retried.labels(self.workers[i].url).inc()

    async def list_models(self, request: HTTPRequest) -> Response:
        """``GET /v1/models``: every healthy worker's list, asked with the client's
        credentials, as one: each model once, ``loaded`` where any worker has it loaded
        (else ``loading``, else ``unloaded``). No worker answering 200: the first answer
        (a 401 as the workers gave it), or a 503 when none answered at all."""
        assert self.http is not None
        healthy = [i for i, w in enumerate(self.workers) if w.healthy]
        headers = self._headers(request)

        async def ask(i: int) -> httpx.Response | None:
            try:
                return await self.http.get(
                    self.workers[i].url + "/v1/models",
                    headers=headers,
                    timeout=self.config.health_check_timeout_s,
                )
            except httpx.HTTPError:
                return None

        answers = await asyncio.gather(*(ask(i) for i in healthy))
        rank = {"loaded": 0, "loading": 1, "unloading": 2, "unloaded": 3}
        cards: dict[str, dict[str, Any]] = {}
        answered = False
        for answer in answers:
            if answer is None or answer.status_code != 200:
                continue
            try:
                data = answer.json().get("data")
            except (ValueError, AttributeError):
                continue
            answered = True
            for card in data if isinstance(data, list) else ():
                if not isinstance(card, dict) or not isinstance(card.get("id"), str):
                    continue
                seen = cards.setdefault(card["id"], card)
                status = card.get("status") or "loaded"  # (a single-model server's card)
                if seen is not card and rank.get(status, 9) < rank.get(
                    seen.get("status") or "loaded", 9
                ):
                    seen["status"] = status
        if answered:
            return json_response({"object": "list", "data": list(cards.values())})
        for answer in answers:
            if answer is not None:
                headers_out = [(b"content-type", b"application/json")]
                return Response(answer.content, answer.status_code, headers_out)
        raise APIError(
            503, "no healthy worker", "service_unavailable_error", code="no_healthy_worker"
        )

    # -- routes ---------------------------------------------------------------------------
    def _build_app(self) -> ASGIApp:
        app = ASGIApp(self.config.max_body_bytes, lambda _: None, self.start, self.shutdown)
        for path in GENERATION_PATHS:
            app.route("POST", path, watch_disconnect=True)(self.proxy_generation)
        app.route("POST", RESPONSES_PATH, watch_disconnect=True)(self.proxy_responses)
        app.route("GET", RESPONSES_PATH + "/{response_id}")(self.proxy_stored)
        app.route("DELETE", RESPONSES_PATH + "/{response_id}")(self.proxy_stored)
        app.error_shapes[MESSAGES_PATH] = anthropic_error  # the router's own 502/503s too
        for path in (
            "/tokenize",
            "/detokenize",
            f"{MESSAGES_PATH}/count_tokens",
            "/v1/completions/render",
            "/v1/chat/completions/render",
        ):
            app.route("POST", path)(self.forward_any)
        app.route("GET", "/v1/models")(self.list_models)

        @app.route("GET", "/health")
        async def health(_: HTTPRequest) -> Response:
            if any(w.healthy for w in self.workers):
                return Response(headers=[])
            return json_response(
                APIError(503, "no healthy worker", "service_unavailable_error").body(), 503
            )

        @app.route("GET", "/metrics")
        async def metrics(_: HTTPRequest) -> Response:
            return Response(
                generate_latest(self.registry),
                headers=[(b"content-type", b"text/plain; version=0.0.4")],
            )

        @app.route("GET", "/workers")
        async def workers(_: HTTPRequest) -> Response:
            return json_response(
                {
                    "policy": self.config.policy,
                    "workers": [
                        {
                            "url": w.url,
                            "healthy": w.healthy,
                            "load": self.balancer.load[i],
                            "tree_size": self.balancer.trees[i].size,
                            # (how many names it serves: which ones is for keys to see)
                            "models": None if w.models is None else len(w.models),
                        }
                        for i, w in enumerate(self.workers)
                    ],
                }
            )

        return app


class _Frames:
    """The SSE frames of a streamed answer, whole events only (a partial event held back
    until its end arrives). If the worker fails mid-stream the stream ends with an
    OpenAI-shaped error event and ``[DONE]`` (a Messages stream: Anthropic's ``error``
    event). ``aclose`` (the client left, or the answer
    ended) stops reading the worker, which aborts the request there."""

    def __init__(
        self, router: Router, flight: _Flight, buffer: bytes = b"", anthropic: bool = False
    ) -> None:
        """``buffer``: what the worker sent already (whole events come out first);
        ``anthropic``: a Messages stream (its error event has Anthropic's shape)."""
        self.router, self.flight = router, flight
        self.buffer = buffer
        self.anthropic = anthropic
        self.done = False

    def __aiter__(self) -> _Frames:
        return self

    async def __anext__(self) -> bytes:
        if self.done:
            raise StopAsyncIteration
        queue = self.flight.queue
        cut = self.buffer.rfind(b"\n\n")
        if cut >= 0:  # events already in (the first ones, read before the stream began)
            frames, self.buffer = self.buffer[: cut + 2], self.buffer[cut + 2 :]
            return frames
        while True:
            kind, value = await queue.get()
            if kind == "data":
                self.buffer += value
                cut = self.buffer.rfind(b"\n\n")
                if cut >= 0:
                    frames, self.buffer = self.buffer[: cut + 2], self.buffer[cut + 2 :]
                    return frames
                continue
            self.done = True
            self.router._finish(self.flight)
            if kind == "end":
                if self.buffer:
                    return self.buffer
                raise StopAsyncIteration
            error = self.router._failure(self.flight, value)
            if self.anthropic:
                return b"event: error\ndata: " + anthropic_error(error).body + b"\n\n"
            return b"data: " + orjson.dumps(error.body()) + b"\n\n" + _DONE

    async def aclose(self) -> None:
        self.done = True
        self.router._finish(self.flight)


class _RouterCollector(Collector):
    """Per-worker gauges (load: requests in flight, health, tree size) and the requests
    waiting for a worker."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator:
        r = self.router
        load = GaugeMetricFamily(
            "radixserve_router_worker_load", "Requests in flight per worker", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "radixserve_router_worker_healthy", "1 while the worker is in", labels=["worker"]
        )
        tree = GaugeMetricFamily(
            "radixserve_router_tree_size",
            "Characters in the worker's approximate prefix tree",
            labels=["worker"],
        )
        queued = GaugeMetricFamily(
            "radixserve_router_queued_requests",
            "Requests waiting for a worker to take them (theirs died or refused them as "
            "overloaded, or none is healthy)",
        )
        queued.add_metric([], r.queued)
        yield queued
        for i, w in enumerate(r.workers):
            load.add_metric([w.url], r.balancer.load[i])
            healthy.add_metric([w.url], 1.0 if w.healthy else 0.0)
            tree.add_metric([w.url], r.balancer.trees[i].size)
        yield from (load, healthy, tree)


def create_router_app(config: RouterConfig) -> ASGIApp:
    return Router(config).app
