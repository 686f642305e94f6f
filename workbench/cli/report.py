"""What a command returns: a result that knows its JSON (`to_json()`, the one object `--json`
prints) and what a person reads (`str(result)`), so that `main` prints any command's result
the same way.

Entry points: `Result` (what every command returns), `Command` (a command's signature) and
`Report`, the result whose person-facing form is the JSON object laid out for reading: units,
nested objects indented, lists of objects as tables, long values shortened. Results with a
form of their own (an export's code, a table) subclass it or define their own class beside
their command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from workbench.units import format_value

__all__ = ["Command", "Report", "Result"]


class Result(Protocol):
    """A command's result: its JSON and, as `str`, what a person reads."""

    def to_json(self) -> dict[str, Any]: ...

    def __str__(self) -> str: ...


Command = Callable[[argparse.Namespace], Result]


@dataclass
class Report:
    """A command's JSON object, read by a person as aligned `key  value` lines with the units
    each key names (`workbench.units.unit_of`)."""

    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return self.data

    def __str__(self) -> str:
        return "\n".join(_human_lines(self.data))


_LONG_TEXT = 100  # characters: longer values print as their start and a note
_LIST_ROWS = 12  # rows of a list shown before "… N more"
_WHOLE_TEXT = frozenset({"verdict"})  # sentences a person needs whole (verify's before_policy)
_CELL_ENTRIES = 3  # entries of a map shown in one table cell, largest first


def _human_value(key: str, value: Any, parent: str = "") -> str:
    """One value with the unit its key names (`workbench.units.unit_of`)."""
    if isinstance(value, bool) or value is None:
        return "yes" if value is True else "no" if value is False else "-"
    if isinstance(value, int | float):
        formatted = format_value(key, value, parent)
        if formatted is not None:
            return formatted
        return f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"
    if value in ({}, [], ""):
        return "none"
    text = str(value)
    if len(text) > _LONG_TEXT and key not in _WHOLE_TEXT:
        return f"{text[:_LONG_TEXT]}… ({len(text):,} characters; --json prints all)"
    return text


def _human_lines(result: dict[str, Any], indent: str = "") -> list[str]:
    """Aligned `key  value` lines; nested objects indented, lists of objects as tables."""
    lines: list[str] = []
    width = max((len(k) for k in result), default=0)
    for key, value in result.items():
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            if all(not isinstance(v, dict | list) for v in value.values()):
                inner = {k: _human_value(k, v, key) for k, v in value.items()}
                lines += _human_lines(inner, indent + "  ")
            else:
                lines += _human_lines(value, indent + "  ")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f"{indent}{key}: {len(value)} rows")
            lines += _table(value[:_LIST_ROWS], indent + "  ")
            if len(value) > _LIST_ROWS:
                lines.append(f"{indent}  … {len(value) - _LIST_ROWS} more (--json prints all)")
        elif isinstance(value, list) and value:
            shown = ", ".join(_human_value(key, v) for v in value[:_LIST_ROWS])
            more = f", … {len(value) - _LIST_ROWS} more" if len(value) > _LIST_ROWS else ""
            lines.append(f"{indent}{key:<{width}}  {_human_value('', shown + more)}")
        else:
            lines.append(f"{indent}{key:<{width}}  {_human_value(key, value)}")
    return lines


def _cell(column: str, value: Any) -> str:
    """A table cell: a map of figures as its largest entries with their units (`Activation
    32.2 GiB, OptState 15.0 GiB, …`), other maps and lists by their length."""
    if isinstance(value, dict) and value:
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
            return f"{len(value)} entries"
        top = sorted(value.items(), key=lambda kv: -kv[1])[:_CELL_ENTRIES]
        more = ", …" if len(value) > _CELL_ENTRIES else ""
        return ", ".join(f"{k} {_human_value(k, v, column)}" for k, v in top) + more
    if isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        return f"{len(value)} items"
    return _human_value(column, value)


def _table(rows: list[dict[str, Any]], indent: str) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(c, row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = [indent + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    return line + [
        indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells
    ]
