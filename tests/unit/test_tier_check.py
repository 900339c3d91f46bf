"""The tier check (tests/support/tier_check.py) on small generated test trees: it passes a tree whose every test is in
one tier, and fails for an unknown marker, a test that every tier deselects and a test two tiers select. CI and the
README run the tiers as tests/support/tiers.py declares them."""

import re
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.tier_check import problems
from tests.support.tiers import BY_NAME, TIERS

ROOT = Path(__file__).resolve().parents[2]

EVERY_KIND = """
import pytest

def test_plain():
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.timing
def test_timing():
    pass

@pytest.mark.slow
@pytest.mark.timing
def test_slow_timing():
    pass

@pytest.mark.gpu
def test_gpu():
    pass

@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_points(n):
    pass
"""


@pytest.fixture
def tree(tmp_path, pytestconfig):
    """A test folder in tmp_path with this project's markers registered and EVERY_KIND as its one module;
    tree(**files) adds more modules."""
    lines = "".join(f"    {marker}\n" for marker in pytestconfig.getini("markers"))
    (tmp_path / "pytest.ini").write_text(f"[pytest]\nmarkers =\n{lines}")
    (tmp_path / "test_kinds.py").write_text(EVERY_KIND)

    def make(**files: str) -> Path:
        for name, text in files.items():
            (tmp_path / f"{name}.py").write_text(text)
        return tmp_path

    return make


def test_a_tree_whose_every_test_is_in_one_tier_passes(tree):
    assert problems(tree()) == []


def test_an_unknown_marker_fails_the_check(tree):
    typo = "import pytest\n\n\n@pytest.mark.slwo\ndef test_misspelt():\n    pass\n"
    (found,) = problems(tree(test_typo=typo))
    assert "'slwo' not found in `markers` configuration option" in found and "test_typo.py" in found


def test_a_test_every_tier_deselects_is_named(tree):
    """The timing tier as CI once ran it ("timing and not slow") leaves a slow timing test to no tier; a CUDA test
    that no tier selects is allowed."""
    tiers = (
        replace(BY_NAME["default"], marks="not slow and not timing and not gpu"),
        BY_NAME["slow"],
        replace(BY_NAME["timing"], marks="timing and not slow"),
    )
    (found,) = problems(tree(), tiers)
    assert found.startswith("test_kinds.py::test_slow_timing: selected by no tier (") and "test_gpu" not in found
    assert '-m "timing and not slow"' in found


def test_a_misspelt_marker_expression_fails_the_check(tree):
    """pytest refuses an unknown marker in `-m` under --strict-markers (an older pytest lets the expression select
    nothing: then the tests it meant are named as in no tier)."""
    found = problems(tree(), (*TIERS[:2], replace(BY_NAME["timing"], marks="timng")))
    assert found and all("timng" in line for line in found), found


def test_a_test_two_tiers_select_is_named(tree):
    tiers = (*TIERS[:2], replace(BY_NAME["timing"], marks="timing or gpu"))
    (found,) = problems(tree(), tiers)
    assert found.startswith("test_kinds.py::test_gpu: selected by 2 tiers (default, timing)"), found


def test_ci_and_the_readme_run_the_declared_tiers():
    """.ci/run checks the tiers, then runs each by name in the declared order; the README prints each command."""
    ci = (ROOT / ".ci" / "run").read_text()
    steps = re.findall(r"^python -m tests\.support\.(tier_check|tiers (\w+))", ci, re.M)
    assert [name or check for check, name in steps] == ["tier_check", *(tier.name for tier in TIERS)], steps
    readme = (ROOT / "README.md").read_text()
    assert [tier.name for tier in TIERS if tier.command not in readme] == []
