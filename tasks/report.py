"""DuckDB reports over the results Parquet: views from sql/views.sql, reports from sql/*.sql."""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
from prefect import task

from kvcompress.results import default_root

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
DEFAULT_REPORTS = ("summary",)


def connect(results: str | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the `runs` and `steps` views over `results`."""
    root = results or default_root()
    con = duckdb.connect()
    con.execute("SET VARIABLE kv_results = ?", [root.rstrip("/")])
    con.execute((SQL_DIR / "views.sql").read_text())
    return con


def sql_file(name_or_path: str) -> Path:
    """A report by name (sql/NAME.sql) or by path."""
    path = Path(name_or_path)
    return path if path.suffix == ".sql" and path.exists() else SQL_DIR / f"{name_or_path}.sql"


def run_report(con: duckdb.DuckDBPyConnection, name_or_path: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of a report's final statement."""
    relation = con.sql(sql_file(name_or_path).read_text())
    return relation.columns, relation.fetchall()


def format_table(columns: list[str], rows: list[tuple]) -> str:
    """A plain-text table: right-aligned numbers, 4 significant digits for floats."""
    def cell(v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in body)) if body else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line, rule, *("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in body)])


def render_reports(results: str | None = None, reports=DEFAULT_REPORTS) -> str:
    con = connect(results)
    parts = []
    for name in reports:
        columns, rows = run_report(con, name)
        parts.append(f"== {Path(name).stem} ({len(rows)} rows)\n{format_table(columns, rows)}")
    return "\n\n".join(parts)


@task(name="report")
def report(results: str | None = None, sweep_id: str | None = None) -> list[dict]:
    """The summary report's rows as dicts (of one sweep when `sweep_id` is given)."""
    columns, rows = run_report(connect(results), "summary")
    records = [dict(zip(columns, r)) for r in rows]
    return [r for r in records if sweep_id is None or r["sweep_id"] == sweep_id]
