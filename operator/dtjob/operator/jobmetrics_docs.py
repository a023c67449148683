"""The README's table of the operator's per-job metrics, generated from contract.JOB_METRICS.

`python -m dtjob.operator.jobmetrics_docs` rewrites the table between the markers in README.md; a
unit test fails when the README differs from what this module generates.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dtjob import contract, generated

BEGIN = "<!-- job-metrics:begin -->"
END = "<!-- job-metrics:end -->"
README = Path(__file__).resolve().parents[3] / "README.md"


def table() -> str:
    rows = [
        f"| `{m.name}` | {m.kind} | {', '.join(f'`{label}`' for label in m.labels)} | {m.meaning} |"
        for m in contract.JOB_METRICS
    ]
    return "\n".join(["| Metric | Type | Labels | Meaning |", "|---|---|---|---|", *rows])


def with_table(readme: str) -> str:
    """`readme` with the text between the markers replaced (an error when they are missing: the
    table belongs in its section, not at the end)."""
    return generated.replace_between(readme, BEGIN, END, table(), append=False)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else README
    path.write_text(with_table(path.read_text()))
    print(f"updated the per-job metrics table of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
