"""The fastest a step could possibly run on this machine: the roofline bound of a forward.

A step computes q_i new tokens for each scheduled request i, after c_i tokens already in its KV
cache (seq_len s_i = c_i + q_i), and produces logits for r rows. With L layers, n_h query heads,
n_kv KV heads, head dim d, hidden size h, vocab V, P the decoder layers' linear parameters and w, w_kv
the bytes of a weight and of a KV element:

    FLOPs   = 2 P Σq_i  +  2 h V r  +  4 L n_h d Σ (q_i c_i + q_i (q_i + 1) / 2)
    bytes   = w (every layer weight + lm_head if r > 0 + embedding rows gathered)  +  2 L n_kv d w_kv Σ s_i
    time   >= max(FLOPs / peak FLOP/s, bytes / bandwidth)

The first FLOP term is the linears (a multiply and an add per weight per token), the second the
lm_head on the rows that sample, the third attention (QK^T and PV, 2 d each per query-key pair; a
chunk's queries see the cached context and, causally, the chunk's own earlier tokens). The bytes are
what must cross the memory bus at least once: every weight (a step reads each once however many
tokens it carries; an untied embedding table only at the rows of the step's tokens, a tied one is
read whole as the lm_head), the cached context's K and V, and the new tokens' K and V written.
Activations, logits and norm arithmetic are left out: they are small, or avoidable by fusion, and a
bound must never be slower than what is possible.

A mixture of experts (ModelConfig.moe) routes each token to k of the E experts of each of its L_s
sparse layers, so P above is the P_a a token computes with, and the linear weights a step of
T = Σq_i tokens reads are those of the experts its tokens touch, at most min(E, k T) a layer. With
P_e one expert's weights (gate, up, down; the router and a shared expert are dense):

    P_a     = P - L_s (E - k) P_e                      (in the FLOPs, for P)
    P_read  = P - L_s (E - min(E, k T)) P_e            (in the bytes, for the linear weights)

That is exact for one token (its k experts are distinct) and the most a step can read: tokens that
share experts read fewer (E (1 - (1 - k/E)^T) on average under uniform routing, up to 1.6x fewer
near k T = E), so for MoE the bytes bound routing that spreads a batch's tokens over the experts.

With FP8 weights (quantization/) a linear weight is one byte and the linears' FLOPs run at the FP8
peak; the lm_head, the embeddings and attention stay 16-bit:

    time   >= max(2 P Σq_i / FP8 peak + (the other FLOPs) / peak, bytes / bandwidth)

The ceilings are measured, not taken from a datasheet: peak is a large matmul in the model's dtype
(and one of e4m3 operands, `torch._scaled_mm`, where FP8 runs), bandwidth a device-to-device copy
counted as bytes read plus bytes written.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from ferry.config import EngineConfig, ModelConfig, MoeConfig
    from ferry.core.outputs import SchedulerOutput

# (query_len, seq_len) of one scheduled request: q_i new tokens, ending at position seq_len - 1.
Step = Sequence[tuple[int, int]]


# ---- the machine ----


@dataclass(frozen=True)
class Hardware:
    peak_flops: float  # FLOP/s of a large matmul in the model's dtype
    bandwidth_bytes_per_s: float  # device memory, bytes read + bytes written per second
    name: str
    fp8_peak_flops: float | None = None  # of an e4m3 matmul; None: not measured (no FP8 matmul here)

    def describe(self) -> str:
        fp8 = f" ({self.fp8_peak_flops / 1e12:.1f} in FP8)" if self.fp8_peak_flops else ""
        return f"{self.name}: {self.peak_flops / 1e12:.1f} TFLOP/s{fp8}, {self.bandwidth_bytes_per_s / 1e12:.2f} TB/s"


def measure_hardware(device: str | torch.device, dtype: torch.dtype | None = None) -> Hardware:
    """Peak matmul FLOP/s and copy bandwidth of `device`, in well under a second on a GPU and a few
    seconds at most on a CPU. dtype defaults to bfloat16 on CUDA and float32 elsewhere."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = _matmul_flops(device, dtype or torch.bfloat16, size=8192, reps=10)
        bandwidth = _copy_bandwidth(device, nbytes=1 << 30, reps=10)
        fp8 = _fp8_matmul_flops(device, size=8192, reps=10)
        torch.cuda.empty_cache()  # give the buffers back before the KV cache is sized from free memory
    else:
        name = platform.processor() or platform.machine() or "cpu"
        flops = _matmul_flops(device, dtype or torch.float32, size=1024, reps=3)
        bandwidth = _copy_bandwidth(device, nbytes=1 << 27, reps=3)
        fp8 = None
    return Hardware(flops, bandwidth, name, fp8)


