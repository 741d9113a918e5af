"""The layer contract (.importlinter) holds: dependencies point one way and no
package has an import circle. Checked with import-linter on the source tree,
and shown to fail on a copy of the tree with one upward import or one circle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"


def lint(package_parent: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contract over the `ssd` found in package_parent."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))"
    )
    return subprocess.run([sys.executable, "-c", script, str(package_parent), str(CONFIG)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_the_source_tree_keeps_every_contract(tmp_path):
    result = lint(ROOT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("engine/batch.py", "from ssd.saguaro import target as _up", "each imports only the layers below it"),
    ("saguaro/plan.py", "from ssd.tools.ablation import replay as _up", "each imports only the layers below it"),
    ("serve/service.py", "from ssd.openai import schema as _up", "each imports only the layers below it"),
    ("serve/worker.py", "import fastapi as _http", "ssd.serve imports neither ssd.openai nor the HTTP stack"),
    ("tools/ablation/trace.py", "from ssd.tools.bench import runner as _up", "benchmarks above ablations"),
    ("models/qcache.py", "from ssd.models import loading as _circle", "no import circles"),
])
def test_the_contract_breaks_on_an_upward_import_or_a_circle(tmp_path, module, line, broken):
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "ssd", copy / "ssd", ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / "ssd" / module
    path.write_text(path.read_text() + f"\n{line}  # injected by the test\n")
    result = lint(copy, tmp_path)
    assert result.returncode != 0, result.stdout
    assert broken in result.stdout.split("Broken contracts")[-1], result.stdout


def import_cycles(package_dir: Path) -> list[list[str]]:
    """Circles among the modules of `package_dir`, package `__init__` files counted, over
    the imports that run at import time (module level, not under TYPE_CHECKING).

    import-linter's acyclic_siblings compares sibling packages; a module that imports
    its own package (`from ssd.models import qcache` inside ssd/models, whose
    __init__ imports that module back) is a circle it does not see.
    """
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: _imported(path, modules) - {name} for name, path in modules.items()}
    return _strongly_connected(graph)


def _imported(path: Path, modules: dict[str, Path]) -> set[str]:
    import ast

    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names if a.name in modules}
            elif isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module in modules:
                found |= {sub.module} | {f"{sub.module}.{a.name}" for a in sub.names} & modules.keys()
    return found


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted(component + [v]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_a_package_that_imports_it_back(tmp_path):
    assert import_cycles(ROOT / "ssd") == []
    copy = tmp_path / "src" / "ssd"
    shutil.copytree(ROOT / "ssd", copy, ignore=shutil.ignore_patterns("__pycache__"))
    loading = copy / "models" / "loading.py"  # offline never imports loading: only the package closes the circle
    loading.write_text(loading.read_text() + "\nfrom ssd.models import offline as _circle  # injected by the test\n")
    (circle,) = import_cycles(copy)  # the package, loading, and tokenizer (the package imports it, it imports loading)
    assert {"ssd.models", "ssd.models.loading"} <= set(circle) and "ssd.models.offline" not in circle


# The `openai` extra (pyproject.toml): the HTTP stack, which only ssd.openai imports.
HTTP_STACK = ("fastapi", "starlette", "uvicorn", "pydantic", "multipart", "python_multipart")


def test_the_serving_core_imports_without_the_openai_extra():
    """Every module of ssd.serve, ssd.openai.server (gRPC alone without http_port) and the
    launchers import with the HTTP stack unimportable; asked for http_port, the server names
    the extra before it binds a port."""
    code = ("import sys, pkgutil, importlib\n"
            + "".join(f"sys.modules[{name!r}] = None\n" for name in HTTP_STACK)
            + "import ssd.serve\n"
              "for module in pkgutil.iter_modules(ssd.serve.__path__, 'ssd.serve.'):\n"
              "    importlib.import_module(module.name)\n"
              "import ssd.openai.server, ssd.app.launcher, ssd.app.cli\n"
              "from ssd.serve.options import ServeOptions\n"
              "ssd.openai.server.OpenAIServer(ServeOptions(port=0), None)\n"
              "ssd.openai.server.OpenAIServer(ServeOptions(port=0, http_port=0), None)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "ConfigError: serve.http_port needs the `openai` extra" in done.stderr, done.stderr
    assert "pip install 'ssd[openai]'" in done.stderr
