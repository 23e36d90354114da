"""KV tiers: a multi-turn chat workload whose conversations do not fit in the KV pool.

    python benchmarks/kv_tiers.py                      # SmolLM2-135M, bfloat16
    python benchmarks/kv_tiers.py --sessions 4 --turns 3   # a quick run

Sessions take turns (one request at a time, as users waiting for replies would): every turn
appends the model's reply and a new user message (text from W1's prompts) to its
conversation and sends the whole conversation again. By default 6 sessions x 6 turns, a
384-token first message, 64-token later ones, 4-token replies: the conversations end at
5.7x the pool (768 tokens), so without tiers a session's history is evicted before it comes
back. The off engine, reset, is the cold side of the restart scenario.

Runs, all in this one invocation: tiers off, host tier (large enough for everything),
host + disk (host tier about 1.5 pools, the rest on disk), and (``--pool-ref``, default on)
no tiers with a pool large enough for everything: the ceiling any tier can reach, and the
exactness check — the host tier moves KV bytes unchanged and matches the same prefixes, so
its greedy outputs must equal this run's token for token even in bfloat16, where both may
differ from tiers off (KV reused from an earlier, differently shaped prefill rounds
differently from KV recomputed in one); then the restart scenario: a
new engine on the warm disk folder replays every session's last conversation, against a
new engine with no tiers (cold). Finally W1 (64 distinct prompts, no hits anywhere) with
tiers off and on, alternated, for the no-hit throughput check.

Prints a table, then one JSON line: ttft_p50_ratio_host (off / host),
ttft_p50_ratio_disk_restart (cold restart / disk-warm restart), hit_rate_off,
hit_rate_tiers (host + disk run), w1_throughput_ratio (tiers on / off), and the rest.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

W1 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w1_offline.jsonl"


def load_w1(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Breakdown:
    """Where a request's time to first token goes: seconds in the cache's promotion (page
    allocation, the demotions it causes and the copies included), in the host-tier copies
    into the pool and out of it, and in the model's forward steps. Installed by wrapping
    those methods (``--breakdown``: this script only); ``rows`` holds one dict per request.
    """

    def __init__(self) -> None:
        from radixserve.core.radix_cache import RadixCache
        from radixserve.executor.kv_tiers import TierTransfer
        from radixserve.executor.model_runner import ModelRunner

        self.acc: dict[str, float] = {}
        self.rows: list[dict[str, float]] = []
        for cls, name, key in (
            (RadixCache, "promote", "promote"),
            (TierTransfer, "load", "copy in"),
            (TierTransfer, "save", "copy out"),
            (ModelRunner, "run", "forward"),
        ):
            self._wrap(cls, name, key)

    def _wrap(self, cls, name: str, key: str) -> None:
        inner, acc = getattr(cls, name), self.acc

        @functools.wraps(inner)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

        setattr(cls, name, timed)

    def median_ms(self, rows: list[dict[str, float]]) -> dict[str, float]:
        keys = ["ttft", "promote", "copy in", "copy out", "forward"]
        out = {k: 1e3 * statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
        out["other"] = 1e3 * statistics.median(
            r["ttft"] - r.get("promote", 0.0) - r.get("forward", 0.0) for r in rows
        )
        return out


BREAKDOWN: Breakdown | None = None


class Runner:
    """One engine serving one request at a time, timing the first token."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def serve(self, ids: list[int], params) -> tuple[float, list[int]]:
        engine = self.engine
        rid = f"bench-{next(self._ids)}"
        if BREAKDOWN is not None:
            BREAKDOWN.acc.clear()
        t0 = time.perf_counter()
        engine.add_request(rid, ids, params)
        first = None
        out: list[int] = []
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.token_ids and first is None:
                    first = time.perf_counter() - t0
                    if BREAKDOWN is not None:
                        BREAKDOWN.rows.append({**BREAKDOWN.acc, "ttft": first})
                out.extend(delta.token_ids)
        assert first is not None
        return first, out


def make_llm(args, **tiers):
    from radixserve import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_memory_gb=args.pool_gb,
        page_size=args.page_size,
        **tiers,
    )


def chat(
    args, llm, sessions: list[list[int]], user_turns: list[list[list[int]]], params, name: str
):
    """Every turn, every session in order; returns (TTFTs, outputs, final conversations,
    wall seconds, output tokens)."""
    runner = Runner(llm.engine)
    convs = [list(s) for s in sessions]
    ttfts: list[float] = []
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        for s, conv in enumerate(convs):
            if turn:
                conv.extend(user_turns[s][turn - 1])
            ttft, out = runner.serve(conv, params)
            ttfts.append(ttft)
            outputs.append(out)
            conv.extend(out)
    wall = time.perf_counter() - start
    llm.engine.check_page_accounting()
    if BREAKDOWN is not None:  # the turns that can hit (not the first)
        rows, BREAKDOWN.rows = BREAKDOWN.rows[len(sessions) :], []
        print(f"breakdown {name}, ms, median over turns 2+: {BREAKDOWN.median_ms(rows)}")
    return ttfts, outputs, convs, wall, sum(len(o) for o in outputs)


