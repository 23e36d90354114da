"""RadixCache micro-benchmarks (match / insert / evict) and the engine-level prefix-cache win.

    python benchmarks/radix_cache.py                 # everything (engine part: ~3 minutes)
    python benchmarks/radix_cache.py --skip-engine   # data structure only
    python benchmarks/radix_cache.py --quick         # smaller trees, for a smoke run

Prints a table per part and, last, one JSON line with match_hit_median_us, match_hit_p99_us,
match_miss_median_us, insert_median_us, evict_one_median_us, evict_1pct_ms (page_size 1),
engine_ttft_speedup and engine_wall_speedup.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from radixserve.core.page_pool import PagePool
from radixserve.core.radix_cache import RadixCache

W2 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w2_shared_prefix.jsonl"


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return float(np.median(a)), float(np.percentile(a, 99))


def _distinct_heads(rng: np.random.Generator, count: int, vocab: int) -> np.ndarray:
    return rng.choice(vocab, size=count, replace=False).astype(np.int32)


def build_tree(page_size: int, num_prefixes: int, per_prefix: int, prefix_len: int, cont_len: int):
    """num_prefixes shared prefixes x per_prefix continuations; first tokens distinct so the
    tree has exactly that shape."""
    rng = np.random.default_rng(0)
    vocab = 50_000
    total_pages = (num_prefixes * prefix_len + num_prefixes * per_prefix * cont_len) // page_size
    # room for the tree, plus the 500 sequences the insert benchmark adds
    pool = PagePool(total_pages + 600 * (prefix_len + cont_len) // page_size, page_size)
    cache = RadixCache(pool)
    prefix_heads = _distinct_heads(rng, num_prefixes, vocab)
    sequences = []
    for i in range(num_prefixes):
        prefix = rng.integers(0, vocab, prefix_len, dtype=np.int32)
        prefix[0] = prefix_heads[i]
        cont_heads = _distinct_heads(rng, per_prefix, vocab)
        for j in range(per_prefix):
            cont = rng.integers(0, vocab, cont_len, dtype=np.int32)
            cont[0] = cont_heads[j]
            seq = np.concatenate([prefix, cont])
            pages = pool.alloc(len(seq) // page_size)
            cache.insert(seq, pages)
            pool.decref(pages)
            sequences.append(seq)
    return cache, pool, sequences, rng


def bench_match_insert(page_size: int, quick: bool) -> dict[str, float]:
    per_prefix = 10 if quick else 100
    cache, pool, seqs, rng = build_tree(page_size, 100, per_prefix, 1024, 3072)
    hits, misses, inserts = [], [], []
    queries = []
    for k in range(2000):
        base = seqs[k % len(seqs)]
        tail = rng.integers(0, 50_000, 4096 - 3500, dtype=np.int32)
        tail[0] = (base[3500] + 1) % 50_000
        queries.append(np.concatenate([base[:3500], tail]))
    for q in queries:
        t = time.perf_counter_ns()
        r = cache.match_prefix(q)
        hits.append(time.perf_counter_ns() - t)
    assert r.num_tokens == 3500 and r.page_ids.size == 3500 // page_size
    miss = np.full(4096, 50_001, dtype=np.int32)
    for _ in range(2000):
        t = time.perf_counter_ns()
        cache.match_prefix(miss)
        misses.append(time.perf_counter_ns() - t)
    for k in range(500):  # a new continuation under an existing prefix
        base = seqs[(k * 7) % len(seqs)]
        seq = np.concatenate([base[:1024], rng.integers(50_002, 60_000, 3072, dtype=np.int32)])
        pages = pool.alloc(4096 // page_size)
        t = time.perf_counter_ns()
        cache.insert(seq, pages)
        inserts.append(time.perf_counter_ns() - t)
        pool.decref(pages)
    hit_med, hit_p99 = _percentiles(hits)
    return {
        "match_hit_median_us": hit_med,
        "match_hit_p99_us": hit_p99,
        "match_miss_median_us": _percentiles(misses)[0],
        "insert_median_us": _percentiles(inserts)[0],
    }


def bench_evict(page_size: int, quick: bool) -> dict[str, float]:
    num_leaves = 4_000 if quick else 40_000
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(0, 50_000, 1024, dtype=np.int32) for _ in range(100)]
    for i, p in enumerate(prefixes):
        p[0] = i
    leaves = []
    for k in range(num_leaves):
        leaf = rng.integers(0, 50_000, 64, dtype=np.int32)
        leaf[0] = k  # distinct under each prefix
        leaves.append(np.concatenate([prefixes[k % 100], leaf]))
    total_tokens = 100 * 1024 + num_leaves * 64
    pool = PagePool(total_tokens // page_size + 10_000, page_size)
    cache = RadixCache(pool)

    def insert(seq: np.ndarray) -> None:
        pages = pool.alloc(seq.size // page_size)
        cache.insert(seq, pages)
        pool.decref(pages)

    for seq in leaves:
        insert(seq)
    leaf_pages = 64 // page_size
    one, pct = [], []
    order = 0
    for _ in range(300):
        t = time.perf_counter_ns()
        cache.evict(leaf_pages)
        one.append(time.perf_counter_ns() - t)
        insert(leaves[order % num_leaves])  # put one back (untimed): same tree size
        order += 1
    one_pct_pages = total_tokens // 100 // page_size
    for _ in range(20):
        t = time.perf_counter_ns()
        cache.evict(one_pct_pages)
        pct.append(time.perf_counter_ns() - t)
        for _ in range(-(-one_pct_pages // leaf_pages)):
            insert(leaves[order % num_leaves])
            order += 1
    return {
        "evict_one_median_us": _percentiles(one)[0],
        "evict_1pct_ms": _percentiles(pct)[0] / 1e3,
        "evict_1pct_leaves": -(-one_pct_pages // leaf_pages),
    }


def bench_engine(args) -> dict[str, float]:
    from radixserve import SamplingParams
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.engine import Engine

    requests = [json.loads(line) for line in W2.read_text().splitlines() if line.strip()]
    results = {}
    for label, disable in (("on", False), ("off", True)):
        engine = Engine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                quantization=args.quantization,
                disable_radix_cache=disable,
            )
        )
        prompts = [engine.tokenize(r["prompt"]) for r in requests]
        start = time.perf_counter()
        for i, (r, p) in enumerate(zip(requests, prompts, strict=True)):
            params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
            engine.add_request(f"w2-{i}", p, params)
        first_token: dict[str, float] = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.token_ids and d.request_id not in first_token:
                    first_token[d.request_id] = time.perf_counter() - start
        wall = time.perf_counter() - start
        results[label] = (float(np.mean(list(first_token.values()))), wall)
        print(f"  cache {label:>3}: mean TTFT {results[label][0]:.2f} s, wall {wall:.2f} s")
    return {
        "engine_ttft_on_s": results["on"][0],
        "engine_ttft_off_s": results["off"][0],
        "engine_wall_on_s": results["on"][1],
        "engine_wall_off_s": results["off"][1],
        "engine_ttft_speedup": results["off"][0] / results["on"][0],
        "engine_wall_speedup": results["off"][1] / results["on"][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "auto", "int8", "int4"],
        help="weights: none = bfloat16 as loaded (the default here: the shipped GGUF is Q4_1, which the engine's own default, auto, would run in int4)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    summary: dict[str, float] = {}
    print(
        f"{'page_size':>9} {'match hit med/p99 us':>22} {'miss med us':>12} {'insert med us':>14}"
        f" {'evict 1 med us':>15} {'evict 1% ms':>12}"
    )
    for page_size in (1, 16):
        m = bench_match_insert(page_size, args.quick)
        e = bench_evict(page_size, args.quick)
        print(
            f"{page_size:>9} {m['match_hit_median_us']:>10.1f} / {m['match_hit_p99_us']:<9.1f}"
            f" {m['match_miss_median_us']:>12.2f} {m['insert_median_us']:>14.1f}"
            f" {e['evict_one_median_us']:>15.1f} {e['evict_1pct_ms']:>12.2f}"
        )
        if page_size == 1:
            summary.update(m)
            summary.update({k: v for k, v in e.items() if k != "evict_1pct_leaves"})
        else:
            summary.update({f"{k}_ps16": v for k, v in {**m, **e}.items()})
    if not args.skip_engine:
        print(f"engine, {W2.name}, SmolLM2-135M {args.dtype}:")
        engine = bench_engine(args)
        print(
            f"  speedup: TTFT {engine['engine_ttft_speedup']:.1f}x, "
            f"wall {engine['engine_wall_speedup']:.1f}x"
        )
        summary.update(engine)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
