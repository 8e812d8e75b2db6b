"""Offline throughput on random prompts, next to the roofline bound of the schedule the engine ran.

    ferry bench throughput --config-dir benchmarks/qwen3-0.6b --dtype bfloat16 \\
        --num-prompts 256 --input-len 100 1024 --output-len 512

Prompts are random token ids and every request generates exactly its output length (EOS ignored), so
the work is fixed whatever the weights: `--config-dir` runs a folder holding only a config.json with
random weights. A length is fixed (`--input-len 512`) or uniform in a range (`--input-len 100 1024`);
prompts and lengths are drawn as nano-vllm's bench.py and the Hugging Face baseline draw them
(Python's `random`, seeded; lengths, then token ids in [0, 10000]), so a seed gives the same workload.

The engine runs as `LLM.generate` drives it, and every step it schedules is recorded: the bound is
the sum over those steps of `roofline.step_bound`, so the batch shapes, prefill chunks and any
recomputation after preemption that the scheduler chose are charged to the bound as to the clock.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

from ferry.bench.roofline import (
    ModelCost, RecordedStep, ScheduleRecorder, add_hardware_args, hardware_from_args, paging_waste, step_bound,
    step_seconds,
)
from ferry.engine_args import add_engine_args, engine_config
from ferry.gc_settings import quiet_gc

MAX_TOKEN_ID = 10000  # random prompt ids are drawn from [0, 10000], as nano-vllm and the baseline do


# ---- options shared with the latency benchmark ----


def add_model_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--config-dir", default=None, metavar="DIR",
                        help="a model folder that may hold only config.json: random weights (--load-format dummy)")
    parser.set_defaults(device="auto")  # cuda when there is one
    add_hardware_args(parser)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results here as JSON")
    parser.add_argument("--quiet-gc", action=argparse.BooleanOptionalAction, default=True,
                        help="once the engine is built, collect garbage rarely, as the server's engine process "
                             "does (ferry/gc_settings.py); it changes this process's collector for good")


def resolve_model_args(args: argparse.Namespace) -> None:
    """Fill in what the options leave open: the model folder, the device, the weights' source."""
    import torch

    if args.config_dir is not None:
        if args.model is not None:
            raise ValueError("give --model or --config-dir, not both")
        args.model, args.load_format = args.config_dir, "dummy"
    if args.model is None:
        from ferry.assets import default_model_path

        args.model = str(default_model_path())
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def setup(args: argparse.Namespace) -> tuple:
    """(engine, hardware, cost model). The ceilings are measured before the engine takes its share
    of device memory (the KV cache is sized from what is free)."""
    import torch

    resolve_model_args(args)
    config = engine_config(args)
    hw = hardware_from_args(args, args.device, getattr(torch, config.model.dtype))
    cost = ModelCost.from_model_config(config.model, config.cache.kv_itemsize(config.model))
    return build_engine(args, config), hw, cost


def build_engine(args: argparse.Namespace, config):
    """The engine of a benchmark; with --quiet-gc, garbage collected as the server's engine process
    collects it (gc_settings.py), so the two compare."""
    from ferry.engine.engine import LLMEngine

    engine = LLMEngine.from_config(config)
    if args.quiet_gc:
        quiet_gc()
    return engine


def length_range(values: list[int], name: str) -> tuple[int, int]:
    """`--x N` -> (N, N); `--x LO HI` -> (LO, HI)."""
    if len(values) not in (1, 2) or min(values) < 1 or values[0] > values[-1]:
        raise ValueError(f"--{name} takes one length or a range LO HI with 1 <= LO <= HI, got {values}")
    return values[0], values[-1]


