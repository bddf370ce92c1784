"""A sweep's result rows as comparable values: what must not depend on where or how the sweep ran
(inline, Prefect workers, Dask; a local path or S3).

The contract: counts, bytes, tokens, texts, ids and statuses are equal; floats agree to FLOAT_TOLERANCE,
not bit for bit. A float reduction's result depends on its order, which the BLAS's thread count changes:
Dask's nanny starts its workers with OPENBLAS_NUM_THREADS=1 (the inline sweep's OpenBLAS runs one thread
per core), and measured on the test grid that moves logit_cosine from 1.0 to 0.99999994, nll from
0.5442314 to 0.5442295, kl from 1.10783e-4 to 1.10755e-4 (issue 50, item 11). Rows are matched by their
exact fields, never by their floats: sorted by them, two rows whose floats differ in the last bit could
swap places, and a row would then be compared with another run's or step's (seen as live_kv_bytes one
token apart).
"""

from __future__ import annotations

import math

from kvcompress.results import read_files, readable_files

# What may differ: wall-clock timings, when a row was written, the sweep id (it tells the compared sweeps
# apart), and MLX's peak memory: the allocator's high-water mark, which counts buffers it keeps cached from
# whatever ran earlier in the process (measured: method_peak_bytes 7.6 MB in the test process, 15.3 MB in a
# fresh Dask worker, same run); live_kv_bytes, the bytes the cache holds, is compared
VARYING = {"runs": {"prefill_s", "decode_tok_s", "created_at", "sweep_id", "peak_memory_bytes", "method_peak_bytes"},
           "steps": {"step_ms", "sweep_id"}, "evidence": {"sweep_id"}}
FLOAT_TOLERANCE = {"rel_tol": 1e-4, "abs_tol": 1e-6}


def _exact(row: tuple) -> tuple:
    """The fields compared exactly: everything but floats."""
    return tuple((k, v) for k, v in row if not isinstance(v, float))


def comparable_rows(root: str, sweep_id: str) -> dict[str, list[tuple]]:
    """{table: rows of `sweep_id` as sorted (column, value) tuples, without the VARYING columns}, each table's
    rows sorted by their exact fields."""
    rows = {}
    for table, varying in VARYING.items():
        paths, broken = readable_files(root, table)
        assert not broken, broken
        records = [r for r in read_files(root, table, paths).to_pylist() if r["sweep_id"] == sweep_id]
        rows[table] = sorted((tuple(sorted((k, v) for k, v in r.items() if k not in varying)) for r in records),
                             key=lambda row: repr(_exact(row)))
    return rows


def _same_float(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, **FLOAT_TOLERANCE)
    return a == b


def assert_same_results(got: dict[str, list[tuple]], expected: dict[str, list[tuple]]) -> None:
    """`got` holds `expected`'s rows: exact fields equal, floats within FLOAT_TOLERANCE (the module's contract)."""
    assert got.keys() == expected.keys()
    for table in expected:
        assert [_exact(r) for r in got[table]] == [_exact(r) for r in expected[table]], table
        for row, want in zip(got[table], expected[table]):
            different = [(k, v, w) for (k, v), (_, w) in zip(row, want) if not _same_float(v, w)]
            assert not different, (table, dict(_exact(want)).get("run_id"), different)
