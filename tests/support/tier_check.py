"""Every test is run by some CI tier: the check collects the suite with `-m ""`, with each tier's marker expression
(tests/support/tiers.py) and with `-m gpu`, in real pytest collections, and names each test that no tier selects
(those marked `gpu` aside: they need CUDA), each test two tiers select (it would run twice), and any marker pytest
does not know (`--strict-markers`): a misspelt marker or marker expression would otherwise hide tests from every run.

`python -m tests.support.tier_check` checks this repository; .ci/run calls it before the tiers.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.tiers import EXEMPT, TIERS, Tier

ROOT = Path(__file__).resolve().parents[2]
COLLECT = ["--collect-only", "-q", "--strict-markers", "-p", "no:cacheprovider"]


class CollectionFailed(Exception):
    """pytest could not collect (an unknown marker, an import error); the message is its report."""


def collect(root: Path, expressions: list[str]) -> dict[str, set[str]]:
    """The node ids each `pytest -m EXPRESSION` selects under `root`. One pytest process collects them all, one
    collection after another (the test modules are imported once)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ids.json"
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        argv = [sys.executable, "-m", "tests.support.tier_check", "--collect", str(out), *expressions]
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CollectionFailed(proc.stdout + proc.stderr)
        return {marks: set(ids) for marks, ids in json.loads(out.read_text()).items()}


def problems(root: Path = ROOT, tiers: tuple[Tier, ...] = TIERS) -> list[str]:
    """What keeps `tiers` from running every test under `root` exactly once; empty when nothing does."""
    try:
        found = collect(root, ["", EXEMPT, *(tier.marks for tier in tiers)])
    except CollectionFailed as exc:
        return [f"pytest could not collect the tests:\n{exc}"]
    out = []
    for test in sorted(found[""]):
        by = [tier.name for tier in tiers if test in found[tier.marks]]
        if not by and test not in found[EXEMPT]:
            out.append(f"{test}: selected by no tier ({'; '.join(tier.command for tier in tiers)})")
        elif len(by) > 1:
            out.append(f"{test}: selected by {len(by)} tiers ({', '.join(by)}), so it would run {len(by)} times")
    return out


def _collect_here(out: Path, expressions: list[str]) -> None:
    """The child of `collect`: in this folder, each expression's node ids into `out` (JSON); exit 1 with pytest's
    report if a collection fails."""
    import pytest

    class Ids:
        def pytest_collection_finish(self, session):
            self.ids = [item.nodeid for item in session.items]

    found = {}
    for marks in expressions:
        ids, report = Ids(), io.StringIO()
        with contextlib.redirect_stdout(report):
            code = pytest.main([*COLLECT, "-m", marks], plugins=[ids])
        if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            sys.exit(f"pytest -m {marks!r} (exit {int(code)}):\n{report.getvalue()}")
        found[marks] = getattr(ids, "ids", [])
    out.write_text(json.dumps(found))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--collect"]:
        return _collect_here(Path(argv[1]), argv[2:])
    found = problems()
    for line in found:
        print(f"tier check: {line}")
    if found:
        sys.exit(1)
    print(f"tier check: every test is in exactly one tier ({', '.join(t.name for t in TIERS)}) or marked {EXEMPT}")


if __name__ == "__main__":
    main(sys.argv[1:])
