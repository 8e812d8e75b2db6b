"""Time to first token and decode time per token of one small batch, next to their roofline bounds.

    ferry bench latency --config-dir benchmarks/llama-3.1-8b --dtype bfloat16 --input-len 512 --output-len 256
    ferry bench latency --config-dir benchmarks/llama-3.1-8b --dtype bfloat16 --input-len 8192 --output-len 1

Each iteration sends `--batch-size` fresh random prompts at once (fresh, so the prefix cache never
helps) and runs them to exactly `--output-len` tokens. TTFT runs from adding the requests to the end
of the step in which the last of them got its first token; decode ms/token is the rest of the time
over the remaining output_len - 1 steps. The bounds are those of the steps the engine ran: for a
batch-1 decode, essentially every weight read once per token at full bandwidth; for a long prefill,
its FLOPs (attention's included) at the matmul peak.

A batch whose prompts take several prefill steps (more prompt tokens than --max-num-batched-tokens)
starts decoding its first requests while later ones still prefill, and ends with its last requests
decoding alone, so the time per token after the first is not that of a step of the whole batch.
That is reported beside it: the mean time of the steps in which every request of the batch decodes
(`full_batch_step_s`, with the mean context of those steps), the ITL of a batch that size.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from dataclasses import dataclass

from ferry.bench.roofline import (
    Hardware, ModelCost, RecordedStep, ScheduleRecorder, percentile, step_bound, step_seconds,
)
from ferry.bench.throughput import (
    add_model_args, command_line, print_results, random_workload, setup, spec_line, spec_summary,
)


@dataclass
class Iteration:
    ttft: float  # seconds
    decode_per_token: float | None  # seconds per step after the first token; None for one output token
    steps: list[RecordedStep]
    num_prefill_steps: int  # the steps that computed the prompts
    full_batch: tuple[float, float, int] | None = None  # (mean s, mean context, steps) of full-batch decode steps


def run_iteration(engine, prompts: list[list[int]], output_len: int, ids) -> Iteration:
    from ferry.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    with ScheduleRecorder(engine) as steps:
        start = time.perf_counter()
        waiting = set()
        for prompt in prompts:
            request_id = str(next(ids))
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            waiting.add(request_id)
        ttft = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if waiting:
                waiting.difference_update(o.request_id for o in outputs if o.outputs[0].token_ids)
                if not waiting:
                    ttft = time.perf_counter() - start
        elapsed = time.perf_counter() - start
    decode = (elapsed - ttft) / (output_len - 1) if output_len > 1 else None
    full = full_batch_steps(steps, start + elapsed, len(prompts))
    return Iteration(ttft, decode, steps, _num_prefill_steps(steps, sum(map(len, prompts))), full)


def full_batch_steps(steps: list[RecordedStep], end: float, batch: int) -> tuple[float, float, int] | None:
    """(mean seconds, mean context, count) of the steps in which all `batch` requests decode one
    token each, or None if there was none. The last step is left out: its time runs to the end of
    the iteration, past the device's work (the final outputs' handling)."""
    times = step_seconds(steps, end)
    full = [(t, s) for t, s in zip(times[:-1], steps[:-1]) if len(s.step) == batch and all(q == 1 for q, _ in s.step)]
    if not full:
        return None
    contexts = [sum(c for _, c in s.step) / batch for _, s in full]
    return sum(t for t, _ in full) / len(full), sum(contexts) / len(full), len(full)


def _num_prefill_steps(steps: list[RecordedStep], prompt_tokens: int) -> int:
    """The steps that computed the prompts. (With asynchronous scheduling the first tokens reach
    the host a step after the last prefill step, so counting the steps up to them would not do.)"""
    computed = 0
    for i, s in enumerate(steps):
        computed += sum(query_len for query_len, _ in s.step)
        if computed >= prompt_tokens:
            return i + 1
    return len(steps)


def bounds(it: Iteration, output_len: int, cost: ModelCost, hw: Hardware) -> dict:
    """Bounds and costs of one iteration's steps, split at the first token."""
    prefill, decode = it.steps[:it.num_prefill_steps], it.steps[it.num_prefill_steps:]
    decode_costs = [cost.step_cost(s.step, s.sampled_rows) for s in decode]
    return {
        "ttft_bound_s": sum(step_bound(s.step, s.sampled_rows, cost, hw) for s in prefill),
        "prefill_flops": sum(cost.step_cost(s.step, s.sampled_rows).flops for s in prefill),
        "decode_bound_s_per_token": (sum(step_bound(s.step, s.sampled_rows, cost, hw) for s in decode)
                                     / (output_len - 1) if output_len > 1 else None),
        "decode_bytes_per_step": (sum(c.bytes for c in decode_costs) / len(decode_costs)
                                  if decode_costs else None),
    }


