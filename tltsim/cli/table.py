"""The one text-table formatter of the command lines and benchmarks.

    print(format_table(rows, {"policy": "policy", "tokens_per_s": "tokens/s", "speedup": "speedup"},
                       {"tokens_per_s": ".1f", "speedup": "{:.2f}x"}, left=("policy",)))

    policy  tokens/s  speedup
    -------------------------
    nospec     812.4    1.00x
    tlt       1490.2    1.84x

Rows are dictionaries; a column is a key (its title is the key, or the value of a ``{key:
title}`` mapping). Cells are right-aligned (``left`` names the columns to left-align, e.g.
names), columns are two spaces apart, and a rule of dashes follows the header. A missing key,
``None`` or NaN prints as ``-``. ``format_fields`` prints a file's key/value provenance.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

# A cell format: a format spec (".2f", ",.0f", ".0%"), a template with one "{}" field
# ("{:.2f}x"), or a function of the value returning the cell text.
CellFormat = str | Callable[[Any], str]
MISSING = "-"
SEPARATOR = "  "


def format_cell(value: Any, fmt: CellFormat | None = None, float_format: str = ".2f") -> str:
    """One cell's text: ``-`` for a missing value, else ``fmt`` applied (default: floats with
    ``float_format``, everything else with ``str``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if callable(fmt):
        return fmt(value)
    if fmt is None:
        return format(value, float_format) if isinstance(value, float) else str(value)
    return fmt.format(value) if "{" in fmt else format(value, fmt)


def format_table(
    rows: Iterable[Mapping[str, Any]],
    columns: Sequence[str] | Mapping[str, str],
    formats: Mapping[str, CellFormat] | None = None,
    *,
    left: Collection[str] = (),
    float_format: str = ".2f",
) -> str:
    """``rows`` as an aligned text table: header, rule, one line per row (module docstring)."""
    titles = dict(columns) if isinstance(columns, Mapping) else {key: key for key in columns}
    formats = formats or {}
    cells = [
        [format_cell(row.get(key), formats.get(key), float_format) for key in titles]
        for row in rows
    ]
    header = list(titles.values())
    widths = [
        max([len(title)] + [len(line[i]) for line in cells]) for i, title in enumerate(header)
    ]
    is_left = [key in left for key in titles]

    def line(texts: list[str]) -> str:
        return SEPARATOR.join(
            text.ljust(width) if is_l else text.rjust(width)
            for text, width, is_l in zip(texts, widths, is_left, strict=True)
        ).rstrip()

    rule = "-" * (sum(widths) + len(SEPARATOR) * (len(widths) - 1))
    return "\n".join([line(header), rule, *(line(texts) for texts in cells)])


def format_fields(fields: dict[str, Any], width: int = 100) -> str:
    """``fields`` one per line (``  key: value``, sorted), a nested dict as ``k=v`` pairs
    wrapped under its key: a file's provenance, which one ``; ``-joined line made unreadable."""
    lines = []
    for key, value in sorted(fields.items()):
        text = (
            ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
            if isinstance(value, dict)
            else str(value)
        )
        lines += textwrap.wrap(
            text,
            width,
            initial_indent=f"  {key}: ",
            subsequent_indent=" " * 4,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [f"  {key}:"]
    return "\n".join(lines)
