"""The bundled default model (and its draft model), trained by tools/train_default_model.py."""

from pathlib import Path

ASSETS = Path(__file__).parent


def default_model_path() -> Path:
    return _existing(ASSETS / "default-model")


def default_draft_model_path() -> Path:
    return _existing(ASSETS / "default-draft")


def _existing(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the bundled model is missing at {path}; pass --model DIR")
    return path
