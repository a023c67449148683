"""docs/design.md: its generated tables are current, and the generator refuses an undocumented name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dtjob import contract, contract_tables

ROOT = Path(__file__).resolve().parents[2]


def test_design_tables_are_current() -> None:
    text = contract_tables.DESIGN.read_text()
    assert contract_tables.BEGIN in text and contract_tables.END in text
    assert contract_tables.with_contract_section(text) == text, (
        "docs/design.md's tables differ from the code: run `python -m dtjob.contract_tables`"
    )


def test_every_contract_name_is_in_the_tables() -> None:
    section = contract_tables.contract_section()
    for prefix in ("ENV_", "EXIT_", "METRIC_"):
        for name, value in contract_tables._constants(prefix).items():
            cell = f"| {value} |" if isinstance(value, int) else f"`{value}`"
            assert cell in section, f"contract.{name} ({value}) is not in docs/design.md's tables"


def test_an_undocumented_constant_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract, "ENV_NEW_THING", "DTJOB_NEW_THING", raising=False)
    with pytest.raises(ValueError, match=r"ENV_NEW_THING missing from contract\.ENVIRONMENT"):
        contract_tables.contract_section()
    monkeypatch.setattr(contract, "EXIT_NEW_THING", 99, raising=False)
    with pytest.raises(ValueError, match=r"EXIT_NEW_THING missing from contract\.EXIT_CODES"):
        contract_tables.exit_codes()


def test_section_is_replaced_between_the_markers() -> None:
    text = f"# t\n\nbefore\n{contract_tables.BEGIN}\nold\n{contract_tables.END}\nafter\n"
    updated = contract_tables.with_contract_section(text)
    assert updated.startswith("# t\n\nbefore\n") and updated.endswith(f"{contract_tables.END}\nafter\n")
    assert "old" not in updated
    assert contract_tables.with_contract_section("# bare\n").endswith(f"{contract_tables.END}\n")


def _module_constants(path: Path) -> dict[str, object]:
    tree = ast.parse(path.read_text())
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }


def test_heartbeat_numbers_are_the_heartbeats() -> None:
    """The generator states the heartbeat's numbers from contract.Liveness without importing
    torch: the heartbeat must take them from there, with no numbers of its own."""
    path = ROOT / "trainer_image" / "dtjob" / "trainer" / "heartbeat.py"
    heartbeat = _module_constants(path)
    assert not {"BEATS_PER_TIMEOUT", "INTERVAL_SECONDS"} & set(heartbeat)
    assert "contract.Liveness(timeout)" in path.read_text()


def test_main_rewrites_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    design = tmp_path / "design.md"
    design.write_text(f"# d\n{contract_tables.BEGIN}\n{contract_tables.END}\n")
    monkeypatch.setattr(contract_tables, "DESIGN", design)
    assert contract_tables.main([]) == 0
    assert contract_tables.with_contract_section(design.read_text()) == design.read_text()
    assert "| 76 | `EXIT_PEER_LOST` |" in design.read_text()
    assert contract_tables.main(["--bogus"]) == 2
