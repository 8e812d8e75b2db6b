"""The engine's command-line options, shared by `ferry generate`, `ferry serve` and the benchmarks.

They are generated from the option fields of `EngineConfig` and its parts (config.py), which hold
each option's default and help text and are named after `LLM`'s keyword arguments, which are vLLM's:
the field `block_size` is `--block-size`, a boolean `enable_prefix_caching` is
`--enable-prefix-caching/--no-enable-prefix-caching`. `engine_config` turns the parsed options into
the `EngineConfig`. vLLM's launch lines work unchanged: an option with vLLM's meaning that ferry has
no other value for yet (`--tensor-parallel-size 2`) is an error naming the
option and the value, and an option that changes nothing in ferry (`--swap-space`) is accepted and
says so in its help.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, NoReturn

from ferry.config import ENGINE_OPTIONS, EngineConfig, EngineOption


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
    """The engine's options (the option fields of config.py that have a flag), then vLLM's that
    ferry has one value for."""
    group = parser.add_argument_group("engine")
    for option in ENGINE_OPTIONS.values():
        if option.flag:
            flags = ["--" + option.name.replace("_", "-"), *([option.short] if option.short else [])]
            group.add_argument(*flags, default=option.default, help=option.help, **_parsing(option))
    vllm = parser.add_argument_group("vLLM's options ferry has one value for")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                      help="GPUs per replica; ferry runs on one (tensor parallelism is not built yet)")
    vllm.add_argument("--swap-space", type=float, default=0,
                      help="accepted, no effect: ferry preempts by recompute and swaps nothing to host memory")
    vllm.add_argument("--trust-remote-code", action="store_true",
                      help="accepted, no effect: ferry runs no code from model folders (chat templates run in "
                           "a sandbox)")


def _parsing(option: EngineOption) -> dict[str, Any]:
    """How argparse reads an option, from its field's type: a boolean as --x/--no-x, a folder as
    the string given, a config of several keys as its JSON text."""
    if option.type is bool:
        return {"action": argparse.BooleanOptionalAction}
    if is_dataclass(option.type):  # a config of several keys, as vLLM's JSON (speculative_config)
        return {"type": str, "metavar": "JSON"}
    if option.type not in (int, float, str, Path):
        raise TypeError(f"the option {option.name} ({option.type.__name__}) has no command-line form: flag=False")
    return {"type": str if option.type is Path else option.type, "choices": option.choices}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the options (the model from `model_path`)."""
    return EngineConfig.create(model_path(args), **engine_kwargs(args))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig.create`'s keyword arguments (`LLM`'s) from the options, all but the model; an
    error naming any option whose value ferry lacks."""
    _only(args.tensor_parallel_size == 1, "--tensor-parallel-size", args.tensor_parallel_size,
          "ferry runs on one GPU; tensor parallelism is not built yet")
    return {name: getattr(args, name) for name, option in ENGINE_OPTIONS.items() if option.flag and name != "model"}


def _only(ok: bool, flag: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"{flag} {value}".rstrip() + f": {why}")


def model_path(args: argparse.Namespace) -> str | Path:
    """--model, else the bundled model."""
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
