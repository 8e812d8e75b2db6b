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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """ferry's modules and the ferry modules each imports, at any depth of its code (imports inside
    functions count too; those under `if TYPE_CHECKING:` do not)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ferry"):
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("ferry")]
            else:
                continue
            edges.update(t for t in map(resolve, targets) if t is not None and t != name)
        graph[name] = edges
    return graph


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # it does read the package
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            assert state.get(target) != 1, "import cycle: " + " -> ".join(path[path.index(target):] + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_core_imports_no_torch_at_all():
    """Not even through what it imports (config.py once brought torch in)."""
    import subprocess
    import sys

    code = ("import sys; import ferry.core.scheduler, ferry.core.kv_cache_manager, ferry.core.prefix_cache, "
            "ferry.config, ferry.sampling_params; print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"
