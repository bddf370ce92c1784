"""Nightly regression report: flags exactly the configs that moved beyond the thresholds."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow.parquet as pq

from kvcompress.results import write_run
from kvcompress_reports.regression import compare, previous_sweep
from kvcompress_reports import connect
from tests.test_results import make_run, make_steps


def write_night(root: str, sweep: str, streaming_score: float, streaming_kl: float, quant_live: int) -> None:
    for i in range(4):
        sample = f"s{i}"
        cells = {
            "full": (None, None, 1.0, 1000, 0.0),
            "streaming": (0.5, None, streaming_score, 500, streaming_kl),
            "mlx-quant": (None, 4, 1.0, quant_live, 0.01),
        }
        for method, (budget, bits, score, live, kl) in cells.items():
            rid = f"{sweep}-{method}-{sample}"
            write_run(root, sweep, method,
                      make_run(rid, method, score, live, budget=budget, bits=bits, sample_id=sample,
                               created_at=datetime(2026, 11, 29, tzinfo=timezone.utc)),
                      make_steps(rid, [kl, kl], [True, True]))


def test_previous_sweep_is_the_latest_earlier_night_of_the_same_grid(tmp_path):
    root = str(tmp_path)
    for sweep in ("nightly-20261127-020000", "nightly-20261128-020000", "other-20261128-030000", "nightly"):
        write_night(root, sweep, 1.0, 0.1, 200)
    con = connect(root)
    assert previous_sweep(con, "nightly-20261129-020000") == "nightly-20261128-020000"
    assert previous_sweep(con, "nightly-20261127-020000") is None
    assert previous_sweep(con, "nightly") is None  # not a scheduled id


def test_regression_flags_score_drop_kl_rise_and_memory_change_only(tmp_path):
    root = str(tmp_path)
    write_night(root, "nightly-20261128-020000", streaming_score=1.0, streaming_kl=0.10, quant_live=200)
    write_night(root, "nightly-20261129-020000", streaming_score=0.5, streaming_kl=0.30, quant_live=260)
    rows = {r["config_label"]: r for r in compare(connect(root), "nightly-20261128-020000",
                                                  "nightly-20261129-020000").to_pylist()}
    assert set(rows) == {"full", "streaming budget=0.5", "mlx-quant bits=4"}
    stream = rows["streaming budget=0.5"]
    assert stream["regressed"] and stream["score_regressed"] and stream["kl_regressed"]
    assert abs(stream["score_delta"] + 0.5) < 1e-12 and abs(stream["kl_delta"] - 0.2) < 1e-12
    assert not stream["memory_changed"]
    quant = rows["mlx-quant bits=4"]
    assert quant["memory_changed"] and not quant["score_regressed"] and not quant["kl_regressed"]
    assert not rows["full"]["regressed"]


def test_nightly_flow_publishes_regression_against_previous_night(prefect_server, tmp_path, embedded):
    from prefect.client.orchestration import get_client

    from kvcompress_flows.sweep import sweep

    results = str(tmp_path / "results")
    grid = {"name": "nightly-test", "decode_steps": 2,
            "datasets": [{"name": "passkey", "context_tokens": [256]}],
            "methods": [{"name": "full"}, {"name": "streaming", "grid": {"budget": [64]}}]}
    sweep(grid=grid, results=results, nightly=True, sweep_id="nightly-test-20261128-020000")
    sweep(grid=grid, results=results, nightly=True, sweep_id="nightly-test-20261129-020000")
    files = list((tmp_path / "results" / "regressions").rglob("*.parquet"))
    assert [f.parent.name for f in files] == ["sweep_id=nightly-test-20261129-020000"]
    table = pq.read_table(files[0]).to_pylist()
    assert len(table) == 2 and not any(r["regressed"] for r in table)  # same code, same numbers
    with get_client(sync_client=True) as client:
        artifact = client.read_latest_artifacts()
        keys = {a.key for a in artifact}
    assert "sweep-nightly-test-20261129-020000-regression" in keys
