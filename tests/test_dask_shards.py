"""Shards on a Dask cluster (flows/dask_shards.py): a real local cluster of two worker processes gives
the rows an inline sweep gives; a bad `dask` value fails before any work."""

from __future__ import annotations

import pytest

from kvcompress.errors import ConfigError
from result_rows import comparable_rows

# two shards (one per sample), two methods each
GRID = {"name": "dask", "decode_steps": 2, "datasets": [{"name": "passkey", "context_tokens": [256], "num_samples": 2}],
        "methods": [{"name": "full"}, {"name": "streaming", "grid": {"budget": [64]}}]}


def test_a_local_two_process_dask_cluster_gives_the_rows_of_an_inline_sweep(prefect_server, tmp_path, embedded):
    from kvcompress_flows.sweep import sweep

    results = str(tmp_path / "results")
    on_dask = sweep(grid=GRID, results=results, sweep_id="on-dask", dask="local:2")
    inline = sweep(grid=GRID, results=results, sweep_id="inline")
    dask_rows, inline_rows = comparable_rows(results, "on-dask"), comparable_rows(results, "inline")
    assert [len(dask_rows[t]) for t in ("runs", "steps")] == [4, 4 * 2]
    assert dask_rows == inline_rows
    assert [r["config_label"] for r in on_dask] == [r["config_label"] for r in inline]


@pytest.mark.parametrize("kwargs, message", [
    ({"dask": "localhost:8786"}, r"dask: expected local:N .* got 'localhost:8786'"),
    ({"dask": "local:0"}, r"dask: expected local:N"),
    ({"dask": "local:2", "distribute": True}, r"dask: .* choose one"),
])
def test_a_bad_dask_value_fails_before_any_work(prefect_server, tmp_path, kwargs, message):
    from kvcompress_flows.sweep import sweep

    with pytest.raises(ConfigError, match=message):
        sweep(grid=GRID, results=str(tmp_path / "results"), **kwargs)
    assert not (tmp_path / "results").exists()
