"""The formulas of `ferry doctor`: each figure from a model's config.json, the engine's configuration
and a machine, with the terms it is made of.

A step's FLOPs and bytes are the roofline model's (`roofline.ModelCost.step_cost`); what ferry's
kernels reach of the machine's ceilings and what a step costs beside them are calibration.py's:

    device = max(matmul FLOPs / (peak x compute), weight bytes / (bandwidth x weight_bandwidth))
             + max(attention FLOPs / (peak x compute), KV read)
             + kernels x kernel_s (+ all-reduces, over several GPUs)
    KV read = t + min(t, layers x kv_ramp_s)    t = KV bytes / (bandwidth x kv_bandwidth)
    step   = max(device, host)    host: layers x eager_layer_s + tokens x eager_token_s where the
                                  step is launched eagerly

The linear layers (and the LM head) and attention are separate kernels, one after the other, so
each is bound by its own work: at a decode batch of 256 the linears of Llama-3.1-8B are bound by
their FLOPs while attention, beside them, is bound by its KV read; the two add.

A prefill is launched eagerly (one step per max_num_batched_tokens) unless a prefill graph holds
its tokens (max_prefill_graph_tokens); a decode step replays a CUDA graph up to the largest captured
batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from ferry.attention.kv_cache import max_useful_blocks
from ferry.bench.roofline import Hardware, ModelCost, Step
from ferry.config import EngineConfig
from ferry.doctor import calibration
from ferry.doctor.calibration import Calibration


@dataclass(frozen=True)
class Machine:
    """Where the engine would run."""

    hardware: Hardware  # its ceilings: a datasheet's or measured
    calibration: Calibration
    memory_bytes: int | None  # device memory; None: a CPU, where ferry's KV pool is cpu_kv_cache_bytes
    link_bytes_per_s: float | None = None  # to a second GPU, each way; None: no second GPU to speak of

    @property
    def device(self) -> str:
        return "cpu" if self.memory_bytes is None else "cuda"

    @property
    def rates(self) -> Hardware:
        """The ceilings as ferry's kernels reach them: what a step's FLOPs and weights divide by."""
        hw, c = self.hardware, self.calibration
        fp8 = hw.fp8_peak_flops * c.fp8_compute if hw.fp8_peak_flops else None
        return Hardware(hw.peak_flops * c.compute, hw.bandwidth_bytes_per_s * c.weight_bandwidth, hw.name, fp8)

    @property
    def kv_bytes_per_s(self) -> float:
        return self.hardware.bandwidth_bytes_per_s * self.calibration.kv_bandwidth


@dataclass(frozen=True)
class Deployment:
    """A model under an engine configuration, on `tensor_parallel` GPUs of one kind."""

    config: EngineConfig
    machine: Machine
    tensor_parallel: int = 1

    @cached_property
    def cost(self) -> ModelCost:
        return ModelCost.from_model_config(self.config.model, self.config.cache.kv_itemsize(self.config.model))


class Figure(NamedTuple):
    key: str  # its name in the JSON
    label: str
    value: float
    unit: str  # s, B, tokens, requests, tok/s
    terms: str  # the formula, with its numbers

    def __str__(self) -> str:
        return f"{self.label} = {self.terms} = {show(self.value, self.unit)}"


def show(value: float, unit: str) -> str:
    if value == math.inf:
        return "never"
    if unit == "s":
        return ms(value)
    if unit == "B":
        return f"{value / 1e9:.2f} GB" if value >= 1e7 else f"{value:,.0f} B"
    if unit == "tok/s":
        return f"{value:,.0f} tok/s"
    return f"{value:,.0f} {unit}"


def ms(seconds: float) -> str:
    v = seconds * 1e3
    return f"{v:.3f} ms" if v < 1 else f"{v:.2f} ms" if v < 100 else f"{v:,.0f} ms"


# ---- one step ----


class StepTime(NamedTuple):
    """A step's predicted time term by term, or several steps' summed (`steps`)."""

    flops: float
    compute_s: float  # all the FLOPs at ferry's rate
    attention_s: float  # attention's FLOPs at that rate (the rest are the matmuls')
    weight_bytes: float
    weights_s: float
    kv_bytes: float
    kv_s: float  # the read and its ramp
    kernels: int
    fixed_s: float  # kernels x kernel_s
    comm_s: float  # all-reduces between GPUs
    host_s: float  # launching eagerly
    seconds: float  # max(max(compute, weights + KV) + fixed + comm, host), step by step
    tokens: int  # computed: a request's new tokens, summed
    steps: int = 1
    replay_host_s: float = 0.0  # a first token's prefill graph: the host's work around it, and its launch


def step_time(d: Deployment, step: Step, sampled_rows: int, host_s: float = 0.0) -> StepTime:
    """One step on each of the deployment's GPUs, which hold 1 / tensor_parallel of its weights and KV."""
    cost, machine, tp = d.cost, d.machine, d.tensor_parallel
    total = cost.step_cost(step, sampled_rows)
    kv_bytes = cost.kv_bytes_per_token * sum(cost.kv_read_tokens(q, s) for q, s in step) / tp  # step_cost's
    weight_bytes = total.bytes / tp - kv_bytes
    compute_s = total.compute_seconds(machine.rates) / tp
    attention_s = sum(cost.attention_flops(q, s) for q, s in step) / tp / machine.rates.peak_flops
    weights_s, kv_s = weight_bytes / machine.rates.bandwidth_bytes_per_s, kv_read_seconds(d, kv_bytes)
    kernels = kernels_per_step(d, sum(q for q, _ in step))
    fixed_s = kernels * machine.calibration.kernel_s
    comm_s = all_reduce_seconds(d, sum(q for q, _ in step))
    device = max(compute_s - attention_s, weights_s) + max(attention_s, kv_s) + fixed_s + comm_s
    return StepTime(total.flops / tp, compute_s, attention_s, weight_bytes, weights_s, kv_bytes, kv_s, kernels, fixed_s,
                    comm_s, host_s, max(device, host_s), sum(q for q, _ in step))


