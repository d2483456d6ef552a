"""The shape of the code: who imports what.

- the lifecycle never imports MLX (``producer`` neither: ``test_producer_cli``);
- ``worker`` uses no RQ code at all (it keeps RQ's data model, read and written by
  its own lifecycle scripts), so RQ upgrades cannot change its behaviour;
- imports inside ``worker`` run one way (no cycles).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def package_modules(package: str) -> dict[str, Path]:
    return {f"{package}.{p.stem}": p for p in sorted((ROOT / package).glob("*.py"))}


def test_worker_uses_no_rq_code():
    users = {
        name: sorted(m for m in imports_of(path) if m == "rq" or m.startswith("rq."))
        for name, path in package_modules("worker").items()
    }
    assert {name: used for name, used in users.items() if used} == {}


def test_worker_imports_have_no_cycles():
    modules = package_modules("worker")
    graph = {
        name: {m for m in imports_of(path) if m in modules and m != name}
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
    assert graph["worker.lifecycle"] <= {"worker.scripts"}  # the lifecycle knows no MLX


def test_the_lifecycle_and_its_scripts_never_import_mlx():
    code = "import sys, worker.lifecycle; print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr
