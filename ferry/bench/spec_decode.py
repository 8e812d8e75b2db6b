"""What speculative decoding gains: the same greedy batch decoded plainly and with proposals, side
by side on one model runner, at each batch size asked.

    python -m ferry.bench.spec_decode --config-dir benchmarks/llama-3.1-8b --dtype bfloat16 \
        --acceptance 0.7 -k 4 --batch-sizes 1 8 32 128
    python -m ferry.bench.spec_decode --prompts code --batch-sizes 1 32 \
        --speculative-config '{"model": "ferry-default-draft", "num_speculative_tokens": 3}'

Models of random weights (a real architecture's shape) have no trained draft, so `--acceptance A`
measures an oracle instead (spec/replay.py): a first, plain pass records each request's greedy
continuation, and the proposer replays it with every proposed token replaced by a wrong one with
probability 1 - A, so a proposal's first token is kept with probability A, and so is each one after
a kept one (k tokens: 1 + A + ... + A^k tokens a step at best). `--speculative-config` measures a real
proposer (prompt lookup, a draft model) instead.

Random weights make a flat next-token distribution, whose near-ties bfloat16 rounds one way in a
decode step and the other in a verify step (other matmul shapes); one flip and the replayed
continuation is no longer the model's. So the output layer of a random-weight model is planted
with a continuation no rounding can flip (`plant_greedy_chain`: token t is followed by pi(t), a
fixed permutation, by a wide margin) and the layers' outputs are scaled down so that they do not
blur it: the same shapes and kernels, hence the same time, and outputs that repeat exactly.

Each batch runs `--batch-size` requests to exactly `--output-len` tokens (greedy, EOS ignored), after
one warm-up run; the time runs from adding them to the last token, prefill included. Each batch runs
plainly and then with proposals before the next batch does (`--num-batches`), each run on a fresh
engine, so that both see the machine as it is at the time. The outputs with speculation must equal
the plain ones (greedy), which the table says.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

# Code openings for the bundled model (it was trained on the standard library's source).
CODE_PROMPTS = (
    "def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
    "def read_lines(filename):\n", "import re\n\ndef parse_int(s):", "def merge_sort(items):",
    "from collections import defaultdict\n\ndef group_by(key, items):", "class Node:\n    def __repr__(self):",
)


def prompts_for(args, engine, batch: int, seed: int) -> list[list[int]]:
    if args.prompts == "code":
        rng = random.Random(seed)
        texts = [CODE_PROMPTS[(seed + i) % len(CODE_PROMPTS)] + rng.choice(("", "\n", "\n    ")) for i in range(batch)]
        return [engine.tokenizer.encode(t) for t in texts]
    rng = random.Random(seed)
    top = min(10000, engine.config.model.vocab_size - 1)
    return [[rng.randint(0, top) for _ in range(args.input_len)] for _ in range(batch)]


def generate(engine, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float, int]:
    """(each request's tokens, seconds, steps)."""
    from ferry.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            final[out.request_id] = out.outputs[0].token_ids
    return [final[str(i)] for i in range(len(prompts))], time.perf_counter() - start, steps


def run(args: argparse.Namespace) -> dict:
    import torch

    from ferry.config import EngineConfig
    from ferry.core.spec_stats import SpecDecodingStats
    from ferry.engine.engine import LLMEngine
    from ferry.executor.model_runner import build_model_runner
    from ferry.spec.replay import ReplayProposer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = args.config_dir or args.model
    if model is None:
        from ferry.assets import default_model_path

        model = default_model_path()
    oracle = args.speculative_config is None
    config = EngineConfig.create(
        model, load_format="dummy" if args.config_dir else "auto", dtype=args.dtype, device=device,
        max_num_seqs=max(args.batch_sizes), max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        speculative_config=None if oracle else json.loads(args.speculative_config), enforce_eager=args.enforce_eager,
    )
    # (With the oracle the runner is built with a stand-in, so that the verify graphs are captured.)
    runner = build_model_runner(config, ReplayProposer(args.k, {}) if oracle else None)
    if args.config_dir and args.plant:
        plant_greedy_chain(runner.model)
    proposer, k = runner.proposer, runner.proposer.num_speculative_tokens
    tokenizer = _tokenizer(config)
    phases = PhaseTimes(runner) if args.phases else None

    def engine_for(proposer_now):
        runner.proposer = proposer_now  # (the engine's scheduler sizes its lookahead from it)
        return LLMEngine(config, runner, tokenizer)

    rows = []
    for batch in args.batch_sizes:
        engine = engine_for(None)
        warm_up = prompts_for(args, engine, batch, batch + 1000)
        batches = [prompts_for(args, engine, batch, batch + 7 * i) for i in range(args.num_batches)]
        if oracle:  # it replays what the plain pass of the same prompts just produced
            reference: dict[tuple[int, ...], list[int]] = {}
            proposer = ReplayProposer(k, reference, vocab_size=config.model.vocab_size,
                                      wrong_rate=1 - args.acceptance, seed=batch)
        totals = {"plain": [[], 0.0, 0], "spec": [[], 0.0, 0]}
        stats = SpecDecodingStats()
        # Plain and speculative in turn, batch by batch, each batch on fresh engines (no prefix
        # cache carried over), so that a machine whose speed drifts during the run drifts for both.
        for i, prompts in enumerate([warm_up, *batches]):
            for mode in ("plain", "spec"):
                engine = engine_for(proposer if mode == "spec" else None)
                if phases is not None:
                    phases.attach(engine, on=mode == "spec" and i > 0)
                tokens, seconds, steps = generate(engine, prompts, args.output_len)
                if oracle and mode == "plain":
                    reference.update(zip(map(tuple, prompts), tokens))
                if i > 0:  # (the first is the warm-up)
                    totals[mode][0] += tokens
                    totals[mode][1] += seconds
                    totals[mode][2] += steps
                    if mode == "spec":
                        stats = stats + engine.scheduler.spec_stats
        (plain, plain_s, plain_steps), (spec, spec_s, spec_steps) = totals["plain"], totals["spec"]
        out_tokens = batch * args.num_batches * args.output_len
        rows.append({
            "batch": batch, "plain_tok_s": out_tokens / plain_s, "spec_tok_s": out_tokens / spec_s,
            "speedup": plain_s / spec_s, "plain_steps": plain_steps, "spec_steps": spec_steps,
            "acceptance_rate": stats.acceptance_rate, "mean_accepted_length": stats.mean_accepted_length,
            "accepted_per_pos": list(stats.accepted_per_pos), "num_drafts": stats.num_drafts,
            "equal": spec == plain,
            "phases_ms_per_step": phases.take() if phases else None,
        })
    runner.proposer = proposer
    return {
        "model": str(model), "architecture": config.model.architecture, "dtype": config.model.dtype,
        "device": device, "k": k,
        "proposer": f"oracle, acceptance {args.acceptance}" if oracle else json.loads(args.speculative_config),
        "input_len": args.input_len, "output_len": args.output_len, "rows": rows,
        "args": {name: value for name, value in vars(args).items() if name != "func"},
    }


class PhaseTimes:
    """Where a speculative step's wall time goes, on the host's clock: the engine's calls into the
    scheduler, the executor (launch; collect, which waits for the device, then proposes) and the
    output processor, timed by wrapping them: the runner's once, each engine's when attached, and
    counted only while the attached engine is a speculative one being measured."""

    def __init__(self, runner) -> None:
        self.totals: dict[str, float] = {}
        self.steps = 0
        self.on = False
        self.wrapped: list = []  # the proposers whose propose is wrapped (kept alive: compared by identity)
        for owner, name, label in ((runner, "launch", "launch"),
                                   (runner, "collect", "collect (wait, sample, propose)")):
            self._wrap(owner, name, label)

    def attach(self, engine, on: bool) -> None:
        self.on = on
        proposer = engine.executor.proposer
        if proposer is not None and not any(p is proposer for p in self.wrapped):  # (each proposer once)
            self.wrapped.append(proposer)
            self._wrap(proposer, "propose", "  of which propose")
        for owner, name, label in ((engine.scheduler, "schedule", "schedule"),
                                   (engine.scheduler, "update_from_output", "update"),
                                   (engine.output_processor, "process", "outputs")):
            self._wrap(owner, name, label)

    def _wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.on:
                    self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - start
                    self.steps += name == "launch"

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """Milliseconds per step of each phase since the last take."""
        per_step = {label: total * 1e3 / max(self.steps, 1) for label, total in self.totals.items()}
        self.totals, self.steps = {}, 0
        return per_step


def plant_greedy_chain(model, seed: int = 0) -> None:
    """Make a random-weight Llama-family model's greedy continuation t -> pi(t) for a fixed random
    permutation pi, by a margin far beyond rounding: lm_head's row pi(t) is the embedding of t (the
    final norm's input is close to that embedding once every layer's output projections are scaled
    down), so the logit of pi(t) is about |e_t|^2 / rms(e_t), and the others are noise around 0."""
    import torch

    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    if embed.data_ptr() == head.data_ptr():
        raise ValueError("plant_greedy_chain needs an untied output layer (tie_word_embeddings false)")
    with torch.no_grad():
        vocab = embed.shape[0]
        inverse = torch.argsort(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)))
        head.copy_(embed[inverse.to(embed.device)])  # head[pi(t)] = embed[t]
        for layer in model.model.layers:
            for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
                linear.weight.mul_(1e-3)


