"""Soak across a deployment (``radixserve soak --router``): two ``radixserve serve``
replicas (the serve flags after ``--``) and ``radixserve router`` over them, all on
127.0.0.1, driven through the router with the single-server soak's request mix (tenant
``mixed``) plus a flooding tenant (``heavy``: long token-id prompts, streamed, from
``--heavy-concurrency`` clients) and a light one (``light``: one short streamed request
after another), while a killer SIGKILLs one replica's engine process at random intervals
(exponential with mean ``--kill-every`` seconds, clipped to [0.25, 3] × the mean, seeded by
``--seed``) and the replica's supervisor restarts it.

Before all that, the light tenant runs alone through the router for ``--light-alone-s``
seconds (no other tenant, no kill), then for ``--flood-only-s`` seconds with the flooding
tenant only (no mixed traffic, no kill): ``light_tenant_ttft_p99_ratio`` is its p99 TTFT
with the flooder present over its p99 alone. ``light_tenant_ttft_p99_ratio_all_traffic``
is the same over the main phase (flood, mixed traffic, bursts and kills);
``light_tenant_ttft_p99_ratio_between_kills`` leaves out of that the light requests that
started or waited for their first token between a kill and the killed replica's return
(when the deployment is one replica short).

The engine process is killed, not the whole replica: the replica's HTTP server stays up and
answers 503 ``engine_dead``/``engine_restarting`` until its engine is back, which is the
path a replica takes in production when its engine crashes, and the one on which the
router can retry (a request that failed before any output goes to the other replica). A
kill happens only while every replica is healthy, and the next waits until the killed
replica serves again, so one replica always serves. The victim is the replica with the
most requests in flight as the router sees them (ties broken by the seeded generator), so
that a kill meets requests.

Every request ends in one outcome (``soak.OUTCOMES`` plus ``failed_midstream``: a stream
that had produced output and ended with an engine or worker failure event then
``[DONE]``, while a kill happened during it — an expected error). ``lost``: no complete
answer; ``unexpected_5xx``: any other 5xx, including a failure event in a stream with no
kill during it. ``retried`` is the router's ``radixserve_router_retries_total`` summed over
workers (it also counts requests a replica refused as overloaded, sent to another);
``retried_around_kills`` the part of it from just before each kill until the router has
the replica back. At the end each replica's engine must go idle and its KV pages all be free
(``/debug/flush_cache``). The last line is JSON with ``lost``, ``unexpected_5xx``,
``retried``, ``light_tenant_ttft_p99_ratio``, ``failed_midstream``, ``kills``, per-tenant
TTFT and the rest; the exit code is
1 if any of lost, unexpected_5xx, wrong, pages_leaked is non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from radixserve.tools.soak import (
    OUTCOMES,
    Lost,
    Outcome,
    Soak,
    free_port,
    http,
    launch,
    percentiles,
)

ROUTER_OUTCOMES = (*OUTCOMES, "failed_midstream")
# a stream's failure event that a killed engine explains: the replica's own (its engine
# died under the stream) or the router's (it took the replica out under the stream)
MIDSTREAM_CODES = {"engine_dead", "engine_hung", "engine_restarting", "worker_failed"}
KEYS = {
    "mixed": "soak-mixed-key-0001",
    "heavy": "soak-heavy-key-0001",
    "light": "soak-light-key-0001",
}
# a kill this long before a stream's first event may still be the one that cut it (the
# event was on its way through the router when the engine died)
KILL_SLACK_S = 1.0


class RouterSoak(Soak):
    """One tenant's traffic through the router. Invariant: as ``Soak``, every request sent
    ends in exactly one outcome (``ROUTER_OUTCOMES``); a stream failure counts as
    ``failed_midstream`` only when output had started and a kill (``kill_times``, shared
    with the killer) fell between its first event and its failure event."""

    def __init__(
        self, args: argparse.Namespace, port: int, tenant: str, kill_times: list[float]
    ) -> None:
        tenant_args = copy.copy(args)
        tenant_args.api_key = KEYS[tenant]
        super().__init__(tenant_args, "127.0.0.1", port)
        self.rng = random.Random(f"{args.seed}-{tenant}")
        self.tenant = tenant
        self.kill_times = kill_times

    def stream_error(self, events: list[tuple[float, bytes]]) -> str | None:
        for i, (t, data) in enumerate(events):
            if not data.startswith(b'{"error"'):
                continue
            code = orjson.loads(data)["error"].get("code")
            first = events[0][0]
            killed = any(first - KILL_SLACK_S <= k <= t for k in self.kill_times)
            if i > 0 and code in MIDSTREAM_CODES and killed:
                return "failed_midstream"
            break
        return super().stream_error(events)

    async def heavy_one(self) -> Outcome:
        length = min(self.args.heavy_prompt, self.max_model_len - self.args.heavy_max_tokens - 1)
        body = {
            "model": self.model,
            "prompt": self.token_prompt(length),
            "max_tokens": self.args.heavy_max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out = await self.guard(
            "heavy", self.generation("/v1/completions", body, length, chat=False)
        )
        out.kind = "heavy"
        return out

    async def light_one(self) -> Outcome:
        body = {
            "model": self.model,
            "prompt": self.token_prompt(self.args.light_prompt),
            "max_tokens": self.args.light_max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out = await self.guard(
            "light", self.generation("/v1/completions", body, self.args.light_prompt, chat=False)
        )
        out.kind = "light"
        return out


class Deployment:
    """The replicas and the router, launched here. Invariant: ``stop`` ends every process
    ``start`` began (the router first, so no request is routed to a stopping replica)."""

    def __init__(self, args: argparse.Namespace, keys_file: Path) -> None:
        self.args = args
        self.keys_file = keys_file
        self.replicas: list[tuple[subprocess.Popen, int]] = []
        self.router: subprocess.Popen | None = None
        self.router_port = 0

    def start(self) -> None:
        serve_args = [*self.args.serve_args, "--api-keys-file", str(self.keys_file)]
        if "--schedule-policy" not in serve_args:
            serve_args += ["--schedule-policy", self.args.tenant_policies.split(",")[0]]
        launch_args = copy.copy(self.args)
        launch_args.serve_args = serve_args
        for _ in range(self.args.replicas):
            self.replicas.append(launch(launch_args))
        self.router_port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "radixserve.cli",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.router_port),
            "--policy",
            self.args.router_policy,
            "--health-check-interval",
            str(self.args.router_health_interval),
            "--health-check-timeout",
            "2",
            *[x for _, port in self.replicas for x in ("--worker", f"http://127.0.0.1:{port}")],
        ]
        print("soak: launching", " ".join(cmd), file=sys.stderr)
        self.router = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited during startup ({self.router.returncode})")
            with contextlib.suppress(Lost, OSError, ValueError, KeyError):
                state = asyncio.run(self.workers())
                if all(w["healthy"] for w in state):
                    return
            time.sleep(0.2)
        raise RuntimeError("the router did not see every replica healthy in time")

    async def workers(self) -> list[dict]:
        answer = await http("127.0.0.1", self.router_port, "GET", "/workers", timeout_s=5)
        return orjson.loads(answer.body)["workers"]

    def stop(self) -> None:
        procs = ([self.router] if self.router is not None else []) + [p for p, _ in self.replicas]
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


async def healthy(port: int) -> bool:
    with contextlib.suppress(Lost, OSError):
        return (await http("127.0.0.1", port, "GET", "/health", timeout_s=2)).status == 200
    return False


# a phase that measures a percentile goes on past its deadline until it has this many
# samples: on a loaded machine a light request can take a second, and a p99 of two
# requests says nothing
MIN_PHASE_SAMPLES = 5


async def repeat_until(deadline: float, make, gap: float = 0.0, at_least: int = 0) -> list[Outcome]:
    """``await make()`` one request after another (``gap`` seconds apart) until
    ``deadline`` and at least ``at_least`` of them; their outcomes."""
    outs: list[Outcome] = []
    while time.monotonic() < deadline or len(outs) < at_least:
        outs.append(await make())
        if gap:
            await asyncio.sleep(gap)
    return outs


async def router_soak_main(args: argparse.Namespace, deployment: Deployment) -> dict:
    kill_times: list[float] = []
    port = deployment.router_port
    mixed = RouterSoak(args, port, "mixed", kill_times)
    heavy = RouterSoak(args, port, "heavy", kill_times)
    light = RouterSoak(args, port, "light", kill_times)
    for s in (mixed, heavy, light):
        await s.setup()
    replicas = [RouterSoak(args, p, "mixed", kill_times) for _, p in deployment.replicas]
    kill_log: list[dict[str, Any]] = []
    skipped = 0
    # the light tenant alone through the router first (no other tenant, no kill): the
    # baseline of light_tenant_ttft_p99_ratio
    alone_until = time.monotonic() + args.light_alone_s
    await light.light_one()  # one warm-up request, not counted
    alone = await repeat_until(alone_until, light.light_one, args.light_gap, MIN_PHASE_SAMPLES)
    # then with the flooding tenant only (no other traffic, no kill): the light tenant's
    # TTFT with the flooder present, light_tenant_ttft_p99_ratio's numerator
    flooded: list[Outcome] = []
    flood_heavy: list[Outcome] = []
    if args.flood_only_s > 0:
        flood_until = time.monotonic() + args.flood_lead_s + args.flood_only_s

        measured = asyncio.Event()

        async def flood_light() -> list[Outcome]:
            try:
                await asyncio.sleep(args.flood_lead_s)  # the flood is on before measuring
                return await repeat_until(
                    flood_until, light.light_one, args.light_gap, MIN_PHASE_SAMPLES
                )
            finally:
                measured.set()

        async def flood_heavy() -> list[Outcome]:
            outs: list[Outcome] = []  # the flood lasts as long as the light tenant measures
            while not measured.is_set():
                outs.append(await heavy.heavy_one())
            return outs

        flooded, *heavies = await asyncio.gather(
            flood_light(), *[flood_heavy() for _ in range(args.heavy_concurrency)]
        )
        flood_heavy = [o for outs in heavies for o in outs]
    started = time.monotonic()
    deadline = started + args.duration

    async def router_retries() -> float | None:
        with contextlib.suppress(Lost, OSError, ValueError):
            answer = await http("127.0.0.1", port, "GET", "/metrics", timeout_s=30)
            return labelled_sum(answer.body.decode(), "radixserve_router_retries_total")
        return None

    async def killer() -> None:
        nonlocal skipped
        rng = random.Random(f"{args.seed}-kills")
        mean = args.kill_every
        while True:
            gap = min(max(rng.expovariate(1 / mean), mean / 4), 3 * mean)
            if time.monotonic() + gap > deadline - 2:
                return
            await asyncio.sleep(gap)
            if time.monotonic() > deadline - 2:
                return
            try:
                state = await deployment.workers()
                up = [await healthy(r.port) for r in replicas]
            except (Lost, OSError, ValueError, KeyError):
                skipped += 1
                continue
            if not all(up) or not all(w["healthy"] for w in state):
                skipped += 1  # one is still coming back: one replica must always serve
                continue
            most = max(w["load"] for w in state)
            victim = rng.choice([i for i, w in enumerate(state) if w["load"] == most])
            info = (await replicas[victim].get("/debug/engine")).json()
            pid = info["engine_pid"]
            retries_before = await router_retries()
            os.kill(pid, signal.SIGKILL)
            at = time.monotonic()
            kill_times.append(at)
            entry: dict[str, Any] = {
                "t_s": round(at - started, 1),
                "replica": victim,
                "load": most,
                "restart_s": None,
                "retried": None,
            }
            kill_log.append(entry)
            print(
                f"soak: killed replica {victim}'s engine (pid {pid}, load {most})", file=sys.stderr
            )
            while time.monotonic() - at < args.restart_timeout:
                await asyncio.sleep(0.2)
                with contextlib.suppress(Lost, ValueError, KeyError):
                    now = (await replicas[victim].get("/debug/engine")).json()
                    back = now["engine_pid"] != pid and now["state"] == "running"
                    if back and await healthy(replicas[victim].port):
                        entry["restart_s"] = round(time.monotonic() - at, 2)
                        break
            else:
                return  # did not come back: no further kills (the report shows it)
            while time.monotonic() - at < args.restart_timeout:  # the router takes it back
                with contextlib.suppress(Lost, OSError, ValueError, KeyError):
                    if (await deployment.workers())[victim]["healthy"]:
                        break
                await asyncio.sleep(0.2)
            retries_after = await router_retries()
            if retries_before is not None and retries_after is not None:
                entry["retried"] = retries_after - retries_before

    async def bursts() -> None:
        while True:
            await asyncio.sleep(min(args.burst_every, max(deadline - time.monotonic(), 0)))
            if time.monotonic() > deadline - 5:
                return
            mixed.outcomes.extend(await mixed.burst())

    async def mixed_worker() -> None:
        while time.monotonic() < deadline:
            mixed.outcomes.append(await mixed.one())

    tasks = [mixed_worker() for _ in range(args.concurrency)]
    heavy_tasks = [repeat_until(deadline, heavy.heavy_one) for _ in range(args.heavy_concurrency)]
    light_task = repeat_until(deadline, light.light_one, args.light_gap)
    results = await asyncio.gather(killer(), bursts(), light_task, *heavy_tasks, *tasks)
    light.outcomes = results[2]
    heavy.outcomes = flood_heavy + [o for outs in results[3 : 3 + len(heavy_tasks)] for o in outs]
    wall = time.monotonic() - started

    flushes = [await r.idle_flush() for r in replicas]
    engines = [(await r.get("/debug/engine")).json() for r in replicas]
    router_metrics = (await http("127.0.0.1", port, "GET", "/metrics", timeout_s=30)).body
    retried = labelled_sum(router_metrics.decode(), "radixserve_router_retries_total")
    worker_failures = labelled_sum(
        router_metrics.decode(), "radixserve_router_worker_failures_total"
    )

    tenants = {"mixed": mixed.outcomes, "heavy": heavy.outcomes, "light": light.outcomes}
    everything = [o for outs in tenants.values() for o in outs] + alone + flooded
    # light requests under the flood: all of them, and those that neither started nor got
    # their first token between a kill and the killed replica's return (one replica short)
    windows = [
        (k, k + (e["restart_s"] if e["restart_s"] is not None else args.restart_timeout))
        for k, e in zip(kill_times, kill_log, strict=True)
    ]

    def clear(o: Outcome) -> bool:
        end = o.started + (o.ttft_s or 0.0)
        return not any(a - KILL_SLACK_S <= end and o.started <= b for a, b in windows)

    def p99(outs: list[Outcome]) -> float | None:
        ttfts = [o.ttft_s for o in outs if o.ttft_s is not None]
        return percentiles(ttfts)["p99"] if ttfts else None

    p_alone, p_all = p99(alone), p99(light.outcomes)
    p_clear = p99([o for o in light.outcomes if clear(o)])
    p_flooded = p99(flooded)
    counts = Counter(o.outcome for o in everything)
    by_kind: dict[str, Counter] = {}
    for o in everything:
        by_kind.setdefault(o.kind, Counter())[o.outcome] += 1
    bad = [o for o in everything if o.outcome in ("lost", "unexpected_5xx", "wrong")]
    return {
        "requests": len(everything),
        "lost": counts["lost"],
        "unexpected_5xx": counts["unexpected_5xx"],
        "retried": retried,
        "retried_around_kills": sum(k["retried"] or 0 for k in kill_log),
        "failed_midstream": counts["failed_midstream"],
        "kills": len(kill_log),
        "kills_skipped": skipped,
        "wrong": counts["wrong"],
        "pages_leaked": sum(f["pages_leaked"] or 0 for f in flushes),
        "page_check_error": next((f["error"] for f in flushes if f["error"]), None),
        "engine_restarts": [e["restarts"] for e in engines],
        "router_worker_failures": worker_failures,
        "outcomes": {k: counts[k] for k in ROUTER_OUTCOMES},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "tenants": {
            name: {
                "requests": len(outs),
                "ok": sum(o.outcome == "ok" for o in outs),
                "ttft_s": percentiles([o.ttft_s for o in outs if o.ttft_s is not None]),
            }
            for name, outs in tenants.items()
        },
        "light_ttft_p99_s": p_all,
        "light_alone_ttft_s": percentiles([o.ttft_s for o in alone if o.ttft_s is not None]),
        "light_alone_requests": len(alone),
        "light_flood_ttft_s": percentiles([o.ttft_s for o in flooded if o.ttft_s is not None]),
        "light_flood_requests": len(flooded),
        "heavy_flood_requests": len(flood_heavy),
        # with the flooding tenant only ÷ alone (None without --flood-only-s)
        "light_tenant_ttft_p99_ratio": _ratio(p_flooded, p_alone),
        # during the main phase: the flood, the mixed traffic, bursts and kills ÷ alone
        "light_tenant_ttft_p99_ratio_all_traffic": _ratio(p_all, p_alone),
        "light_tenant_ttft_p99_ratio_between_kills": _ratio(p_clear, p_alone),
        "kill_log": kill_log,
        "replicas": len(replicas),
        "duration_s": round(wall, 1),
        "examples": [f"{o.kind}: {o.outcome}: {o.detail}" for o in bad[:10]],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def labelled_sum(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples over its labels."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_router_soak(args: argparse.Namespace) -> int:
    if args.replicas < 2:
        raise ValueError("--replicas must be at least 2 (one serves while another restarts)")
    if args.url is not None:
        raise ValueError("--router launches its own replicas and router; --url is not used")
    if args.kill_every <= 0:
        raise ValueError("--kill-every must be positive")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "tenants.keys"
        keys_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        deployment = Deployment(args, keys_file)
        try:
            deployment.start()
            report = asyncio.run(router_soak_main(args, deployment))
        finally:
            deployment.stop()
    for name, value in report["outcomes"].items():
        print(f"{name:>16}  {value}")
    for name, t in report["tenants"].items():
        print(f"{name:>8}: {t['requests']} requests, {t['ok']} ok, TTFT {t['ttft_s']}")
    print(f"kills {report['kills']} (restart s {[k['restart_s'] for k in report['kill_log']]})")
    print(
        f"light TTFT p99: alone {report['light_alone_ttft_s']['p99']} s "
        f"({report['light_alone_requests']} requests), with the flooder only "
        f"{report['light_flood_ttft_s']['p99']} s ({report['light_flood_requests']} requests): "
        f"light_tenant_ttft_p99_ratio {report['light_tenant_ttft_p99_ratio']}; with all the "
        f"traffic and kills {report['light_ttft_p99_s']} s: "
        f"{report['light_tenant_ttft_p99_ratio_all_traffic']} "
        f"({report['light_tenant_ttft_p99_ratio_between_kills']} between kills)"
    )
    print(
        f"retried {report['retried']} ({report['retried_around_kills']} around kills), "
        f"failed mid-stream {report['failed_midstream']}"
    )
    for line in report["examples"]:
        print("  !", line)
    print(json.dumps(report))
    failed = (
        report["lost"]
        or report["unexpected_5xx"]
        or report["wrong"]
        or report["pages_leaked"]
        or report["page_check_error"]
    )
    return 1 if failed else 0


def add_router_soak_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--router: replicas behind the router, engines killed")
    g.add_argument(
        "--router",
        action="store_true",
        help="soak a router over replicas (with the --heavy-*/--light-* flags of --tenants)",
    )
    g.add_argument("--replicas", type=int, default=2, help="serve processes (at least 2)")
    g.add_argument("--kill-every", type=float, default=15.0, help="mean seconds between kills")
    g.add_argument(
        "--light-alone-s",
        type=float,
        default=20.0,
        help="seconds of the light tenant alone first (the ratio's baseline)",
    )
    g.add_argument(
        "--flood-only-s",
        type=float,
        default=30.0,
        help="then seconds of the light tenant with the flooding tenant only, after "
        "--flood-lead-s (light_tenant_ttft_p99_ratio's numerator; 0: skip)",
    )
    g.add_argument("--restart-timeout", type=float, default=120.0, help="seconds")
    g.add_argument("--router-policy", default="cache-aware", help="the router's --policy")
    g.add_argument("--router-health-interval", type=float, default=0.5, help="seconds")