def _matmul_flops(device: torch.device, dtype: torch.dtype, size: int, reps: int) -> float:
    import torch

    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / _best_time(lambda: torch.mm(a, b), device, reps)


def _fp8_matmul_flops(device: torch.device, size: int, reps: int) -> float | None:
    """FLOP/s of torch._scaled_mm on e4m3 operands (bf16 out), or None where it does not run."""
    import torch

    try:
        a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()  # (column-major, as cuBLASLt takes it)
        one = torch.ones((), device=device)
        return 2 * size**3 / _best_time(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, reps)
    except (RuntimeError, AttributeError, TypeError):  # an older GPU, or a torch without the op
        return None


def _copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), device, reps)


def _best_time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Seconds of the fastest of `reps` calls after two warm-up calls. The fastest, because a
    ceiling is what the machine can reach, not what it reaches on average."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


def add_hardware_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("roofline ceilings (measured on the device unless given)")
    group.add_argument("--peak-tflops", type=float, default=None, help="matmul peak in TFLOP/s")
    group.add_argument("--bandwidth-tbps", type=float, default=None, help="memory bandwidth in TB/s")


def hardware_from_args(args: argparse.Namespace, device: str, dtype: torch.dtype) -> Hardware:
    """The ceilings the flags give, measuring only those missing."""
    if args.peak_tflops is not None and args.bandwidth_tbps is not None:
        return Hardware(args.peak_tflops * 1e12, args.bandwidth_tbps * 1e12, "given")
    measured = measure_hardware(device, dtype)
    return Hardware(
        args.peak_tflops * 1e12 if args.peak_tflops is not None else measured.peak_flops,
        args.bandwidth_tbps * 1e12 if args.bandwidth_tbps is not None else measured.bandwidth_bytes_per_s,
        measured.name, measured.fp8_peak_flops,
    )


# ---- the model ----


class StepCost(NamedTuple):
    flops: float
    bytes: float
    fp8_flops: float = 0.0  # the part of `flops` in FP8 matmuls (the linears, with FP8 weights)

    def compute_seconds(self, hw: Hardware) -> float:
        """The FLOPs at their peaks (the FP8 ones at the FP8 peak, where there is one)."""
        fp8_peak = hw.fp8_peak_flops or hw.peak_flops
        return (self.flops - self.fp8_flops) / hw.peak_flops + self.fp8_flops / fp8_peak


