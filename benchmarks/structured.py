"""Constrained (JSON schema) vs free decoding on the same engine, same prompts, same run.

    python benchmarks/structured.py [--model PATH] [--requests 64] [--max-tokens 160]

Each request asks for a nested ~10-field object; the constrained pass gives every request
the schema (xgrammar bitmask, one batched fill per step), the free pass none. The free pass
then generates exactly as many tokens per request as the constrained pass did
(``max_tokens`` = that length, ``ignore_eos``), so both run the same batch sizes step by step
and the ratio measures what the constraint costs, not how the two texts happen to end
(``--free-max-tokens`` runs the free pass to ``--max-tokens`` with EOS instead, as before).
The passes alternate for ``--rounds`` rounds after a warm-up; the best run of each counts.
Reports output tokens/s of both, their ratio, and the per-step mask time (batched fill +
apply, for all constrained rows of the step). Last line: JSON with
``constrained_vs_free_throughput`` and ``mask_ms_per_step_p50``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from radixserve import LLM, SamplingParams
from radixserve.executor.grammar import GrammarBatch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "maxLength": 32},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "phone": {"type": "string", "pattern": "^[0-9+ -]{7,15}$"},
        "notes": {"type": "string", "maxLength": 40},
    },
    "required": [
        "name",
        "age",
        "email",
        "active",
        "score",
        "role",
        "tags",
        "address",
        "phone",
        "notes",
    ],
}

PEOPLE = ["a chef", "a pilot", "a teacher", "a painter", "a nurse", "a farmer", "a coder", "a poet"]


def _prompts(llm: LLM, count: int) -> list[str]:
    tok = llm.tokenizer
    return [
        tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Invent a profile of {PEOPLE[i % len(PEOPLE)]} number {i} as "
                    "JSON with name, age, email, active, score, role, tags, address (street, "
                    "city, zip), phone and notes.",
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(count)
    ]


def _pass(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "auto", "int8", "int4"],
        help="weights: none = bfloat16 as loaded (the default here: the shipped GGUF is Q4_1, which the engine's own default, auto, would run in int4)",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--free-max-tokens",
        action="store_true",
        help="free pass: --max-tokens with EOS, not the constrained pass's lengths",
    )
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization)
    prompts = _prompts(llm, args.requests)
    constrained = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, structured_output={"json": SCHEMA}
    )
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    _pass(llm, prompts[:2], constrained)  # warm-up: compiles (and caches) the grammar
    # and one short pass of the whole batch: the first 64-request steps grow the heap
    _pass(llm, prompts, SamplingParams(temperature=0, max_tokens=8))
    # (seconds, tokens, steps, outputs) of the best run of each side: its figures belong
    # together (tokens can differ by a few between rounds: batch-dependent rounding)
    best_con: tuple | None = None
    best_free: tuple | None = None
    masks: list[float] = []
    for round_ in range(args.rounds):  # alternating; the best run of each side counts
        GrammarBatch.mask_ms.clear()
        steps_before = llm.engine.num_steps
        elapsed, tokens, outs = _pass(llm, prompts, constrained)
        run = (elapsed, tokens, llm.engine.num_steps - steps_before, outs)
        masks.extend(GrammarBatch.mask_ms)
        best_con = run if best_con is None or elapsed < best_con[0] else best_con
        if not args.free_max_tokens:  # the same length per request as the constrained pass
            free = [
                SamplingParams(
                    temperature=0, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True
                )
                for o in outs
            ]
        steps_before = llm.engine.num_steps
        free_elapsed, free_tokens, _ = _pass(llm, prompts, free)
        run = (free_elapsed, free_tokens, llm.engine.num_steps - steps_before, None)
        best_free = run if best_free is None or free_elapsed < best_free[0] else best_free
        print(f"round {round_ + 1}: constrained {elapsed:.2f} s, free {free_elapsed:.2f} s")
    assert best_con is not None and best_free is not None, "--rounds must be at least 1"
    t_con, n_con, con_steps, outs = best_con
    t_free, n_free, free_steps, _ = best_free
    valid = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    con_tps, free_tps = n_con / t_con, n_free / t_free
    masks.sort()
    result = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "constrained_tokens": n_con,
        "constrained_s": round(t_con, 3),
        "constrained_tokens_per_s": round(con_tps, 1),
        "constrained_steps": con_steps,
        "constrained_valid_json": valid,
        "free_tokens": n_free,
        "free_s": round(t_free, 3),
        "free_tokens_per_s": round(free_tps, 1),
        "free_steps": free_steps,
        "constrained_vs_free_throughput": round(con_tps / free_tps, 3),
        "free_lengths": "max_tokens, EOS" if args.free_max_tokens else "as constrained",
        "constrained_vs_free_ms_per_step": round(
            (t_con / max(1, con_steps)) / (t_free / max(1, free_steps)), 3
        ),
        "mask_ms_per_step_p50": round(statistics.median(masks), 3) if masks else None,
        "mask_ms_per_step_p90": round(masks[int(0.9 * (len(masks) - 1))], 3) if masks else None,
        "mask_steps": len(masks),
    }
    for key, value in result.items():
        print(f"{key:>32}  {value}")
    print(json.dumps(result))
    llm.engine.close()


if __name__ == "__main__":
    main()
