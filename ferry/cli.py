"""The `ferry` command line: `ferry generate`, `ferry serve` (and `python -m ferry ...`)."""

from __future__ import annotations

import argparse
import sys

from ferry.sampling_params import RequestOutputKind, SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's options, named after `LLM`'s keyword arguments."""
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="run every step eagerly; --no-enforce-eager replays decode steps from CUDA graphs "
                             "(the default on CUDA)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and launch each step before waiting for the last one's tokens, so "
                             "the host's work overlaps the device's (the default on CUDA)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=args.load_format, seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
    )


def model_path(args: argparse.Namespace):
    if args.model is not None:
        return args.model
    from ferry.assets import default_model_path

    return default_model_path()


def generate(args: argparse.Namespace) -> int:
    from ferry.engine.engine import LLMEngine, make_engine_config

    engine = LLMEngine.from_config(make_engine_config(model_path(args), **engine_kwargs(args)))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sampling_seed, stop=args.stop, output_kind=RequestOutputKind.DELTA,
    )
    prompt = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])}
    else:
        sys.stdout.write(prompt)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.outputs[0].text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry", description="LLM inference engine and OpenAI-compatible server")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete one prompt, streaming the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    add_engine_args(gen)
    gen.set_defaults(func=generate)

    from ferry.server.cli import add_serve_command

    add_serve_command(commands)
    from ferry.bench.cli import add_bench_command

    add_bench_command(commands)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
