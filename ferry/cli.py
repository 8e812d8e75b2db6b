"""The `ferry` command line: `ferry generate`, `ferry serve` (and `python -m ferry ...`)."""

from __future__ import annotations

import argparse
import sys

from ferry import __version__
from ferry.engine_args import CommandParser, add_engine_args, engine_config, parse
from ferry.sampling_params import RequestOutputKind, SamplingParams


def generate(args: argparse.Namespace) -> int:
    from ferry.engine.engine import LLMEngine

    engine = LLMEngine.from_config(engine_config(args))
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
    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    gen = commands.add_parser("generate", help="complete one prompt, streaming the text",
                              description="Complete one prompt with the engine in this process, streaming the text.")
    gen.add_argument("prompt", help="the text to complete")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the most likely tokens of this mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeat for more)")
    add_engine_args(gen)
    gen.set_defaults(func=generate, command_parser=gen)

    from ferry.server.cli import add_serve_command

    add_serve_command(commands)
    from ferry.bench.cli import add_bench_command

    add_bench_command(commands)
    from ferry.doctor.cli import add_doctor_command

    add_doctor_command(commands)

    args = parse(parser, argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
