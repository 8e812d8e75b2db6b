"""The directions of import in docs/architecture.md, checked on the source."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ferry"


def ferry_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def files_of(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


@pytest.mark.parametrize("path", files_of("core"), ids=lambda p: p.name)
def test_core_is_pure_bookkeeping(path):
    allowed = ("ferry.core", "ferry.config", "ferry.sampling_params")
    for name in ferry_imports(path):
        if name.startswith("ferry"):
            assert name.startswith(allowed), f"{path.name} imports {name}"
        assert name.split(".")[0] not in ("torch", "triton", "fastapi", "uvicorn"), f"{path.name} imports {name}"


@pytest.mark.parametrize("path", files_of("metrics"), ids=lambda p: p.name)
def test_metrics_only_watch(path):
    # Fed by the engine and the server, it knows neither: it reads the core's and the engine's
    # plain data (SchedulerOutput, RequestOutput), in the standard library alone.
    allowed = ("ferry.metrics", "ferry.core", "ferry.outputs")
    for name in ferry_imports(path):
        if name.startswith("ferry"):
            assert name.startswith(allowed), f"{path.name} imports {name}"
        assert name.split(".")[0] not in ("torch", "triton", "fastapi", "uvicorn", "prometheus_client"), name


@pytest.mark.parametrize(
    "path", files_of("models") + files_of("layers") + files_of("attention"), ids=lambda p: p.name
)
def test_model_code_knows_nothing_of_scheduling_or_serving(path):
    for name in ferry_imports(path):
        assert not name.startswith(("ferry.core", "ferry.engine", "ferry.server")), f"{path.name} imports {name}"
