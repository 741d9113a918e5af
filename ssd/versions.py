"""The torch and transformers a run may keep: the range the project was tested on.

The package pins torch 2.13.0 and transformers 5.24.0 (the CPU build on this project's
machines; `pip install -e .` is the CPU install). A GPU image brings its own CUDA build of
torch, which pip would replace: docs/gpus.md installs the package without its
dependencies and then the rest, which

    python -m ssd.versions [EXTRA ...]

prints (every requirement of the installed package and of its EXTRAs but these two). At
start-up, a version outside the tested range is named in the log (`outside_tested`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import sys

log = logging.getLogger(__name__)

# Inclusive; the low ends ran on the lent H200 (torch 2.11 + CUDA 13.0, transformers 5.17:
# the smoke run and the CUDA tests passed, docs/gpus.md), the high ends are the pins.
TESTED = {"torch": ((2, 11), (2, 13)), "transformers": ((5, 17), (5, 24))}


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def outside_tested(installed: dict[str, str] | None = None) -> list[str]:
    """A line for each of torch and transformers whose installed version is outside TESTED."""
    if installed is None:
        installed = {name: importlib.metadata.version(name) for name in TESTED}
    lines = []
    for name, (low, high) in TESTED.items():
        if not low <= _minor(installed[name]) <= high:
            lines.append(f"{name} {installed[name]} is outside the tested {'.'.join(map(str, low))}"
                         f"-{'.'.join(map(str, high))}: results may differ (docs/gpus.md)")
    return lines


def warn_if_untested() -> None:
    for line in outside_tested():
        log.warning(line)


def requirements_keeping_torch(extras: list[str], requires: list[str] | None = None) -> list[str]:
    """The installed package's requirements and its `extras`' (an extra that names others,
    as test names ssd[openai], brings theirs), each once, but torch and transformers."""
    if requires is None:
        requires = importlib.metadata.requires("ssd") or []
    parsed = [_parse(line) for line in requires]
    wanted = set(extras)
    while more := {e for name, spec, extra in parsed if name == "ssd" and extra in wanted
                   for e in re.findall(r"\w+", spec.partition("[")[2])} - wanted:
        wanted |= more
    out: list[str] = []
    for name, spec, extra in parsed:
        if name not in ("ssd", *TESTED) and (extra is None or extra in wanted) and spec not in out:
            out.append(spec)
    return out


def _parse(line: str) -> tuple[str, str, str | None]:
    """(name, requirement, the extra it belongs to or None) of a metadata Requires-Dist line."""
    spec, _, marker = line.partition(";")
    extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
    return re.match(r"[A-Za-z0-9_.\-]+", spec).group(0).lower(), spec.strip(), extra and extra.group(1)


def main(argv: list[str] | None = None) -> int:
    print("\n".join(requirements_keeping_torch(list(sys.argv[1:] if argv is None else argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
