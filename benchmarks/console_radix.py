"""Engine-side cost of the console's radix summary (``/v1/engine/radix``).

    python benchmarks/console_radix.py            # 10,000- and 100,000-node trees
    python benchmarks/console_radix.py --quick    # 10,000 only

Builds RadixCaches of two shapes — "branching" (conversations that fork off earlier ones at
random points, page size 16) and "flat" (every sequence a child of the root, the worst case
for the children scan) — and times what the engine loop does for one query: ``summarize``
plus building and msgpack-encoding the reply message. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np

from radixserve.core.page_pool import PagePool
from radixserve.core.radix_cache import RadixCache
from radixserve.core.radix_summary import summarize
from radixserve.serving import protocol as p

VOCAB = 50_000


def build(shape: str, target_nodes: int, page_size: int = 16, seed: int = 0) -> RadixCache:
    rng = np.random.default_rng(seed)
    pool = PagePool(target_nodes * 24, page_size)
    cache = RadixCache(pool)
    sequences: list[np.ndarray] = []
    while cache.num_nodes < target_nodes:
        if shape == "branching" and sequences and rng.random() < 0.85:
            base = sequences[int(rng.integers(len(sequences)))]
            cut = int(rng.integers(1, base.size))
            tail = rng.integers(0, VOCAB, int(rng.integers(16, 96)), dtype=np.int32)
            seq = np.concatenate([base[:cut], tail])
        else:
            seq = rng.integers(0, VOCAB, int(rng.integers(64, 256)), dtype=np.int32)
        pages = pool.alloc(-(-seq.size // page_size))
        cache.insert(seq, pages)
        pool.decref(pages)
        sequences.append(seq)
    return cache


def query_cost_ms(cache: RadixCache, max_nodes: int, max_depth: int, runs: int) -> list[float]:
    """What ``engine_process`` does for one ``RadixQuery``: summarize, wrap, encode (after
    collecting the build's garbage and 10 warm-up queries)."""
    gc.collect()
    times = []
    for i in range(runs + 10):
        t0 = time.perf_counter()
        s = summarize(cache, max_nodes=max_nodes, max_depth=max_depth)
        msg = p.RadixSummary(
            0,
            s.nodes,
            s.namespaces,
            s.total_nodes,
            s.total_tokens,
            s.evictable_pages,
            s.protected_pages,
            s.page_size,
            s.truncated,
            0.0,
        )
        p.encoder.encode(msg)
        if i >= 10:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    sizes = [10_000] if args.quick else [10_000, 100_000]
    result: dict[str, float] = {}
    print(f"{'shape':>10} {'nodes':>8} {'bounds':>14} {'median ms':>10} {'p99 ms':>8} {'rows':>5}")
    for size in sizes:
        for shape in ("branching", "flat"):
            cache = build(shape, size)
            for max_nodes, max_depth in ((256, 8), (512, 64)):
                t = query_cost_ms(cache, max_nodes, max_depth, args.runs)
                rows = len(summarize(cache, max_nodes=max_nodes, max_depth=max_depth).nodes)
                med, p99 = float(np.median(t)), float(np.percentile(t, 99))
                print(
                    f"{shape:>10} {cache.num_nodes:>8} {f'{max_nodes}/{max_depth}':>14} "
                    f"{med:>10.3f} {p99:>8.3f} {rows:>5}"
                )
                key = f"{shape}_{size // 1000}k_{max_nodes}"
                result[key + "_median_ms"] = round(med, 3)
                result[key + "_p99_ms"] = round(p99, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
