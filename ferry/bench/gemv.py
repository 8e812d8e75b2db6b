"""Time the small-batch linear layers of the benchmark models: cuBLAS against every GEMV candidate
(ferry/layers/gemv.py), as the startup tuning measures them, with the bandwidth each achieves, and
the add+RMSNorm inside the GEMV against the norm's own kernel before it.

    python -m ferry.bench.gemv        # CUDA only: Qwen3-0.6B's and Llama-3.1-8B's layer shapes

At one row a linear layer reads its weight once and does almost nothing else, so its time against
weight bytes / bandwidth says how much of the step's floor it wastes. The bandwidth is the
device-to-device copy's (bytes read + written), measured in the same run; a read-only kernel can
exceed it a little.
"""

from __future__ import annotations

import argparse

import torch

from ferry.bench.kernel_check import BENCHMARKS, copy_bandwidth
from ferry.config import ModelConfig
from ferry.layers import gemv
from ferry.layers.gemv import GemvConfig

MODELS = ("qwen3-0.6b", "llama-3.1-8b")


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of one decoder layer's linear layers."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, intermediate = config.hf_config["hidden_size"], config.hf_config["intermediate_size"]
    return {
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }


def _name(config: GemvConfig | None) -> str:
    return "cuBLAS" if config is None else f"GEMV {config.block_n}x{config.block_k}, {config.num_warps} warps"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.gemv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=3, help="candidates to list per shape and row count")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ferry.bench.gemv times kernels on a CUDA device")
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    for model in MODELS:
        config = ModelConfig.from_pretrained(BENCHMARKS / model, "bfloat16", None, "dummy")
        for name, (n, k) in layer_shapes(config).items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            with torch.inference_mode():
                times = gemv.measure(weight, None)
            floor = weight.nbytes / bandwidth
            print(f"\n{model} {name} {n} x {k} ({weight.nbytes / 1e6:.1f} MB, floor {floor * 1e6:.2f} us); "
                  f"chosen: {_name(gemv.choose(times, 1))} at 1 row, "
                  f"{_name(gemv.choose(times, gemv.MAX_ROWS))} at {gemv.MAX_ROWS}")
            for rows in (1, gemv.MAX_ROWS):
                ranked = sorted((t, c is None, _name(c)) for (r, c), t in times.items() if r == rows)
                cublas = times[rows, None]
                shown = [row for row in ranked if not row[1]][:args.top] + [row for row in ranked if row[1]]
                for t, _, label in shown:
                    print(f"  rows {rows}  {label:<28} {t * 1e6:7.2f} us  {floor / t:6.1%} of floor  "
                          f"{cublas / t:5.2f}x cuBLAS")
            best = min(gemv.CANDIDATES, key=lambda c: times[1, c])
            with torch.inference_mode():
                fused, separate = gemv.measure_norm_fusion(weight, None, best)
            print(f"  rows 1  add+RMSNorm inside {_name(best)}: {fused * 1e6:.2f} us; "
                  f"the norm's kernel, then the GEMV: {separate * 1e6:.2f} us")
            del weight


if __name__ == "__main__":
    main()
