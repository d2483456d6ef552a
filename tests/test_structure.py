"""The shape of the code: which package imports what.

- ``worker.lifecycle`` (Redis) and ``worker.engine`` (MLX) never import each other;
- ``worker.schedule`` imports neither Redis nor MLX (nor the engines or the lifecycle);
- ``worker.gguf`` (file conversion) imports no Redis and no other worker package;
- only ``worker.runner`` (and the CLI) import across packages;
- no runtime module imports the dev fixtures (``worker.dev``);
- ``worker`` uses no RQ code at all (it keeps RQ's data model, read and written by
  its own lifecycle scripts), so RQ upgrades cannot change its behaviour;
- imports inside ``worker`` run one way (no cycles), and no module keeps mutable
  state at module level behind a ``global``;
- no class in ``worker.runner`` or ``worker.schedule`` (where the scheduling lives)
  grows past 300 lines.
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


def test_no_scheduling_class_grows_past_300_lines():
    """The batch loop was one class of 584 lines and 36 methods (issue 69): kept small."""
    long = {
        f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1
        for package in ("runner", "schedule")
        for path in sorted((ROOT / "worker" / package).glob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300
    }
    assert long == {}


def test_scheduling_module_docstrings_stay_short():
    """At most 20 lines each (issue 69): the rules and their reasons are docs/scheduling.md's."""
    long = {
        path.name: len(doc.splitlines())
        for package in ("runner", "schedule")
        for path in sorted((ROOT / "worker" / package).glob("*.py"))
        if (doc := ast.get_docstring(ast.parse(path.read_text()), clean=False))
        and len(doc.splitlines()) > 20
    }
    assert long == {}


@pytest.mark.parametrize(
    "module", ["worker.lifecycle.held", "worker.lifecycle.upkeep", "worker.schedule.policy"]
)
def test_the_lifecycle_and_the_scheduler_import_no_mlx_at_run_time(module):
    code = f"import sys, {module}; print(sorted(m for m in ('mlx', 'redis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    expected = "['redis']" if "lifecycle" in module else "[]"
    assert out.stdout.strip() == expected, out.stderr


#: The folders whose modules the README's Layout lists one by one.
LAID_OUT = (
    "schemas",
    "producer",
    "producer/serve",
    "worker",
    *(f"worker/{p}" for p in PACKAGES),
    "bench",
    "tests",
)


def readme_layout() -> dict[str, set[str]]:
    """The README's Layout block: folder -> the ``*.py`` names listed under it (a line that
    starts with ``folder/`` opens a folder; indented lines go on with it)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed: dict[str, set[str]] = {}
    folder = ""
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder = line.split()[0].rstrip("/")
            listed.setdefault(folder, set())
        listed.setdefault(folder, set()).update(
            w.strip("(),") for w in line.split() if w.strip("(),").endswith(".py") and "*" not in w
        )
    return listed


def test_the_readme_layout_lists_every_module():
    listed = readme_layout()
    for folder in LAID_OUT:
        names = {p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        if folder == "tests":
            names = {n for n in names if not n.startswith("test_")}
        assert listed.get(folder, set()) == names, (
            f"README Layout, {folder}/: missing {sorted(names - listed.get(folder, set()))}, "
            f"not in the tree {sorted(listed.get(folder, set()) - names)}"
        )


def test_the_readme_is_short_and_its_links_resolve():
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_the_quick_tier_names_tests_that_exist():
    """A renamed test would drop out of ``-m quick`` silently: every name it lists exists."""
    from tests.conftest import QUICK_FILES, QUICK_TESTS

    for name in QUICK_FILES:
        assert (ROOT / "tests" / name).is_file(), name
    for node in QUICK_TESTS:
        path, func = node.split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert func in names, node
