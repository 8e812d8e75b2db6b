"""Finding and reading a Hugging Face safetensors checkpoint: one file or an indexed set of shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights, in a stable order.

    A sharded checkpoint lists its shards in the index's `weight_map` (tensor name -> file); an
    unsharded one is a single model.safetensors.
    """
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {path} (found: {', '.join(found) or 'nothing'}); "
        "ferry loads only Hugging Face safetensors checkpoints, or load_format='dummy' for random weights"
    )


def iterate_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read one at a time onto the CPU."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
