"""The figures of one deployment, and what FP8 weights, an FP8 KV cache, speculative decoding and a
second GPU would change, as text and as JSON."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

from ferry.config import DEFAULT_DISABLE_BY_BATCH_SIZE, EngineConfig
from ferry.doctor import calibration
from ferry.doctor.predict import (
    Deployment, Figure, compute_bound_batch, concurrency, itl, kv_bytes_per_token, kv_capacity, show, speculative,
    throughput, tokens_per_verify_step, ttft, weights_memory,
)


class Workload(NamedTuple):
    prompt_len: int
    output_len: int
    context_len: int  # of the requests whose decode steps are timed
    batch_sizes: tuple[int, ...]
    spec_tokens: int  # k proposals a step
    spec_acceptance: float  # the chance that each is kept


@dataclass(frozen=True)
class Report:
    deployment: Deployment
    workload: Workload
    figures: list[Figure]
    what_ifs: list[tuple[str, dict[str, Figure]]]  # (name, summary()), the first as configured
    speculative: list[Figure]


def figures(d: Deployment, w: Workload) -> list[Figure]:
    return [
        weights_memory(d), kv_bytes_per_token(d), kv_capacity(d), concurrency(d, w.context_len),
        ttft(d, w.prompt_len), *(itl(d, b, w.context_len) for b in w.batch_sizes),
        throughput(d, w.prompt_len, w.output_len), compute_bound_batch(d, w.context_len), compute_bound_batch(d, 0),
    ]


def summary(d: Deployment, w: Workload) -> dict[str, Figure]:
    """The figures a what-if is compared by, under short names."""
    largest = max(w.batch_sizes)
    return {
        "weights": weights_memory(d), "KV tokens": kv_capacity(d), "concurrency": concurrency(d, w.context_len),
        "TTFT": ttft(d, w.prompt_len), "ITL b=1": itl(d, 1, w.context_len),
        f"ITL b={largest}": itl(d, largest, w.context_len), "throughput": throughput(d, w.prompt_len, w.output_len),
    }


def variants(d: Deployment, make_config: Callable[..., EngineConfig]) -> list[tuple[str, Deployment]]:
    """The deployment with FP8 weights, with an FP8 KV cache, and over two GPUs; a variant that is
    what is configured already, or that the GPU cannot run (FP8 without FP8 tensor cores), is left out."""
    machine = d.machine
    fp8_ok = machine.device == "cpu" or machine.hardware.fp8_peak_flops is not None
    found = []
    if fp8_ok:
        found += [("FP8 weights", replace(d, config=make_config(quantization="fp8"))),
                  ("FP8 KV cache", replace(d, config=make_config(kv_cache_dtype="fp8")))]
    if machine.link_bytes_per_s is not None:
        found.append(("tensor parallel 2", replace(d, tensor_parallel=2)))
    return [(name, v) for name, v in found if (v.cost, v.tensor_parallel) != (d.cost, d.tensor_parallel)]


def build(d: Deployment, w: Workload, make_config: Callable[..., EngineConfig]) -> Report:
    what_ifs = [("as configured", summary(d, w))]
    what_ifs += [(name, summary(v, w)) for name, v in variants(d, make_config)]
    spec = [speculative(d, b, w.context_len, w.spec_tokens, w.spec_acceptance) for b in w.batch_sizes]
    return Report(d, w, figures(d, w), what_ifs, spec)


# ---- as text ----


def text(r: Report) -> str:
    return "\n".join([*header(r), "", *(str(f) for f in r.figures), "", *what_if_table(r), "", *speculative_lines(r)])


def header(r: Report) -> list[str]:
    d, w = r.deployment, r.workload
    model, cache, scheduler, machine = d.config.model, d.config.cache, d.config.scheduler, d.machine
    weights = "FP8 linear weights" if model.quantization_spec else f"{model.dtype} weights"
    memory = "" if machine.memory_bytes is None else f", {machine.memory_bytes / 2**30:.1f} GiB"
    return [
        f"{model.architecture} ({model.path}): {weights}, {'FP8' if cache.fp8_kv else model.dtype} KV cache",
        f"machine: {machine.hardware.describe()}{memory}",
        f"engine: max_model_len {scheduler.max_model_len:,}, max_num_seqs {scheduler.max_num_seqs}, "
        f"max_num_batched_tokens {scheduler.max_num_batched_tokens:,}, block_size {cache.block_size}, "
        f"gpu_memory_utilization {cache.gpu_memory_utilization}",
        step_model(d),
        f"workload: prompts of {w.prompt_len:,} tokens, {w.output_len:,} output tokens; decode at context "
        f"{w.context_len:,}",
    ]


def step_model(d: Deployment) -> str:
    """The model of a step with this machine's constants (calibration.py)."""
    c = d.machine.calibration
    kv = f"KV bytes / (bandwidth x {c.kv_bandwidth:.3g})"
    line = (f"model of a step ({c.source}; ferry/doctor/calibration.py): max(matmul FLOPs / (peak x {c.compute:.3g}), "
            f"weight bytes / (bandwidth x {c.weight_bandwidth:.3g})) + max(attention FLOPs / (peak x {c.compute:.3g}), "
            f"KV read) + kernels x {c.kernel_s * 1e6:.3g} us")
    if c.kv_ramp_s:
        line += f", KV read = t + min(t, layers x {c.kv_ramp_s * 1e6:.3g} us), t = {kv}"
    else:
        line += f", KV read = {kv}"
    if c.eager_layer_s:
        line += (f"; a step launched eagerly takes the host at least layers x {c.eager_layer_s * 1e3:.3g} ms + "
                 f"tokens x {c.eager_token_s * 1e6:.3g} us")
    if d.machine.memory_bytes is not None:
        line += f"; {calibration.ALLOWANCE_BYTES / 2**30:.1f} GiB of GPU memory left to the CUDA context and workspaces"
    return line


