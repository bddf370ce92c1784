"""The `sweep` flow: expand grid -> validate -> fan out shards -> gather -> report.

Deployments (prefect.yaml): `sweep/default` on the embedded defaults, `sweep/nightly` on a
schedule. `kvcompress sweep` runs the same flow in-process.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from kvcompress.results import default_root
from tasks.datasets import load_dataset
from tasks.report import artifact_key, publish_artifacts, report
from tasks.sweep import plan_sweep, run_shard


@flow(name="sweep")
def sweep(grid: str | dict[str, Any] = "default", results: str | None = None, sweep_id: str | None = None) -> list[dict]:
    """Run every cell of `grid` (a built-in grid name, a YAML path or a mapping) into `results`.

    Reruns skip finished runs: a sweep id (default: the grid's name) names one set of results.
    Returns the summary report rows of this sweep.
    """
    logger = get_run_logger()
    results = results or default_root()
    plan = plan_sweep(grid)  # raises before any work if any cell is invalid
    sweep_id = sweep_id or plan["name"]
    shards = plan["shards"]
    logger.info("sweep %s: %s -> %s", sweep_id, json.dumps(plan["estimate"]), results)

    for dataset, params in sorted({(s["dataset"], s["dataset_params"]) for s in shards}):
        load_dataset(dataset, params, plan["model"])

    progress = create_progress_artifact(0.0, key=artifact_key(sweep_id, "progress"), description=f"sweep {sweep_id}")
    start = time.monotonic()
    totals = {"skipped": 0, "ran": 0, "failed": 0}
    for done, shard in enumerate(shards, start=1):
        counts = run_shard(shard, plan["model"], plan["decode_steps"], sweep_id, results)
        totals = {k: totals[k] + counts[k] for k in totals}
        elapsed = time.monotonic() - start
        eta = elapsed / done * (len(shards) - done)
        update_progress_artifact(progress, 100.0 * done / len(shards))
        logger.info("progress %d/%d shards, runs %s, elapsed %.0fs, ETA %.0fs", done, len(shards), totals, elapsed, eta)

    rows = report(results, sweep_id)
    publish_artifacts(results, sweep_id)  # summary table + the other reports as markdown
    logger.info("sweep %s done: %s", sweep_id, totals)
    return rows