def hit_rates(llm) -> dict[str, float]:
    cache = llm.engine.prefix_cache
    q = max(1, cache.queried_tokens)
    host, disk = cache.tiers.host_hit_tokens, cache.tiers.disk_hit_tokens
    return {
        "all": cache.hit_tokens / q,
        "pool": (cache.hit_tokens - host - disk) / q,
        "host": host / q,
        "disk": disk / q,
    }


def close(llm) -> None:
    llm.engine.close()
    del llm
    gc.collect()


def w1_throughput(args, llm, requests) -> float:
    from radixserve import SamplingParams

    prompts = [llm.engine.tokenize(r["prompt"]) for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.engine.check_page_accounting()
    llm.engine.check_idle()
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def kv_bytes_per_token(args) -> int:
    """KV bytes of one token of the model, from its metadata (no weights loaded)."""
    from radixserve.engine.model_source import resolve_model
    from radixserve.executor.loader.gguf_loader import read_metadata
    from radixserve.executor.loader.safetensors_loader import read_json

    source = resolve_model(args.model)
    width = 4 if args.dtype == "float32" else 2
    if source.kind == "gguf":
        meta = read_metadata(source.path)
        arch = meta["general.architecture"]
        layers = int(meta[f"{arch}.block_count"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta[f"{arch}.embedding_length"]) // heads
    else:
        c = read_json(source.path / "config.json")
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads", heads)
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * layers * kv_heads * head_dim * width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=384, help="first message")
    parser.add_argument("--turn-tokens", type=int, default=64, help="each later message")
    parser.add_argument("--max-tokens", type=int, default=4, help="reply length")
    parser.add_argument("--pool-tokens", type=int, default=768, help="KV pool size")
    parser.add_argument("--w1-runs", type=int, default=1, help="W1 runs per side (0: skip)")
    parser.add_argument("--workload", type=Path, default=W1)
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument(
        "--pool-ref",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run with no tiers and a pool holding everything (reference)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="print where the TTFT of turns 2+ goes (promotion, copies, forward)",
    )
    args = parser.parse_args()
    if args.breakdown:
        global BREAKDOWN
        BREAKDOWN = Breakdown()

    from radixserve import SamplingParams

    requests = load_w1(args.workload)
    token_bytes = kv_bytes_per_token(args)
    args.pool_gb = args.pool_tokens * token_bytes / 2**30
    off_llm = make_llm(args)
    text_ids = [off_llm.engine.tokenize(r["prompt"]) for r in requests]

    # conversations from W1 text: a session's first message, then its later messages
    stream = itertools.cycle(itertools.chain.from_iterable(text_ids))
    sessions = [[next(stream) for _ in range(args.first_tokens)] for _ in range(args.sessions)]
    user_turns = [
        [[next(stream) for _ in range(args.turn_tokens)] for _ in range(args.turns - 1)]
        for _ in range(args.sessions)
    ]
    final_ctx = args.first_tokens + (args.turns - 1) * (args.turn_tokens + args.max_tokens)
    total_ctx = args.sessions * (final_ctx + args.max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    host_all_gb = 1.5 * total_ctx * token_bytes / 2**30
    host_small_gb = 1.5 * args.pool_gb
    folder = args.cache_dir or Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    if folder.exists() and args.cache_dir is None:
        shutil.rmtree(folder)
    print(
        f"{args.sessions} sessions x {args.turns} turns; last context {final_ctx} tokens, all "
        f"conversations {total_ctx} tokens = {total_ctx / args.pool_tokens:.1f}x the pool "
        f"({args.pool_tokens} tokens, {args.pool_gb * 1024:.1f} MiB); host tier "
        f"{host_all_gb * 1024:.0f} MiB (host run), {host_small_gb * 1024:.0f} MiB (+disk run)"
    )

    rows: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    disk_dir = str(folder / "disk")
    configs = {
        "off": {},
        "host": {"kv_host_gb": host_all_gb},
        "host+disk": {"kv_host_gb": host_small_gb, "kv_disk_gb": 4.0, "kv_cache_dir": disk_dir},
    }
    big_pool = argparse.Namespace(**{**vars(args), "pool_gb": host_all_gb})
    runs = [*configs.items(), *((("pool holds all", {}),) if args.pool_ref else ())]
    last_convs: list[list[int]] = []
    for name, tiers in runs:
        if name == "off":
            llm = off_llm
        elif name == "pool holds all":
            llm = make_llm(big_pool)
        else:
            llm = make_llm(args, **tiers)
        ttfts, outs, convs, wall, ntok = chat(args, llm, sessions, user_turns, params, name)
        rows[name] = {
            "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99),
            "tok_s": ntok / wall,
            "wall_s": wall,
            "hit": hit_rates(llm),
        }
        if llm.engine.kv_transfer is not None:
            s = llm.engine.kv_transfer.stats
            rows[name]["moved_mib"] = (
                s.host_bytes_in + s.host_bytes_out + s.disk_bytes_out
            ) / 2**20
            rows[name]["move_s"] = s.host_seconds + s.disk_seconds
        outputs[name] = outs
        if name != "pool holds all":
            last_convs = convs
        if name != "off":
            close(llm)  # host+disk: persists the tree to the disk tier

    # restart: replay every session's last conversation on a new engine
    replay = [c[: len(c) - args.max_tokens] for c in last_convs]
    restart: dict[str, dict] = {}
    off_llm.engine.check_idle()  # empties its tree: the cold side (no tiers, nothing cached)
    for name, tiers in (("cold", {}), ("disk-warm", configs["host+disk"])):
        llm = off_llm if name == "cold" else make_llm(args, **tiers)
        llm.engine.prefix_cache.hit_tokens = llm.engine.prefix_cache.queried_tokens = 0
        runner = Runner(llm.engine)
        ttfts = [runner.serve(conv, params)[0] for conv in replay]
        restart[name] = {
            "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99),
            "hit": hit_rates(llm),
        }
        llm.engine.check_page_accounting()
        close(llm)

    w1: dict[str, list[float]] = {"off": [], "tiers": []}
    if args.w1_runs:
        w1_dir = folder / "w1"
        llms = {
            "off": make_llm(argparse.Namespace(**{**vars(args), "pool_gb": 2.0})),
            "tiers": make_llm(
                argparse.Namespace(**{**vars(args), "pool_gb": 2.0}),
                kv_host_gb=1.0,
                kv_disk_gb=4.0,
                kv_cache_dir=str(w1_dir),
            ),
        }
        for llm in llms.values():  # warm-up
            llm.generate([text_ids[0]], params, use_tqdm=False)
            llm.engine.check_idle()
        for _ in range(args.w1_runs):
            for name, llm in llms.items():
                w1[name].append(w1_throughput(args, llm, requests))
        for llm in llms.values():
            close(llm)
    if args.cache_dir is None:
        shutil.rmtree(folder, ignore_errors=True)

    print(
        f"{'run':<16}{'TTFT p50':>10}{'p99':>9}{'tok/s':>8}{'hit':>7}{'pool':>7}{'host':>7}"
        f"{'disk':>7}{'moved MiB':>11}{'move s':>8}"
    )
    for name, r in [*rows.items(), *((f"restart {k}", v) for k, v in restart.items())]:
        h = r["hit"]
        print(
            f"{name:<16}{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>9.3f}"
            f"{r.get('tok_s', float('nan')):>8.1f}{h['all']:>7.2f}{h['pool']:>7.2f}"
            f"{h['host']:>7.2f}{h['disk']:>7.2f}{r.get('moved_mib', 0):>11.1f}"
            f"{r.get('move_s', 0):>8.2f}"
        )
    if w1["off"]:
        print(f"W1 output tok/s: off {w1['off']}, tiers on {w1['tiers']}")
    summary = {
        "ttft_p50_ratio_host": rows["off"]["ttft_p50_s"] / rows["host"]["ttft_p50_s"],
        "ttft_p50_ratio_host_disk": rows["off"]["ttft_p50_s"] / rows["host+disk"]["ttft_p50_s"],
        "ttft_p50_ratio_disk_restart": restart["cold"]["ttft_p50_s"]
        / restart["disk-warm"]["ttft_p50_s"],
        "hit_rate_off": rows["off"]["hit"]["all"],
        "hit_rate_tiers": rows["host+disk"]["hit"]["all"],
        "hit_rate_host": rows["host"]["hit"]["all"],
        "hit_rate_tiers_by_tier": rows["host+disk"]["hit"],
        "throughput_ratio_host": rows["host"]["tok_s"] / rows["off"]["tok_s"],
        "outputs_equal_off_host": outputs["off"] == outputs["host"],
        "outputs_equal_off_host_disk": outputs["off"] == outputs["host+disk"],
        "ttft_p50_ratio_pool_holds_all": (
            rows["off"]["ttft_p50_s"] / rows["pool holds all"]["ttft_p50_s"]
            if args.pool_ref
            else None
        ),
        "outputs_equal_host_pool_holds_all": (
            outputs["host"] == outputs["pool holds all"] if args.pool_ref else None
        ),
        "w1_throughput_ratio": (
            statistics.median(w1["tiers"]) / statistics.median(w1["off"]) if w1["off"] else None
        ),
        "w1_tok_s_off": w1["off"],
        "w1_tok_s_tiers": w1["tiers"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