def kernels_per_step(d: Deployment, rows: int) -> int:
    """Kernels of a step of `rows` tokens: fewer where the small-batch path fuses them into its GEMVs."""
    small = rows <= calibration.GEMV_MAX_ROWS
    per_layer = calibration.KERNELS_PER_LAYER if small else calibration.KERNELS_PER_LAYER_GEMM
    return per_layer * d.cost.num_layers + calibration.KERNELS_OUTSIDE_LAYERS


def kv_rate(d: Deployment) -> float:
    """Bytes a second at which attention streams the KV cache."""
    return d.machine.kv_bytes_per_s * (calibration.FP8_KV_RATE if d.config.cache.fp8_kv else 1.0)


def kv_read_seconds(d: Deployment, kv_bytes: float) -> float:
    """A short read costs itself again in fixed costs (each split's query, partial row and merge),
    a long one no more than kv_ramp_s a layer beside its bytes."""
    t = kv_bytes / kv_rate(d)
    return t + min(t, d.cost.num_layers * d.machine.calibration.kv_ramp_s)


def all_reduce_seconds(d: Deployment, rows: int) -> float:
    """The hidden states' all-reduces of one step over the deployment's GPUs (a ring moves
    2 (n - 1) / n of the tensor each way)."""
    tp = d.tensor_parallel
    if tp == 1:
        return 0.0
    nbytes = rows * d.cost.hidden_size * d.cost.weight_itemsize * 2 * (tp - 1) / tp
    each = calibration.ALL_REDUCE_LATENCY_S + nbytes / d.machine.link_bytes_per_s
    return calibration.ALL_REDUCES_PER_LAYER * d.cost.num_layers * each


def eager_host_seconds(d: Deployment, tokens: int) -> float:
    """The host's time on a step launched eagerly: each layer's launches, each token's bookkeeping."""
    c = d.machine.calibration
    return d.cost.num_layers * c.eager_layer_s + tokens * c.eager_token_s


def largest_graph(d: Deployment) -> int:
    """The largest decode batch replayed from a CUDA graph (0: every step runs eagerly)."""
    if d.config.enforce_eager:
        return 0
    return max(d.config.decode_graph_sizes)


def decode_step(d: Deployment, batch: int, context: int, tokens_per_row: int = 1) -> StepTime:
    """A step of `batch` requests at `context` tokens each, each computing `tokens_per_row` new ones
    (1; 1 + k to verify k proposals)."""
    host_s = eager_host_seconds(d, batch * tokens_per_row) if batch > largest_graph(d) else 0.0
    return step_time(d, [(tokens_per_row, context + tokens_per_row)] * batch, batch * tokens_per_row, host_s)


