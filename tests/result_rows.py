"""A sweep's result rows as comparable values: what must not depend on where or how the sweep ran
(inline, Prefect workers, Dask; a local path or S3)."""

from __future__ import annotations

import math

from kvcompress.results import read_files, readable_files

# What may differ: wall-clock timings, when a row was written, the sweep id (it tells the compared sweeps
# apart), and MLX's peak memory: the allocator's high-water mark, which counts buffers it keeps cached from
# whatever ran earlier in the process (measured: method_peak_bytes 7.6 MB in the test process, 15.3 MB in a
# fresh Dask worker, same run); live_kv_bytes, the bytes the cache holds, is compared
VARYING = {"runs": {"prefill_s", "decode_tok_s", "created_at", "sweep_id", "peak_memory_bytes", "method_peak_bytes"},
           "steps": {"step_ms", "sweep_id"}, "evidence": {"sweep_id"}}


def _comparable(value):
    return "NaN" if isinstance(value, float) and math.isnan(value) else value  # NaN != NaN, yet the same result


def comparable_rows(root: str, sweep_id: str) -> dict[str, list[tuple]]:
    """{table: rows of `sweep_id`, sorted} for runs, steps and evidence, without the VARYING columns."""
    rows = {}
    for table, varying in VARYING.items():
        paths, broken = readable_files(root, table)
        assert not broken, broken
        records = [r for r in read_files(root, table, paths).to_pylist() if r["sweep_id"] == sweep_id]
        rows[table] = sorted((tuple(sorted((k, _comparable(v)) for k, v in r.items() if k not in varying))
                              for r in records), key=repr)
    return rows
