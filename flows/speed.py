"""The `speed` flow: a speed grid (`kind: speed`) -> validate and check -> measure each group -> the
throughput report. Deployments (prefect.yaml): `speed/h200` (the documented H200 table) and
`speed/cpu` (the embedded model, minutes on a CPU); `kvcompress sweep GRID` runs the same flow
in-process when the grid is a speed grid."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from kvcompress.results import check_root, default_root, failed_speed_measurements, validate_sweep_id
from kvcompress.sweep import SpeedSpec, SweepError, load_spec
from kvcompress_reports import connect, run_report
from kvcompress_reports.render import format_markdown
from kvcompress_tasks.report import artifact_key
from kvcompress_tasks.speed import measure_group, plan_speed


@flow(name="speed")
def speed(grid: str | dict[str, Any] | SpeedSpec = "speed-cpu", results: str | None = None,
          sweep_id: str | None = None) -> list[dict]:
    """Measure every cache of `grid` (a built-in grid name, a YAML path, a mapping, or a parsed spec)
    into `results`' `speed` table. Reruns with the same sweep id (default: the grid's name) skip
    finished measurements. Returns the throughput report's rows of this sweep; ends failed, after
    the report, when a measurement failed (a cache that does not fit the budget, say)."""
    logger = get_run_logger()
    results = results or default_root()
    if sweep_id is not None:
        validate_sweep_id(sweep_id)
    spec = load_spec(grid)
    if not isinstance(spec, SpeedSpec):
        raise SweepError([f"grid: expected a speed grid (kind: speed), got kind {spec.kind!r}: run it with the sweep flow"])
    spec.plan()  # every invalid setting before the model loads
    check_root(results)
    plan = plan_speed(spec)
    sweep_id = sweep_id or plan.name
    logger.info("speed %s: %s -> %s", sweep_id, json.dumps(plan.estimate()), results)
    for group in plan.groups:
        counts = measure_group(plan, group, sweep_id, results)
        logger.info("speed %s: %s: %s", sweep_id, group.describe(), counts)
    columns, rows = run_report(connect(results), "throughput")
    rows = [r for r in rows if r[columns.index("sweep_id")] == sweep_id]
    create_markdown_artifact(
        key=artifact_key(sweep_id, "throughput"),
        markdown=f"### throughput\n\n{format_markdown(columns, rows)}\n",
        description=f"throughput report of speed sweep {sweep_id} ({len(rows)} rows, "
                    f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)")
    failed = failed_speed_measurements(results, sweep_id)
    if failed:  # after the report, so what did run is published; the sweep itself ends failed
        lines = "; ".join(f"{cell}: {error.splitlines()[0][:200]}" for cell, error in failed.items())
        raise RuntimeError(f"speed {sweep_id}: {len(failed)} measurement(s) failed: {lines}")
    return [dict(zip(columns, r)) for r in rows]
