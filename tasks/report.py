"""Prefect tasks over the reports layer (kvcompress_reports): a sweep's summary rows, and its
reports published as artifacts (shown under the flow run in Prefect's dashboard)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from kvcompress_reports import DEFAULT_REPORTS, connect, run_report, sweep_ids, sweep_reports
from kvcompress_reports.render import artifact_cell, format_markdown


def artifact_key(sweep_id: str, report_name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in f"sweep-{sweep_id}-{report_name}".lower())


def publish_artifacts(results: str | None, sweep_id: str, reports=DEFAULT_REPORTS) -> dict[str, str]:
    """Publish one sweep's reports as Prefect artifacts: the summary as a table artifact, the
    others as Markdown tables. Returns {report name: artifact key}. Call inside a flow or task
    run so the artifacts attach to it."""
    if len(sweep_ids(results)) < 2:  # nothing to compare the sweep with
        reports = [r for r in reports if r != "compare_sweeps"]
    reports = [r for r in reports if r != "throughput"]  # speed sweeps': the speed flow publishes it
    keys = {}
    for name, (columns, rows) in sweep_reports(results, sweep_id, reports).items():
        key = artifact_key(sweep_id, name)
        description = f"{name} report of sweep {sweep_id} ({len(rows)} rows)"
        if name == "summary":
            table = [{c: artifact_cell(v) for c, v in zip(columns, r)} for r in rows]
            create_table_artifact(table=table, key=key, description=description)
        else:
            create_markdown_artifact(markdown=f"### {name}\n\n{format_markdown(columns, rows)}\n",
                                     key=key, description=description)
        keys[name] = key
    return keys


@task(name="report")
def report(results: str | None = None, sweep_id: str | None = None) -> list[dict]:
    """The summary report's rows as dicts (of one sweep when `sweep_id` is given)."""
    columns, rows = run_report(connect(results), "summary")
    records = [dict(zip(columns, r)) for r in rows]
    return [r for r in records if sweep_id is None or r["sweep_id"] == sweep_id]
