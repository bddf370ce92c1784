"""Run results as two hive-partitioned Parquet datasets, one file per run, written atomically.

    {root}/runs/sweep_id={sweep}/method={method}/{run_id}.parquet    one row per run
    {root}/steps/sweep_id={sweep}/method={method}/{run_id}.parquet   one row per decode step

`sweep_id` and `method` live in the directory names only (DuckDB's `hive_partitioning` turns
them into columns and prunes on them). A run is finished when its `runs` file exists: the steps
file is written first, each file goes to a temporary name and is renamed into place, so a reader
never sees a half-written file and a killed writer leaves no finished-looking run behind.
`root` is a local path or any URL pyarrow understands (s3://, gs://, file://, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

RUNS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("model", pa.string()),
        ("dataset", pa.string()),
        ("task", pa.string()),
        ("sample_id", pa.string()),
        ("context_tokens", pa.int64()),  # the configured context length (the grouping key)
        ("prompt_tokens", pa.int64()),  # tokens actually fed to the model
        ("budget", pa.float64()),  # as configured: tokens, or a fraction of the prompt
        ("budget_tokens", pa.float64()),  # the budget resolved for this prompt (mean over layers)
        ("bits", pa.float64()),
        ("tau_init", pa.float64()),
        ("tau_end", pa.float64()),
        ("score", pa.float64()),
        ("status", pa.string()),  # ok | error | nonfinite | timeout
        ("error", pa.string()),
        ("prefill_s", pa.float64()),  # shared full prefill + this method's compression
        ("decode_tok_s", pa.float64()),  # teacher-forced decode steps per second
        ("live_kv_bytes", pa.int64()),  # resident KV bytes after the last decode step
        ("full_kv_bytes", pa.int64()),  # the full cache's, same tokens
        ("tokens_kept", pa.int64()),
        ("peak_memory_bytes", pa.int64()),
        ("decode_steps", pa.int64()),
        ("prediction", pa.string()),
        ("config_label", pa.string()),  # method + non-default parameters: what reports group by
        ("config", pa.string()),  # JSON of the full run configuration (what run_id hashes)
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

STEPS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("position", pa.int64()),  # sequence position of the token fed at this step
        ("ref_token", pa.int64()),  # the full cache's next token (or the dataset's, for lm)
        ("token", pa.int64()),  # this method's argmax
        ("top1_agree", pa.bool_()),
        ("kl", pa.float64()),  # KL(full || method), nats
        ("logit_cosine", pa.float64()),
        ("nll", pa.float64()),  # -log p_method(ref_token)
        ("tokens_kept", pa.int64()),
        ("live_kv_bytes", pa.int64()),
        ("step_ms", pa.float64()),
    ]
)

TABLES = {"runs": RUNS_SCHEMA, "steps": STEPS_SCHEMA}


def run_id(config: dict[str, Any]) -> str:
    """Stable id of a run: sha256 of its canonical JSON configuration (16 hex digits)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def default_root() -> str:
    return os.environ.get("KVCOMPRESS_RESULTS", "results")


def _filesystem(root: str) -> tuple[pafs.FileSystem, str]:
    if "://" in root:
        return pafs.FileSystem.from_uri(root)
    return pafs.LocalFileSystem(), os.path.abspath(root)


def write_table(root: str, relative_dir: str, name: str, table: pa.Table) -> str:
    """Write `table` to {root}/{relative_dir}/{name}.parquet atomically (temp file + rename)."""
    fs, base = _filesystem(root)
    directory = f"{base}/{relative_dir}"
    fs.create_dir(directory, recursive=True)
    final = f"{directory}/{name}.parquet"
    temporary = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
    pq.write_table(table, temporary, filesystem=fs)
    fs.move(temporary, final)
    return final


def write_run(root: str, sweep_id: str, method: str, run: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    """Write one run's steps, then its runs row (the row marks the run finished)."""
    for table, rows in (("steps", steps), ("runs", [run])):
        partition = f"{table}/sweep_id={sweep_id}/method={method}"
        write_table(root, partition, run["run_id"], pa.Table.from_pylist(rows, schema=TABLES[table]))


def finished_run_ids(root: str, sweep_id: str) -> set[str]:
    """Run ids of a sweep whose `runs` file exists (finished, whatever their status)."""
    fs, base = _filesystem(root)
    selector = pafs.FileSelector(f"{base}/runs/sweep_id={sweep_id}", recursive=True, allow_not_found=True)
    return {
        info.base_name[: -len(".parquet")]
        for info in fs.get_file_info(selector)
        if info.is_file and info.base_name.endswith(".parquet") and not info.base_name.startswith(".")
    }
