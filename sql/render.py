"""Renderings of report rows: terminal tables, Markdown, and JSON scalars for Prefect artifacts."""

from __future__ import annotations

import math
from pathlib import Path

from .db import DEFAULT_REPORTS, connect, run_report


def format_cell(value) -> str:
    """How every report shows a value: '-' for missing, 4 significant digits for floats."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(columns: list[str], rows: list[tuple]) -> str:
    """A plain-text table: right-aligned values, 4 significant digits for floats."""
    body = [[format_cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in body)) if body else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line, rule, *("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body)])


def format_markdown(columns: list[str], rows: list[tuple]) -> str:
    """A GitHub-flavoured Markdown table, cells formatted as in the terminal."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(v).replace("|", "\\|") for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render_reports(results: str | None = None, reports=DEFAULT_REPORTS, baseline: str | None = None) -> str:
    """Every report as a terminal table, titled with its name and row count."""
    con = connect(results, baseline)
    parts = []
    for name in reports:
        columns, rows = run_report(con, name)
        parts.append(f"== {Path(name).stem} ({len(rows)} rows)\n{format_table(columns, rows)}")
    return "\n\n".join(parts)




def artifact_cell(value):
    """Table artifacts take JSON scalars; floats rounded as shown in the terminal."""
    if isinstance(value, float):
        return None if math.isnan(value) else float(format_cell(value))
    return value if isinstance(value, (int, str, bool)) or value is None else str(value)
