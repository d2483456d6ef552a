"""The shape of the code: which package imports what.

- ``worker.lifecycle`` (Redis) and ``worker.engine`` (MLX) never import each other;
- ``worker.schedule`` imports neither Redis nor MLX (nor the engines or the lifecycle);
- ``worker.gguf`` (file conversion) imports no Redis and no other worker package;
- only ``worker.runner`` (and the CLI) import across packages;
- no runtime module imports the dev fixtures (``worker.dev``);
- ``worker`` uses no RQ code at all (it keeps RQ's data model, read and written by
  its own lifecycle scripts), so RQ upgrades cannot change its behaviour;
- imports inside ``worker`` run one way (no cycles), and no module keeps mutable
  state at module level behind a ``global``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lifecycle", "schedule", "engine", "runner", "dev", "gguf")


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (top level or inside functions), fully qualified."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def worker_modules() -> dict[str, Path]:
    """Every module of ``worker``, by dotted name (packages by their ``__init__``)."""
    out = {}
    for p in sorted((ROOT / "worker").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "worker" and parts[1] in PACKAGES else None


def worker_imports(path: Path) -> set[str]:
    return {m for m in imports_of(path) if m == "worker" or m.startswith("worker.")}


def test_worker_uses_no_rq_code():
    users = {
        name: sorted(m for m in imports_of(path) if m == "rq" or m.startswith("rq."))
        for name, path in worker_modules().items()
    }
    assert {name: used for name, used in users.items() if used} == {}


#: What each package may import of the others (the runner and the CLI: anything).
ALLOWED = {
    "lifecycle": set(),
    "schedule": set(),
    "engine": set(),
    "dev": set(),
    "gguf": set(),  # file conversion: no Redis, no worker code
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_their_room_allows(package):
    crossing = {}
    for name, path in worker_modules().items():
        if package_of(name) != package:
            continue
        others = {package_of(m) for m in worker_imports(path)} - {package, None}
        if others - ALLOWED[package]:
            crossing[name] = sorted(others)
    assert crossing == {}


def test_no_runtime_module_imports_the_dev_fixtures():
    users = [
        name
        for name, path in worker_modules().items()
        if package_of(name) != "dev" and any(package_of(m) == "dev" for m in worker_imports(path))
    ]
    assert users == []


@pytest.mark.parametrize(
    ("package", "banned"),
    [
        ("schedule", ("redis", "mlx", "mlx_lm")),
        ("lifecycle", ("mlx", "mlx_lm")),
        ("gguf", ("redis",)),
    ],
)
def test_packages_stay_off_the_libraries_their_room_bans(package, banned):
    used = {
        name: sorted(m for m in imports_of(path) if m.split(".")[0] in banned)
        for name, path in worker_modules().items()
        if package_of(name) == package
    }
    assert {n: u for n, u in used.items() if u} == {}


def test_worker_imports_have_no_cycles():
    modules = worker_modules()
    graph = {
        name: {m for m in worker_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append([*stack[stack.index(node) :], node])
            return
        for nxt in graph[node]:
            visit(nxt, [*stack, node])

    for name in graph:
        visit(name, [])
    assert cycles == []


def test_no_module_rebinds_module_level_state():
    users = [
        name
        for name, path in worker_modules().items()
        if any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(path.read_text())))
    ]
    assert users == []


@pytest.mark.parametrize(
    "module", ["worker.lifecycle.held", "worker.lifecycle.upkeep", "worker.schedule.policy"]
)
def test_the_lifecycle_and_the_scheduler_import_no_mlx_at_run_time(module):
    code = f"import sys, {module}; print(sorted(m for m in ('mlx', 'redis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    expected = "['redis']" if "lifecycle" in module else "[]"
    assert out.stdout.strip() == expected, out.stderr
