"""The `sweep` flow: expand grid -> validate -> fan out shards -> gather -> report.

Deployments (prefect.yaml): `sweep/default` on the embedded defaults, `sweep/nightly` on a
schedule (each night its own sweep id, compared with the previous night). `kvcompress sweep`
runs the same flow in-process. Shards run inline, one after the other; with `distribute=True` as
`sweep-shard/shard` flow runs that any number of Prefect workers split; or with `dask=...` as tasks on
a Dask cluster (flows/dask_shards.py). docs/many-machines.md says when to use which.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from typing import Any, Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.deployments import run_deployment

from kvcompress.errors import ConfigError
from kvcompress.results import (check_root, configs_without_ok_run, default_root, finished_run_ids, redact,
                                validate_sweep_id)
from kvcompress.sweep import Shard, SweepSpec, load_spec
from kvcompress_flows import interrupt
from kvcompress_flows.dask_shards import run_on_dask, validate_dask
from kvcompress_tasks.datasets import prepare_dataset
from kvcompress_tasks.regression import regression_report
from kvcompress_tasks.report import artifact_key, publish_artifacts, report
from kvcompress_tasks.sweep import plan_sweep, run_shard

SHARD_DEPLOYMENT = "sweep-shard/shard"
# Called with (done, total, what) as shards finish, by flows run in this process (the CLI's progress bar).
PROGRESS_LISTENERS: list[Callable[[int, int, str], None]] = []


class Progress:
    """done/total with elapsed time and ETA, as a Prefect progress artifact and log lines."""

    def __init__(self, sweep_id: str, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()
        self.logger = get_run_logger()
        self.artifact = create_progress_artifact(0.0, key=artifact_key(sweep_id, "progress"),
                                                 description=f"shards of sweep {sweep_id}")
        for listener in PROGRESS_LISTENERS:
            listener(0, total, f"sweep {sweep_id}")

    def advance(self, what: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        filled = round(20 * self.done / self.total)
        update_progress_artifact(self.artifact, 100.0 * self.done / self.total)
        for listener in PROGRESS_LISTENERS:
            listener(self.done, self.total, what)
        self.logger.info("[%s%s] %d/%d shards, %.0f s elapsed, ETA %.0f s  (%s)",
                         "#" * filled, "." * (20 - filled), self.done, self.total, elapsed, eta, what)


@flow(name="sweep")
def sweep(
    grid: str | dict[str, Any] | SweepSpec = "default",
    results: str | None = None,
    sweep_id: str | None = None,
    distribute: bool = False,
    nightly: bool = False,
    shard_timeout_s: float = 6 * 3600,
    dask: str | None = None,
) -> list[dict]:
    """Run every cell of `grid` (a built-in grid name, a YAML path, a mapping, or a parsed spec, as
    `kvcompress sweep` passes it) into `results`.

    Reruns with the same sweep id (default: the grid's name) skip finished runs. `nightly` names
    the sweep `<grid>-<UTC time>` and reports regressions against the previous such sweep.
    `dask` (`local:N` or a scheduler's `tcp://HOST:PORT`) runs the shards on a Dask cluster instead of
    inline; `shard_timeout_s` bounds the wait for shards on workers or Dask. Returns the summary report rows of this sweep.
    """
    logger = get_run_logger()
    results = results or default_root()
    if "://" not in results:  # shards may run elsewhere (a worker's own working directory): the same place
        results = os.path.abspath(results)
    if sweep_id is not None:
        validate_sweep_id(sweep_id)
    validate_dask(dask)
    if distribute and dask is not None:
        raise ConfigError(f"dask: runs the shards on Dask, distribute=True on Prefect workers: choose one, "
                          f"got distribute=True and dask={dask!r}")
    plan = plan_sweep(load_spec(grid))  # raises before any work if any cell is invalid
    check_root(results)  # an unwritable or unknown results root fails once, before any model load
    if nightly:
        sweep_id = sweep_id or f"{plan.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    sweep_id = sweep_id or plan.name
    shards = plan.shards
    logger.info("sweep %s: %s -> %s", sweep_id, json.dumps(plan.estimate()), redact(results))

    loaded = []  # each dataset cell once (shards of one context length share it)
    for shard in shards:
        if (shard.dataset, shard.dataset_params) not in loaded:
            interrupt.check()
            loaded.append((shard.dataset, shard.dataset_params))
            prepare_dataset(shard.dataset, shard.dataset_params, plan.model)

    progress = Progress(sweep_id, len(shards))
    shard_args = dict(model=plan.model, decode_steps=plan.decode_steps, sweep_id=sweep_id,
                      results=results, run_timeout_s=plan.run_timeout_s)
    if distribute:
        _run_on_workers(shards, shard_args, progress, shard_timeout_s)
    elif dask is not None:
        run_on_dask(dask, shards, shard_args, progress.advance, shard_timeout_s)
    else:
        held = []  # shards another launch of this sweep is running: theirs first, then wait for them
        for shard in shards:
            interrupt.check()
            counts = run_shard(shard, **shard_args)
            if "leased_by" in counts:
                held.append(shard)
                continue
            progress.advance(f"{shard.dataset} #{shard.sample_index}: {counts}")
        for shard in held:
            counts = run_shard(shard, **shard_args, lease_wait_s=shard_timeout_s)
            progress.advance(f"{shard.dataset} #{shard.sample_index}: {counts}")

    finished = len(finished_run_ids(results, sweep_id))
    expected = plan.runs
    logger.info("sweep %s: %d of %d runs finished", sweep_id, finished, expected)
    if finished < expected:
        raise RuntimeError(f"sweep {sweep_id}: only {finished} of {expected} runs finished; rerun to resume")

    rows = report(results, sweep_id)
    publish_artifacts(results, sweep_id)
    if nightly:
        regression_report(results, sweep_id)
    broken = configs_without_ok_run(results, sweep_id)
    if broken:  # after the reports, so what did run is published; the sweep itself ends failed
        lines = "; ".join(f"{label}: {error[:200]}" for label, error in broken.items())
        raise RuntimeError(f"sweep {sweep_id}: {len(broken)} config(s) have no ok run: {lines}")
    return rows


def _run_on_workers(shards: tuple[Shard, ...], shard_args: dict, progress: Progress, timeout_s: float) -> None:
    """Submit each shard as a `sweep-shard/shard` flow run, then wait for all of them.

    Idempotency keys tie each submission to this parent run, so a retried parent does not submit
    a shard twice; shards that fail or time out leave their runs unfinished for the next rerun.
    """
    parent = get_run_context().flow_run.id
    submitted = [
        run_deployment(SHARD_DEPLOYMENT, parameters={"shard": shard.to_dict(), **shard_args}, timeout=0,
                       idempotency_key=f"{parent}-{i}",
                       flow_run_name=f"{shard_args['sweep_id']}-{shard.dataset}-{shard.sample_index}")
        for i, shard in enumerate(shards)
    ]
    pending = {run.id: shard for run, shard in zip(submitted, shards)}
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while pending and time.monotonic() < deadline:
            for run_id in list(pending):
                state = client.read_flow_run(run_id).state
                if state is not None and state.is_final():
                    shard = pending.pop(run_id)
                    progress.advance(f"{shard.dataset} #{shard.sample_index}: {state.name}")
            time.sleep(1.0)
