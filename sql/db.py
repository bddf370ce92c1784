"""DuckDB over the results Parquet: the views of views.sql and run_scores.sql, one report per
NAME.sql (package data of `kvcompress_reports`), and a report's (columns, rows)."""

from __future__ import annotations

import re
import warnings
from importlib import resources
from pathlib import Path

import duckdb

from kvcompress.errors import ConfigError
from kvcompress.results import (TABLES, default_root, is_object_store, read_files, readable_files, redact,
                                valid_sweep_id)
from kvcompress.stats import compare

RAW_VIEWS = ("views", "speed_views")  # views over the Parquet tables (speed: the speed sweep's)
VIEW_FILES = ("views.sql", "speed_views.sql", "run_scores.sql")  # raw Parquet views, then the derived view and macros
DEFAULT_REPORTS = ("leaderboard", "summary", "paired", "evidence", "pareto", "degradation", "speed_memory", "throughput",
                   "compare_sweeps")


def connect(results: str | None = None, baseline: str | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the `runs`, `steps`, `evidence`, `speed` and `run_scores` views over
    `results`; `baseline` (a config_label) is the second reference of the `paired` report.

    Only files that read as Parquet are viewed: each one that does not is named in one warning
    (`kvcompress check --repair` moves them aside). No runs and no speed measurements at all is a
    `ConfigError` with a hint. Local results are read by DuckDB itself; on an object store pyarrow
    reads each table once (the store's credentials and endpoint as the writers use them) and DuckDB
    queries it in memory, so no report needs DuckDB's network extension (a download, impossible
    offline)."""
    root = (results or default_root()).rstrip("/")
    con = duckdb.connect()
    con.execute("SET VARIABLE kv_results = ?", [root])
    con.execute("SET VARIABLE baseline = ?", [baseline])
    files = {}
    for table in TABLES:
        files[table], broken = readable_files(root, table)
        for problem in broken:
            warnings.warn(f"skipping {problem.path}: {problem.reason} (see `kvcompress check`)", stacklevel=2)
    if not files["runs"] and not files["speed"]:
        raise ConfigError(f"results: no runs under {redact(root)!r}: run `kvcompress sweep` first, or pass --results")
    in_memory = is_object_store(root)
    for table, paths in files.items():
        if paths and not in_memory:
            con.execute(f"SET VARIABLE kv_{table}_files = ?", [paths])
    for statement in ";\n".join(sql_text(name) for name in RAW_VIEWS).split(";\n"):  # one view per table
        view = re.search(r"CREATE OR REPLACE VIEW (\w+) AS", statement)
        if view and (in_memory or not files[view.group(1)]):  # (local: e.g. only failed runs so far, no steps files)
            table = view.group(1)
            con.register(f"kv_{table}_table", read_files(root, table, files[table]))
            statement = f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM kv_{table}_table"
        if statement.strip():
            con.execute(statement)
    for name in VIEW_FILES[len(RAW_VIEWS):]:
        con.execute(_packaged(name).read_text())
    return con


def _packaged(name: str):
    """The packaged file `name` (NAME.sql of this package), found through the package, not a path."""
    return resources.files(__package__).joinpath(name)


def report_names() -> list[str]:
    """The packaged reports (every NAME.sql but the views)."""
    return sorted(f.name[:-4] for f in resources.files(__package__).iterdir()
                  if f.name.endswith(".sql") and f.name not in VIEW_FILES)


def sql_text(name_or_path: str) -> str:
    """A report's SQL by name (a packaged NAME.sql, views included) or a .sql file's path; a
    `ConfigError` listing the names otherwise."""
    if name_or_path.endswith(".sql"):
        path = Path(name_or_path)
        if path.exists():
            return path.read_text()
        raise ConfigError(f"--report: no such file {name_or_path!r}")
    packaged = _packaged(f"{name_or_path}.sql")
    if re.fullmatch(r"\w+", name_or_path) and packaged.is_file():
        return packaged.read_text()
    raise ConfigError(f"--report: expected a .sql file or one of {report_names()}, got {name_or_path!r}")


def check_report(name_or_path: str) -> None:
    """Raise the `ConfigError` of an unknown report name before any query runs."""
    if Path(name_or_path).stem in (*RAW_VIEWS, "run_scores") and not name_or_path.endswith(".sql"):
        raise ConfigError(f"--report: expected a .sql file or one of {report_names()}, got {name_or_path!r}")
    sql_text(name_or_path)


def run_report(con: duckdb.DuckDBPyConnection, name_or_path: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of a report's final statement (`paired`: its statistics)."""
    check_report(name_or_path)
    relation = con.sql(sql_text(name_or_path))
    columns, rows = relation.columns, relation.fetchall()
    if Path(name_or_path).stem == "paired":
        return paired_statistics(columns, rows)
    if Path(name_or_path).stem == "leaderboard" and not name_or_path.endswith(".sql"):
        paired = con.sql(sql_text("paired"))
        return leaderboard_statistics(columns, rows, paired.columns, paired.fetchall())
    return columns, rows


PAIRED_COLUMNS = [
    "sweep_id", "protocol", "dataset", "task", "context_tokens", "config_label", "n", "score_mean",
    "score_full_mean", "diff_vs_full", "diff_vs_full_ci_low", "diff_vs_full_ci_high", "mcnemar_p_vs_full",
    "vs_full", "n_baseline", "diff_vs_baseline", "diff_vs_baseline_ci_low", "diff_vs_baseline_ci_high",
    "mcnemar_p_vs_baseline", "vs_baseline",
]


def paired_statistics(columns: list[str], rows: list[tuple]) -> tuple[list[str], list[tuple]]:
    """Per config x cell, from sql/paired.sql's rows: paired differences vs the full cache and vs
    the baseline with bootstrap CIs, exact McNemar p (0/1 scores), n, and a verdict that says
    "not distinguishable" when the CI spans 0 (kvcompress/stats.py)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        r = dict(zip(columns, row))
        key = tuple(r[c] for c in ("sweep_id", "protocol", "dataset", "task", "context_tokens", "config_label"))
        groups.setdefault(key, []).append(r)
    out = []
    for key, runs in groups.items():
        scored = [r for r in runs if r["score"] is not None]
        out_row = [*key, len(scored), _mean([r["score"] for r in scored])]
        for other in ("score_full", "score_baseline"):
            pairs = [(r["score"], r[other]) for r in scored if r[other] is not None]
            stats = compare([a for a, _ in pairs], [b for _, b in pairs]) if pairs else None
            if other == "score_full":
                out_row.append(_mean([b for _, b in pairs]))
            else:
                out_row.append(len(pairs))
            if stats is None:
                out_row += [None, None, None, None, None]
            else:
                out_row += [stats.diff_mean, stats.ci_low, stats.ci_high, stats.mcnemar_p, stats.verdict]
        out.append(tuple(out_row))
    return PAIRED_COLUMNS, out


LEADERBOARD_STATISTICS = ["diff_vs_full_ci_low", "diff_vs_full_ci_high", "mcnemar_p_vs_full", "vs_full"]


def leaderboard_statistics(columns: list[str], rows: list[tuple], paired_columns: list[str],
                           paired_rows: list[tuple]) -> tuple[list[str], list[tuple]]:
    """sql/leaderboard.sql's rows with the paired bootstrap CI, McNemar p and verdict of each config's
    difference from the full cache, over its runs pooled across tasks (sql/paired.sql's rows: each run
    and the full cache's score on its sample), as the paired report computes them per task."""
    pairs: dict[tuple, list[tuple[float, float]]] = {}
    for row in paired_rows:
        r = dict(zip(paired_columns, row))
        if r["score"] is not None and r["score_full"] is not None:
            pairs.setdefault((r["sweep_id"], r["protocol"], r["config_label"]), []).append((r["score"], r["score_full"]))
    out = []
    for row in rows:
        r = dict(zip(columns, row))
        found = pairs.get((r["sweep_id"], r["protocol"], r["config_label"]))
        if not found or r["method"] == "full":
            out.append((*row, None, None, None, None))
            continue
        stats = compare([a for a, _ in found], [b for _, b in found])
        out.append((*row, stats.ci_low, stats.ci_high, stats.mcnemar_p, stats.verdict))
    return columns + LEADERBOARD_STATISTICS, out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def sweep_reports(results: str | None, sweep_id: str, reports=DEFAULT_REPORTS,
                  baseline: str | None = None) -> dict[str, tuple[list[str], list[tuple]]]:
    """Each report's (columns, rows) restricted to one sweep; compare_sweeps sets it against the
    sweep that ran before it (the report's default when sweep_a is unset)."""
    con = connect(results, baseline)
    con.execute("SET VARIABLE sweep_b = ?", [sweep_id])
    out = {}
    for name in reports:
        columns, rows = run_report(con, name)
        if "sweep_id" in columns:
            index = columns.index("sweep_id")
            rows = [r for r in rows if r[index] == sweep_id]
        out[Path(name).stem] = (columns, rows)
    return out


def sweep_ids(results: str | None | duckdb.DuckDBPyConnection) -> list[str]:
    """Sweeps under `results` (a root or a connection to one), the one with the newest run first."""
    con = results if isinstance(results, duckdb.DuckDBPyConnection) else connect(results)
    rows = con.sql(  # connect: a ConfigError with a hint when there are no runs at all
        "SELECT sweep_id FROM (SELECT sweep_id, created_at FROM runs UNION ALL SELECT sweep_id, created_at FROM speed) "
        "GROUP BY sweep_id ORDER BY max(created_at) DESC, sweep_id DESC"
    ).fetchall()
    # `connect` views only files under valid partition names; a view over other files (a caller's
    # own connection) may hold any text: such a name never becomes a sweep to show or a path
    return [r[0] for r in rows if valid_sweep_id(r[0])]
