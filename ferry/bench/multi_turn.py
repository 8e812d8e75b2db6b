"""A 100-turn agent loop: each turn resends the whole conversation plus new user text.

    python -m ferry.bench.multi_turn [--model DIR] [--turns 100] [--device cpu]

Without prefix caching every turn prefills the whole history again; with it, only what is new. For
both settings it reports the prompt tokens prefilled (computed, not found in the cache) against the
tokens that are really new (the new user text, plus the previous reply's last token, which was
sampled but never computed), and the time to first token of the first and last turns.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from ferry.config import EngineConfig
from ferry.engine.engine import LLMEngine
from ferry.sampling_params import RequestOutputKind, SamplingParams


def run_conversation(engine: LLMEngine, turns: int, user_tokens: tuple[int, int], output_tokens: int, seed: int):
    rng = random.Random(seed)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    conversation: list[int] = []
    computed_before = 0  # tokens of the conversation whose K/V the last turn computed
    rows = []
    for turn in range(turns):
        conversation += [rng.randrange(10, vocab) for _ in range(rng.randint(*user_tokens))]
        engine.add_request(f"turn{turn}", {"prompt_token_ids": list(conversation)}, params)
        start, ttft, cached, reply = time.perf_counter(), None, 0, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - start
                cached = out.num_cached_tokens
                reply += out.outputs[0].token_ids
        rows.append({"prompt": len(conversation), "new": len(conversation) - computed_before,
                     "prefilled": len(conversation) - cached, "ttft": ttft})
        computed_before = len(conversation) + len(reply) - 1
        conversation += reply
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--turns", type=int, default=100)
    # Defaults keep 100 turns inside the bundled model's 2048-token context.
    parser.add_argument("--user-tokens", type=int, nargs=2, default=(6, 14))
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if args.model is None:
        from ferry.assets import default_model_path

        args.model = default_model_path()

    results = {}
    for caching in (False, True):
        config = EngineConfig.create(
            args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            load_format=args.load_format, enable_prefix_caching=caching,
            max_model_len=None,
        )
        engine = LLMEngine.from_config(config)
        # A short conversation of other tokens first, so that one-time costs (kernel compilation,
        # allocator growth) do not land in turn 1's TTFT.
        run_conversation(engine, 3, tuple(args.user_tokens), args.output_tokens, seed=1)
        results[caching] = run_conversation(engine, args.turns, tuple(args.user_tokens), args.output_tokens, seed=0)
        del engine  # its KV cache took most of the device memory; the next engine needs it
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    new = sum(r["new"] for r in results[True])
    print(f"{args.turns} turns, final prompt {results[True][-1]['prompt']} tokens, block size {args.block_size}")
    print(f"{'prefix caching':>15} {'prefilled':>10} {'x new':>7} {'TTFT turn 1':>12} {'TTFT last':>10}")
    for caching, rows in results.items():
        prefilled = sum(r["prefilled"] for r in rows)
        print(f"{'on' if caching else 'off':>15} {prefilled:10d} {prefilled / new:7.3f} "
              f"{rows[0]['ttft'] * 1e3:10.1f}ms {rows[-1]['ttft'] * 1e3:8.1f}ms")
    print(f"{'really new':>15} {new:10d}")


if __name__ == "__main__":
    main()
