"""status.phase is written in one place (ReconcilePass.set_phase), through api.JobPhase, as a plain
string."""

from __future__ import annotations

import ast
from pathlib import Path

from dtjob.api import JobPhase
from dtjob.operator import metrics, reconcile_pass

OPERATOR = Path(reconcile_pass.__file__).resolve().parent


def _phase_writes(tree: ast.AST) -> list[int]:
    """Lines that assign x["phase"] or call x.update(phase=...)."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            key = target.slice if isinstance(target, ast.Subscript) else None
            if isinstance(key, ast.Constant) and key.value == "phase":
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            lines += [node.lineno for kw in node.keywords if kw.arg == "phase"]
    return lines


def test_the_phase_is_written_by_set_phase_only() -> None:
    writes = {
        f"{path.name}:{line}": path
        for path in sorted(OPERATOR.glob("*.py"))
        for line in _phase_writes(ast.parse(path.read_text()))
    }
    assert len(writes) == 1, f"status.phase written in {sorted(writes)}: use ReconcilePass.set_phase"
    (where,) = writes
    tree = ast.parse((OPERATOR / "reconcile_pass.py").read_text())
    set_phase = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "set_phase")
    assert where == f"reconcile_pass.py:{_phase_writes(set_phase)[0]}"


def test_every_phase_constant_is_a_job_phase() -> None:
    names = ("PENDING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "SUSPENDED")
    assert {getattr(reconcile_pass, name) for name in names} == set(JobPhase)
    assert all(isinstance(getattr(reconcile_pass, name), JobPhase) for name in names)
    assert set(metrics.PHASES) == {phase.value for phase in JobPhase}
