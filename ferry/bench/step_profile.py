"""Where one decode step's time goes: the whole engine step, the GPU work in it, and its kernels.

    python -m ferry.bench.step_profile --config-dir benchmarks/qwen3-0.6b --dtype bfloat16 \\
        --no-enforce-eager --batch-size 256 --input-len 700

`--batch-size` requests of `--input-len` random tokens are prefilled and decoded for
`--warmup-steps` steps; then, with every request decoding:

- step ms: wall time of `engine.step()`, averaged over `--steps` steps;
- graph replay ms: the decode graph of that batch size replayed alone (with graphs), which is the
  forward's GPU time with no host work between kernels;
- GPU ms per step: the kernels' own time under torch.profiler, over `--profile-steps` steps; step ms
  minus this is the time the GPU waited for the host;
- the kernels that take the most of it, per step.

With programmatic dependent launch (on Hopper: kernels/pdl.py) a kernel starts before the
one before it ends and its time includes that wait: kernel times then overlap and add up to more
than the step. FERRY_PDL=0 launches them one after another, for a breakdown by kernel.

`--trace PATH` also writes the profiled steps as a Chrome trace (open it in ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import sys
import time

from ferry.bench.throughput import (
    add_model_args, build_engine, command_line, print_kernels, random_workload, resolve_model_args,
)


def _timed(fn, n: int, sync) -> float:
    """Mean milliseconds of fn over n calls, after one untimed call."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n * 1e3


def run(args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ferry.engine_args import engine_config
    from ferry.sampling_params import RequestOutputKind, SamplingParams

    resolve_model_args(args)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.batch_size
    engine = build_engine(args, engine_config(args))
    cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    needed = args.warmup_steps + args.steps + args.profile_steps + 2
    prompts, _ = random_workload(args.batch_size, (args.input_len,) * 2, (1, 1), engine.config.model.vocab_size, 0)
    params = SamplingParams(temperature=0.0, max_tokens=needed, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(args.warmup_steps):
        engine.step()
    if engine.scheduler.num_waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running
    ):
        raise ValueError("some prompts are still prefilling after the warm-up steps: raise --warmup-steps")

    print(f"{engine.config.model.architecture} ({args.model}), {args.dtype} on {args.device}; "
          f"{args.batch_size} requests decoding, contexts from {args.input_len + args.warmup_steps} tokens")
    step_ms = _timed(engine.step, args.steps, sync)
    print(f"step ms: {step_ms:.3f} (mean of {args.steps})")
    graphs = engine.executor.decode_graphs
    if graphs is not None and graphs.num_captured:
        b = graphs.padded_size(args.batch_size)
        replay_ms = _timed(graphs._graphs[b, 1].replay, args.steps, sync)  # (the one-token decode graph)
        print(f"graph replay ms (batch {b}): {replay_ms:.3f}")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        sync()
    if cuda:
        gpu_ms = print_kernels(prof, args.profile_steps, args.top)
        print(f"the GPU waits for the host about {max(0.0, step_ms - gpu_ms):.3f} ms of each step")
        from ferry.kernels.pdl import use_pdl  # (Triton: CUDA only)

        if use_pdl(torch.device(args.device)):
            print("(kernels launched with PDL overlap the one before them: their times include the wait, "
                  "FERRY_PDL=0 separates them)")
    else:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.set_defaults(max_num_seqs=None)  # the batch size
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--warmup-steps", type=int, default=40, help="steps before measuring (prefill included)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15, help="kernels to list")
    parser.add_argument("--trace", default=None, metavar="PATH", help="write a Chrome trace of the profiled steps")


def main(argv: list[str] | None = None) -> int:
    return command_line("step_profile", __doc__, add_args, lambda args: run(args) or 0, argv)


if __name__ == "__main__":
    sys.exit(main())
