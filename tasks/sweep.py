"""Prefect tasks of a sweep: plan (validate + expand), run one shard."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from kvcompress.errors import ConfigError
from kvcompress.execute import execute_shard
from kvcompress.sweep import Plan, Shard, SweepSpec


def retry_unless_config_error(task, task_run, state) -> bool:
    """Retry what can succeed on retry (I/O, a killed process); a bad setting fails the same way
    every time, so it fails at once."""
    try:
        state.result()
    except ConfigError:
        return False
    except BaseException:
        return True
    return True


@task(name="plan-sweep", cache_policy=NO_CACHE)
def plan_sweep(spec: SweepSpec) -> Plan:
    """Validate every cell (raises SweepError listing all invalid ones) and expand into shards,
    once per spec (a spec the CLI has planned already is not expanded again)."""
    return spec.plan()


@task(name="run-shard", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30],
      retry_condition_fn=retry_unless_config_error,
      task_run_name="run-shard-{shard.dataset}-{shard.sample_index}")
def run_shard(shard: Shard, model: str, decode_steps: int | None, sweep_id: str, results: str,
              run_timeout_s: float | None = None, lease_wait_s: float = 0.0) -> dict:
    """One dataset sample through every unfinished method: one prefill, results written per run.

    Retries cover transient failures (I/O, a killed process); finished runs are skipped on retry.
    A shard another launch of the sweep holds is waited for up to `lease_wait_s` seconds, then left
    to it (counts with "leased_by").
    """
    return execute_shard(shard, model, decode_steps, sweep_id, results, run_timeout_s, lease_wait_s,
                         log=get_run_logger().info)
