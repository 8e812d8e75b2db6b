"""What structured output costs: the same requests with and without a JSON schema, side by side in one
run, and the time the grammars' masks take per token at several batch sizes.

    python -m ferry.bench.structured --config-dir benchmarks/qwen3-0.6b --tokenizer DIR --num-prompts 64

The model folder may hold only a config.json (random weights); --tokenizer names a folder whose
tokenizer.json has the model's vocabulary. Every request generates exactly --output-len tokens (EOS
ignored), so both runs do the same work on the device: the difference is the host's (each sequence's
matcher takes its token, and the step's masks are filled in llguidance's threads while the engine
processes the step before) and applying the masks (a kernel on the device). The schema has no length
limits (an array of objects with free strings), so no grammar completes early.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

SCHEMA = {
    "type": "array",
    "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}},
        "required": ["name", "city", "age", "tags", "active"], "additionalProperties": False},
}


def run(llm, prompts: list[list[int]], output_len: int, structured) -> tuple[float, int]:
    """(seconds, output tokens) of one batch."""
    from ferry.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0, seed=0,
                            structured_outputs=structured)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def mask_timing(llm, batch: int, input_len: int, output_len: int, structured, vocab: int) -> tuple[float, float]:
    """(ms per step, us per sequence and token) that the grammars' masks take to fill on the host,
    from the start of a step's work to its end (Grammars.start_masks), in llguidance's threads."""
    grammars = llm.engine.executor.grammars
    grammars.mask_seconds, grammars.mask_batches, grammars.mask_rows = 0.0, 0, 0
    rng = random.Random(batch)
    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(batch)]
    run(llm, prompts, output_len, structured)
    seconds = grammars.mask_seconds
    return seconds / max(grammars.mask_batches, 1) * 1e3, seconds / max(grammars.mask_rows, 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", required=True)
    parser.add_argument("--tokenizer", required=True, help="a folder with a tokenizer.json of the model's vocabulary")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--mask-batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternated; the best counts")
    args = parser.parse_args(argv)

    import torch

    from ferry import LLM
    from ferry.structured.params import StructuredOutputsParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    llm = LLM(args.config_dir, load_format="dummy", tokenizer=args.tokenizer, dtype=args.dtype, device=device,
              max_num_seqs=max(args.num_prompts, *args.mask_batch_sizes),
              max_model_len=args.input_len + args.output_len + 16, enable_prefix_caching=False)
    vocab = llm.engine.config.model.vocab_size
    structured = StructuredOutputsParams(json=json.dumps(SCHEMA))
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    run(llm, prompts[:4], 16, None)  # warm-up: compilation, the grammar's tokenizer view
    run(llm, prompts[:4], 16, structured)
    grammars = llm.engine.executor.grammars
    # The masks in their own thread while the engine goes on (the default), and in the engine's thread.
    kinds = {"free": (None, True), "json": (structured, True), "json, masks in line": (structured, False)}
    best = dict.fromkeys(kinds, 0.0)
    for _ in range(args.repeats):
        for name, (grammar, background) in kinds.items():
            grammars.background = background
            elapsed, tokens = run(llm, prompts, args.output_len, grammar)
            best[name] = max(best[name], tokens / elapsed)
    grammars.background = True
    print(f"{llm.engine.config.model.architecture} ({args.config_dir}), {llm.engine.config.model.dtype} on {device}, "
          f"vocab {vocab}: {args.num_prompts} requests, {args.input_len} prompt / {args.output_len} output tokens")
    print(f"unconstrained:    {best['free']:>10,.0f} output tok/s")
    print(f"JSON schema:      {best['json']:>10,.0f} output tok/s  ({best['json'] / best['free']:.1%})")
    print(f"  masks in line:  {best['json, masks in line']:>10,.0f} output tok/s  "
          f"({best['json, masks in line'] / best['free']:.1%}; the masks filled in the engine's thread)")
    print()
    print(f"{'batch':>6} {'mask ms/step':>13} {'us/token':>9}")
    for batch in args.mask_batch_sizes:
        per_step, per_token = mask_timing(llm, batch, 64, 64, structured, vocab)
        print(f"{batch:>6} {per_step:>13.3f} {per_token:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