def run(args: argparse.Namespace) -> dict:
    if args.max_num_seqs is None:
        args.max_num_seqs = args.batch_size
    engine, hw, cost = setup(args)
    ids = itertools.count()
    iterations = []
    for i in range(args.num_iters_warmup + args.num_iters):
        if i == args.num_iters_warmup:
            spec_before = copy.deepcopy(engine.scheduler.spec_stats)
        prompts, _ = random_workload(args.batch_size, (args.input_len,) * 2, (1, 1), cost.vocab_size, args.seed + i)
        it = run_iteration(engine, prompts, args.output_len, ids)
        if i >= args.num_iters_warmup:
            iterations.append(it)
    ttfts = [it.ttft for it in iterations]
    decodes = [it.decode_per_token for it in iterations if it.decode_per_token is not None]
    fulls = [it.full_batch for it in iterations if it.full_batch is not None]
    # Every iteration runs the same shapes, so the last one's steps stand for all.
    b = bounds(iterations[-1], args.output_len, cost, hw)
    return {
        "model": str(args.model), "architecture": engine.config.model.architecture,
        "dtype": engine.config.model.dtype, "device": args.device,
        "hardware": {"name": hw.name, "peak_flops": hw.peak_flops, "bandwidth_bytes_per_s": hw.bandwidth_bytes_per_s},
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "num_prefill_steps": iterations[-1].num_prefill_steps,
        "weight_bytes": cost.weight_bytes, "tied_embedding": cost.tied,
        "ttft_s": {"p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "all": ttfts},
        "decode_s_per_token": ({"p50": percentile(decodes, 50), "p90": percentile(decodes, 90), "all": decodes}
                               if decodes else None),
        "full_batch_step_s": ({"p50": percentile([f[0] for f in fulls], 50), "p90": percentile([f[0] for f in fulls], 90),
                               "all": [f[0] for f in fulls], "mean_context": sum(f[1] for f in fulls) / len(fulls),
                               "steps": sum(f[2] for f in fulls)} if fulls else None),
        **b,
        "speculative": spec_summary(engine, spec_before),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }


def report(r: dict) -> str:
    hw = r["hardware"]
    lines = [
        f"{r['architecture']} ({r['model']}), {r['dtype']} on {r['device']}",
        f"ceilings: {hw['name']}: {hw['peak_flops'] / 1e12:.1f} TFLOP/s, {hw['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s",
        f"batch {r['batch_size']}, prompts of {r['input_len']} tokens, output {r['output_len']} tokens each; "
        f"{r['num_iters']} measured iterations",
        "",
        f"{'':>16} {'p50':>10} {'p90':>10} {'bound':>10} {'achieved':>9}",
        _row("TTFT ms", r["ttft_s"], r["ttft_bound_s"]),
    ]
    if r["decode_s_per_token"] is not None:
        lines.append(_row("decode ms/token", r["decode_s_per_token"], r["decode_bound_s_per_token"]))
    full = r.get("full_batch_step_s")
    if full is not None and r["num_prefill_steps"] > 1:
        lines.append(f"{'':>16} the prompts took {r['num_prefill_steps']} steps: a step of all {r['batch_size']} "
                     f"requests decoding took {full['p50'] * 1e3:.3f} ms (p50; {full['steps']} such steps, "
                     f"mean context {full['mean_context']:,.0f})")
    flops, ttft = r["prefill_flops"], r["ttft_s"]["p50"]
    lines += [
        "",
        f"prefill ({r['num_prefill_steps']} step(s)): {flops:.3g} FLOPs, attention's included, in the p50 TTFT: "
        f"{flops / ttft / 1e12:.1f} TFLOP/s = {flops / ttft / hw['peak_flops']:.1%} of the peak",
    ]
    if r["decode_bytes_per_step"] is not None:
        untied = "" if r["tied_embedding"] else ", less the untied embedding table but the rows it looks up"
        lines.append(f"decode: a step moves at least {r['decode_bytes_per_step'] / 1e9:.3f} GB: "
                     f"the weights ({r['weight_bytes'] / 1e9:.3f} GB{untied}) and the KV cache")
    return "\n".join(lines + spec_line(r.get("speculative")))


def _row(name: str, measured: dict, bound: float) -> str:
    p50, p90 = measured["p50"] * 1e3, measured["p90"] * 1e3
    return f"{name:>16} {p50:>10.3f} {p90:>10.3f} {bound * 1e3:>10.3f} {bound * 1e3 / p50:>9.1%}"


# ---- command line ----


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.set_defaults(max_num_seqs=None)  # the batch size
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=256, help="tokens to generate per request")
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=10)


def main_from_args(args: argparse.Namespace) -> int:
    if args.num_iters < 1:
        raise ValueError(f"--num-iters must be >= 1, got {args.num_iters}")
    return print_results(run(args), report, args.json)


def main(argv: list[str] | None = None) -> int:
    return command_line("latency", __doc__, add_args, main_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
