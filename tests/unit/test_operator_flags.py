"""`dtjob operator`'s flags are derived from the settings dataclasses: one flag per field."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import pytest

from dtjob.operator import flags
from dtjob.operator.main import parse_args
from dtjob.operator.settings import ObserverSettings, OperatorSettings


def _fields(cls: type, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every settings field that is not a nested settings class, as its path."""
    hints = typing.get_type_hints(cls)
    found: set[tuple[str, ...]] = set()
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if dataclasses.is_dataclass(hints[f.name]) and f.name not in flags.FROM_ENVIRONMENT:
            found |= _fields(hints[f.name], (*path, f.name))  # type: ignore[arg-type]
        else:
            found.add((*path, f.name))
    return found


def test_every_settings_field_has_a_flag_and_every_flag_a_field() -> None:
    by_path = {flag.path: flag for flag in flags.flags()}
    assert set(by_path) == {p for p in _fields(OperatorSettings) if p[-1] not in flags.FROM_ENVIRONMENT}
    options = {
        option
        for action in flags.parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    switches = {name for name, _, _ in flags.OFF_SWITCH.values()}
    assert options == {flag.name for flag in by_path.values()} | switches
    assert by_path[("observer", "api_concurrency")].name == "--api-concurrency"
    assert by_path[("retry", "backoff_seconds")].name == "--retry-backoff-seconds"
    assert by_path[("interval_seconds",)].name == "--interval"


def test_a_flag_takes_its_fields_type_default_and_documentation() -> None:
    flag = {f.path: f for f in flags.flags()}[("observer", "scrape_workers")]
    assert (flag.kind, flag.default) == (int, ObserverSettings().scrape_workers)
    assert flag.help == "Threads scraping rank 0 of every job, each scrape bounded by metrics_timeout_seconds"
    assert vars(parse_args(["--scrape-workers", "3"]))["scrape_workers"] == 3


@dataclass(frozen=True)
class _Nested:
    knob_seconds: float = 2.5
    """A nested knob. More about it."""


@dataclass(frozen=True)
class _Extended(OperatorSettings):
    new_limit: int = 7
    """A setting added after the flags were written."""

    nested: _Nested = dataclasses.field(default_factory=_Nested)
    """A group of its own."""


def test_a_new_setting_gets_its_flag_without_declaring_one() -> None:
    parser = flags.parser(_Extended)
    assert flags.settings(parser.parse_args([]), {}, _Extended) == _Extended()
    args = parser.parse_args(["--new-limit", "9", "--knob-seconds", "0.5", "--standalone", "-n", "a"])
    built = flags.settings(args, {}, _Extended)
    assert built == _Extended(new_limit=9, nested=_Nested(knob_seconds=0.5), peering=None, namespaces=("a",))
    assert "A setting added after the flags were written (default 7)" in " ".join(
        parser.format_help().split()
    )
    assert "A nested knob (default 2.5)" in " ".join(parser.format_help().split())


def test_a_setting_of_a_type_no_flag_can_hold_is_refused_naming_it() -> None:
    @dataclass(frozen=True)
    class Odd:
        table: dict[str, int] = dataclasses.field(default_factory=dict)
        """A mapping."""

    with pytest.raises(TypeError, match=r"setting table: no flag for a field of type dict\[str, int\]"):
        flags.parser(Odd)


def test_none_turns_an_optional_setting_off() -> None:
    built = flags.settings(parse_args(["--liveness", "none", "--peering", "none"]), {})
    assert (built.liveness, built.peering) == (None, None)
