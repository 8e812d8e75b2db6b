"""How much CPU time one engine step costs besides the model: scheduling, input preparation, sampling
bookkeeping, detokenization and output building, with a model that does no work.

    python -m ferry.bench.step_overhead [--requests 256] [--steps 200] [--model DIR]

Every running request decodes one token per step, so this is the per-step overhead that sits on top
of each decode step's GPU time (a 0.6B model decodes a batch in a few ms on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ferry.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from ferry.engine.engine import LLMEngine
from ferry.executor.model_runner import ModelRunner
from ferry.sample import Sampler
from ferry.sampling_params import RequestOutputKind, SamplingParams


class NullModel(torch.nn.Module):
    """Returns fixed logits: row i always predicts a token of its own."""

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        super().__init__()
        self.logits = torch.full((max_rows, vocab_size), -1.0)
        rows = torch.arange(max_rows)
        self.logits[rows, (rows * 7 + 300) % vocab_size] = 1.0

    def forward(self, input_ids, positions, ctx):
        return input_ids

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def null_engine(model: str | None, num_requests: int, block_size: int) -> LLMEngine:
    if model is None:
        from ferry.assets import default_model_path

        model = default_model_path()
    model_config = ModelConfig.from_pretrained(model, "float32")
    config = EngineConfig(
        model=model_config,
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_requests * 256 // block_size),
        scheduler=SchedulerConfig(num_requests, 8192, model_config.max_model_len),
    )
    kv_caches = [torch.empty(2, config.cache.num_kv_blocks, block_size, 1, 1)]
    runner = ModelRunner(config, NullModel(model_config.vocab_size, num_requests), kv_caches, None, Sampler())
    from ferry.tokenizer import Tokenizer

    return LLMEngine(config, runner, Tokenizer.from_pretrained(model))


def timed_step(engine: LLMEngine) -> dict[str, float]:
    """One step, timed by phase. Sampling is timed apart: on a GPU it is device work, here it runs
    on CPU tensors and would hide the bookkeeping this benchmark is about."""
    runner = engine.executor
    t0 = time.perf_counter()
    scheduler_output = engine.scheduler.schedule()
    engine.output_processor.mark_scheduled([s.request_id for s in scheduler_output.scheduled if s.new], t0)
    t1 = time.perf_counter()
    runner.update_states(scheduler_output)
    inputs = runner.prepare_inputs(scheduler_output.scheduled)
    t2 = time.perf_counter()
    logits = runner.model.compute_logits(inputs.input_ids)
    runner_output = runner.collect(runner.sample(scheduler_output.scheduled, inputs, logits))
    t3 = time.perf_counter()
    updates = engine.scheduler.update_from_output(scheduler_output, runner_output)
    outputs, stopped, _ = engine.output_processor.process(updates)
    t4 = time.perf_counter()
    assert len(outputs) == len(scheduler_output.scheduled) and not stopped
    return {
        "schedule": t1 - t0, "prepare inputs": t2 - t1, "update+outputs": t4 - t3,
        "cpu total": (t2 - t0) + (t4 - t3), "(sampling)": t3 - t2,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="tokenizer and config source (default: bundled model)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    engine = null_engine(args.model, args.requests, args.block_size)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.steps + 10, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
    )
    for i in range(args.requests):
        engine.add_request(str(i), {"prompt_token_ids": [(i + j) % 1000 + 10 for j in range(args.prompt_len)]}, params)
    while engine.scheduler.num_waiting:
        engine.step()  # prefill everything first, in chunks of the token budget
    for _ in range(3):
        engine.step()
    times = [timed_step(engine) for _ in range(args.steps)]
    print(f"{args.requests} running requests, decode steps: {args.steps}, model: none (fixed logits)")
    print(f"{'phase':>16} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for phase in times[0]:
        values = sorted(t[phase] * 1e3 for t in times)
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        print(f"{phase:>16} {statistics.fmean(values):8.3f} {statistics.median(values):8.3f} {p99:8.3f}")


if __name__ == "__main__":
    main()
