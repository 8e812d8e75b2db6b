"""`ferry doctor --check`: the predicted quantities measured on this machine by ferry's own
benchmarks (bench/latency.py, bench/throughput.py, each run as its command line runs it, on random
weights of the model's shape), and the error of each prediction.

- KV capacity: the throughput run's engine's blocks x block size (the KV pool it allocated).
- TTFT: a batch-1 latency run of the prompt, one output token (at least TTFT_ITERS iterations: a
  short prompt's TTFT is the host's time, which varies from one to the next).
- ITL at each batch size: a latency run of that many prompts of the context length, long enough
  that after the prompts' prefill steps `decode_steps` steps decode every request at once; the
  mean time of those full-batch steps (p50 over iterations), predicted at their mean context. (Its
  time per token after the first would mix in steps of fewer requests, wherever the prompts take
  several prefill steps.)
- Throughput: `requests` prompts of prompt_len in / output_len out, at most max_num_seqs at once;
  predicted at that batch (by default the requests are the predicted saturation batch).
"""

from __future__ import annotations

import argparse
import gc
from typing import NamedTuple

from ferry.doctor.predict import Deployment, Figure, concurrency, itl, kv_capacity, show, throughput, ttft
from ferry.doctor.report import Workload


# TTFT runs at least this many iterations: each is one short prefill.
TTFT_ITERS = 10


class CheckPlan(NamedTuple):
    requests: int | None  # of the throughput run; None: the predicted saturation batch
    iterations: int  # measured iterations of each latency run (after one warm-up)
    decode_steps: int  # full-batch decode steps a latency run times


class CheckRow(NamedTuple):
    quantity: str
    unit: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured


def run_check(d: Deployment, w: Workload, plan: CheckPlan) -> list[CheckRow]:
    from ferry.bench import latency

    rows = _throughput_rows(d, w, plan)
    measured = _run(latency, _latency_flags(d, 1, w.prompt_len, 1, plan._replace(iterations=max(plan.iterations, TTFT_ITERS))))
    rows.append(_row(ttft(d, w.prompt_len), measured["ttft_s"]["p50"]))
    budget = d.config.scheduler.max_num_batched_tokens
    for batch in w.batch_sizes:
        prefill_steps = -(-batch * w.context_len // budget)
        measured = _run(latency, _latency_flags(d, batch, w.context_len, prefill_steps + plan.decode_steps + 1, plan))
        full = measured["full_batch_step_s"]
        if full is None:
            raise ValueError(f"no step decoded all {batch} requests at once (fewer fit the KV cache at context "
                             f"{w.context_len:,}): give smaller --batch-sizes")
        rows.append(_row(itl(d, batch, round(full["mean_context"])), full["p50"]))
    return rows


def _throughput_rows(d: Deployment, w: Workload, plan: CheckPlan) -> list[CheckRow]:
    from ferry.bench import throughput as bench

    saturation = concurrency(d, w.prompt_len + w.output_len).value
    if saturation == 0:
        raise ValueError(f"no request of {w.prompt_len + w.output_len:,} tokens fits the predicted KV cache")
    requests = plan.requests or saturation
    flags = [*_engine_flags(d), "--max-num-seqs", str(d.config.scheduler.max_num_seqs), "--num-prompts", str(requests),
             "--input-len", str(w.prompt_len), "--output-len", str(w.output_len),
             "--num-warmup-prompts", str(min(requests, 16))]
    measured = _run(bench, flags)
    predicted = throughput(d, w.prompt_len, w.output_len, min(requests, saturation))
    return [
        _row(kv_capacity(d), measured["kv_blocks"] * measured["block_size"]),
        _row(predicted._replace(label=f"throughput, {requests} requests of {w.prompt_len:,} in / {w.output_len:,} out"),
             measured["output_tokens_per_s"]),
    ]


def _latency_flags(d: Deployment, batch: int, input_len: int, output_len: int, plan: CheckPlan) -> list[str]:
    return [*_engine_flags(d), "--batch-size", str(batch), "--input-len", str(input_len),
            "--output-len", str(output_len), "--num-iters-warmup", "1", "--num-iters", str(plan.iterations)]


def _engine_flags(d: Deployment) -> list[str]:
    """The deployment's engine as the benchmarks' flags: random weights of the model's shape, and
    the machine's ceilings given (so that no benchmark measures them again)."""
    config, hw = d.config, d.machine.hardware
    flags = [
        "--config-dir", str(config.model.path), "--device", d.machine.device, "--dtype", config.model.dtype,
        "--max-model-len", str(config.model.max_model_len), "--block-size", str(config.cache.block_size),
        "--kv-cache-dtype", config.cache.kv_cache_dtype,
        "--gpu-memory-utilization", str(config.cache.gpu_memory_utilization),
        "--max-num-batched-tokens", str(config.scheduler.max_num_batched_tokens),
        "--max-prefill-graph-tokens", str(config.max_prefill_graph_tokens),
        "--peak-tflops", str(hw.peak_flops / 1e12), "--bandwidth-tbps", str(hw.bandwidth_bytes_per_s / 1e12),
    ]
    if config.model.quantization:
        flags += ["--quantization", config.model.quantization]
    return flags


def _run(module, flags: list[str]) -> dict:
    """One benchmark's `run`, on the options its command line would parse; the engine's memory is
    given back before the next one starts. A benchmark freezes what is alive once its engine is
    built (gc_settings.quiet_gc, as ferry's engine process does): unfrozen, the engine is garbage."""
    import torch

    parser = argparse.ArgumentParser()
    module.add_args(parser)
    result = module.run(parser.parse_args(flags))
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _row(predicted: Figure, measured: float) -> CheckRow:
    return CheckRow(predicted.label, predicted.unit, predicted.value, measured)


def check_table(rows: list[CheckRow], machine_name: str) -> list[str]:
    width = max(len(r.quantity) for r in rows)
    lines = [f"check, measured on this machine ({machine_name}) by ferry's benchmarks:",
             f"  {'':<{width}}  {'predicted':>14}  {'measured':>14}  {'error':>7}"]
    for r in rows:
        lines.append(f"  {r.quantity:<{width}}  {show(r.predicted, r.unit):>14}  {show(r.measured, r.unit):>14}  "
                     f"{r.error:>+7.1%}")
    return lines


def check_json(rows: list[CheckRow]) -> list[dict]:
    return [{**r._asdict(), "error": r.error} for r in rows]
