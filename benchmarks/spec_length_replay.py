"""Replay greedy outputs through proposal-length rules: which rule the n-gram proposer uses.

Greedy verification keeps exactly the proposals that match the plain greedy output, so a
rule's steps can be replayed without the model: generate each prompt's greedy output once
(speculation off), then for each rule walk the output: at each step the n-gram proposer
(the engine's) guesses up to the rule's limit, the longest prefix matching the output is
kept, plus one token, and the step costs ``1 + row_cost * proposals`` plain decode steps
(the linear cost measured at batch 1: docs/speculative.md). The score is tokens per plain
step's time, i.e. the predicted speedup over no speculation at batch 1.

The adaptive rule replayed is the engine's own class (``AdaptiveLength``); the others are
alternatives tried. Prompts: the benchmark's grounded prompts (``speculative.py``) and
W3/W1 prompts.

    OMP_NUM_THREADS=1 python benchmarks/spec_length_replay.py --row-cost 0.24 --row-cost 0.35
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speculative as bench

from radixserve.executor.spec.length import AdaptiveLength
from radixserve.executor.spec.ngram import ngram_propose


class Rule:
    """A proposal-length rule for one request: ``limit()``, then ``update`` after a verify
    of ``verified`` proposals (of ``limit``) that kept ``accepted``."""

    def limit(self) -> int:
        raise NotImplementedError

    def update(self, limit: int, verified: int, accepted: int) -> None:
        pass


class Fixed(Rule):
    def __init__(self, k: int) -> None:
        self.k = k

    def limit(self) -> int:
        return self.k


class Engine(Rule):
    """The engine's rule (batch 1), its floor ``base`` (``num_spec_tokens``, 4)."""

    def __init__(self, start: int, cap: int, base: int = 4) -> None:
        self.lengths = AdaptiveLength(base, cap, start)

    def limit(self) -> int:
        return self.lengths.limit("r", 1)

    def update(self, limit: int, verified: int, accepted: int) -> None:
        self.lengths.update("r", limit, verified, accepted)


class GrowShrink(Rule):
    """``k`` proposals: after a verify that kept all of them, ``grow`` (at most ``cap``);
    after a rejection, ``shrink`` (at least 1). By default double / halve: the engine's
    rule with no floor."""

    def __init__(self, start: int, cap: int) -> None:
        self.k, self.cap = start, cap

    def limit(self) -> int:
        return self.k

    def update(self, limit: int, verified: int, accepted: int) -> None:
        if accepted < verified:
            self.k = max(1, self.shrink(limit, accepted))
        elif verified == limit:
            self.k = min(self.cap, self.grow(limit))

    def grow(self, limit: int) -> int:
        return 2 * limit

    def shrink(self, limit: int, accepted: int) -> int:
        return limit // 2


class HalveToOne(GrowShrink):
    """The engine's rule with no floor: a rejection halves the length down to 1."""


class AddSub(GrowShrink):
    """+up when all kept, -down on a rejection (transformers' assisted generation)."""

    def __init__(self, start: int, cap: int, up: int = 2, down: int = 1) -> None:
        super().__init__(start, cap)
        self.up, self.down = up, down

    def grow(self, limit: int) -> int:
        return limit + self.up

    def shrink(self, limit: int, accepted: int) -> int:
        return limit - self.down


class DoubleHalfway(GrowShrink):
    """Double when all kept; on a rejection, halfway down to what was kept plus one."""

    def shrink(self, limit: int, accepted: int) -> int:
        return (limit + accepted + 1) // 2


RULES: dict[str, Callable[[], Rule]] = {
    "fixed 4": lambda: Fixed(4),
    "fixed 8": lambda: Fixed(8),
    "fixed 12": lambda: Fixed(12),
    "fixed 16": lambda: Fixed(16),
    "double/halve 4..12": lambda: Engine(4, 12),
    "double/halve 4..16": lambda: Engine(4, 16),
    "double/halve 8..16 (engine)": lambda: Engine(8, 16),
    "double/halve 8..24": lambda: Engine(8, 24),
    "double/halve 16..16": lambda: Engine(16, 16),
    "double/halve to 1, 8..16": lambda: HalveToOne(8, 16),
    "double/halve to 1, 4..16": lambda: HalveToOne(4, 16),
    "+2/-1 4..12": lambda: AddSub(4, 12),
    "+4/-1 4..16": lambda: AddSub(4, 16, 4, 1),
    "double/halfway 4..16": lambda: DoubleHalfway(4, 16),
    "double/halfway 8..16": lambda: DoubleHalfway(8, 16),
}


def replay(prompt: list[int], output: list[int], rule: Rule, row_cost: float) -> float:
    """Predicted speedup of ``rule`` over plain decoding on one request."""
    history = list(prompt)
    t = 0
    cost = 0.0
    while t < len(output):
        limit = min(rule.limit(), len(output) - t - 1)  # max_tokens cuts the last ones
        proposal = (
            ngram_propose(np.array(history, dtype=np.int32), 4, 2, limit)
            if limit > 0
            else np.zeros(0, np.int32)
        )
        v = int(proposal.size)
        a = 0
        while a < v and int(proposal[a]) == output[t + a]:
            a += 1
        cost += 1.0 + row_cost * v
        if v:
            rule.update(limit, v, a)
        history += output[t : t + a + 1]
        t += a + 1
    return len(output) / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=Path, default=bench.DEFAULT_WORKLOADS)
    ap.add_argument("--row-cost", type=float, action="append", default=None)
    ap.add_argument("--grounded", type=int, default=6, help="grounded prompts")
    ap.add_argument("--free", type=int, default=8, help="W3 and W1 prompts each")
    args = ap.parse_args()
    costs = args.row_cost or [0.24]

    from radixserve import LLM, SamplingParams

    w1 = bench.load(args.workloads / "w1_offline.jsonl")
    w3 = bench.load(args.workloads / "w3_online.jsonl")
    texts = [r["prompt"] for r in w1] + [r["prompt"] for r in w3]
    llm = LLM(None, dtype="float32")
    grounded = bench.grounded_prompts(llm.engine, texts, args.grounded)

    def outputs(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    g_out = outputs(grounded, 128)
    w3_p = [llm.engine.tokenize(r["prompt"]) for r in w3[: args.free]]
    w1_p = [llm.engine.tokenize(r["prompt"]) for r in w1[: args.free]]
    sets = {
        "grounded #0, 64": [(grounded[0], g_out[0][:64])],
        f"grounded x{len(grounded)}, 64": [
            (p, o[:64]) for p, o in zip(grounded, g_out, strict=True)
        ],
        f"grounded x{len(grounded)}, 128": list(zip(grounded, g_out, strict=True)),
        f"W3 x{len(w3_p)}": list(zip(w3_p, outputs(w3_p, int(w3[0]["max_tokens"])), strict=True)),
        f"W1 x{len(w1_p)}": list(zip(w1_p, outputs(w1_p, int(w1[0]["max_tokens"])), strict=True)),
    }
    for row_cost in costs:
        print(f"\npredicted speedup at batch 1, a verify step costing 1 + {row_cost} per proposal")
        print(f"{'rule (start..cap; floor 4)':28}" + "".join(f"{name:>18}" for name in sets))
        for name, make in RULES.items():
            scores = [
                float(np.mean([replay(p, o, make(), row_cost) for p, o in items]))
                for items in sets.values()
            ]
            print(f"{name:28}" + "".join(f"{s:18.2f}" for s in scores))


if __name__ == "__main__":
    main()
