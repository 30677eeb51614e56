"""The shape of the code (serial, reads the sources only): the checkpoint knows components by
their shard descriptors (app/shards.py), not by their internals, and components are passed
with their types, not as `Any`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(60)

APP = REPO / "app"
# Names under which gridlm passes its components around (parameters and attributes).
COMPONENTS = {"dp", "optimizer", "scaler", "sampler", "model", "trainer", "state", "grid", "runtime", "watchdog",
              "timers", "pipeline", "report"}  # fmt: skip
ANY = {"Any", "Optional[Any]", "Any | None", "'Any'"}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-local imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_checkpoint_imports_nothing_from_the_parallel_or_optimizer_packages():
    for path in sorted((APP / "checkpoint").glob("*.py")):
        bad = sorted(m for m in _imports(path) if m.startswith(("app.parallel", "app.optim", "app.model", "app.train")))
        assert not bad, f"{path.relative_to(REPO)} imports {bad}: go through app.shards instead"


def _any_components(path: Path) -> list[str]:
    """'file:line name' for every parameter or annotated attribute named like a component and
    annotated `Any` (or Optional[Any])."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        pairs = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            pairs = [(a.arg, a.annotation) for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            pairs = [(name, node.annotation)]
        for name, annotation in pairs:
            if name in COMPONENTS and annotation is not None and ast.unparse(annotation) in ANY:
                found.append(f"{path.name}:{annotation.lineno} {name}: {ast.unparse(annotation)}")
    return found


def test_no_component_is_passed_as_any():
    found = [hit for path in sorted(APP.rglob("*.py")) for hit in _any_components(path)]
    assert not found, "components typed Any (use the class, or a Protocol where an import would cycle):\n" + "\n".join(
        found
    )


def test_the_structure_checks_can_fail(tmp_path):
    """The Any check sees what it is meant to see."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import Any, Optional\n"
        "def f(dp: Any, x: Any) -> None: ...\n"
        "class C:\n    watchdog: Optional[Any] = None\n"
    )
    assert len(_any_components(sample)) == 2  # dp and watchdog; x is not a component name


def test_a_group_that_runs_fewer_tests_than_its_floor_fails():
    """launch/test.sh gives every group a floor (--min-tests, tests/conftest.py): a group that lost
    tests to collection, selection or skips fails instead of passing on what is left."""
    import subprocess
    import sys

    one = "tests/test_structure.py::test_the_structure_checks_can_fail"

    def run(floor: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", one, f"--min-tests={floor}"]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)

    assert run(1).returncode == 0
    short = run(2)
    assert short.returncode == 1 and "fewer than this group's floor of 2" in short.stdout, short.stdout