def prefill_chunks(prompt_len: int, num_prompts: int, budget: int) -> list[tuple[list[tuple[int, int]], int]]:
    """The steps that compute `num_prompts` prompts under a token budget a step, as the scheduler
    cuts them: (step, rows that sample) for each."""
    chunks, step, room, sampled = [], [], budget, 0
    for _ in range(num_prompts):
        done = 0
        while done < prompt_len:
            q = min(room, prompt_len - done)
            done, room = done + q, room - q
            step.append((q, done))
            sampled += done == prompt_len
            if room == 0:
                chunks.append((step, sampled))
                step, room, sampled = [], budget, 0
    if step:
        chunks.append((step, sampled))
    return chunks


def prefill(d: Deployment, prompt_len: int, num_prompts: int = 1, first_token: bool = False) -> StepTime:
    """The prompts' steps summed, each launched eagerly unless a prefill graph holds its tokens.
    first_token: the steps wait for nothing before them, so a replayed step's host work (its inputs,
    its graph's launch, the sampling after it) adds to its time rather than overlapping."""
    chunks = prefill_chunks(prompt_len, num_prompts, d.config.scheduler.max_num_batched_tokens)
    times = []
    for step, sampled in chunks:
        tokens = sum(q for q, _ in step)
        if _replayed(d, tokens):
            t = step_time(d, step, sampled)
            if first_token:
                c = d.machine.calibration
                host = c.replay_host_s + t.kernels * c.graph_launch_kernel_s
                t = t._replace(replay_host_s=host, seconds=t.seconds + host)
        else:
            t = step_time(d, step, sampled, eager_host_seconds(d, tokens))
        times.append(t)
    return StepTime(*(sum(values) for values in zip(*times)))


def _replayed(d: Deployment, tokens: int) -> bool:
    """A step with prefill chunks replays a graph where one holds its tokens (max_prefill_graph_tokens,
    executor/prefill_graphs.py), and is launched eagerly otherwise."""
    sizes = () if d.config.enforce_eager else d.config.prefill_graph_sizes
    return bool(sizes) and tokens <= sizes[-1]


def describe(t: StepTime, d: Deployment) -> str:
    """The terms of a step time, with what each comes to."""
    machine, c = d.machine, d.machine.calibration
    flop_rate = t.flops / t.compute_s if t.compute_s else machine.rates.peak_flops
    attention_flops = t.attention_s * machine.rates.peak_flops
    device = (
        f"max({t.flops - attention_flops:.3g} matmul FLOP / {flop_rate / 1e12:.3g} TFLOP/s = "
        f"{ms(t.compute_s - t.attention_s)}, {t.weight_bytes / 1e9:.3g} GB weights / "
        f"{machine.rates.bandwidth_bytes_per_s / 1e12:.3g} TB/s = {ms(t.weights_s)})"
        f" + max({attention_flops:.3g} attention FLOP = {ms(t.attention_s)}, KV read {_kv_terms(t, d)})"
        f" + {t.kernels:,} kernels x {c.kernel_s * 1e6:.3g} us = {ms(t.fixed_s)}"
    )
    if t.comm_s:
        device += (f" + {calibration.ALL_REDUCES_PER_LAYER * d.cost.num_layers * t.steps} all-reduces over "
                   f"{machine.link_bytes_per_s / 1e9:.0f} GB/s = {ms(t.comm_s)}")
    if t.host_s:
        host = f"{t.steps} x {d.cost.num_layers} layers x {ms(c.eager_layer_s)}"
        if c.eager_token_s:
            host += f" + {t.tokens:,} tokens x {c.eager_token_s * 1e6:.3g} us"
        device = f"max(host {host} = {ms(t.host_s)}, {device})"
    if t.replay_host_s:
        device += (f" + replayed from a graph: host {ms(c.replay_host_s)} + {t.kernels:,} kernels launched x "
                   f"{c.graph_launch_kernel_s * 1e6:.3g} us = {ms(t.replay_host_s)}")
    return device if t.steps == 1 else f"{t.steps} steps' terms summed (each step its own max): {device}"


