"""The commands README.md and docs/*.md show use flags their scripts still have.

Every line of a ```bash block (and every inline `code` span) that runs
`python launch/NAME.py ...`, or the `ssd NAME ...` command that runs the same
script's main (ssd/main.py), is split as the shell would split it; each `-x` /
`--flag` in it must be an option of that script's argument parser, or of its
subcommand's (`launch/ablate.py plan --trace ...`). The parsers come from each
script's `build_parser()` (defined in the script, or in the module whose
`main` it runs), built in a child process: nothing runs, and whatever a
script sets up when imported stays out of this test process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ssd.main import COMMANDS as SSD_COMMANDS  # `ssd NAME` -> launch/<script>; imports nothing heavy

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
CONTROL = {"&&", "||", ";", "|", "&", "(", ")"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
FLAG = re.compile(r"^--?[A-Za-z][\w-]*")  # not "-" and not a negative number
SCRIPT = re.compile(r"^launch/(\w+)\.py$")
MENTION = re.compile(r"launch/|(^|[\s;&|(])ssd\s")  # a line or span that may run a script


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    script: str  # launch/NAME.py -> NAME
    args: tuple[str, ...]


def shell_words(line: str) -> list[str]:
    """The line's words as the shell splits them (quotes removed, # comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def launch_commands(line: str, where: str) -> list[Command]:
    """Each `python launch/NAME.py ...` or `ssd NAME ...` in one shell line (also after `&&`, `;`, `|`)."""
    segments: list[list[str]] = [[]]
    for word in shell_words(line):
        if word in CONTROL:
            segments.append([])
        else:
            segments[-1].append(word)
    commands = []
    for words in segments:
        while words and ASSIGNMENT.match(words[0]):  # VAR=value python launch/...
            words = words[1:]
        if len(words) >= 2 and re.fullmatch(r"python3?", words[0]) and (m := SCRIPT.match(words[1])):
            commands.append(Command(where, m.group(1), tuple(words[2:])))
        elif len(words) >= 2 and words[0] == "ssd" and words[1] in SSD_COMMANDS:
            commands.append(Command(where, SSD_COMMANDS[words[1]].script.removesuffix(".py"), tuple(words[2:])))
    return commands


def documented_commands(text: str, name: str) -> list[Command]:
    """The launch commands of one markdown file: bash blocks line by line, then inline code spans."""
    commands = []
    for block in FENCE.finditer(text):
        start = text.count("\n", 0, block.start(2)) + 1
        if block.group(1) not in ("bash", "sh", "shell", "console"):
            continue
        joined, first = "", None
        for offset, line in enumerate(block.group(2).splitlines()):
            first = start + offset if first is None else first
            if line.rstrip().endswith("\\"):  # a continued line: one command
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            if MENTION.search(joined):
                try:
                    commands += launch_commands(joined, f"{name}:{first}")
                except ValueError:  # a quote open until a later line
                    joined += "\n"
                    continue
            joined, first = "", None
        assert not joined, f"{name}:{first}: a quote never closed"
    prose = FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)  # same line numbers
    for span in re.finditer(r"`([^`]+)`", prose):
        if MENTION.search(span.group(1)):
            line = prose.count("\n", 0, span.start()) + 1
            commands += launch_commands(" ".join(span.group(1).split()), f"{name}:{line}")
    return commands


def unknown_flags(commands: list[Command], parsers: dict[str, dict]) -> list[str]:
    """'file:line: launch/NAME.py [COMMAND] --flag: ...' for every flag the script's parser lacks."""
    problems = []
    for c in commands:
        parser = parsers[c.script]
        if "error" in parser:
            problems.append(f"{c.where}: launch/{c.script}.py: {parser['error']}")
            continue
        flags, subcommand = parser["flags"], None
        for word in c.args:
            if subcommand is None and word in parser["subcommands"]:
                subcommand, flags = word, parser["subcommands"][word]
            elif (m := FLAG.match(word)) and m.group(0) not in flags:
                shown = f"launch/{c.script}.py" + (f" {subcommand}" if subcommand else "")
                problems.append(f"{c.where}: {shown} has no option {m.group(0)}")
    return problems


