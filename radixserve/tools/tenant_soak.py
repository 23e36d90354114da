"""Two-tenant soak of a live server (``radixserve soak --tenants``): a heavy tenant floods
long token-id prompts from ``--heavy-concurrency`` clients while a light tenant sends one
short streamed request after another; the light tenant's time to first token is measured
alone and under the flood, for each policy of ``--tenant-policies`` (one launched server
each, with a keys file naming the two tenants and ``--schedule-policy``).

``light_tenant_ttft_p99_ratio`` (last-line JSON) is the light tenant's p99 TTFT under the
flood divided by its p99 TTFT alone, both on the same server, with the first policy
(``fair`` by default); ``light_tenant_ttft_p99_ratio_<policy>`` the same for the others.
``lost`` counts requests with no complete answer, ``unexpected_5xx`` any 5xx; the exit code
is 1 if either is non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

import orjson

from radixserve.tools.soak import Lost, http, launch, percentiles

KEYS = {"heavy": "soak-heavy-key-0001", "light": "soak-light-key-0001"}


class TenantSoak:
    """One server, two tenants. Invariant: every request sent is counted once, in
    ``ttfts`` (light, answered), ``ok`` (heavy, answered), ``lost`` or ``errors``."""

    def __init__(self, args: argparse.Namespace, port: int) -> None:
        self.args = args
        self.port = port
        self.rng = random.Random(args.seed)
        self.lost = 0
        self.errors: dict[int, int] = {}
        self.heavy_ok = 0

    def _headers(self, tenant: str) -> dict[str, str]:
        return {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tenant]}"}

    def _prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, 200) for _ in range(length)]

    async def _post(self, tenant: str, body: dict) -> tuple[float, object | None]:
        started = time.monotonic()
        try:
            answer = await http(
                "127.0.0.1",
                self.port,
                "POST",
                "/v1/completions",
                orjson.dumps(body),
                self._headers(tenant),
                timeout_s=self.args.request_timeout,
            )
        except Lost:
            self.lost += 1
            return started, None
        if answer.status != 200:
            self.errors[answer.status] = self.errors.get(answer.status, 0) + 1
            return started, None
        if body.get("stream") and (not answer.events or answer.events[-1][1] != b"[DONE]"):
            self.lost += 1
            return started, None
        return started, answer

    async def light(self, stop_at: float) -> list[float]:
        """Light requests one after another until ``stop_at`` (at least one)."""
        ttfts: list[float] = []
        sent = 0
        while sent == 0 or time.monotonic() < stop_at:
            sent += 1
            body = {
                "prompt": self._prompt(self.args.light_prompt),
                "max_tokens": self.args.light_max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            started, answer = await self._post("light", body)
            if answer is not None:
                ttfts.append(answer.events[0][0] - started)  # type: ignore[attr-defined]
            await asyncio.sleep(self.args.light_gap)
        return ttfts

    async def heavy(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            body = {
                "prompt": self._prompt(self.args.heavy_prompt),
                "max_tokens": self.args.heavy_max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            _, answer = await self._post("heavy", body)
            self.heavy_ok += answer is not None

    async def phase(self, flood: bool) -> list[float]:
        stop_at = time.monotonic() + self.args.phase_s
        heavy = [
            asyncio.create_task(self.heavy(stop_at))
            for _ in range(self.args.heavy_concurrency if flood else 0)
        ]
        if heavy:
            await asyncio.sleep(self.args.flood_lead_s)  # the flood is on before measuring
        ttfts = await self.light(stop_at)
        await asyncio.gather(*heavy)
        return ttfts


def _p99(values: list[float]) -> float | None:
    return percentiles(values)["p99"] if values else None


def run_tenant_soak(args: argparse.Namespace) -> int:
    report: dict = {"policies": {}}
    lost = unexpected = 0
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "tenants.keys"
        keys_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        for policy in args.tenant_policies.split(","):
            launch_args = copy.copy(args)
            launch_args.serve_args = [
                *args.serve_args,
                "--api-keys-file",
                str(keys_file),
                "--schedule-policy",
                policy,
            ]
            proc, port = launch(launch_args)
            try:
                soak = TenantSoak(args, port)
                asyncio.run(soak.light(time.monotonic()))  # one warm-up request, not counted
                alone = asyncio.run(soak.phase(flood=False))
                flood = asyncio.run(soak.phase(flood=True))
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            lost += soak.lost
            unexpected += sum(n for status, n in soak.errors.items() if status >= 500)
            p_alone, p_flood = _p99(alone), _p99(flood)
            ratio = p_flood / p_alone if p_alone and p_flood is not None else None
            report["policies"][policy] = {
                "light_alone_ttft_s": percentiles(alone),
                "light_flood_ttft_s": percentiles(flood),
                "light_requests": [len(alone), len(flood)],
                "heavy_requests_done": soak.heavy_ok,
                "errors": soak.errors,
                "ratio": None if ratio is None else round(ratio, 3),
            }
            print(
                f"{policy:>8}: light TTFT p99 alone {p_alone} s, under the flood {p_flood} s "
                f"(x{ratio}); heavy requests answered {soak.heavy_ok}"
            )
    first, *others = args.tenant_policies.split(",")
    report["light_tenant_ttft_p99_ratio"] = report["policies"][first]["ratio"]
    for policy in others:
        report[f"light_tenant_ttft_p99_ratio_{policy}"] = report["policies"][policy]["ratio"]
    report["lost"], report["unexpected_5xx"] = lost, unexpected
    print(json.dumps(report))
    return 1 if lost or unexpected else 0


def add_tenant_soak_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--tenants: a heavy and a light tenant (tools/tenant_soak.py)")
    g.add_argument("--tenants", action="store_true", help="run the two-tenant soak instead")
    g.add_argument("--tenant-policies", default="fair,fcfs", help="one server each; the first's ratio is light_tenant_ttft_p99_ratio")  # fmt: skip
    g.add_argument("--phase-s", type=float, default=60.0, help="seconds alone, then flooded")
    g.add_argument("--flood-lead-s", type=float, default=5.0)
    g.add_argument("--heavy-concurrency", type=int, default=8)
    g.add_argument("--heavy-prompt", type=int, default=1024, help="tokens")
    g.add_argument("--heavy-max-tokens", type=int, default=32)
    g.add_argument("--light-prompt", type=int, default=32, help="tokens")
    g.add_argument("--light-max-tokens", type=int, default=8)
    g.add_argument("--light-gap", type=float, default=0.2, help="seconds between requests")
