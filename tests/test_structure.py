"""The shape of the code (serial, reads the sources only): the checkpoint knows components by
their shard descriptors (app/shards.py), not by their internals, and components are passed
with their types, not as `Any`."""

from __future__ import annotations

import ast
import re
import sys
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


# ---- floors and cycles ---------------------------------------------------------------------

# The floors of app/, lowest first (docs/ARCHITECTURE.md draws them): a module imports only from
# its own floor or a lower one, at any depth (function-level and TYPE_CHECKING imports included),
# and no modules import each other in a cycle. Entry points (`__main__`) stand above them all.
FLOORS = [
    ["app", "app.schema", "app.names", "app.errors", "app.untrusted", "app.shards", "app.archs"],
    ["app.deck_yaml", "app.deck", "app.deck_paths"],
    ["app.runtime", "app.sharding", "app.data", "app.job"],
    ["app.metrics"],
    ["app.tensor_parallel"],
    ["app.model"],
    ["app.parallel"],
    ["app.optim", "app.plan", "app.checkpoint"],
    ["app.eval"],
    ["app.train"],
    ["app.generate", "app.memorization"],
]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "app") -> dict[str, dict[str, int]]:
    """module -> {imported module of `package`: line}, for every module under root/package; `from
    a.b import c` names module a.b.c where c is one, else a.b."""
    modules = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def floor_of(module: str, floors: list[list[str]]) -> int:
    if module.rsplit(".", 1)[-1] == "__main__":
        return len(floors)
    found = [(len(prefix), i) for i, floor in enumerate(floors) for prefix in floor
             if module == prefix or module.startswith(prefix + ".")]  # fmt: skip
    assert found, f"{module} is on no floor: add it to FLOORS (and to docs/ARCHITECTURE.md)"
    return max(found)[1]


def upward_imports(graph: dict[str, dict[str, int]], floors: list[list[str]]) -> list[str]:
    return [f"{m}:{line} imports {t} (floor {floor_of(t, floors)} above {floor_of(m, floors)})"
            for m, edges in sorted(graph.items()) for t, line in sorted(edges.items())
            if floor_of(t, floors) > floor_of(m, floors)]  # fmt: skip


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_module_imports_from_a_higher_floor():
    bad = upward_imports(import_graph(REPO), FLOORS)
    assert not bad, "imports up a floor (move the shared part down, or pass a Protocol):\n" + "\n".join(bad)


def test_no_modules_import_each_other_in_a_cycle():
    cycles = import_cycles(import_graph(REPO))
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(map(str, cycles))


def test_the_floor_and_cycle_checks_see_a_planted_cycle_and_upward_import(tmp_path):
    """A package whose low module imports a high one (inside a function) and whose two middle
    modules import each other: both checks fail on it."""
    pkg = tmp_path / "toy"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "base.py").write_text("def f():\n    from toy.high import g\n    return g\n")
    (pkg / "mid_a.py").write_text("import toy.mid_b\n")
    (pkg / "mid_b.py").write_text("from toy import mid_a\n")
    (pkg / "high.py").write_text("from toy.low.base import f\ng = f\n")
    graph = import_graph(tmp_path, "toy")
    floors = [["toy", "toy.low"], ["toy.mid_a", "toy.mid_b"], ["toy.high"]]
    assert upward_imports(graph, floors) == ["toy.low.base:2 imports toy.high (floor 2 above 0)"]
    assert import_cycles(graph) == [["toy.high", "toy.low.base"], ["toy.mid_a", "toy.mid_b"]]


def drawn_floors(text: str) -> list[set[str]]:
    """The floors docs/ARCHITECTURE.md draws (its "Floors" picture: `N  app/a/, app/b.py  words`
    lines, continued on indented lines), as module names per floor, lowest first."""
    block = text.split("**Floors.**", 1)[1].split("```", 2)[1]
    floors: dict[int, set[str]] = {}
    number = None
    for line in block.splitlines():
        head = re.split(r"\s{3,}(?!app/)", line.strip(), maxsplit=1)[0]  # the module column, not the words
        if head.split() and head.split()[0].isdigit():
            number = int(head.split()[0])
            head = head.split(maxsplit=1)[1]
        if number is not None:
            for path in re.findall(r"app/[\w/]*?(?:\.py|/)", head):
                floors.setdefault(number, set()).add(path.removesuffix("/").removesuffix(".py").replace("/", "."))
    return [floors.get(n, set()) for n in range(max(floors) + 1)]


def test_architecture_md_draws_the_floors_the_imports_are_held_to():
    drawn = drawn_floors((REPO / "docs/ARCHITECTURE.md").read_text())
    assert drawn == [set(floor) - {"app"} for floor in FLOORS], "docs/ARCHITECTURE.md's Floors picture differs"
    moved = [set(floor) - {"app"} for floor in FLOORS[::-1]]  # a picture drawn upside down is caught
    assert drawn != moved


def test_a_test_that_fails_on_one_rank_ends_the_mpi_group_at_the_guard():
    """conftest.PeerGuard: rank 1 fails a test that rank 0 is still inside (blocked in a barrier).
    The ranks meet before the next test on a communicator of their own, rank 1 waits there in vain
    and aborts the job after --mpi-peer-timeout, long before the per-test timeout; rank 0's test is
    never reported passed (without the guard, rank 1's barrier in the next test freed it)."""
    from conftest import run_mpi

    out = run_mpi(
        2, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi", "-m", "mpi",
        "--timeout=300", "--timeout-method=thread", "--mpi-peer-timeout=5", "tests/planted_one_rank_failure.py",
        timeout=280,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "planted: only rank 1 fails" in text and "not every rank reached" in text, text
    assert "Timeout" not in text and "passed" not in text, text  # the guard ended it, not pytest-timeout
