"""The `dtjob` command: one entry point, one sub-command per part of the project.

Sub-commands import their part lazily, so the trainer image (no kopf) and the operator image
(no torch) can both run it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# sub-command -> (module, function, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("dtjob.trainer.__main__", "main", "run the trainer (same as python -m dtjob.trainer)"),
    "operator": ("dtjob.operator.main", "main", "run the operator"),
    "crd": ("dtjob.api.crd", "main", "print the DistributedTrainingJob CRD generated from the models"),
    "devcluster": ("dtjob.devcluster.cli", "main", "the local cluster: up, down, status, env, node"),
}


def _usage() -> str:
    lines = ["usage: dtjob COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, _, help_) in _COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if args[0] not in _COMMANDS:
        print(f"dtjob: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = _COMMANDS[args[0]]
    module = __import__(module_name, fromlist=[func_name])
    func: Callable[[list[str]], int | None] = getattr(module, func_name)
    return int(func(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