def _kv_terms(t: StepTime, d: Deployment) -> str:
    read, ramp_s = t.kv_bytes / kv_rate(d), d.machine.calibration.kv_ramp_s
    terms = f"{t.kv_bytes / 1e9:.3g} GB / {kv_rate(d) / 1e12:.3g} TB/s = {ms(read)}"
    if not ramp_s:
        return terms
    layers = t.steps * d.cost.num_layers
    return f"{terms} + min({ms(read)}, {layers} layers x {ramp_s * 1e6:.3g} us = {ms(layers * ramp_s)}) = {ms(t.kv_s)}"


# ---- memory ----


def weights_memory(d: Deployment) -> Figure:
    cost, tp = d.cost, d.tensor_parallel
    others = cost.num_params - cost.linear_params
    what = "embedding (the LM head), norms" if cost.tied else "embedding, LM head, norms"
    terms = (f"{cost.linear_params / 1e9:.3f}B linear weights x {cost.linear_itemsize or cost.weight_itemsize} B"
             f" + {others / 1e9:.3f}B {what} x {cost.weight_itemsize} B")
    return Figure("weights_bytes", "weights" + _per_gpu(tp), cost.weight_bytes / tp, "B", _over(terms, tp))


def kv_bytes_per_token(d: Deployment) -> Figure:
    cost, tp = d.cost, d.tensor_parallel
    halves = "2" if cost.kv_halves == 2 else "1 (the latent: its values are its keys)"
    terms = (f"{halves} x {cost.num_layers} layers x {cost.num_kv_heads} KV heads x {cost.head_dim} head dim"
             f" x {cost.kv_itemsize} B")
    return Figure("kv_bytes_per_token", "KV cache per token" + _per_gpu(tp), cost.kv_bytes_per_token / tp, "B",
                  _over(terms, tp))


def kv_budget(d: Deployment) -> tuple[float, str]:
    """Bytes for the KV cache on each GPU, as the executor sizes it (model_runner._num_kv_blocks)."""
    cache, memory = d.config.cache, d.machine.memory_bytes
    if memory is None:
        return cache.cpu_kv_cache_bytes, f"ferry's CPU pool of {cache.cpu_kv_cache_bytes / 2**30:.2f} GiB"
    weights = d.cost.weight_bytes / d.tensor_parallel
    budget = memory * cache.gpu_memory_utilization - weights - calibration.ALLOWANCE_BYTES
    return budget, (f"{memory / 2**30:.1f} GiB x {cache.gpu_memory_utilization} - {weights / 1e9:.2f} GB weights"
                    f" - {calibration.ALLOWANCE_BYTES / 2**30:.1f} GiB allowance")


