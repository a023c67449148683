"""One liveness model: every timeout of the operator is a row of docs/design.md's "who detects
what" table (saying why it is not a multiple of T) or is named as timing no failure."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from dtjob import contract, liveness_table
from dtjob.operator import settings

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "dtjob" / "operator"
SETTINGS = (
    settings.ReconcilerSettings,
    settings.ObserverSettings,
    settings.RetrySettings,
    settings.OperatorSettings,
)


def operator_timeouts() -> set[str]:
    """Every `*_SECONDS` module constant of the operator as "module.NAME", and every `*_seconds`
    field of its settings as "Class.field"."""
    found = {
        f"{cls.__name__}.{f.name}"
        for cls in SETTINGS
        for f in dataclasses.fields(cls)
        if f.name.endswith("_seconds")
    }
    for path in OPERATOR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Name) and target.id.endswith("_SECONDS"):
                    found.add(f"{path.stem}.{target.id}")
    return found


def test_every_operator_timeout_is_in_the_model() -> None:
    in_rows = {name for d in liveness_table.detectors() for name in d.timeouts}
    named = in_rows | set(liveness_table.NOT_LIVENESS)
    found = operator_timeouts()
    missing = sorted(found - named)
    assert not missing, f"timeouts in neither the liveness table's rows nor NOT_LIVENESS: {missing}"
    assert not named - found, f"named but not found (renamed?): {sorted(named - found)}"
    assert not in_rows & set(liveness_table.NOT_LIVENESS)
    assert len(found) >= 20, sorted(found)  # the scan sees the settings and the module constants


def test_each_row_says_whether_it_is_a_multiple_of_t_and_else_why_not() -> None:
    rows = liveness_table.detectors()
    for d in rows:
        assert d.from_t == "yes" or (d.from_t.startswith("no: ") and len(d.from_t) > 10), d
        assert d.from_t == "yes" or d.timeouts or "T" not in d.within, f"{d.who}: a multiple of T? {d.from_t}"
    multiples = [d for d in rows if d.from_t == "yes"]
    assert {d.who.split(" (")[0] for d in multiples} == {"trainer heartbeat", "coordinator", "pod agent"}
    for d in multiples:
        assert " T" in d.within and not d.timeouts, d  # stated from contract.Liveness, not the operator's


def test_the_table_follows_contract_liveness() -> None:
    """The in-pod rows are contract.Liveness's numbers at the job's default T."""
    lv = contract.Liveness(liveness_table.default_timeout())
    text = "\n".join(liveness_table.table())
    assert f"({lv.heartbeat_verdict_seconds:g} s)" in text
    assert f"({lv.agent_timeout_seconds:g} s;" in text and f"({lv.answer_timeout_seconds:g} s)" in text
    assert liveness_table.default_timeout() == contract.DEFAULT_HEARTBEAT_TIMEOUT
