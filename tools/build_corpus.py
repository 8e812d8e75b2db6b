"""Build the training corpus of ferry's default model from the CPython standard library.

The corpus is every `.py` file of the running interpreter's standard library (the `stdlib`
directory of `sysconfig`, without `site-packages`), test suites included, that decodes as UTF-8
and parses with `ast`. The standard library is under the PSF License Agreement, which permits
using it, and works derived from it, for any purpose; so the models trained on it may ship.

Output: one JSON object per line, `{"path", "split", "text"}`, files in sorted path order, and
the library's LICENSE.txt beside it (the training script ships it with the models). The
split is decided by a hash of the relative path alone, so it does not depend on file contents and
a file keeps its split across Python patch releases:

    sha256(path) % 100  in [0, 3)  -> "test"  (held-out: reported perplexity and agreement)
                        in [3, 5)  -> "val"   (held-out: the loss curve during training)
                        otherwise  -> "train"

Usage: python tools/build_corpus.py --out .train/corpus.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import sys
import sysconfig
from pathlib import Path


def split_of(relpath: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") % 100
    if bucket < 3:
        return "test"
    return "val" if bucket < 5 else "train"


def read_source(path: Path) -> str | None:
    """The file's text, or None for files that are not valid Python 3 (the test suite keeps a few
    on purpose: bad encodings, syntax-error fixtures)."""
    try:
        text = path.read_bytes().decode("utf-8")
        ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    return text


def iter_documents(stdlib: Path):
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        relpath = path.relative_to(stdlib).as_posix()
        if relpath.startswith("site-packages/"):
            continue
        text = read_source(path)
        if text is not None:
            yield {"path": relpath, "split": split_of(relpath), "text": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".train/corpus.jsonl"))
    args = parser.parse_args()

    stdlib = Path(sysconfig.get_path("stdlib"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    counts: dict[str, list[int]] = {}
    with args.out.open("w", encoding="utf-8", newline="\n") as f:
        for doc in iter_documents(stdlib):
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            files_bytes = counts.setdefault(doc["split"], [0, 0])
            files_bytes[0] += 1
            files_bytes[1] += len(doc["text"].encode())
    shutil.copyfile(stdlib / "LICENSE.txt", args.out.parent / "LICENSE.txt")
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"Python {sys.version.split()[0]}, stdlib {stdlib}")
    for split, (files, size) in sorted(counts.items()):
        print(f"{split:5s} {files:5d} files {size:>11,d} bytes")
    print(f"wrote {args.out} sha256 {digest}")


if __name__ == "__main__":
    main()
