"""The engine's command-line options, shared by `ferry generate`, `ferry serve` and the benchmarks.

Named after `LLM`'s keyword arguments, which are vLLM's; `engine_kwargs` turns them back into those
keyword arguments. vLLM's launch lines work unchanged: an option with vLLM's meaning that ferry has
no other value for yet (`--tensor-parallel-size 2`, `--quantization fp8`) is an error naming the
option and the value, and an option that changes nothing in ferry (`--enable-chunked-prefill`,
always on) is accepted and says so in its help.
"""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn


class CommandParser(argparse.ArgumentParser):
    """A (sub)command's parser: defaults in the help, and an unknown option reported by the command
    that was given it, with the closest options it knows."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # an abbreviation that works today breaks when an option is added
        super().__init__(*args, **kwargs)

    def reject_unknown(self, extras: list[str]) -> NoReturn:
        known = [s for action in self._actions for s in action.option_strings]
        flags = [extra for extra in extras if extra.startswith("-")]
        lines = []
        for extra in flags or extras:  # the values after an unknown option are not news
            flag = extra.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6) if flag.startswith("-") else []
            lines.append(f"unrecognized argument: {extra}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        self.error("; ".join(lines))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's options, named after `LLM`'s keyword arguments."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    group.add_argument("--tokenizer", default=None, help="folder of the tokenizer (default: the model's)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float", "half"],
                       help="auto: the checkpoint's half-precision dtype on a GPU, float32 on a CPU")
    group.add_argument("--device", default="cpu", help="cpu or cuda")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per step (default: 2048 on a CPU; max(8192, min(max_model_len, 16384)) on a GPU)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's max_position_embeddings)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of the GPU's memory for weights, activations and the KV cache")
    group.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights from config.json alone, for benchmarks")
    group.add_argument("--seed", type=int, default=0, help="seed of the sampler's shared generator")
    group.add_argument("--generation-config", default="auto",
                       help="where EOS ids come from: auto (the model's generation_config.json), vllm (config.json "
                            "only), or a folder with a generation_config.json")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV cache of shared prompt prefixes")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                       help="run every step eagerly; --no-enforce-eager replays decode steps from CUDA graphs "
                            "(default: graphs on CUDA)")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and launch each step before waiting for the last one's tokens, so the host's "
                            "work overlaps the device's (default: on CUDA)")
    vllm = parser.add_argument_group("vLLM's options ferry has one value for")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                      help="GPUs per replica; ferry runs on one (tensor parallelism is not built yet)")
    vllm.add_argument("--kv-cache-dtype", default="auto",
                      help="auto: the model's dtype (an FP8 KV cache is not built yet)")
    vllm.add_argument("--quantization", "-q", default=None, help="none: the checkpoint's weights as they are")
    vllm.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                      help="always on in ferry: long prompts are cut into chunks that share steps with decodes")
    vllm.add_argument("--swap-space", type=float, default=0,
                      help="accepted, no effect: ferry preempts by recompute and swaps nothing to host memory")
    vllm.add_argument("--trust-remote-code", action="store_true",
                      help="accepted, no effect: ferry runs no code from model folders (chat templates run in "
                           "a sandbox)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM`'s keyword arguments from the options; an error naming any option whose value ferry lacks."""
    _only(args.tensor_parallel_size == 1, "--tensor-parallel-size", args.tensor_parallel_size,
          "ferry runs on one GPU; tensor parallelism is not built yet")
    _only(args.kv_cache_dtype == "auto", "--kv-cache-dtype", args.kv_cache_dtype,
          "the KV cache is kept in the model's dtype; an FP8 KV cache is not built yet")
    _only(args.quantization in (None, "none"), "--quantization", args.quantization,
          "ferry runs the checkpoint's weights as they are; quantization is not built yet")
    _only(args.enable_chunked_prefill, "--no-enable-chunked-prefill", "",
          "ferry always chunks long prompts (a step mixes prefill chunks with decodes)")
    return dict(
        dtype=args.dtype, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=args.load_format, seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, tokenizer=args.tokenizer,
        generation_config=args.generation_config,
    )


def _only(ok: bool, flag: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"{flag} {value}".rstrip() + f": {why}")


def model_path(args: argparse.Namespace):
    if args.model is not None:
        return args.model
    from ferry.assets import default_model_path

    return default_model_path()


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, except that unknown options are reported by the subcommand they were given to."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = getattr(args, "command_parser", parser)
        if isinstance(command, CommandParser):
            command.reject_unknown(extras)
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args