@dataclass(frozen=True)
class ModelCost:
    """Parameter counts and shapes of a Llama-family model (and of its mixtures of experts), from
    its config.json alone."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_params: int  # every decoder layer's projections, weights and biases
    norm_params: int  # every RMSNorm scale, the final norm's included
    tied: bool  # lm_head is the embedding matrix
    weight_itemsize: int
    kv_itemsize: int
    linear_itemsize: int = 0  # bytes of a decoder layer's linear weight; 0: weight_itemsize
    fp8_linears: bool = False  # the linears' matmuls run in FP8
    # A mixture of experts: `num_experts` routed experts of `expert_params` each (counted in
    # linear_params) in each of `sparse_layers` layers, `experts_per_token` of them active; 0: dense.
    sparse_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    # An attention window of `sliding_window` keys in `windowed_layers` of the layers (all of them in
    # Mistral, the local ones in Gemma; ModelConfig.layer_windows); the others attend to every key.
    sliding_window: int | None = None
    windowed_layers: int = 0
    kv_halves: int = 2  # K and V; 1 where the values are the keys (latent attention: kv_cache.py)

    @classmethod
    def from_model_config(cls, config: ModelConfig, kv_itemsize: int | None = None) -> ModelCost:
        """kv_itemsize: bytes of a cached K or V value (CacheConfig.kv_itemsize); None: the model's dtype's."""
        hf = config.hf_config
        fp8 = config.quantization_spec  # (FP8 weights: a byte each, scales aside)
        h, d = hf["hidden_size"], config.head_dim
        norms = 2 * h  # input_layernorm, post_attention_layernorm
        if config.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            norms += 2 * h  # pre_ and post_feedforward_layernorm
        if config.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
            norms += 2 * d  # q_norm, k_norm over each head
        if config.latent_attention:
            norms += hf["kv_lora_rank"] + (hf.get("q_lora_rank") or 0)  # kv_a_layernorm, q_a_layernorm
        return cls(
            hidden_size=h, vocab_size=config.vocab_size, num_layers=config.num_layers,
            num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=d,
            linear_params=config.num_layers * _attention_params(config) + _feed_forward_params(config),
            norm_params=config.num_layers * norms + h,
            tied=bool(hf.get("tie_word_embeddings", False)),
            weight_itemsize=config.dtype_bytes, kv_itemsize=kv_itemsize or config.dtype_bytes,
            linear_itemsize=1 if fp8 else config.dtype_bytes, fp8_linears=fp8 and fp8.activations != "none",
            **_expert_fields(h, config.moe), **_window_fields(config.layer_windows),
            kv_halves=1 if config.latent_attention else 2,
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter, a tied embedding counted once."""
        return self.linear_params + self.norm_params + self.embedding_params * (1 if self.tied else 2)

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: all but the experts it is not routed to."""
        return self.num_params - self.linear_params + self.active_linear_params

    @property
    def active_linear_params(self) -> int:
        """P_a: the linear weights one token computes with."""
        inactive = self.num_experts - self.experts_per_token
        return self.linear_params - self.sparse_layers * inactive * self.expert_params

    def linear_params_read(self, num_tokens: int) -> int:
        """P_read: the linear weights a step of `num_tokens` tokens reads, its experts at most
        min(E, k T) a sparse layer."""
        touched = min(self.num_experts, self.experts_per_token * num_tokens)
        return self.linear_params - self.sparse_layers * (self.num_experts - touched) * self.expert_params

    @property
    def weight_bytes(self) -> int:
        return (self.num_params - self.linear_params) * self.weight_itemsize + self.linear_params * self._linear_bytes

    @property
    def _linear_bytes(self) -> int:
        return self.linear_itemsize or self.weight_itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.kv_halves * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_itemsize

    def attention_flops(self, query_len: int, seq_len: int) -> int:
        full, windowed = self._pairs(query_len, seq_len, None), self._pairs(query_len, seq_len, self.sliding_window)
        layers = (self.num_layers - self.windowed_layers) * full + self.windowed_layers * windowed
        return 4 * self.num_heads * self.head_dim * layers

    @staticmethod
    def _pairs(query_len: int, seq_len: int, w: int | None) -> int:
        """(query, key) pairs of one layer that attend: the query at position p sees p + 1 keys, or
        with a window min(p + 1, w)."""
        first = seq_len - query_len  # the first query's position
        if w is None or seq_len <= w:
            return query_len * first + query_len * (query_len + 1) // 2
        low = max(0, min(seq_len, w) - first)  # queries at first .. first + low - 1 see p + 1 keys
        return low * (2 * first + low + 1) // 2 + (query_len - low) * w

    def kv_read_tokens(self, query_len: int, seq_len: int) -> float:
        """Tokens of K/V a step's request moves, averaged over the layers: its cached keys that its
        queries see (all of them, or in a windowed layer the last w - 1 before its first query), and
        its new tokens' written. Times kv_bytes_per_token, the bytes."""
        cached = seq_len - query_len
        if self.sliding_window is None or not self.windowed_layers:
            return seq_len
        windowed = min(cached, self.sliding_window - 1)
        return query_len + (self.windowed_layers * windowed + (self.num_layers - self.windowed_layers) * cached) / self.num_layers

    def step_cost(self, step: Step, sampled_rows: int) -> StepCost:
        if not step:
            return StepCost(0.0, 0.0)
        num_tokens = sum(q for q, _ in step)
        linear_flops = 2 * self.active_linear_params * num_tokens
        flops = (linear_flops + 2 * self.embedding_params * sampled_rows
                 + sum(self.attention_flops(q, s) for q, s in step))
        gathered = min(num_tokens, self.vocab_size) * self.hidden_size
        lm_head = self.embedding_params if sampled_rows else 0
        head = max(gathered, lm_head) if self.tied else gathered + lm_head
        weights = (self.linear_params_read(num_tokens) * self._linear_bytes
                   + (self.norm_params + head) * self.weight_itemsize)
        kv = self.kv_bytes_per_token * sum(self.kv_read_tokens(q, s) for q, s in step)  # c_i read + q_i written = s_i
        fp8_flops = linear_flops if self.fp8_linears else 0
        return StepCost(float(flops), float(weights + kv), float(fp8_flops))


