"""Time the small-batch linear layers of the benchmark models: cuBLAS against every GEMV candidate
(ferry/layers/gemv.py), with the bandwidth each achieves; then, for the layers fed by a small op
(RMSNorm, SiLU-and-mul), the paths the startup tuning chooses among: the op's kernel then cuBLAS,
the op's kernel then the GEMV, or the GEMV with the op inside.

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


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int, str | None]]:
    """name -> (out_features, in_features, the op that feeds it) of one decoder layer's linear layers."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, intermediate = config.hf_config["hidden_size"], config.hf_config["intermediate_size"]
    return {
        "qkv_proj": (q + 2 * kv, hidden, "rms_norm"),
        "o_proj": (hidden, q, None),
        "gate_up_proj": (2 * intermediate, hidden, "rms_norm"),
        "down_proj": (hidden, intermediate, "silu_and_mul"),
    }


def _name(config: GemvConfig | None) -> str:
    return str(config) if config is not None else "cuBLAS"


def _path(key: tuple[GemvConfig | None, bool]) -> str:
    config, inside = key
    return _name(config) + (" (norm inside)" if inside else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.gemv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=3, help="candidates to list per shape and row count")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ferry.bench.gemv times kernels on a CUDA device")
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    for model in MODELS:
        config = ModelConfig.from_pretrained(BENCHMARKS / model, "bfloat16", None, "dummy", "cuda")
        for name, (n, k, input_op) in layer_shapes(config).items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            with torch.inference_mode():
                times = gemv.measure(weight, None)
            floor = weight.nbytes / bandwidth
            print(f"\n{model} {name} {n} x {k} ({weight.nbytes / 1e6:.1f} MB, floor {floor * 1e6:.2f} us)")
            for rows in gemv.ROW_BUCKETS:
                ranked = sorted((t, c is None, _name(c)) for (r, c), t in times.items() if r == rows)
                cublas = times[rows, None]
                shown = [row for row in ranked if not row[1]][:args.top] + [row for row in ranked if row[1]]
                for t, _, label in shown:
                    print(f"  rows {rows}  {label:<28} {t * 1e6:7.2f} us  {floor / t:6.1%} of floor  "
                          f"{cublas / t:5.2f}x cuBLAS")
            if input_op is not None:  # the layer as the model runs it, with the op that feeds it
                copies = gemv.cold_copies(weight)
                for rows in gemv.ROW_BUCKETS:
                    with torch.inference_mode():
                        paths = gemv.path_times(gemv.LayerWeights(weight), input_op, rows, copies)
                    chosen = gemv.fastest_path(paths)
                    best = min((key for key in paths if key[0] is not None), key=paths.__getitem__)
                    print(f"  rows {rows}  with {input_op}: its kernel + cuBLAS {paths[None, False] * 1e6:.2f} us; "
                          f"best GEMV path {_path(best)} {paths[best] * 1e6:.2f} us; chosen: {_path(chosen)}")
                del copies
            del weight


if __name__ == "__main__":
    main()
