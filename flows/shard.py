"""The `sweep-shard` flow: one shard as its own flow run, so any number of workers split a sweep.

The `sweep` flow with `distribute=True` submits every shard to the deployment
`sweep-shard/shard` (work pool `kvcompress-shards`); each worker on that pool, started with
`--limit 1`, takes one shard at a time. Workers may run on other machines that share the Prefect
server and the results store (a path on a shared filesystem, or an object-store URL).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from kvcompress.results import validate_sweep_id
from kvcompress.sweep import Shard
from kvcompress_tasks.sweep import run_shard


@flow(name="sweep-shard")
def sweep_shard(shard: dict[str, Any], model: str, decode_steps: int | None, sweep_id: str, results: str,
                run_timeout_s: float | None = None) -> dict:
    """`shard` is `Shard.to_dict()`'s JSON (the Prefect edge); the task gets the typed shard."""
    validate_sweep_id(sweep_id)
    return run_shard(Shard.from_dict(shard), model, decode_steps, sweep_id, results, run_timeout_s)