def random_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """Prompts of random token ids and each request's output length, uniform in the given ranges."""
    rng = random.Random(seed)
    top = min(MAX_TOKEN_ID, vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    return prompts, [rng.randint(*output_len) for _ in range(num_prompts)]


# ---- the run ----


def print_kernels(prof, num_steps: int, top: int) -> float:
    """Print the CUDA kernels of a torch.profiler run over `num_steps` steps that took the most
    time, per step; returns the kernels' total milliseconds per step."""
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / num_steps
    print(f"GPU ms per step (kernel time, profiled): {gpu_ms:.3f}")
    print(f"\n{'kernel':<60} {'ms/step':>8} {'calls/step':>10} {'share':>6}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        ms = e.self_device_time_total / 1e3 / num_steps
        print(f"{e.key[:60]:<60} {ms:>8.3f} {e.count / num_steps:>10.1f} {ms / gpu_ms:>6.1%}")
    return gpu_ms


class ProfileWindow:
    """Kernel times over `steps` engine steps from step `after` of a run (torch.profiler, CUDA): the
    steps the run really takes, mixed prefill chunks and all. Profiling slows the steps it covers,
    so a run's wall time with a window is not its throughput."""

    def __init__(self, after: int, steps: int, top: int = 20) -> None:
        self.after, self.steps, self.top = after, steps, top
        self._prof = None

    def tick(self, step: int) -> None:
        """Before engine step number `step` (from 0)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        if step == self.after:
            torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.__enter__()
        elif step == self.after + self.steps:
            self.close()

    def close(self) -> None:
        import torch

        if self._prof is None:
            return
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        print(f"kernels of steps {self.after} to {self.after + self.steps - 1} (torch.profiler):")
        print_kernels(self._prof, self.steps, self.top)
        self._prof = None


def generate(
    engine, prompts: list[list[int]], output_lens: list[int], temperature: float, tag: str,
    window: ProfileWindow | None = None,
) -> int:
    """Run every request to its end, as `LLM.generate` does; returns the output tokens generated."""
    from ferry.sampling_params import RequestOutputKind, SamplingParams

    for i, (prompt, max_tokens) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params)
    generated = step = 0
    while engine.has_unfinished_requests():
        if window is not None:
            window.tick(step)
        for output in engine.step():
            generated += len(output.outputs[0].token_ids)
        step += 1
    if window is not None:
        window.close()
    return generated


def bound_summary(steps: list[RecordedStep], cost: ModelCost, hw) -> dict:
    """The bound of the recorded steps, split by which ceiling each step meets."""
    compute = memory = flops = nbytes = 0.0
    for s in steps:
        step_cost = cost.step_cost(s.step, s.sampled_rows)
        flops, nbytes = flops + step_cost.flops, nbytes + step_cost.bytes
        t = step_bound(s.step, s.sampled_rows, cost, hw)
        if step_cost.compute_seconds(hw) >= step_cost.bytes / hw.bandwidth_bytes_per_s:
            compute += t
        else:
            memory += t
    return {"bound_s": compute + memory, "bound_compute_s": compute, "bound_memory_s": memory,
            "flops": flops, "bytes": nbytes}


def run(args: argparse.Namespace) -> dict:
    input_len, output_len = length_range(args.input_len, "input-len"), length_range(args.output_len, "output-len")
    engine, hw, cost = setup(args)
    prompts, output_lens = random_workload(args.num_prompts, input_len, output_len, cost.vocab_size, args.seed)

    if args.num_warmup_prompts:
        n = args.num_warmup_prompts
        warm_prompts, _ = random_workload(n, input_len, output_len, cost.vocab_size, args.seed + 1)
        generate(engine, warm_prompts, [min(8, output_len[1])] * n, args.temperature, "warmup-")
    preemptions_before = engine.scheduler.num_preemptions
    recomputed_before = engine.scheduler.num_recomputed_tokens
    spec_before = copy.deepcopy(engine.scheduler.spec_stats)
    with ScheduleRecorder(engine) as steps:
        start = time.perf_counter()
        if args.profile_steps < 0 or args.profile_after < 0:
            raise ValueError("--profile-steps and --profile-after must be >= 0")
        window = ProfileWindow(args.profile_after, args.profile_steps) if args.profile_steps else None
        generated = generate(engine, prompts, output_lens, args.temperature, "", window)
        end = time.perf_counter()
        elapsed = end - start

    input_tokens = sum(map(len, prompts))
    bound = bound_summary(steps, cost, hw)
    kv = engine.scheduler.kv_cache
    return {
        "model": str(args.model), "architecture": engine.config.model.architecture,
        "dtype": engine.config.model.dtype, "device": args.device,
        "hardware": {"name": hw.name, "peak_flops": hw.peak_flops, "bandwidth_bytes_per_s": hw.bandwidth_bytes_per_s,
                     "fp8_peak_flops": hw.fp8_peak_flops},
        "num_requests": len(prompts), "input_len": input_len, "output_len": output_len,
        "input_tokens": input_tokens, "output_tokens": generated, "expected_output_tokens": sum(output_lens),
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (input_tokens + generated) / elapsed,
        **bound,
        "achieved_fraction": bound["bound_s"] / elapsed,
        "num_steps": len(steps),
        "num_prefill_steps": sum(any(q > 1 for q, _ in s.step) for s in steps),
        "by_step_kind": by_step_kind(steps, step_seconds(steps, end), cost, hw),
        "num_preemptions": engine.scheduler.num_preemptions - preemptions_before,
        # Computed tokens that preemptions threw away, to be computed again: against the tokens the
        # workload itself computes (prompts and outputs).
        "recomputed_tokens": engine.scheduler.num_recomputed_tokens - recomputed_before,
        "recomputed_fraction": (engine.scheduler.num_recomputed_tokens - recomputed_before) / max(input_tokens + generated, 1),
        "kv_blocks": kv.num_blocks, "block_size": kv.block_size,
        "kv_paging_waste": paging_waste(steps),
        "speculative": spec_summary(engine, spec_before),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }


def by_step_kind(steps: list[RecordedStep], seconds: list[float], cost: ModelCost, hw) -> dict:
    """Wall time against bound for the steps that only decode and for those with prefill chunks:
    where a run falls short of its bound (the first run as the decode graphs replay them, the
    second eagerly)."""
    kinds = {"decode only": [0, 0.0, 0.0, 0], "with prefill chunks": [0, 0.0, 0.0, 0]}
    for s, t in zip(steps, seconds):
        kind = kinds["with prefill chunks" if any(q > 1 for q, _ in s.step) else "decode only"]
        kind[0] += 1
        kind[1] += t
        kind[2] += step_bound(s.step, s.sampled_rows, cost, hw)
        kind[3] += sum(q for q, _ in s.step)
    return {name: {"steps": n, "seconds": t, "bound_s": b, "tokens": tokens} for name, (n, t, b, tokens) in kinds.items()}


def spec_summary(engine, before) -> dict | None:
    """How speculative proposals fared since `before` (a copy of the scheduler's SpecDecodingStats);
    None without speculative decoding."""
    if engine.config.speculative_config is None:
        return None
    stats = engine.scheduler.spec_stats.since(before)
    return {"method": engine.config.speculative_config.method,
            "num_speculative_tokens": engine.config.speculative_config.num_speculative_tokens,
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length, "acceptance_per_pos": stats.acceptance_by_position}


def spec_line(spec: dict | None) -> list[str]:
    """The report's line on speculative decoding (none without it)."""
    if spec is None:
        return []
    per_pos = ", ".join(f"{a:.2f}" for a in spec["acceptance_per_pos"])
    return [f"speculative ({spec['method']}, k = {spec['num_speculative_tokens']}): {spec['num_drafts']:,} verify rows, "
            f"acceptance {spec['acceptance_rate']:.1%}, mean accepted length {spec['mean_accepted_length']:.2f}, "
            f"by position {per_pos}"]


def report(r: dict) -> str:
    bound, elapsed, hw = r["bound_s"], r["elapsed_s"], r["hardware"]
    lo, hi = r["input_len"]
    out_lo, out_hi = r["output_len"]
    rows = [
        ("wall time (s)", elapsed, bound, ".3f"),
        ("requests/s", r["num_requests"] / elapsed, r["num_requests"] / bound, ".2f"),
        ("output tok/s", r["output_tokens"] / elapsed, r["output_tokens"] / bound, ",.0f"),
        ("total tok/s", (r["input_tokens"] + r["output_tokens"]) / elapsed,
         (r["input_tokens"] + r["output_tokens"]) / bound, ",.0f"),
    ]
    lines = [
        f"{r['architecture']} ({r['model']}), {r['dtype']} on {r['device']}",
        f"ceilings: {hw['name']}: {hw['peak_flops'] / 1e12:.1f} TFLOP/s, {hw['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s",
        f"{r['num_requests']} requests, prompts {_span(lo, hi)} tokens ({r['input_tokens']:,} in all), "
        f"outputs {_span(out_lo, out_hi)} tokens ({r['output_tokens']:,} in all)",
        "",
        f"{'':>15} {'measured':>12} {'bound':>12}",
        *(f"{name:>15} {m:>12{fmt}} {b:>12{fmt}}" for name, m, b, fmt in rows),
        f"{'achieved':>15} {r['achieved_fraction']:>12.1%} of the roofline bound",
        "",
        f"steps: {r['num_steps']:,} ({r['num_prefill_steps']:,} with prefill chunks), "
        f"preemptions: {r['num_preemptions']}, recomputed tokens: {r['recomputed_tokens']:,} "
        f"({r['recomputed_fraction']:.2%} of the workload's)",
        *(f"{name}: {k['steps']:,} step{'s' if k['steps'] != 1 else ''}, {k['tokens'] / max(k['steps'], 1):,.0f} tokens a step, "
          f"{k['seconds']:.3f} s against a bound of {k['bound_s']:.3f} s ({k['bound_s'] / k['seconds']:.1%})"
          for name, k in r.get("by_step_kind", {}).items() if k["steps"]),
        f"bound: {r['bound_compute_s']:.3f} s in compute-bound steps + {r['bound_memory_s']:.3f} s in "
        f"memory-bound steps; {r['flops']:.3g} FLOPs, {r['bytes'] / 1e9:,.1f} GB moved",
        f"KV cache: {r['kv_blocks']:,} blocks of {r['block_size']} tokens; "
        f"paging waste {r['kv_paging_waste']:.2%} of allocated slots (mean over steps)",
        *spec_line(r.get("speculative")),
    ]
    if r["output_tokens"] != r["expected_output_tokens"]:
        lines.append(f"warning: {r['output_tokens']:,} output tokens, {r['expected_output_tokens']:,} expected")
    return "\n".join(lines)


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


# ---- command line ----


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs="+", default=[100, 1024], metavar="N",
                        help="prompt tokens: N, or LO HI for uniform in [LO, HI]")
    parser.add_argument("--output-len", type=int, nargs="+", default=[512], metavar="N",
                        help="tokens to generate per request: N, or LO HI for uniform in [LO, HI]")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--num-warmup-prompts", type=int, default=16,
                        help="requests run before the measured ones (8 output tokens each)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="CUDA: print the kernels of this many steps of the run (torch.profiler; the profiled "
                             "steps run slower, so the run's figures are not its throughput)")
    parser.add_argument("--profile-after", type=int, default=100, help="the step the profiled ones start from")


def main_from_args(args: argparse.Namespace) -> int:
    return print_results(run(args), report, args.json)


def print_results(results: dict, report, json_path: str | None) -> int:
    """Print a benchmark's report, and write its results as JSON when asked."""
    print(report(results))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


def command_line(module: str, doc: str, add_args, main_from_args, argv: list[str] | None) -> int:
    """`python -m ferry.bench.<module>`: parse argv with the module's options and run it."""
    parser = argparse.ArgumentParser(prog=f"python -m ferry.bench.{module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    return main_from_args(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    return command_line("throughput", __doc__, add_args, main_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
