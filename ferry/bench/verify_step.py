"""What a step that verifies proposed tokens costs next to a plain decode step, and that its outputs
are those of single steps, through the decode graphs.

    python -m ferry.bench.verify_step --config-dir benchmarks/llama-3.1-8b --dtype bfloat16

Decode is bound by reading the weights; a step that brings each request's last token and k proposals
reads them once for k + 1 positions, so it should cost barely more than a decode step. This times the
executor's whole step (inputs, graph replay, logits, sampling, the tokens back on the host) for one
token a request and for 1 + k, at each batch size and context length asked, and prints their ratio.

Then it checks the outputs: greedy generations with an oracle proposer (the single-step run's own
tokens, and the same with every other proposal wrong) must equal the single-step run token for token,
with the verify steps replayed from their CUDA graphs (counted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from ferry.spec.replay import ReplayProposer

MAX_TOKEN_ID = 10000


def time_steps(runner, batch: int, context: int, k: int, iters: int) -> tuple[float, float]:
    """Median seconds of a decode step and of a (1 + k)-token verify step, `batch` requests at
    `context` tokens each (the same step run again and again: the same slots are rewritten)."""
    import random

    from ferry.core.outputs import ScheduledRequest, SchedulerOutput
    from ferry.sampling_params import SamplingParams

    block_size = runner.block_size
    blocks_each = -(-(context + k + 1) // block_size)
    if batch * blocks_each > runner.num_kv_blocks:
        raise ValueError(f"{batch} x {context} tokens need {batch * blocks_each} KV blocks; "
                         f"the cache has {runner.num_kv_blocks}")
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    ids = [f"t{batch}-{context}-{i}" for i in range(batch)]
    prefill = []
    for i, request_id in enumerate(ids):
        prompt = [rng.randrange(MAX_TOKEN_ID) for _ in range(context)]
        blocks = list(range(i * blocks_each, (i + 1) * blocks_each))
        prefill.append(ScheduledRequest(request_id, prompt, 0, blocks, sample=True, new=True, sampling_params=params,
                                        prompt_token_ids=prompt, output_token_ids=[]))
    runner.execute(SchedulerOutput(prefill, batch * context))
    decode = [ScheduledRequest(r, [1], context, [], sample=True) for r in ids]
    verify = [ScheduledRequest(r, [1, 2, 3, 4, 5][:k + 1], context, [], sample=True, num_draft_tokens=k) for r in ids]
    timings = {}
    for name, scheduled in (("decode", decode), ("verify", verify)):
        output = SchedulerOutput(scheduled, len(scheduled))
        for _ in range(10):
            runner.execute(output)  # warm-up
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            runner.execute(output)
            samples.append(time.perf_counter() - start)
        timings[name] = statistics.median(samples)
    runner.execute(SchedulerOutput([], 0, finished_request_ids=set(ids)))
    return timings["decode"], timings["verify"]


def check_outputs(runner, config, k: int, num_prompts: int, prompt_len: int, output_len: int) -> list[dict]:
    """Single steps, then the same prompts with all-right and half-wrong proposals: equal tokens?"""
    import random

    from ferry.bench.spec_decode import generate as greedy
    from ferry.engine.engine import LLMEngine

    rng = random.Random(1)
    prompts = [[rng.randrange(MAX_TOKEN_ID) for _ in range(prompt_len)] for _ in range(num_prompts)]
    graphs = runner.decode_graphs
    replays = {"n": 0}
    forward = graphs.forward

    def counting(inputs):  # on CUDA every step that reaches here replays a captured graph
        replays["n"] += inputs.attn_metadata.max_query_len > 1
        return forward(inputs)

    graphs.forward = counting

    def generate(proposer) -> tuple[list[list[int]], int]:
        runner.proposer = proposer
        tokens, _, steps = greedy(LLMEngine(config, runner, tokenizer=None), prompts, output_len)
        return tokens, steps

    single, single_steps = generate(None)
    reference = {tuple(p): t for p, t in zip(prompts, single)}
    results = []
    for name, wrong_every in (("all proposals right", 0), ("every other proposal wrong", 2)):
        replays["n"] = 0
        tokens, steps = generate(ReplayProposer(k, reference, wrong_every, MAX_TOKEN_ID))
        results.append({"case": name, "equal": tokens == single, "steps": steps, "single_steps": single_steps,
                        "verify_graph_replays": replays["n"]})
    runner.proposer = None
    graphs.forward = forward
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.verify_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", required=True, help="a model folder (config.json is enough: dummy weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--num-kv-blocks", type=int, default=16384)
    parser.add_argument("--device", default=None, help="default: cuda when there is one (on a CPU the graphs' padded "
                        "steps run eagerly: a smoke test, not a measurement)")
    parser.add_argument("--no-timing", action="store_true", help="only check the outputs")
    parser.add_argument("--no-check", action="store_true", help="only time the steps")
    parser.add_argument("--prompt-len", type=int, default=200, help="prompt tokens of each checked generation")
    parser.add_argument("--output-len", type=int, default=64, help="tokens each checked generation makes")
    args = parser.parse_args(argv)

    import torch

    from ferry.config import EngineConfig
    from ferry.executor.model_runner import build_model_runner

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    k = args.num_speculative_tokens
    config = EngineConfig.create(
        args.config_dir, load_format="dummy", dtype=args.dtype, device=device, num_kv_blocks=args.num_kv_blocks,
        enforce_eager=False,
        max_num_seqs=max(args.batch_sizes), cuda_graph_batch_sizes=sorted(set(args.batch_sizes)),
        max_model_len=max(*args.contexts, args.prompt_len + args.output_len) + 2 * (k + 1),
    )
    runner = build_model_runner(config, ReplayProposer(k, {}))
    runner.proposer = None  # the timings and the single-step run take no proposals
    print(f"{config.model.architecture} ({args.config_dir}), {config.model.dtype}, k = {k}, on {device}")
    if not args.no_timing:
        print(f"step time through the decode graphs, median of {args.iters}")
        print(f"{'batch':>6} {'context':>8} {'decode ms':>10} {f'verify {k + 1} ms':>12} {'ratio':>7}")
        for batch in args.batch_sizes:
            for context in args.contexts:
                decode, verify = time_steps(runner, batch, context, k, args.iters)
                print(f"{batch:>6} {context:>8} {decode * 1e3:>10.3f} {verify * 1e3:>12.3f} {verify / decode:>7.3f}")
        print()
    if args.no_check:
        return 0
    # A verify step's rows go through other matmul shapes than single steps' (five rows, not one),
    # so in bfloat16 their logits differ by rounding and a greedy near-tie can go either way; in
    # float32 the differences are far below the gaps between top tokens.
    ok = True
    for r in check_outputs(runner, config, k, num_prompts=4, prompt_len=args.prompt_len, output_len=args.output_len):
        ok &= r["equal"] and r["verify_graph_replays"] > 0
        print(f"{r['case']}: outputs equal to single steps: {r['equal']}; {r['steps']} steps "
              f"(single steps: {r['single_steps']}), {r['verify_graph_replays']} verify steps on the decode graphs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
