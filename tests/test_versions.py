"""A GPU image keeps its torch (ssd.versions): the install's second step lists every requirement
but torch and transformers, and a version outside the tested range is named at start-up."""

from __future__ import annotations

import tomllib

import pytest

from ssd import versions
from tests.conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_rest_is_every_dependency_but_torch_and_transformers():
    rest = versions.requirements_keeping_torch([])
    assert rest == [d for d in PROJECT["dependencies"] if not d.startswith(("torch==", "transformers=="))]
    assert len(rest) == len(PROJECT["dependencies"]) - 2


def test_an_extra_brings_its_own_and_those_it_names():
    """test names ssd[openai] and ssd[tools]: asking for test brings fastapi and matplotlib too."""
    extras = PROJECT["optional-dependencies"]
    rest = versions.requirements_keeping_torch(["test"])
    assert set(rest) >= set(extras["openai"]) | set(extras["tools"])
    assert not any(r.startswith("ssd") for r in rest) and len(rest) == len(set(rest))
    assert not set(extras["models"]) & set(rest)  # not asked for


def test_nested_extras_from_metadata_lines():
    requires = ['torch==2.13.0', 'ray==2.60.0', 'ssd[b,c]; extra == "a"', 'x==1; extra == "b"',
                'y==1; extra == "c"', 'z==1; extra == "d"', 'transformers==5.24.0; extra == "a"']
    assert versions.requirements_keeping_torch(["a"], requires) == ["ray==2.60.0", "x==1", "y==1"]
    assert versions.requirements_keeping_torch([], requires) == ["ray==2.60.0"]


@pytest.mark.parametrize("torch, transformers, named", [
    ("2.11.0+cu130", "5.17.0", []), ("2.13.0", "5.24.0", []), ("2.13.5", "5.20.1", []),
    ("2.10.2", "5.24.0", ["torch 2.10.2"]), ("2.14.1", "5.24.0", ["torch 2.14.1"]),
    ("2.12.0", "5.16.0", ["transformers 5.16.0"]), ("3.0.0", "6.0.0", ["torch 3.0.0", "transformers 6.0.0"]),
])
def test_a_version_outside_the_tested_range_is_named(torch, transformers, named):
    lines = versions.outside_tested({"torch": torch, "transformers": transformers})
    assert [line.split(" is outside")[0] for line in lines] == named


def test_the_installed_versions_are_tested_ones_and_the_gpu_install_is_documented():
    assert versions.outside_tested() == []
    assert "python -m ssd.versions" in (ROOT / "docs" / "gpus.md").read_text()
