"""`dtjob operator`'s flags, derived from the settings dataclasses (dtjob.operator.settings).

Each field of `OperatorSettings` and of its nested settings is one flag: `--api-concurrency` for
`observer.api_concurrency`, its type and default the field's, its help the first sentence of the
field's docstring. Adding a setting adds its flag; nothing else declares one. The few flags
spelled otherwise than their field (as the chart and existing scripts write them) are named in
the tables below, and `ReconcilerSettings.workers` comes from the chart's environment instead
(dtjob.operator.worker_defaults).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from dtjob.operator.settings import OperatorSettings
from dtjob.operator.worker_defaults import from_env

# Field -> flag where the flag is not `--` + the field's name (the names users already type).
RENAMED = {"namespaces": "--namespace", "interval_seconds": "--interval"}
SHORT = {"namespaces": "-n", "verbose": "-v"}
# A nested group's flags start with this, where its field names alone would not say what they set.
GROUP_PREFIX = {"retry": "retry-"}
# Fields that are no flag, and where they come from.
FROM_ENVIRONMENT = {"workers": from_env}
# A flag that sets its field to its "off" value, exclusive with the field's own flag.
OFF_SWITCH = {
    "namespaces": ("--all-namespaces", "-A", "serve every namespace (the default without --namespace)"),
    "peering": ("--standalone", None, "no peering: this replica is always active"),
}
NONE_WORD = "none"  # a `str | None` setting given this word is None (off)


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the settings field it sets."""

    path: tuple[str, ...]  # ("observer", "api_concurrency")
    name: str  # "--api-concurrency"
    kind: Any  # the field's type: int, float, bool, str | None, tuple[str, ...]
    default: Any
    help: str

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def _docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of `cls`'s source (as the settings document their fields)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    return {
        stmt.target.id: after.value.value
        for stmt, after in itertools.pairwise(body)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }


def _first_sentence(text: str) -> str:
    sentence = " ".join(text.split()).split(". ")[0]
    return sentence.rstrip(".")


def _docs(cls: type) -> dict[str, str]:
    """Each field's docstring, those of base classes included."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_docstrings(base))
    return docs


def _walk(cls: type, path: tuple[str, ...] = ()) -> Iterator[Flag]:
    hints = typing.get_type_hints(cls)
    docs = _docs(cls)
    prefix = GROUP_PREFIX.get(path[-1], "") if path else ""
    defaults = cls()
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if f.name in FROM_ENVIRONMENT:
            continue
        if dataclasses.is_dataclass(kind):
            yield from _walk(kind, (*path, f.name))  # type: ignore[arg-type]
            continue
        default = getattr(defaults, f.name)
        name = RENAMED.get(f.name) or "--" + prefix + f.name.replace("_", "-")
        yield Flag((*path, f.name), name, kind, default, _first_sentence(docs[f.name]))


@cache
def flags(root: type = OperatorSettings) -> tuple[Flag, ...]:
    """Every flag of the settings `root`, in the order of its fields."""
    return tuple(_walk(root))


def _add(parser: argparse.ArgumentParser | argparse._ActionsContainer, flag: Flag) -> None:
    names = [flag.name, *([SHORT[flag.path[-1]]] if flag.path[-1] in SHORT else [])]
    if flag.kind is bool:
        parser.add_argument(*names, dest=flag.dest, action="store_true", help=flag.help)
    elif flag.kind in (int, float):
        metavar = "SECONDS" if flag.name.endswith("-seconds") or flag.name == "--interval" else "N"
        metavar = "PORT" if flag.name.endswith("-port") else metavar
        parser.add_argument(
            *names,
            dest=flag.dest,
            type=flag.kind,
            default=flag.default,
            metavar=metavar,
            help=f"{flag.help} (default %(default)s)",
        )
    elif flag.kind == str | None:
        parser.add_argument(
            *names,
            dest=flag.dest,
            default=flag.default,
            metavar=flag.dest.upper(),
            help=f"{flag.help} (default %(default)s; '{NONE_WORD}': off)",
        )
    elif flag.kind == tuple[str, ...]:
        parser.add_argument(
            *names,
            dest=flag.dest,
            action="append",
            default=[],
            metavar=flag.dest.upper(),
            help=f"{flag.help} (repeatable)",
        )
    else:
        raise TypeError(f"setting {'.'.join(flag.path)}: no flag for a field of type {flag.kind}")


def parser(root: type = OperatorSettings, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of every flag of `root`, each nested settings class in its own group."""
    result = argparse.ArgumentParser(**kwargs)
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for flag in flags(root):
        container: Any = result
        if len(flag.path) > 1:
            group = flag.path[:-1]
            if group not in groups:
                groups[group] = result.add_argument_group(f"{'.'.join(group)} settings")
            container = groups[group]
        if flag.path[-1] in OFF_SWITCH:
            container = container.add_mutually_exclusive_group()
            off, short, text = OFF_SWITCH[flag.path[-1]]
            container.add_argument(*[n for n in (off, short) if n], action="store_true", help=text)
        _add(container, flag)
    return result


def _value(flag: Flag, args: argparse.Namespace) -> Any:
    value = getattr(args, flag.dest)
    off = OFF_SWITCH.get(flag.path[-1])
    if off is not None and getattr(args, off[0][2:].replace("-", "_")):
        return flag.kind() if flag.kind == tuple[str, ...] else None
    if flag.kind == tuple[str, ...]:
        return tuple(value)
    if flag.kind == str | None and value == NONE_WORD:
        return None
    return value


def settings(args: argparse.Namespace, env: Mapping[str, str], root: type = OperatorSettings) -> Any:
    """The settings `root` from parsed flags and the environment (for FROM_ENVIRONMENT's fields)."""

    def build(cls: type, path: tuple[str, ...]) -> Any:
        values: dict[str, Any] = {}
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in FROM_ENVIRONMENT:
                values[f.name] = FROM_ENVIRONMENT[f.name](env)
            elif dataclasses.is_dataclass(hints[f.name]):
                values[f.name] = build(hints[f.name], (*path, f.name))
            else:
                values[f.name] = _value(by_path[(*path, f.name)], args)
        return cls(**values)

    by_path = {flag.path: flag for flag in flags(root)}
    return build(root, ())
