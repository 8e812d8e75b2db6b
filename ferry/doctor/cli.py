"""`ferry doctor [MODEL] --gpu NAME`: what the engine would hold and how fast it would run, from the
model's config.json and a GPU, before anything runs; `--check` measures the same here.

    ferry doctor benchmarks/llama-3.1-8b --gpu H200 --context-len 1024 --batch-sizes 1 32 256
    ferry doctor benchmarks/qwen3-0.6b --gpu H100-SXM --quantization fp8 --kv-cache-dtype fp8
    ferry doctor --gpu cpu --check --prompt-len 16 --output-len 4 --batch-sizes 1 2 --check-requests 4

The options are parsed with the standard library alone (torch is imported only to measure).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ferry.config import ENGINE_OPTIONS, MAX_SPECULATIVE_TOKENS, EngineConfig

# The engine's options the predictions depend on, with the engine's defaults and help.
ENGINE_FLAGS = ("dtype", "quantization", "kv_cache_dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "gpu_memory_utilization", "block_size", "max_prefill_graph_tokens")
DESCRIPTION = ("Predict an engine's memory, TTFT, ITL and throughput from a model's config.json and a GPU, each "
               "figure with its formula; --check measures the same on this machine.")


def add_doctor_command(subparsers) -> None:
    parser = subparsers.add_parser("doctor", help="predict memory and speed from config.json and a GPU; --check "
                                   "measures them here", description=DESCRIPTION)
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="a model folder, or one with only config.json (default: the bundled model)")
    from ferry.doctor.gpus import GPUS

    parser.add_argument("--gpu", default=None, metavar="NAME",
                        help=f"one of {', '.join(g.name for g in GPUS)} (datasheets), 'measured' (this machine's "
                             "GPU, or its CPU where there is none), or 'cpu' (default: measured where CUDA is)")
    engine = parser.add_argument_group("engine (as ferry serve takes them)")
    for name in ENGINE_FLAGS:
        option = ENGINE_OPTIONS[name]
        engine.add_argument("--" + name.replace("_", "-"), type=option.type, default=option.default,
                            choices=option.choices, help=option.help)
    work = parser.add_argument_group("workload")
    work.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (TTFT, throughput)")
    work.add_argument("--output-len", type=int, default=256, help="output tokens a request (throughput)")
    work.add_argument("--context-len", type=int, default=None,
                      help="tokens in each request's KV cache at the decode steps timed (default: prompt + output)")
    work.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256], metavar="N",
                      help="decode batch sizes to predict the ITL of")
    work.add_argument("--spec-tokens", type=int, default=4, help="speculative decoding's proposals a step (k)")
    work.add_argument("--spec-acceptance", type=float, default=0.7,
                      help="the chance that each proposal is kept (a)")
    check = parser.add_argument_group("check")
    check.add_argument("--check", action="store_true", help="measure the same on this machine and print each "
                       "prediction's error (runs ferry bench latency and throughput)")
    check.add_argument("--check-requests", type=int, default=None,
                       help="requests of the throughput run (default: the predicted saturation batch)")
    check.add_argument("--check-iters", type=int, default=3, help="measured iterations of each latency run")
    check.add_argument("--check-steps", type=int, default=32, help="steps decoding the whole batch that each ITL run times")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write everything here as JSON")
    parser.set_defaults(func=doctor, command_parser=parser)


def doctor(args: argparse.Namespace) -> int:
    from ferry.doctor.predict import Deployment
    from ferry.doctor.report import as_json, build, text

    model = args.model if args.model is not None else _default_model()
    device = _device(args.gpu)
    options = {name: getattr(args, name) for name in ENGINE_FLAGS}

    def make_config(**changes) -> EngineConfig:
        return EngineConfig.create(model, device=device, load_format="dummy", **{**options, **changes})

    config = make_config()
    workload = _workload(args, config)
    plan = _check_plan(args, device) if args.check else None
    deployment = Deployment(config, _machine(args.gpu, device, config.model.dtype))
    report = build(deployment, workload, make_config)
    print(text(report))
    result = as_json(report)
    if plan is not None:
        result["check"] = _check(plan, deployment, workload)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


def _check_plan(args: argparse.Namespace, device: str):
    from ferry.doctor.check import CheckPlan

    if device == "cuda" and not _cuda_available():
        raise ValueError("--check measures this machine, which has no CUDA device: predict for it with --gpu cpu")
    for flag, value in (("--check-iters", args.check_iters), ("--check-steps", args.check_steps),
                        ("--check-requests", args.check_requests)):
        if value is not None:
            _positive(flag, value)
    return CheckPlan(args.check_requests, args.check_iters, args.check_steps)


def _check(plan, deployment, workload) -> list[dict]:
    from ferry.doctor.check import check_json, check_table, run_check

    rows = run_check(deployment, workload, plan)
    print()
    print("\n".join(check_table(rows, deployment.machine.hardware.name)))
    return check_json(rows)


def _workload(args: argparse.Namespace, config: EngineConfig):
    """The workload the options describe; a ValueError names an option out of range."""
    from ferry.doctor.report import Workload

    context = args.context_len if args.context_len is not None else args.prompt_len + args.output_len
    for flag, value in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len),
                        ("--context-len", context), *(("--batch-sizes", b) for b in args.batch_sizes)):
        _positive(flag, value)
    limit = config.model.max_model_len
    whole = args.prompt_len + args.output_len
    for what, tokens in (("--context-len", context), ("--prompt-len + --output-len", whole)):
        if tokens > limit:
            raise ValueError(f"{what} is {tokens:,} tokens, more than max_model_len {limit:,}")
    if not 1 <= args.spec_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--spec-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {args.spec_tokens}")
    if not 0 <= args.spec_acceptance < 1:
        raise ValueError(f"--spec-acceptance must be in [0, 1), got {args.spec_acceptance}")
    return Workload(args.prompt_len, args.output_len, context, tuple(args.batch_sizes), args.spec_tokens,
                    args.spec_acceptance)


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def _default_model() -> Path:
    from ferry.assets import default_model_path

    return default_model_path()


def _device(gpu: str | None) -> str:
    """Where the engine predicted for would run: cuda for a named or measured GPU, else cpu."""
    if gpu is None:
        if not _cuda_available():
            raise ValueError("no CUDA device here: name a GPU with --gpu (see --help), or give --gpu cpu")
        return "cuda"
    if gpu.lower() == "cpu" or (gpu.lower() == "measured" and not _cuda_available()):
        return "cpu"
    if gpu.lower() != "measured":
        from ferry.doctor.gpus import find_gpu

        find_gpu(gpu)  # an unknown name is an error here, before anything is read
    return "cuda"


def _machine(gpu: str | None, device: str, dtype: str):
    from ferry.doctor import calibration
    from ferry.doctor.gpus import find_gpu
    from ferry.doctor.predict import Machine

    if gpu is not None and gpu.lower() not in ("cpu", "measured"):
        spec = find_gpu(gpu)
        return Machine(spec.hardware(), calibration.DATASHEET_GPU, spec.memory_bytes, spec.link_gbps * 1e9)
    return _measured_machine(device, dtype)


def _measured_machine(device: str, dtype: str):
    """This machine's ceilings, measured as the benchmarks measure them (bench/roofline.py)."""
    import torch

    from ferry.bench.roofline import measure_hardware
    from ferry.doctor import calibration
    from ferry.doctor.gpus import gpu_named_like
    from ferry.doctor.predict import Machine

    hardware = measure_hardware(device, getattr(torch, dtype))
    if device == "cpu":
        return Machine(hardware, calibration.CPU, None)
    like = gpu_named_like(hardware.name)  # the link to a second GPU is not measured: the table's, if it has this GPU
    return Machine(hardware, calibration.MEASURED_GPU, torch.cuda.mem_get_info()[1],
                   like.link_gbps * 1e9 if like else None)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

