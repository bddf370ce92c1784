"""Prefect task: load a dataset's samples (validates first, so bad parameters fail before work)."""

from __future__ import annotations

from typing import Any, Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE

from kvcompress.execute import load_samples


@task(name="load-dataset", cache_policy=NO_CACHE, task_run_name="load-dataset-{dataset}")
def load_dataset(dataset: str, params: Mapping[str, Any], model: str) -> int:
    """Build (and cache in-process) the samples of one dataset cell; returns the sample count."""
    return len(load_samples(dataset, params, model))