def _window_fields(layer_windows: tuple[int | None, ...]) -> dict[str, Any]:
    """ModelCost's window fields: one window for the layers that have one (ferry's models have at
    most one size)."""
    windows = {w for w in layer_windows if w is not None}
    if len(windows) > 1:
        raise ValueError(f"layers with different windows {sorted(windows)}: the cost model takes one")
    if not windows:
        return {}
    return {"sliding_window": windows.pop(), "windowed_layers": sum(w is not None for w in layer_windows)}


def _attention_params(config: ModelConfig) -> int:
    """q, k, v and o of one layer, with their biases."""
    if config.latent_attention:
        return _latent_attention_params(config.hf_config)
    hf, d = config.hf_config, config.head_dim
    h, q_size, kv_size = hf["hidden_size"], config.num_heads * d, config.num_kv_heads * d
    bias = bool(hf.get("attention_bias", False))
    # Qwen2: biases on q, k and v only; Qwen2-MoE too, unless its config turns them off.
    qkv_bias = bias or config.architecture == "Qwen2ForCausalLM" or (
        config.architecture == "Qwen2MoeForCausalLM" and hf.get("qkv_bias", True))
    params = h * (q_size + 2 * kv_size) + q_size * h
    if qkv_bias:
        params += q_size + 2 * kv_size
    if bias:
        params += h
    return params


def _latent_attention_params(hf: dict) -> int:
    """Multi-head latent attention's projections (models/deepseek_v2.py): the query (whole, or through
    a rank of q_lora_rank), the latent and its RoPE key, kv_b_proj's per-head keys and values, o."""
    h, heads, rank, rope = hf["hidden_size"], hf["num_attention_heads"], hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    nope, v, q_rank = hf["qk_nope_head_dim"], hf["v_head_dim"], hf.get("q_lora_rank")
    q_size = heads * (nope + rope)
    q = h * q_size if not q_rank else h * q_rank + q_rank * q_size
    return q + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h  # (no biases: deepseek_v2.py)


def _feed_forward_params(config: ModelConfig) -> int:
    """Every layer's MLP; a sparse layer's is its router (a row of h an expert), every expert (gate,
    up, down) and a shared expert (the same, and its gate: a row of h)."""
    hf, moe = config.hf_config, config.moe
    dense = 3 * hf["hidden_size"] * hf["intermediate_size"]  # gate, up, down
    if hf.get("mlp_bias", False):
        dense += 2 * hf["intermediate_size"] + hf["hidden_size"]
    if moe is None:
        return config.num_layers * dense
    h, shared = hf["hidden_size"], moe.shared_expert_intermediate_size
    gated = config.architecture == "Qwen2MoeForCausalLM"  # its shared expert's gate: a row of h
    sparse = moe.num_experts * (h + 3 * h * moe.moe_intermediate_size) + (3 * h * shared + h * gated if shared else 0)
    return (config.num_layers - len(moe.sparse_layers)) * dense + len(moe.sparse_layers) * sparse


def _expert_fields(h: int, moe: MoeConfig | None) -> dict[str, int]:
    """ModelCost's fields of a mixture of experts; none for a dense model."""
    if moe is None:
        return {}
    return dict(sparse_layers=len(moe.sparse_layers), num_experts=moe.num_experts,
                experts_per_token=moe.num_experts_per_tok, expert_params=3 * h * moe.moe_intermediate_size)


