"""Generated sections of the docs: the text between two HTML comment markers, rewritten from code
(the README's API and per-job metrics tables, docs/design.md's contract tables)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def replace_between(text: str, begin: str, end: str, body: str, *, append: bool = True) -> str:
    """`text` with what lies between `begin` and `end` replaced by `body` (markers kept). Where
    the markers are missing: the markered block appended, or, with append=False, a ValueError
    (a table that belongs in a given section)."""
    block = f"{begin}\n{body}\n{end}"
    if begin not in text or end not in text:
        if not append:
            raise ValueError(f"the text lacks {begin} ... {end}")
        return text.rstrip("\n") + "\n\n" + block + "\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + block + tail


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
