"""Execute one sweep shard with resume: load (cached) model and samples, skip finished runs,
write each run the moment it finishes. Used by the Prefect task and by tests alike."""

from __future__ import annotations

from typing import Any, Mapping

from . import datasets
from .model import context_window, load_model, load_tokenizer, model_fingerprint
from .results import finished_run_ids, run_id, write_run
from .runner import RunContext, run_sample
from .sweep import Shard

_SAMPLES: dict[tuple, list[dict]] = {}  # (dataset, frozen params, model) -> samples, a few per process
_SAMPLES_KEPT = 8


def _frozen(value: Any) -> Any:
    """A hashable stand-in for loader parameters (nested lists and mappings), for the cache key."""
    if isinstance(value, Mapping):
        return (dict, tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (list, tuple(_frozen(v) for v in value))
    return value


def load_samples(dataset: str, params: Mapping[str, Any], model_name: str) -> list[dict]:
    """A dataset's samples as dicts, sized in `model_name`'s tokens; cached per process (the
    shards of one dataset share it)."""
    key = (dataset, _frozen(params), model_name)
    if key not in _SAMPLES:
        if len(_SAMPLES) >= _SAMPLES_KEPT:
            _SAMPLES.pop(next(iter(_SAMPLES)))  # the oldest
        tokenizer = load_tokenizer(model_name)
        _SAMPLES[key] = datasets.load_dataset(dataset, tokenizer=tokenizer, **params).to_list()
    return _SAMPLES[key]


def execute_shard(shard: Shard, model_name: str, decode_steps: int | None, sweep_id: str, results: str,
                  run_timeout_s: float | None = None) -> dict:
    """Run a shard's unfinished runs; returns counts {"skipped", "ran", "failed"}."""
    model, tokenizer = load_model(model_name)
    first = shard.sample_index
    samples = load_samples(shard.dataset, shard.dataset_params, model_name)[first:first + shard.rows]
    context = RunContext(model_name, model_fingerprint(model_name), shard.dataset, shard.dataset_params, decode_steps,
                         run_timeout_s)
    finished = finished_run_ids(results, sweep_id)
    window = context_window(model_name)
    beyond_window = bool(window and shard.dataset_params.get("context_tokens", 0) > window)

    def write(record) -> None:
        if beyond_window:  # the grid opted in (allow_beyond_window): every report shows it
            record.run["config_label"] += f" [beyond {window}-token window]"
        write_run(results, sweep_id, record.method, record.run, record.steps, record.evidence)

    records = run_sample(model, tokenizer, samples, list(shard.methods), context, on_record=write,
                         protocols=shard.protocols, pending=lambda config: run_id(config) not in finished)
    total = len(samples) * len(shard.methods) * len(shard.protocols)
    return {"skipped": total - len(records), "ran": len(records), "failed": sum(r.run["status"] != "ok" for r in records)}
