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
