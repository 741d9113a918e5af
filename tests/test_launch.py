"""The launch scripts and the `ssd` command: thin scripts over ssd/, one main per command.

Every launch/*.py stays a few lines (its logic lives in ssd/app or ssd/tools, where
tests import it); `ssd COMMAND` runs the very main its launch script runs; the
runtime never imports matplotlib (the `tools` extra), and the commands start
without it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
import tomllib

import pytest

from ssd import main as ssd_main
from tests.conftest import ROOT

LAUNCH = ROOT / "launch"
MAX_LINES = 60  # issue 56: about 60 lines a script; what is longer belongs in ssd/


def _script(name: str):
    """launch/NAME as `python launch/NAME` imports it (not as __main__: nothing runs)."""
    spec = importlib.util.spec_from_file_location(f"_launch_{name[:-3]}", LAUNCH / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_launch_script_is_a_few_lines():
    scripts = sorted(LAUNCH.glob("*.py"))
    assert len(scripts) > 20
    long = {p.name: n for p in scripts if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"launch scripts over {MAX_LINES} lines (move their logic into ssd/): {long}"


def test_each_ssd_command_runs_its_launch_script_s_main(monkeypatch):
    monkeypatch.syspath_prepend(str(LAUNCH))  # `import _bootstrap`, as `python launch/NAME.py` has it
    for name, command in ssd_main.COMMANDS.items():
        module = importlib.import_module(command.module)
        assert callable(module.build_parser) and _script(command.script).main is module.main, name


def test_ssd_help_lists_the_commands_and_each_command_has_its_own(capsys):
    argv = list(sys.argv)
    with pytest.raises(SystemExit) as done:
        ssd_main.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and all(f"  {name} " in out for name in ssd_main.COMMANDS)
    with pytest.raises(SystemExit) as done:
        ssd_main.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: ssd generate ") and "--max-new-tokens" in out
    assert sys.argv == argv  # put back after the command
    for wrong in ([], ["no-such-command"], ["--", "serve"]):
        with pytest.raises(SystemExit) as done:
            ssd_main.main(wrong)
        assert done.value.code == 2, wrong


RETURNED: list[object] = []


def main(argv: list[str]) -> object:  # a stand-in command: returns what the test put in RETURNED
    assert sys.argv == ["ssd fake", *argv]
    return RETURNED.pop()


@pytest.mark.parametrize("returned, status", [(0, 0), (3, 3), (None, 0), ({"policy": 1}, 0), (True, 0)])
def test_the_exit_status_is_the_command_s_int_else_0(monkeypatch, returned, status):
    """As the launch scripts exit: main's int, and 0 where main returns its results instead."""
    monkeypatch.setitem(ssd_main.COMMANDS, "fake", ssd_main.Command(__name__, "fake.py", "a stand-in"))
    RETURNED.append(returned)
    assert ssd_main.main(["fake", "--x", "1"]) == status


def test_the_package_declares_the_entry_point_and_matplotlib_as_a_tools_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"ssd": "ssd.main:main"}
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(d.startswith("matplotlib==") for d in extras["tools"]) and "ssd[tools]" in extras["test"]


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_runtime_never_imports_matplotlib():
    """ssd/ outside ssd/tools runs without the tools extra: no import of matplotlib, even in a function."""
    runtime = [p for p in (ROOT / "ssd").rglob("*.py") if "tools" not in p.relative_to(ROOT / "ssd").parts]
    assert len(runtime) > 50
    assert [str(p.relative_to(ROOT)) for p in runtime if "matplotlib" in _imports(p)] == []
    tools = [p for p in (ROOT / "ssd" / "tools").rglob("*.py") if "matplotlib" in _imports(p)]
    assert tools, "the tools' plots import matplotlib (the check above would see an import)"


def test_the_commands_start_without_matplotlib():
    """Without the tools extra, `python -m ssd --help` answers and every command's module imports
    (only a plot, when asked for, needs matplotlib)."""
    modules = [c.module for c in ssd_main.COMMANDS.values()]
    code = ("import importlib, sys; sys.modules['matplotlib'] = None\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "from ssd.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    sys.exit(e.code)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "run-batch" in done.stdout, done.stderr[-3000:]