def kv_blocks(d: Deployment) -> tuple[int, str]:
    """Blocks of the KV cache: what the budget holds, but no more than every running request at
    max_model_len could use."""
    cache, scheduler = d.config.cache, d.config.scheduler
    per_block = d.cost.kv_bytes_per_token * cache.block_size / d.tensor_parallel
    budget, budget_terms = kv_budget(d)
    useful = max_useful_blocks(scheduler, cache.block_size)
    blocks = max(0, min(useful, int(budget // per_block)))
    terms = (f"min(({budget_terms}) / {per_block / 1e6:.3g} MB a block, max_num_seqs {scheduler.max_num_seqs} x "
             f"{useful // scheduler.max_num_seqs:,} blocks of max_model_len {scheduler.max_model_len:,})"
             f" = {blocks:,} blocks")
    return blocks, terms


def kv_capacity(d: Deployment) -> Figure:
    blocks, terms = kv_blocks(d)
    size = d.config.cache.block_size
    return Figure("kv_capacity_tokens", "KV capacity", blocks * size, "tokens",
                  f"{terms} x {size} tokens")


def concurrency(d: Deployment, context: int) -> Figure:
    """Requests of `context` tokens that run at once: what the KV cache holds, at most max_num_seqs."""
    blocks, _ = kv_blocks(d)
    each = -(-context // d.config.cache.block_size)
    limit = d.config.scheduler.max_num_seqs
    value = min(blocks // each, limit)
    return Figure("max_concurrency", f"max concurrency at context {context:,}", value, "requests",
                  f"min({blocks:,} blocks // {each:,} blocks a request = {blocks // each:,}, max_num_seqs {limit})")


# ---- speed ----


def ttft(d: Deployment, prompt_len: int) -> Figure:
    t = prefill(d, prompt_len, first_token=True)
    return Figure("ttft_s", f"TTFT, one prompt of {prompt_len:,} tokens", t.seconds, "s", describe(t, d))


def itl(d: Deployment, batch: int, context: int) -> Figure:
    t = decode_step(d, batch, context)
    return Figure(f"itl_s_batch_{batch}", f"ITL at batch {batch}, context {context:,}", t.seconds, "s",
                  describe(t, d))


def throughput(d: Deployment, prompt_len: int, output_len: int, batch: int | None = None) -> Figure:
    """Output tokens a second with `batch` requests running (default: as many as fit): each batch
    prefills its prompts, then decodes output_len - 1 steps at the mean context."""
    if batch is None:
        batch = concurrency(d, prompt_len + output_len).value
    label = f"throughput, requests of {prompt_len:,} in / {output_len:,} out at batch {batch}"
    if batch == 0:
        return Figure("throughput_tok_s", label, 0.0, "tok/s", "no request fits the KV cache")
    first = prefill(d, prompt_len, batch)
    step = decode_step(d, batch, prompt_len + output_len // 2)
    seconds = first.seconds + (output_len - 1) * step.seconds
    terms = (f"{batch} x {output_len:,} tokens / (prefill {ms(first.seconds)} + {output_len - 1:,} decode steps x "
             f"{ms(step.seconds)} at context {prompt_len + output_len // 2:,})"
             f" = {batch * output_len:,} / {seconds:.3f} s")
    return Figure("throughput_tok_s", label, batch * output_len / seconds, "tok/s", terms)


# No engine runs more requests at once than this; a crossover beyond it is "never".
MAX_BATCH = 1 << 16


def compute_bound_batch(d: Deployment, context: int) -> Figure:
    """The smallest batch whose decode step's FLOPs take longer than its bytes. FLOPs grow with the
    batch; of the bytes only the KV cache does (and untied embedding rows), so past this batch
    decode is bound by compute, unless each request's KV read outlasts its FLOPs: then never."""
    key = f"compute_bound_batch_context_{context}"
    label = f"decode turns compute-bound at context {context:,} from batch"
    bound = _compute_bound(d, context, MAX_BATCH)
    if not bound:
        t = decode_step(d, MAX_BATCH, context)
        return Figure(key, label, math.inf, "requests", f"at batch {MAX_BATCH:,} the FLOPs take {ms(t.compute_s)}, "
                      f"the weights and KV read {ms(t.weights_s + t.kv_s)}: a request's KV read outlasts its FLOPs")
    low, high = 0, 1  # not bound at low (0: no batch at all), bound at high: double, then bisect
    while not _compute_bound(d, context, high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if _compute_bound(d, context, middle) else (middle, high)
    t = decode_step(d, high, context)
    rates = d.machine.rates
    terms = (f"FLOPs {ms(t.compute_s)} >= weights {ms(t.weights_s)} + KV read {ms(t.kv_s)} (peak / bandwidth = "
             f"{rates.peak_flops / rates.bandwidth_bytes_per_s:.0f} FLOP a byte as ferry reaches them)")
    return Figure(key, label, high, "requests", terms)


def _compute_bound(d: Deployment, context: int, batch: int) -> bool:
    t = decode_step(d, batch, context)
    return t.compute_s >= t.weights_s + t.kv_s


def tokens_per_verify_step(k: int, acceptance: float) -> float:
    """Tokens a step yields when each of k proposals is kept with probability `acceptance`, up to the
    first one that is not, plus the token the step samples: sum of a^i for i = 0..k."""
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def speculative(d: Deployment, batch: int, context: int, k: int, acceptance: float) -> Figure:
    tokens = tokens_per_verify_step(k, acceptance)
    verify, plain = decode_step(d, batch, context, 1 + k), decode_step(d, batch, context)
    value = verify.seconds / tokens
    terms = (f"verify step {ms(verify.seconds)} ({batch} x {1 + k} tokens) / {tokens:.2f} tokens, against "
             f"{ms(plain.seconds)} a plain step: {plain.seconds / value:.2f}x")
    return Figure(f"speculative_itl_s_batch_{batch}", f"ITL with k = {k} proposals at batch {batch}", value, "s",
                  terms)


def _per_gpu(tp: int) -> str:
    return "" if tp == 1 else " per GPU"


def _over(terms: str, tp: int) -> str:
    return terms if tp == 1 else f"({terms}) / {tp} GPUs"
