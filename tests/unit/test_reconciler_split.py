"""The reconciler split by concern (#45): its rules in one file of a few hundred lines, each helper
module small, no module-level mutable state; the parsed-pod memo is a WorkerCache the operator
owns and passes in with each observation."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from dtjob.operator import reconciler
from dtjob.operator.observed import Worker, WorkerCache
from dtjob.operator.reconciler import plan
from dtjob.operator.settings import ReconcilerSettings
from tests.unit.reconciler_fixtures import gang, make_job, observed, running_status, two_nodes

OPERATOR = Path(reconciler.__file__).resolve().parent
# The pure reconciler: reconciler.py and the modules that work on its ReconcilePass.
PURE = frozenset(
    {
        "reconciler",
        "reconcile_pass",
        "observed",
        "conditions",
        "nodes",
        "failures",
        "restarts",
        "rescale",
        "lifecycle",
        "trainer_reports",
        "suspects",
    }
)
# The rules and plan() read in one file (424 lines at the split, room for a rule or two); each
# helper module holds one concern (the largest, rescale.py, 179 lines at the split).
RULES_LINES = 500
HELPER_LINES = 250
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray"}


def _imports_reconcile_pass(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.ImportFrom) and node.module == "dtjob.operator.reconcile_pass"
        for node in ast.walk(tree)
    )


def _mutable_module_state(path: Path) -> list[str]:
    """`name:line` of each module-level name bound to a mutable container (a dict, list or set
    display or comprehension, or a call of dict(), list(), set(), defaultdict() and the like)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            value, targets = node.value, node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            value, targets = node.value, [node.target]
        else:
            continue
        literal = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
        func = value.func if isinstance(value, ast.Call) else None
        called = getattr(func, "id", None) or getattr(func, "attr", None)
        if literal or called in MUTABLE_CALLS:
            found += [f"{ast.unparse(t)}:{node.lineno}" for t in targets]
    return found


def test_the_pure_reconciler_modules_are_known() -> None:
    """Every module that works on a ReconcilePass is checked below (a new helper joins PURE)."""
    users = {p.stem for p in OPERATOR.glob("*.py") if _imports_reconcile_pass(p)}
    assert users <= PURE, f"add {sorted(users - PURE)} to PURE"
    assert all((OPERATOR / f"{name}.py").exists() for name in PURE)


def test_the_rules_read_in_one_file_and_each_helper_is_small() -> None:
    sizes = {name: len((OPERATOR / f"{name}.py").read_text().splitlines()) for name in PURE}
    assert sizes["reconciler"] <= RULES_LINES, sizes
    too_big = {name: n for name, n in sizes.items() if name != "reconciler" and n > HELPER_LINES}
    assert not too_big, f"split these by concern: {too_big}"


def test_no_module_of_the_reconciler_holds_mutable_state() -> None:
    found = {name: _mutable_module_state(OPERATOR / f"{name}.py") for name in sorted(PURE)}
    assert not {k: v for k, v in found.items() if v}, f"module-level mutable state: {found}"


def test_mutable_module_state_is_found(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "A = {1, 2}\nB: dict[str, int] = {}\nC = frozenset({1})\nD = collections.defaultdict(list)\n"
        "E = (1, 2)\nF = [x for x in E]\ndef f():\n    g = {}\n"
    )
    assert _mutable_module_state(source) == ["A:1", "B:2", "D:4", "F:6"]


def test_a_worker_cache_parses_each_version_of_a_pod_once_and_is_bounded() -> None:
    pods = gang(3)
    for rank, pod in enumerate(pods):
        pod["metadata"].update(uid=f"u-{rank}", resourceVersion="7")
    cache, other = WorkerCache(limit=2), WorkerCache()
    first = cache.of(pods[0])
    assert cache.of(pods[0]) is first and other.of(pods[0]) is not first, "one cache, one memo"
    assert cache.of(pods[1]) is cache.of(pods[1])
    cache.of(pods[2])  # a third version: the cache of two starts over
    assert cache.of(pods[0]) is not first and cache.of(pods[0]) == first


def test_passes_given_the_operators_cache_parse_each_pod_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's Kube keeps one WorkerCache and gives it to every Observed: a second pass
    over the same pods parses none of them; an Observed without one parses each pod once."""
    parsed: list[str] = []
    parse = Worker.of

    def counted(pod: dict[str, Any]) -> Worker:
        parsed.append(pod["metadata"]["name"])
        return parse(pod)

    monkeypatch.setattr(Worker, "of", staticmethod(counted))
    pods = gang(4)
    for rank, pod in enumerate(pods):
        pod["metadata"].update(uid=f"u-{rank}", resourceVersion="7")
    job = {**make_job(replicas=4), "status": running_status(4)}
    cache = WorkerCache()
    first = plan(observed(job, pods, two_nodes(), now=100.0, worker_cache=cache), ReconcilerSettings())
    assert sorted(parsed) == [f"gpt-worker-{r}" for r in range(4)]
    again = plan(observed(job, pods, two_nodes(), now=100.0, worker_cache=cache), ReconcilerSettings())
    assert len(parsed) == 4, "the second pass parsed the same pods again"
    assert again == first
    parsed.clear()
    alone = plan(observed(job, pods, two_nodes(), now=100.0), ReconcilerSettings())
    assert len(parsed) == 4 and alone == first


def test_each_rule_names_the_functions_that_hold_its_details() -> None:
    """The docstring's numbered rules each end in [functions]: every one of them exists, in
    reconciler.py (a bare name) or in the helper module it is prefixed with."""
    doc = reconciler.__doc__ or ""
    rules = re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |^\S|\Z)", doc, flags=re.M | re.S)
    assert [int(n) for n, _ in rules] == list(range(1, len(rules) + 1)) and len(rules) >= 8
    for number, text in rules:
        named = re.findall(r"\[([^\]]+)\]\s*$", text.strip())
        assert named, f"rule {number} names no function"
        for name in (n.strip() for n in " ".join(named[0].split()).split(",")):
            module, _, function = name.rpartition(".")
            owner = importlib.import_module(f"dtjob.operator.{module}") if module else reconciler
            assert callable(getattr(owner, function, None)), f"rule {number}: no {name}"