def what_if_table(r: Report) -> list[str]:
    base = r.what_ifs[0][1]
    rows = [["", *base]] + [[name, *(_cell(figs[k], base[k]) for k in base)] for name, figs in r.what_ifs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["what if (each against the configuration above; weights per GPU where there are two):"]
    return lines + ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _cell(f: Figure, base: Figure) -> str:
    value = show(f.value, f.unit)
    if f is base or f.value == base.value or base.value in (0, math.inf):
        return value
    return f"{value} ({f.value / base.value:.2f}x)"


def speculative_lines(r: Report) -> list[str]:
    w = r.workload
    a, k = w.spec_acceptance, w.spec_tokens
    lines = [f"speculative decoding, k = {k} proposals each kept with probability a = {a}: "
             f"(1 - a^(k+1)) / (1 - a) = {tokens_per_verify_step(k, a):.2f} tokens a step; the proposer's own "
             "cost left out (prompt lookup's is host work; a draft model adds its k forwards)"]
    for f, batch in zip(r.speculative, w.batch_sizes):
        off = (f" (ferry turns proposals off above {DEFAULT_DISABLE_BY_BATCH_SIZE} running requests by default)"
               if batch > DEFAULT_DISABLE_BY_BATCH_SIZE else "")
        lines.append(f"  {f}{off}")
    return lines


# ---- as JSON ----


def as_json(r: Report) -> dict:
    d, scheduler = r.deployment, r.deployment.config.scheduler
    return {
        "model": str(d.config.model.path), "architecture": d.config.model.architecture,
        "engine": {"dtype": d.config.model.dtype, "quantization": d.config.model.quantization,
                   "kv_cache_dtype": d.config.cache.kv_cache_dtype, "max_model_len": scheduler.max_model_len,
                   "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                   "block_size": d.config.cache.block_size,
                   "gpu_memory_utilization": d.config.cache.gpu_memory_utilization},
        "machine": {"name": d.machine.hardware.name, "peak_flops": d.machine.hardware.peak_flops,
                    "fp8_peak_flops": d.machine.hardware.fp8_peak_flops,
                    "bandwidth_bytes_per_s": d.machine.hardware.bandwidth_bytes_per_s,
                    "memory_bytes": d.machine.memory_bytes},
        "calibration": asdict(d.machine.calibration),
        "workload": r.workload._asdict(),
        "figures": [_figure(f) for f in r.figures],
        "what_if": {name: {short: _figure(f) for short, f in figs.items()} for name, figs in r.what_ifs},
        "speculative": [_figure(f) for f in r.speculative],
    }


def _figure(f: Figure) -> dict:
    return {**f._asdict(), "value": f.value if math.isfinite(f.value) else None}