def schedule_bound(config: EngineConfig, hardware: Hardware | None = None) -> Callable[[SchedulerOutput], float]:
    """The roofline bound (seconds) of any step the engine of `config` schedules, on `hardware`:
    measured once per process when not given (under a second on a GPU, a few on a CPU)."""
    cost = ModelCost.from_model_config(config.model, config.cache.kv_itemsize(config.model))
    hw = hardware or measured_hardware(config.device)

    def bound(output: SchedulerOutput) -> float:
        step = [(len(s.token_ids), s.start_pos + len(s.token_ids)) for s in output.scheduled]
        return step_bound(step, sum(s.sample for s in output.scheduled), cost, hw)

    return bound


_measured: dict[str, Hardware] = {}


def measured_hardware(device: str) -> Hardware:
    """measure_hardware(device), once per process."""
    if device not in _measured:
        _measured[device] = measure_hardware(device)
    return _measured[device]


def step_bound(step: Step, sampled_rows: int, cost: ModelCost, hw: Hardware) -> float:
    """Seconds one forward over `step` needs at least: its FLOPs at peak or its bytes at full
    bandwidth, whichever takes longer."""
    step_cost = cost.step_cost(step, sampled_rows)
    return max(step_cost.compute_seconds(hw), step_cost.bytes / hw.bandwidth_bytes_per_s)


# ---- what the engine ran ----


@dataclass(frozen=True)
class RecordedStep:
    step: list[tuple[int, int]]
    sampled_rows: int
    kv_slots: int  # token slots in the KV blocks in use after scheduling
    kv_tokens: int  # tokens whose K/V those slots hold (or will, once this step runs)
    scheduled_at: float = 0.0  # time.perf_counter() when it was scheduled


class ScheduleRecorder:
    """Records every step the engine's scheduler makes while in a `with` block:

        with ScheduleRecorder(engine) as steps:
            while engine.has_unfinished_requests():
                engine.step()
        bound = sum(step_bound(s.step, s.sampled_rows, cost, hw) for s in steps)

    The schedule is recorded rather than predicted, so chunking, batch shapes and recomputation
    after preemption are charged to the bound exactly as the engine ran them. Recording costs a
    pass over the scheduled and running requests per step (tens of microseconds for hundreds).
    Each step notes when it was scheduled: the engine schedules one step per `step()` call, so the
    time from one to the next is the time the engine spent on a step (`step_seconds`).
    """

    def __init__(self, engine) -> None:
        self.scheduler = engine.scheduler
        self.steps: list[RecordedStep] = []

    def __enter__(self) -> list[RecordedStep]:
        scheduler, original = self.scheduler, self.scheduler.schedule
        kv_cache = scheduler.kv_cache

        def schedule():
            out = original()
            if out.scheduled:
                pool = kv_cache.pool
                self.steps.append(RecordedStep(
                    [(len(s.token_ids), s.start_pos + len(s.token_ids)) for s in out.scheduled],
                    sum(s.sample for s in out.scheduled),
                    (pool.num_blocks - pool.num_free_blocks) * kv_cache.block_size,
                    sum(r.num_computed_tokens for r in scheduler.running),
                    time.perf_counter(),
                ))
            return out

        scheduler.schedule = schedule  # an instance attribute, shadowing the method
        return self.steps

    def __exit__(self, *exc) -> None:
        del self.scheduler.schedule


def step_seconds(steps: Sequence[RecordedStep], end: float) -> list[float]:
    """Each step's share of the wall clock: from its scheduling to the next step's (the last one's
    to `end`). With asynchronous scheduling a step is scheduled while the one before it runs, so
    this is one engine iteration, which in a device-bound run is the device's time on one step."""
    starts = [s.scheduled_at for s in steps] + [end]
    return [b - a for a, b in zip(starts, starts[1:])]


def paging_waste(steps: Sequence[RecordedStep]) -> float:
    """Internal fragmentation of the paged KV cache: allocated slots not holding a token, as a
    fraction of allocated slots, averaged over steps. Blocks shared through the prefix cache count
    once but hold tokens of several requests, so sharing pushes this down (random prompts share none)."""
    ratios = [(s.kv_slots - s.kv_tokens) / s.kv_slots for s in steps if s.kv_slots]
    return sum(ratios) / len(ratios) if ratios else 0.0


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), interpolating linearly between the closest ranks."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
