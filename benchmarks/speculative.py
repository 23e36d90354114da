"""Speculative decoding: n-gram (prompt lookup) and auto against no speculation, one run.

    VENV/bin/python benchmarks/speculative.py
    VENV/bin/python benchmarks/speculative.py --workloads DIR --quick
    VENV/bin/python benchmarks/speculative.py --sweep --quick     # batch 1, 2, 4, 8, 16
    VENV/bin/python benchmarks/speculative.py --only w1 --quick   # ngram_ratio_w1 alone
    VENV/bin/python benchmarks/speculative.py --dtype bfloat16
    VENV/bin/python benchmarks/speculative.py --dtype bfloat16 --quantization none \
        --modes off --draft-model MODEL.gguf --draft-quantization int4  # int4 copy as draft

Modes: ``off``; ``ngram`` speculates every step it can (``spec_policy="always"``: the raw
gain or loss of speculation, from which the crossover is read); ``auto`` is ngram under
the measured policy (the default: a cost controller per batch size turns it on where it
measured a gain); with ``--draft-model``, ``draft`` (always) and ``draft-auto`` (measured).

Workloads (from ``--workloads``, default ``../shared/workloads`` next to the repository):

* grounded: outputs that reuse the prompt, built from W1/W3 passages: "repeat the passage
  with a small edit", a Python function (its names taken from the passage) "with a
  variable renamed", and "a summary quoting the first sentence" — at batch sizes 1, 4, 16;
* W1 (64 x 256 -> 64, all at once: offline) and W3 (256 -> 128) free generation at batch
  sizes 1 and 16 (the first requests of W3; ``--sweep``: 1, 2, 4, 8 and 16 for both W3 and
  grounded).

Each configuration runs the same requests with ``off``, ``ngram`` and ``auto``, and
``draft`` when ``--draft-model PATH`` names a draft with the target's tokenizer
(``draft_speedup_bs1`` is null without one). Greedy outputs must be
byte-identical across modes; the benchmark checks and says so. Beside each acceptance
figure it reports how much the non-speculative output repeats itself (its 4-grams seen
earlier in the output) and copies the prompt (4-grams seen in the prompt), so a model that
loops on itself is not mistaken for a speedup.

Prints a table, then one JSON line: ngram_speedup_bs1_grounded,
ngram_speedup_bs16_grounded, ngram_ratio_w1 (throughput with auto vs off on W1),
draft_speedup_bs1 (grounded) and draft_speedup_bs1_w3 (free generation), greedy_identical,
the crossovers (per workload and always-speculating mode, the largest batch size up to
which it beat off at every size), each controller's final per-bucket table, the load
average before and after, and the per-configuration figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
MODES = ("off", "ngram", "auto")
DRAFT_MODES = ("draft", "draft-auto")
# the policy of each mode: "always" shows what speculation itself gains or costs at a batch
# size; "measured" is the controller that should take only the gains
POLICY = {"ngram": "always", "auto": "measured", "draft": "always", "draft-auto": "measured"}


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _passage(text: str, words: int) -> str:
    return " ".join(text.split()[:words])


def grounded_prompts(engine, texts: list[str], count: int) -> list[list[int]]:
    """Prompts whose answers reuse the prompt: edit-and-repeat, rename-in-code, quote."""
    out: list[list[int]] = []
    for i in range(count):
        text = texts[i % len(texts)]
        kind = i % 3
        if kind == 0:
            passage = _passage(text, 90)
            word = next((w for w in passage.split() if len(w) > 5 and w.isalpha()), "object")
            ask = (
                f'Repeat the passage below exactly, word for word, but write "{word.upper()}" '
                f'instead of "{word}".\n\nPassage:\n{passage}'
            )
        elif kind == 1:
            names = [w.lower() for w in text.split() if w.isalpha() and len(w) > 3][:6]
            names += ["alpha", "beta", "gamma", "delta", "omega", "sigma"][len(names) :]
            a, b, c, d, e, f = names[:6]
            code = (
                f"def {a}_{b}({c}, {d}):\n"
                f'    """Combine {c} and {d} into one {e}."""\n'
                f"    {e} = []\n"
                f"    for item in {c}:\n"
                f"        if item in {d}:\n"
                f"            {e}.append(item)\n"
                f"        else:\n"
                f"            {e}.append({f}(item))\n"
                f"    total = len({e}) + len({c})\n"
                f"    return {e}, total\n"
            )
            ask = (
                f"Rewrite this Python function with the variable `{e}` renamed to "
                f"`result`. Change nothing else.\n\n```python\n{code}```"
            )
        else:
            passage = _passage(text, 110)
            ask = (
                "Summarize the passage below in a few sentences. Start by quoting its first "
                f"two sentences exactly.\n\nPassage:\n{passage}"
            )
        out.append(engine.inputs.chat_ids([{"role": "user", "content": ask}]))
    return out


def repetition(prompt: list[int], output: list[int], n: int = 4) -> tuple[float, float]:
    """(share of the output's n-grams seen earlier in the output, share seen in the prompt)."""
    if len(output) < n + 1:
        return 0.0, 0.0
    seen_out: set[tuple[int, ...]] = set()
    in_prompt = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    own = copied = total = 0
    for i in range(len(output) - n + 1):
        g = tuple(output[i : i + n])
        total += 1
        own += g in seen_out
        copied += g in in_prompt
        seen_out.add(g)
    return own / total, copied / total


@dataclass
class Run:
    """Figures of one (workload, batch size, mode) run."""

    wall_s: float
    output_tokens: int
    ttft_s: float
    itl_s: float
    proposed: int
    accepted: int
    verify_rows: int
    spec_steps: int
    steps: int
    outputs: list[list[int]] = field(repr=False)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def proposals_per_step(self) -> float:
        return self.proposed / self.spec_steps if self.spec_steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.verify_rows if self.verify_rows else 1.0


def combine(runs: list[Run], num_groups: int) -> Run:
    """One mode's figures over groups and rounds: sums, and means of the latencies; the
    outputs of the first round, checked against every later round."""
    first = [o for r in runs[:num_groups] for o in r.outputs]
    for k in range(num_groups, len(runs), num_groups):
        again = [o for r in runs[k : k + num_groups] for o in r.outputs]
        if again != first:
            raise SystemExit("a mode gave different outputs in two rounds")
    return Run(
        wall_s=sum(r.wall_s for r in runs),
        output_tokens=sum(r.output_tokens for r in runs),
        ttft_s=float(np.mean([r.ttft_s for r in runs])),
        itl_s=float(np.mean([r.itl_s for r in runs])),
        proposed=sum(r.proposed for r in runs),
        accepted=sum(r.accepted for r in runs),
        verify_rows=sum(r.verify_rows for r in runs),
        spec_steps=sum(r.spec_steps for r in runs),
        steps=sum(r.steps for r in runs),
        outputs=first,
    )


def run_engine(engine, prompts: list[list[int]], max_tokens: int, bs: int, tag: str) -> Run:
    """Keep ``bs`` requests in flight until all are done (greedy, ignore_eos)."""
    from radixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.check_idle()  # also empties the prefix cache: every run starts cold
    s0 = engine.stats()
    steps0 = engine.num_steps
    spec_steps0 = engine.spec_steps
    pending = list(range(len(prompts)))
    active: set[int] = set()
    start: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    outputs: dict[int, list[int]] = {i: [] for i in pending}
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < bs:
            i = pending.pop(0)
            engine.add_request(f"{tag}-{i}", prompts[i], params)
            start[i] = time.perf_counter()
            active.add(i)
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            i = int(d.request_id.rsplit("-", 1)[1])
            if d.token_ids:
                first.setdefault(i, now)
                last[i] = now
                outputs[i].extend(d.token_ids)
            if d.finished:
                active.discard(i)
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    n = len(prompts)
    itl = [(last[i] - first[i]) / (len(outputs[i]) - 1) for i in range(n) if len(outputs[i]) > 1]
    return Run(
        wall_s=wall,
        output_tokens=sum(len(o) for o in outputs.values()),
        ttft_s=float(np.mean([first[i] - start[i] for i in range(n)])),
        itl_s=float(np.mean(itl)) if itl else 0.0,
        proposed=s1.spec_proposed_tokens - s0.spec_proposed_tokens,
        accepted=s1.spec_accepted_tokens - s0.spec_accepted_tokens,
        verify_rows=s1.spec_verify_rows - s0.spec_verify_rows,
        spec_steps=engine.spec_steps - spec_steps0,
        steps=engine.num_steps - steps0,
        outputs=[outputs[i] for i in range(n)],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32 (default): the precision in which greedy output is batch-invariant "
        "(docs/architecture.md, invariant 3), so the identity check is meaningful; with "
        "bfloat16 a verify chunk and a decode round differently and near-ties can flip",
    )
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument(
        "--spec-max-tokens",
        type=int,
        default=None,
        help="the n-gram proposer's adaptive length cap (default: the engine's, 16; 0: the "
        "length fixed at --num-spec-tokens)",
    )
    ap.add_argument(
        "--spec-auto-max-batch",
        type=int,
        default=None,
        help="the cold-start crossover of the measured policy (auto, draft-auto)",
    )
    ap.add_argument("--draft-model", default=None, help="a draft for mode draft (same tokenizer)")
    ap.add_argument(
        "--draft-quantization",
        default="auto",
        help="how the draft runs (auto | none | int8 | int4): int4 with the target's own file "
        "as --draft-model is an int4 copy of the target proposing for it",
    )
    ap.add_argument(
        "--quantization", default="auto", help="the target's (auto | none | int8 | int4)"
    )
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help="which of off, ngram, auto to run (off always runs: the baseline); each engine "
        "holds its own weights and KV cache",
    )
    ap.add_argument(
        "--draft-modes",
        default=",".join(DRAFT_MODES),
        help="with --draft-model: draft (always speculates), draft-auto (measured policy)",
    )
    ap.add_argument("--grounded-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16", help="grounded batch sizes")
    ap.add_argument("--w3-batch-sizes", default="1,16")
    ap.add_argument(
        "--sweep", action="store_true", help="batch sizes 1,2,4,8,16 for grounded and W3"
    )
    ap.add_argument(
        "--only", default=None, help="comma list of grounded, w1, w3 (default: all three)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per configuration")
    ap.add_argument("--grounded-only", action="store_true", help="skip W1/W3 (no ngram_ratio_w1)")
    args = ap.parse_args()
    if args.sweep:
        args.batch_sizes = args.w3_batch_sizes = "1,2,4,8,16"
    only = set((args.only or "grounded,w1,w3").split(","))
    if args.grounded_only:
        only = {"grounded"}
    load_before = os.getloadavg()

    from radixserve import LLM

    w1 = load(args.workloads / "w1_offline.jsonl")
    w3 = load(args.workloads / "w3_online.jsonl")
    spec_kw = {"num_spec_tokens": args.num_spec_tokens, "quantization": args.quantization}
    if args.spec_auto_max_batch is not None:
        spec_kw["spec_auto_max_batch"] = args.spec_auto_max_batch
    if args.spec_max_tokens is not None:
        spec_kw["spec_max_tokens"] = args.spec_max_tokens
    modes = ["off", *(m for m in args.modes.split(",") if m in MODES and m != "off")]
    engines = {
        mode: LLM(
            args.model,
            dtype=args.dtype,
            speculative_mode="off" if mode == "off" else "ngram",
            spec_policy=POLICY.get(mode, "measured"),
            **spec_kw,
        ).engine
        for mode in modes
    }
    if args.draft_model is not None:
        for mode in args.draft_modes.split(","):
            if mode not in DRAFT_MODES:
                raise SystemExit(f"unknown draft mode {mode!r} (draft, draft-auto)")
            engines[mode] = LLM(
                args.model,
                dtype=args.dtype,
                speculative_mode="draft",
                spec_draft_model=args.draft_model,
                spec_draft_quantization=args.draft_quantization,
                spec_policy=POLICY[mode],
                **spec_kw,
            ).engine
    off = engines["off"]
    texts = [r["prompt"] for r in w1] + [r["prompt"] for r in w3]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    scale = 0.5 if args.quick else 1.0

    configs: list[tuple[str, int, list[list[int]], int]] = []
    if "grounded" in only:
        for bs in sizes:
            count = max(1, int(scale * {1: 3, 2: 4, 4: 4}.get(bs, 16)))
            count = max(count, bs)
            tokens = args.grounded_tokens if bs < 16 else (3 * args.grounded_tokens) // 4
            configs.append(("grounded", bs, grounded_prompts(off, texts, count), tokens))
    w1_prompts = [engines["off"].tokenize(r["prompt"]) for r in w1]
    w3_prompts = [engines["off"].tokenize(r["prompt"]) for r in w3]
    w1_n = int(scale * len(w1_prompts))
    if "w1" in only:
        configs.append(("w1", w1_n, w1_prompts[:w1_n], int(w1[0]["max_tokens"])))
    if "w3" in only:
        for bs in [int(b) for b in args.w3_batch_sizes.split(",")]:
            # at least the batch size, so each size keeps that many requests in flight
            count = max(bs, int(scale * 2) if bs == 1 else int(scale * 16))
            configs.append(("w3", bs, w3_prompts[:count], int(w3[0]["max_tokens"])))

    for mode, engine in engines.items():  # warm-up: kernels compiled, buffers grown
        run_engine(engine, grounded_prompts(off, texts, 2), 8, 2, f"warm-{mode}")
        run_engine(engine, grounded_prompts(off, texts, 1), 8, 1, f"warm1-{mode}")

    header = (
        f"{'workload':9} {'bs':>3} {'mode':10} {'tok/s':>8} {'speedup':>7} {'TTFT ms':>8} "
        f"{'ITL ms':>7} {'prop/step':>9} {'acc len':>7} {'acc %':>6} {'own rep':>7} "
        f"{'copy':>5} {'same':>5}"
    )
    print(header)
    print("-" * len(header))
    results: list[dict] = []
    identical = True
    for name, bs, prompts, max_tokens in configs:
        # untimed: every mode sees this configuration's shapes once (kernel selection and
        # buffers of a new shape cost the first run that meets it, whichever mode that is)
        for mode, engine in engines.items():
            run_engine(engine, prompts, min(max_tokens, 6), bs, f"w{name}{bs}{mode}")
        # timed, interleaved: the prompts in groups of ``bs`` (one group per batch), every
        # group run by every mode back to back, the order rotating from group to group and
        # round to round, so the shared machine's drift hits the modes alike; a mode's
        # figures are its sums over groups and rounds
        parts: dict[str, list[Run]] = {mode: [] for mode in engines}
        groups = [list(range(j, min(j + bs, len(prompts)))) for j in range(0, len(prompts), bs)]
        order = list(engines)
        turn = 0
        for rnd in range(args.rounds):
            for g, members in enumerate(groups):
                for mode in order[turn % len(order) :] + order[: turn % len(order)]:
                    r = run_engine(
                        engines[mode],
                        [prompts[i] for i in members],
                        max_tokens,
                        bs,
                        f"{name}{bs}{mode}{rnd}g{g}",
                    )
                    parts[mode].append(r)
                turn += 1
        runs = {mode: combine(rs, len(groups)) for mode, rs in parts.items()}
        base = runs["off"]
        reps = [repetition(p, o) for p, o in zip(prompts, base.outputs, strict=True)]
        own = float(np.mean([r[0] for r in reps]))
        copy = float(np.mean([r[1] for r in reps]))
        for mode, r in runs.items():
            same_count = sum(a == b for a, b in zip(r.outputs, base.outputs, strict=True))
            same = same_count == len(prompts)
            identical &= same
            acc = r.accepted / r.proposed if r.proposed else 0.0
            row = {
                "workload": name,
                "batch_size": bs,
                "mode": mode,
                "requests": len(prompts),
                "output_tokens": r.output_tokens,
                "tok_s": round(r.tok_s, 2),
                "speedup": round(r.tok_s / base.tok_s, 3),
                "ttft_ms": round(1000 * r.ttft_s, 1),
                "itl_ms": round(1000 * r.itl_s, 2),
                "proposals_per_step": round(r.proposals_per_step, 2),
                "mean_accepted_length": round(r.mean_accepted_length, 3),
                "acceptance": round(acc, 3),
                "off_own_repetition": round(own, 3),
                "off_prompt_copy": round(copy, 3),
                "identical": same,
                "identical_requests": same_count,
                "steps": r.steps,
            }
            results.append(row)
            print(
                f"{name:9} {bs:>3} {mode:10} {r.tok_s:>8.1f} {row['speedup']:>7.2f} "
                f"{row['ttft_ms']:>8.1f} {row['itl_ms']:>7.2f} {row['proposals_per_step']:>9.2f} "
                f"{row['mean_accepted_length']:>7.2f} {100 * acc:>6.1f} {own:>7.2f} "
                f"{copy:>5.2f} {'yes' if same else f'{same_count}/{len(prompts)}':>5}",
                flush=True,
            )

    def pick(workload: str, bs: int | None, mode: str) -> dict | None:
        rows = [
            r
            for r in results
            if r["workload"] == workload
            and r["mode"] == mode
            and (bs is None or r["batch_size"] == bs)
        ]
        return rows[0] if rows else None

    def speedup(workload: str, bs: int | None, mode: str) -> float | None:
        r = pick(workload, bs, mode)
        return None if r is None else r["speedup"]

    def crossover(workload: str, mode: str) -> int | None:
        """The largest batch size up to which ``mode`` beat off at every size measured
        (0: not even at the smallest; None: not measured)."""
        rows = sorted(
            (r for r in results if r["workload"] == workload and r["mode"] == mode),
            key=lambda r: r["batch_size"],
        )
        if not rows:
            return None
        best = 0
        for r in rows:
            if r["speedup"] <= 1.0:
                break
            best = r["batch_size"]
        return best

    crossovers = {
        f"{mode}_{workload}": crossover(workload, mode)
        for workload in ("grounded", "w3")
        for mode in ("ngram", "draft")
        if mode in engines
    }
    controllers = {
        mode: e.spec_control.table() for mode, e in engines.items() if e.spec_control is not None
    }
    for mode, table in controllers.items():
        print(
            f"controller of {mode}: "
            + "; ".join(
                f"{t['batch']}: {'on' if t['speculate'] else 'off'} "
                f"(spec {t['spec_tok_s']} tok/s x{t['spec_samples']}, "
                f"plain {t['plain_tok_s']} tok/s x{t['plain_samples']})"
                for t in table
            )
        )
    load_after = os.getloadavg()
    print(f"crossovers (largest batch size always speculating beat off): {crossovers}")
    print(
        "load average (1, 5, 15 min) before: "
        + ", ".join(f"{x:.2f}" for x in load_before)
        + "; after: "
        + ", ".join(f"{x:.2f}" for x in load_after)
    )
    print(
        "greedy outputs byte-identical across modes in every configuration: "
        + ("yes" if identical else "NO")
    )
    if "draft" not in engines:
        print("no draft model given (--draft-model): draft_speedup_bs1 is null")
    print(
        json.dumps(
            {
                "ngram_speedup_bs1_grounded": speedup("grounded", 1, "ngram"),
                "ngram_speedup_bs16_grounded": speedup("grounded", 16, "ngram"),
                "ngram_ratio_w1": speedup("w1", None, "auto"),
                "draft_speedup_bs1": speedup("grounded", 1, "draft"),
                "draft_speedup_bs1_w3": speedup("w3", 1, "draft"),
                "auto_speedup_bs1_grounded": speedup("grounded", 1, "auto"),
                "greedy_identical": identical,
                "crossovers": crossovers,
                "controllers": controllers,
                "load_before": [round(x, 2) for x in load_before],
                "load_after": [round(x, 2) for x in load_after],
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
