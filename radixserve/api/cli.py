"""The ``radixserve`` command line."""

from __future__ import annotations

import argparse
import sys

from radixserve.engine.config import DTYPES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    g.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV cache size in GiB")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--long-prefill-threshold", type=int, default=None)
    g.add_argument("--num-threads", type=int, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_memory_gb": args.kv_cache_memory,
        "page_size": args.page_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "long_prefill_threshold": args.long_prefill_threshold,
        "num_threads": args.num_threads,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion and stream it to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--no-chat", action="store_true", help="raw completion, no chat template")
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.2)
    gen.add_argument("--top-p", type=float, default=0.9)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(gen)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from radixserve import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
    )
    llm = LLM(**engine_kwargs(args))
    if args.no_chat:
        stream = llm.stream(args.prompt, params)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        stream = llm.stream(messages, params, chat=True)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
    except ValueError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
