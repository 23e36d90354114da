"""Where a decode step's time goes, with the one-call decode program and without.

    python benchmarks/decode_step.py [--model FILE] [--threads 2] [--rounds 3] [--tokens 129]
                                     [--rows 1]

Loads the model once (default: the shipped SmolLM2-135M Q4_1 file, ``--quantization
auto``), then alternates rounds with the decode program (``executor/decode_program.py``)
and without it (the op-by-op forward, ``RADIXSERVE_DECODE_PROGRAM=0``'s path): each round
generates ``--tokens`` tokens greedily from a fresh random one-token prompt, alone, and
times the steps after the first with wall-clock timers around the model's forward, the
LM head (``compute_logits``), the runner's step (``run``: forward, head, sampling) and the
engine's step (scheduling, inputs, outputs). With ``--rows N`` (N > 1) a round is N fresh
one-token prompts generating together through ``LLM.generate``: ``--tokens`` steps of N
rows (the first, the prompts' own, is one of them too), all timed. Prints the median of
each mode's rounds in ms per step and the step rate; the last line is JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import time

from profile_step import add_timer  # benchmarks/ is this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=129)
    parser.add_argument("--rows", type=int, default=1, help="sequences decoding together")
    args = parser.parse_args()

    from radixserve import LLM, SamplingParams
    from radixserve.executor import decode_program

    llm = LLM(args.model, num_threads=args.threads, quantization=args.quantization)
    engine = llm.engine
    runner = engine.runner
    model = runner.model
    print(engine.startup_line, flush=True)
    split: dict[str, float] = collections.defaultdict(float)
    timing = [False]

    def timer(owner: object, name: str, label: str) -> None:
        add_timer(owner, name, label, split, timing)

    timer(model, "forward", "forward")
    timer(model, "compute_logits", "lm_head")
    timer(runner, "run", "runner")
    timer(engine, "step", "engine")
    vocab = model.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def rows_round() -> dict[str, float]:
        """ms per step of ``args.rows`` sequences generating together, split."""
        prompts = [[rng.randrange(vocab)] for _ in range(args.rows)]
        split.clear()
        timing[0] = True
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        timing[0] = False
        engine.check_idle()
        out = {"step": 1e3 * elapsed / args.tokens}
        for label in ("forward", "lm_head", "runner", "engine"):
            out[label] = 1e3 * split[label] / args.tokens
        return out

    def one_round() -> dict[str, float]:
        """ms per step of the steps after the first, split."""
        if args.rows > 1:
            return rows_round()
        split.clear()
        first = last = None
        for delta in llm.stream_deltas([rng.randrange(vocab)], params):
            now = time.perf_counter()
            if first is None and delta.token_ids:
                first = now
                split.clear()  # from the first token on
                timing[0] = True
            last = now
        timing[0] = False
        engine.check_idle()
        assert first is not None and last is not None
        steps = args.tokens - 1
        out = {"step": 1e3 * (last - first) / steps}
        for label in ("forward", "lm_head", "runner", "engine"):
            out[label] = 1e3 * split[label] / steps
        return out

    modes = {"program": True, "op_by_op": False}
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for enabled in modes.values():  # warm-up
        decode_program.ENABLED = enabled
        model._program_for = None
        one_round()
    for r in range(args.rounds):
        for mode, enabled in modes.items() if r % 2 == 0 else reversed(list(modes.items())):
            decode_program.ENABLED = enabled
            model._program_for = None
            rounds[mode].append(one_round())
            print(f"round {r + 1} {mode:<9} {rounds[mode][-1]['step']:.2f} ms/step", flush=True)
    engine.close()
    result: dict[str, object] = {
        "threads": args.threads,
        "rows": args.rows,
        "loadavg": os.getloadavg(),
    }
    print(
        f"\n{'mode':<10} {'step ms':>8} {'tok/s':>7} {'forward':>8} {'LM head':>8} "
        f"{'sampling etc.':>14} {'engine rest':>12}"
    )
    for mode in modes:
        med = {k: statistics.median(x[k] for x in rounds[mode]) for k in rounds[mode][0]}
        sampling = med["runner"] - med["forward"] - med["lm_head"]
        rest = med["step"] - med["runner"]
        print(
            f"{mode:<10} {med['step']:8.2f} {1e3 / med['step']:7.1f} {med['forward']:8.2f} "
            f"{med['lm_head']:8.2f} {sampling:14.2f} {rest:12.2f}"
        )
        result[mode] = {k: round(v, 3) for k, v in med.items()}
        result[f"{mode}_steps_ms"] = [round(x["step"], 3) for x in rounds[mode]]
    ratio = result["op_by_op"]["step"] / result["program"]["step"]  # type: ignore[index]
    result["speedup"] = round(ratio, 3)
    print(f"op-by-op step / program step: {ratio:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
