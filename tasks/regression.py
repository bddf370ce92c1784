"""Nightly regression report: this scheduled sweep against the previous one of the same grid."""

from __future__ import annotations

import re

import pyarrow as pa

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from kvcompress.results import write_table
from tasks.report import SQL_DIR, artifact_key, connect, format_markdown

NIGHTLY_ID = re.compile(r"^(?P<grid>.+)-\d{8}-\d{6}$")  # <grid name>-YYYYmmdd-HHMMSS (UTC)


def previous_sweep(con, sweep_id: str) -> str | None:
    """The latest earlier sweep of the same grid (ids sort by time), or None."""
    match = NIGHTLY_ID.match(sweep_id)
    if match is None:
        return None
    ids = [r[0] for r in con.execute("SELECT DISTINCT sweep_id FROM runs").fetchall()]
    earlier = [s for s in ids if s < sweep_id and (m := NIGHTLY_ID.match(s)) and m["grid"] == match["grid"]]
    return max(earlier, default=None)


def compare(con, sweep_a: str, sweep_b: str) -> pa.Table:
    """sql/regression.sql over sql/compare_sweeps.sql for the two sweeps."""
    con.execute("SET VARIABLE sweep_a = ?", [sweep_a])
    con.execute("SET VARIABLE sweep_b = ?", [sweep_b])
    comparison = (SQL_DIR / "compare_sweeps.sql").read_text().strip().rstrip(";")
    con.execute(f"CREATE OR REPLACE TEMP VIEW sweep_comparison AS {comparison}")
    return con.sql((SQL_DIR / "regression.sql").read_text()).to_arrow_table()


@task(name="regression-report", cache_policy=NO_CACHE)
def regression_report(results: str, sweep_id: str) -> list[dict]:
    """Compare `sweep_id` with the previous sweep of its grid; publish flagged rows as a markdown
    artifact and keep the whole comparison as Parquet under {results}/regressions/ (queryable)."""
    logger = get_run_logger()
    con = connect(results)
    previous = previous_sweep(con, sweep_id)
    if previous is None:
        logger.info("regression: no earlier sweep of this grid than %s; nothing to compare", sweep_id)
        return []
    table = compare(con, previous, sweep_id)
    write_table(results, f"regressions/sweep_id={sweep_id}", "regression", table)
    rows = table.to_pylist()
    flagged = [r for r in rows if r["regressed"]]
    logger.info("regression: %d of %d configs of %s moved beyond thresholds since %s",
                len(flagged), len(rows), sweep_id, previous)
    shown = ["config_label", "dataset", "task", "context_tokens", "score_regressed", "kl_regressed",
             "top1_regressed", "memory_changed", "score_mean_a", "score_mean_b", "kl_mean_a", "kl_mean_b",
             "live_kv_bytes_a", "live_kv_bytes_b"]
    picked = [tuple(r[c] for c in shown) for r in flagged]
    body = format_markdown(shown, picked) if picked else "No metric moved beyond its threshold."
    create_markdown_artifact(
        key=artifact_key(sweep_id, "regression"),
        markdown=f"### Regressions of {sweep_id} since {previous}\n\n{len(flagged)} of {len(rows)} configs flagged.\n\n{body}\n",
        description=f"nightly regression report {previous} -> {sweep_id}",
    )
    return rows
