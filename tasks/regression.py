"""Nightly regression report: this scheduled sweep against the previous one of the same grid."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from kvcompress.results import write_table
from kvcompress_reports import connect
from kvcompress_reports.regression import compare, previous_sweep
from kvcompress_reports.render import format_markdown
from kvcompress_tasks.report import artifact_key


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