def parser_flags(scripts: set[str]) -> dict[str, dict]:
    """{script: {"flags": [...], "subcommands": {name: [...]}} or {"error": why}}, from a child process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, *sorted(scripts)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def _dump(scripts: list[str]) -> None:
    """In the child: import each launch script (not as __main__), build its parser, print the options."""
    import argparse

    out: dict[str, dict] = {}
    sys.path[:0] = [str(ROOT / "launch"), str(ROOT)]  # as `python launch/NAME.py` would have it
    for script in scripts:
        path = ROOT / "launch" / f"{script}.py"
        if not path.exists():
            out[script] = {"error": "no such script"}
            continue
        spec = importlib.util.spec_from_file_location(f"_documented_{script}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        build = getattr(module, "build_parser", None)
        if build is None and hasattr(module, "main"):
            build = getattr(sys.modules[module.main.__module__], "build_parser", None)
        if build is None:
            out[script] = {"error": "no build_parser() in the script or in the module of its main()"}
            continue
        parser = build()
        subcommands = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                subcommands.update({name: sorted(p._option_string_actions) for name, p in action.choices.items()})
        out[script] = {"flags": sorted(parser._option_string_actions), "subcommands": subcommands}
    print(json.dumps(out))


# --- the tests ---------------------------------------------------------------

MADE_UP = """
```bash
python launch/generate.py --mode sd --no-such-flag 3   # a flag no parser has
ATEN_CPU_CAPABILITY=avx2 python launch/ablate.py plan --trace t.safetensors \\
    --no-such-flag
```
And inline: `python launch/client.py "abc" --no-such-flag`, `ssd run-batch -i x --no-such-flag`.
"""


@pytest.fixture(scope="module")
def documented() -> list[Command]:
    return [c for path in DOC_FILES for c in documented_commands(path.read_text(), path.relative_to(ROOT).as_posix())]


@pytest.fixture(scope="module")
def parsers(documented: list[Command]) -> dict[str, dict]:
    made_up = documented_commands(MADE_UP, "made-up.md")
    return parser_flags({c.script for c in documented + made_up})


def test_the_docs_show_the_main_commands(documented: list[Command]) -> None:
    in_readme = {c.script for c in documented if c.where.startswith("README.md:")}
    assert {"cluster", "serve", "client", "generate", "bench", "ablate"} <= in_readme
    assert any(c.script == "ablate" and c.args[:1] == ("plan",) for c in documented)


def test_every_documented_flag_is_one_the_script_takes(documented: list[Command], parsers: dict[str, dict]) -> None:
    problems = unknown_flags(documented, parsers)
    assert not problems, "documented flags the scripts do not take:\n" + "\n".join(problems)


def test_a_made_up_flag_is_reported(parsers: dict[str, dict]) -> None:
    commands = documented_commands(MADE_UP, "made-up.md")
    assert [(c.script, c.args[:1]) for c in commands] == [("generate", ("--mode",)), ("ablate", ("plan",)),
                                                          ("client", ("abc",)), ("run_batch", ("-i",))]
    assert unknown_flags(commands, parsers) == [
        "made-up.md:3: launch/generate.py has no option --no-such-flag",
        "made-up.md:4: launch/ablate.py plan has no option --no-such-flag",
        "made-up.md:7: launch/client.py has no option --no-such-flag",
        "made-up.md:7: launch/run_batch.py has no option --no-such-flag",
    ]
    # --trace is plan's, not the top-level parser's: flags are checked against the subcommand's
    assert unknown_flags([Command("x", "ablate", ("--trace", "t"))], parsers) == [
        "x: launch/ablate.py has no option --trace"]


if __name__ == "__main__":
    _dump(sys.argv[1:])
