"""Execute one sweep shard with resume: load (cached) model and samples, skip finished runs,
write each run the moment it finishes. Used by the Prefect task and by tests alike."""

from __future__ import annotations

import functools
import json
from typing import Any

from . import datasets
from .methods import method_config
from .model import context_window, load_model, load_tokenizer, model_fingerprint
from .results import finished_run_ids, run_id, write_run
from .runner import RunContext, run_config, run_sample


@functools.lru_cache(maxsize=8)
def load_samples(dataset: str, params_json: str, model_name: str) -> list[dict]:
    """A dataset's samples as dicts, sized in `model_name`'s tokens; cached per process (the
    shards of one dataset share it)."""
    tokenizer = load_tokenizer(model_name)
    return datasets.load_dataset(dataset, tokenizer=tokenizer, **json.loads(params_json)).to_list()


def shard_methods(shard: dict[str, Any]) -> list:
    return [method_config(**json.loads(m)) for m in shard["methods"]]


def execute_shard(shard: dict[str, Any], model_name: str, decode_steps: int, sweep_id: str, results: str,
                  run_timeout_s: float | None = None) -> dict:
    """Run a shard's unfinished methods; returns counts {"skipped", "ran", "failed"}.

    `shard` is plain JSON (see `kvcompress.sweep.Shard.to_dict`) so a Prefect task can take it.
    """
    model, tokenizer = load_model(model_name)
    sample = load_samples(shard["dataset"], shard["dataset_params"], model_name)[shard["sample_index"]]
    context = RunContext(model_name, model_fingerprint(model_name), shard["dataset"], shard["dataset_params"], decode_steps,
                         run_timeout_s)
    finished = finished_run_ids(results, sweep_id)
    methods = shard_methods(shard)
    todo = [m for m in methods if run_id(run_config(context, sample, m)) not in finished]
    window = context_window(model_name)
    beyond_window = bool(window and json.loads(shard["dataset_params"]).get("context_tokens", 0) > window)

    def write(record) -> None:
        if beyond_window:  # the grid opted in (allow_beyond_window): every report shows it
            record.run["config_label"] += f" [beyond {window}-token window]"
        write_run(results, sweep_id, record.method, record.run, record.steps)

    failed = 0
    if todo:
        records = run_sample(model, tokenizer, sample, todo, context, on_record=write)
        failed = sum(r.run["status"] != "ok" for r in records)
    return {"skipped": len(methods) - len(todo), "ran": len(todo), "failed": failed}
