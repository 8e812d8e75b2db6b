"""PNG plots of serving benchmark results, drawn from the result dicts that `--save-result` writes
(so a saved run can be plotted again). matplotlib is optional: it is imported only here, and only
when plots are asked for.

    latency_histograms.png  TTFT, TPOT, ITL and E2EL histograms, with mean, median and p99 marked
    latency_cdfs.png        the same four as cumulative distributions
    sweep_throughput.png    request and output token throughput against the request rate
    sweep_latency.png       mean and p99 of each latency against the request rate
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

PANELS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("latencies", "E2EL"))


def require_matplotlib() -> None:
    """Fail before a run, not after it, when plots are asked for and cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--plot-dir needs matplotlib (pip install matplotlib)")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def latency_samples(run: dict) -> dict[str, np.ndarray]:
    """Each latency's samples in milliseconds, over the successful requests of one run."""
    samples = {}
    for key, name in PANELS:
        values = run[key]
        if key == "itls":  # one list of gaps per request
            values = [gap for gaps, error in zip(values, run["errors"]) if error is None for gap in gaps]
        else:
            values = [v for v, error in zip(values, run["errors"]) if error is None and v is not None]
        samples[name] = np.asarray(values, dtype=float) * 1000
    return samples


def plot_latency_distributions(run: dict, out_dir: Path, prefix: str = "") -> list[Path]:
    plt = _pyplot()
    samples = latency_samples(run)
    paths = []
    for kind in ("histograms", "cdfs"):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        for ax, (name, ms) in zip(axes.flat, samples.items()):
            (_histogram if kind == "histograms" else _cdf)(ax, ms, name)
        fig.suptitle(_title(run))
        fig.tight_layout()
        paths.append(_save(fig, plt, out_dir / f"{prefix}latency_{kind}.png"))
    return paths


def _histogram(ax, ms: np.ndarray, name: str) -> None:
    ax.set_title(name)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")
    if ms.size == 0:
        ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
        return
    ax.hist(ms, bins=min(50, max(10, ms.size // 5)), color="tab:blue", alpha=0.7)
    for value, label, style in ((ms.mean(), "mean", "-"), (np.median(ms), "median", "--"),
                                (np.percentile(ms, 99), "p99", ":")):
        ax.axvline(value, color="black", linestyle=style, label=f"{label} {value:.1f}")
    ax.legend(fontsize="small")


def _cdf(ax, ms: np.ndarray, name: str) -> None:
    ax.set_title(f"{name} CDF")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    if ms.size:
        ax.step(np.sort(ms), np.arange(1, ms.size + 1) / ms.size, where="post")
    ax.grid(alpha=0.3)


def plot_sweep(runs: list[dict], out_dir: Path) -> list[Path]:
    """Throughput and latency against the request rate; inf is drawn as the last point."""
    plt = _pyplot()
    x, labels = np.arange(len(runs)), [rate_label(r["request_rate"]) for r in runs]
    fig, (requests, tokens) = plt.subplots(1, 2, figsize=(11, 4.5))
    requests.plot(x, [r["request_throughput"] for r in runs], "o-", label="successful requests")
    if all(r.get("request_goodput") is not None for r in runs):
        requests.plot(x, [r["request_goodput"] for r in runs], "s--", label="goodput")
    requests.set_title("requests/s")
    tokens.plot(x, [r["output_throughput"] for r in runs], "o-", label="output tokens")
    tokens.plot(x, [r["total_token_throughput"] for r in runs], "s--", label="input + output tokens")
    tokens.set_title("tokens/s")
    for ax in (requests, tokens):
        _rate_axis(ax, x, labels)
        ax.legend(fontsize="small")
    fig.suptitle("Throughput against request rate")
    fig.tight_layout()
    paths = [_save(fig, plt, out_dir / "sweep_throughput.png")]

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name) in zip(axes.flat, (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))):
        for stat, style in (("mean", "o-"), ("p99", "s--")):
            ax.plot(x, [_nan(r.get(f"{stat}_{key}_ms")) for r in runs], style, label=stat)
        ax.set_title(f"{name} (ms)")
        _rate_axis(ax, x, labels)
        ax.legend(fontsize="small")
    fig.suptitle("Latency against request rate")
    fig.tight_layout()
    paths.append(_save(fig, plt, out_dir / "sweep_latency.png"))
    return paths


def _rate_axis(ax, x, labels) -> None:
    ax.set_xticks(x, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)


def rate_label(rate: float | str) -> str:
    rate = float(rate)  # the JSON holds an infinite rate as "inf"
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def _title(run: dict) -> str:
    return f"{run['model']} {run['endpoint']} - rate {rate_label(run['request_rate'])}, {run['completed']} requests"


def _save(fig, plt, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