def _tokenizer(config):
    if not (config.model.tokenizer_dir / "tokenizer.json").is_file():
        return None
    from ferry.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(config.model.tokenizer_dir)


def report(r: dict) -> str:
    lines = [
        f"{r['architecture']} ({r['model']}), {r['dtype']} on {r['device']}; k = {r['k']}, proposer: {r['proposer']}",
        f"greedy, output {r['output_len']} tokens a request, {r['args']['num_batches']} batch(es) of each size"
        + ("" if r["args"]["prompts"] == "code" else f", prompts of {r['input_len']} tokens"),
        "",
        f"{'batch':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'accepted':>9} {'mean len':>9} "
        f"{'steps':>11} {'equal':>6}",
    ]
    for row in r["rows"]:
        lines.append(f"{row['batch']:>6} {row['plain_tok_s']:>12.1f} {row['spec_tok_s']:>11.1f} {row['speedup']:>7.2f}x "
                     f"{row['acceptance_rate']:>9.3f} {row['mean_accepted_length']:>9.2f} "
                     f"{row['plain_steps']:>5}/{row['spec_steps']:<5} {str(row['equal']):>6}")
    lines.append("(accepted: proposed tokens kept; mean len: tokens a verify step yields; steps: plain/speculative)")
    for row in r["rows"]:
        if row["phases_ms_per_step"]:
            times = ", ".join(f"{label} {ms:.3f}" for label, ms in row["phases_ms_per_step"].items())
            lines.append(f"batch {row['batch']}, ms per speculative step: {times}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.spec_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", default=None, help="a model folder (config.json is enough: dummy weights)")
    parser.add_argument("--model", default=None, help="a model folder with weights (default: the bundled model)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="a real proposer (vLLM's JSON); without it, the oracle at --acceptance")
    parser.add_argument("--acceptance", type=float, default=0.7, help="the oracle's chance to keep each token")
    parser.add_argument("-k", type=int, default=4, help="the oracle's proposals a step")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompts", choices=("random", "code"), default="random",
                        help="random token ids of --input-len, or code openings (for the bundled model)")
    parser.add_argument("--num-batches", type=int, default=1,
                        help="batches of other prompts run one after another at each size (their times added)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--plant", action=argparse.BooleanOptionalAction, default=True,
                        help="with --config-dir: plant a greedy continuation that rounding cannot flip")
    parser.add_argument("--phases", action="store_true", help="also time the speculative steps' phases")
    parser.add_argument("--json", default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.acceptance <= 1:
        parser.error(f"--acceptance must be in [0, 1], got {args.acceptance}")
    results = run(args)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0 if all(row["equal"] for row in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
