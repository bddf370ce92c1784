"""Prefect task: build a dataset cell's samples once, before the shards that read them (bad parameters
fail here, before any model work). Returns a count: the samples stay cached in the process."""

from __future__ import annotations

from typing import Any, Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE

from kvcompress.execute import load_samples


@task(name="prepare-dataset", cache_policy=NO_CACHE, task_run_name="prepare-dataset-{dataset}")
def prepare_dataset(dataset: str, params: Mapping[str, Any], model: str) -> int:
    """Build (and cache in-process) the samples of one dataset cell; returns the sample count."""
    return len(load_samples(dataset, params, model))
