"""Prefect tasks of a speed sweep: plan (validate + expand) and check, measure one group."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from kvcompress.execute import check_speed_plan, execute_speed_group
from kvcompress.sweep import SpeedGroup, SpeedPlan, SpeedSpec
from kvcompress_tasks.sweep import retry_unless_config_error


@task(name="plan-speed", cache_policy=NO_CACHE)
def plan_speed(spec: SpeedSpec) -> SpeedPlan:
    """Validate every field and cell (raises SweepError listing all invalid ones) and expand into
    groups; then load the model and check that every cache runs a batch, before any measurement."""
    plan = spec.plan()
    check_speed_plan(plan)
    return plan


@task(name="measure-speed", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=[5],
      retry_condition_fn=retry_unless_config_error,
      task_run_name="measure-speed-{group.context_tokens}-{group.batch}-{group.kv_budget_bytes}")
def measure_group(plan: SpeedPlan, group: SpeedGroup, sweep_id: str, results: str) -> dict:
    """One context length at one batch or KV budget: the group's unfinished caches measured taking
    turns, each written as it finishes; a retry skips the finished ones."""
    logger = get_run_logger()
    return execute_speed_group(plan, group, sweep_id, results, log=logger.info)
