"""DuckDB reports over the results Parquet: views from sql/views.sql and sql/run_scores.sql,
one report per sql/NAME.sql. The library never imports DuckDB; reports live here and in sql/."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import duckdb
import pyarrow as pa
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from kvcompress.errors import ConfigError
from kvcompress.results import TABLES, default_root, readable_files

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
VIEW_FILES = ("views.sql", "run_scores.sql")  # raw Parquet views, then the derived view and macros
DEFAULT_REPORTS = ("summary", "pareto", "degradation", "speed_memory", "compare_sweeps")


def connect(results: str | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the `runs`, `steps` and `run_scores` views over `results`.

    Only files that read as Parquet are viewed: each one that does not is named in one warning
    (`kvcompress check --repair` moves them aside). No runs at all is a `ConfigError` with a hint."""
    root = (results or default_root()).rstrip("/")
    con = duckdb.connect()
    con.execute("SET VARIABLE kv_results = ?", [root])
    files = {}
    for table in TABLES:
        files[table], broken = readable_files(root, table)
        for problem in broken:
            warnings.warn(f"skipping {problem.path}: {problem.reason} (see `kvcompress check`)", stacklevel=2)
    if not files["runs"]:
        raise ConfigError(f"results: no runs under {root!r}: run `kvcompress sweep` first, or pass --results")
    for table, paths in files.items():
        if paths:
            con.execute(f"SET VARIABLE kv_{table}_files = ?", [paths])
    for statement in (SQL_DIR / "views.sql").read_text().split(";\n"):  # one view per table
        view = re.search(r"CREATE OR REPLACE VIEW (\w+) AS", statement)
        if view and not files[view.group(1)]:  # e.g. only failed runs so far: no steps files
            con.register(f"empty_{view.group(1)}", _empty(view.group(1)))
            statement = f"CREATE OR REPLACE VIEW {view.group(1)} AS SELECT * FROM empty_{view.group(1)}"
        if statement.strip():
            con.execute(statement)
    for name in VIEW_FILES[1:]:
        con.execute((SQL_DIR / name).read_text())
    return con


def _empty(table: str) -> pa.Table:
    """An empty table with the schema of `table` and its hive partition columns."""
    schema = TABLES[table].append(pa.field("sweep_id", pa.string())).append(pa.field("method", pa.string()))
    return schema.empty_table()


def sql_file(name_or_path: str) -> Path:
    """A report by name (sql/NAME.sql) or by path; a `ConfigError` listing the names otherwise."""
    path = Path(name_or_path)
    if path.suffix == ".sql":
        if path.exists():
            return path
        raise ConfigError(f"--sql: no such file {name_or_path!r}")
    path = SQL_DIR / f"{name_or_path}.sql"
    if not path.exists() or name_or_path in ("views", "run_scores"):
        names = sorted(p.stem for p in SQL_DIR.glob("*.sql") if p.name not in VIEW_FILES)
        raise ConfigError(f"--sql: expected a .sql file or one of {names}, got {name_or_path!r}")
    return path


def run_report(con: duckdb.DuckDBPyConnection, name_or_path: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of a report's final statement."""
    relation = con.sql(sql_file(name_or_path).read_text())
    return relation.columns, relation.fetchall()


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


def render_reports(results: str | None = None, reports=DEFAULT_REPORTS) -> str:
    """Every report as a terminal table, titled with its name and row count."""
    con = connect(results)
    parts = []
    for name in reports:
        columns, rows = run_report(con, name)
        parts.append(f"== {Path(name).stem} ({len(rows)} rows)\n{format_table(columns, rows)}")
    return "\n\n".join(parts)


def sweep_reports(results: str | None, sweep_id: str, reports=DEFAULT_REPORTS) -> dict[str, tuple[list[str], list[tuple]]]:
    """Each report's (columns, rows) restricted to one sweep; compare_sweeps sets it against the
    sweep that ran before it (the report's default when sweep_a is unset)."""
    con = connect(results)
    con.execute("SET VARIABLE sweep_b = ?", [sweep_id])
    out = {}
    for name in reports:
        columns, rows = run_report(con, name)
        if "sweep_id" in columns:
            index = columns.index("sweep_id")
            rows = [r for r in rows if r[index] == sweep_id]
        out[Path(name).stem] = (columns, rows)
    return out


def artifact_key(sweep_id: str, report_name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in f"sweep-{sweep_id}-{report_name}".lower())


def publish_artifacts(results: str | None, sweep_id: str, reports=DEFAULT_REPORTS) -> dict[str, str]:
    """Publish one sweep's reports as Prefect artifacts: the summary as a table artifact, the
    others as Markdown tables. Returns {report name: artifact key}. Call inside a flow or task
    run so the artifacts attach to it."""
    keys = {}
    for name, (columns, rows) in sweep_reports(results, sweep_id, reports).items():
        key = artifact_key(sweep_id, name)
        description = f"{name} report of sweep {sweep_id} ({len(rows)} rows)"
        if name == "summary":
            table = [{c: _artifact_cell(v) for c, v in zip(columns, r)} for r in rows]
            create_table_artifact(table=table, key=key, description=description)
        else:
            create_markdown_artifact(markdown=f"### {name}\n\n{format_markdown(columns, rows)}\n",
                                     key=key, description=description)
        keys[name] = key
    return keys


def _artifact_cell(value):
    """Table artifacts take JSON scalars; floats rounded as shown in the terminal."""
    if isinstance(value, float):
        return None if math.isnan(value) else float(format_cell(value))
    return value if isinstance(value, (int, str, bool)) or value is None else str(value)


@task(name="report")
def report(results: str | None = None, sweep_id: str | None = None) -> list[dict]:
    """The summary report's rows as dicts (of one sweep when `sweep_id` is given)."""
    columns, rows = run_report(connect(results), "summary")
    records = [dict(zip(columns, r)) for r in rows]
    return [r for r in records if sweep_id is None or r["sweep_id"] == sweep_id]
