"""Shards on a Dask cluster (flows/dask_shards.py): a local cluster of two worker processes, and a
scheduler with two worker machines started with docs/many-machines.md's commands, give the rows of an
inline sweep; a bad `dask` value fails before any work."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from kvcompress.errors import ConfigError
from kvcompress_flows.local_server import free_port
from machines import Machine
from result_rows import assert_same_results, comparable_rows

DOC = (Path(__file__).resolve().parent.parent / "docs" / "many-machines.md").read_text()
# two shards (one per sample), two methods each
GRID = {"name": "dask", "decode_steps": 2, "datasets": [{"name": "passkey", "context_tokens": [256], "num_samples": 2}],
        "methods": [{"name": "full"}, {"name": "streaming", "grid": {"budget": [64]}}]}


@pytest.fixture(scope="module")
def inline_rows(prefect_server, tmp_path_factory, embedded) -> dict:
    from kvcompress_flows.sweep import sweep

    results = str(tmp_path_factory.mktemp("inline") / "results")
    sweep(grid=GRID, results=results, sweep_id="inline")
    rows = comparable_rows(results, "inline")
    assert [len(rows[t]) for t in ("runs", "steps")] == [4, 4 * 2]
    return rows


def test_a_local_two_process_dask_cluster_gives_the_rows_of_an_inline_sweep(inline_rows, tmp_path, caplog):
    import logging

    from kvcompress_flows.sweep import sweep

    results = str(tmp_path / "results")
    with caplog.at_level(logging.INFO):
        summary = sweep(grid=GRID, results=results, sweep_id="on-dask", dask="local:2")
    # the cluster's own lines are not the sweep's (38 of them: workers starting, retiring, killed at close)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("distributed") and r.levelno < logging.ERROR]
    assert_same_results(comparable_rows(results, "on-dask"), inline_rows)
    assert sorted(r["config_label"] for r in summary) == ["full", "streaming budget=64"]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_scheduler_and_two_worker_machines_as_documented_write_the_inline_rows_to_s3(
        inline_rows, prefect_server, s3_results, tmp_path):
    """`dask scheduler` and, on two machines that share nothing but the API and the bucket, `dask worker
    tcp://SCHEDULER:8786 --nworkers 1 --nthreads 1`; the sweep joins the scheduler."""
    import distributed

    from kvcompress_flows.sweep import sweep

    _, _, url = s3_results
    worker_command = "dask worker tcp://SCHEDULER:8786 --nworkers 1 --nthreads 1"
    assert f".venv/bin/{worker_command}" in DOC and ".venv/bin/dask scheduler --host 0.0.0.0 --port 8786" in DOC
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    scheduler = Machine(tmp_path, "scheduler", prefect_server)
    workers = [Machine(tmp_path, f"machine-{i}", prefect_server) for i in range(2)]
    try:
        scheduler.start([sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", str(port),
                         "--no-dashboard"], until=lambda: listening(port))
        for machine in workers:
            args = worker_command.replace("tcp://SCHEDULER:8786", address).split()
            machine.start([sys.executable, "-m", *args], until=lambda: True)
        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=300)
            assert all(w["nthreads"] == 1 for w in client.scheduler_info()["workers"].values())
        sweep(grid=GRID, results=url, sweep_id="scheduler", dask=address)
    finally:
        for machine in [*workers, scheduler]:
            machine.stop()
    assert_same_results(comparable_rows(url, "scheduler"), inline_rows)


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


def test_workers_with_more_than_one_thread_are_refused_before_any_shard(prefect_server, tmp_path):
    import distributed

    from kvcompress_flows.sweep import sweep

    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, protocol="tcp://",
                                  dashboard_address=None) as cluster:
        with pytest.raises(ConfigError, match=r"dask: every worker must run one thread .*--nthreads 1"):
            sweep(grid=GRID, results=str(tmp_path / "results"), dask=cluster.scheduler_address)
    assert not list((tmp_path / "results").glob("runs/**/*.parquet"))


SHARDS = """import sys
from kvcompress.execute import execute_shard
from kvcompress.sweep import load_spec
plan = load_spec(%r).plan()
for shard in plan.shards:
    execute_shard(shard, plan.model, plan.decode_steps, "threads", sys.argv[1], None)
"""


def test_rows_agree_across_blas_thread_counts_within_the_contract(tmp_path):
    """A Dask worker's BLAS runs one thread (the nanny sets OPENBLAS_NUM_THREADS=1), the inline sweep's one per
    core: float reductions add in another order, and the rows, compared bit for bit, differed (issue 50,
    item 11). tests/result_rows.py's contract: exact fields equal, floats within FLOAT_TOLERANCE."""
    import os
    import subprocess

    rows = []
    for threads in ("1", str(os.cpu_count() or 2)):
        results = str(tmp_path / f"threads-{threads}")
        done = subprocess.run([sys.executable, "-c", SHARDS % (GRID,), results], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "OPENBLAS_NUM_THREADS": threads})
        assert done.returncode == 0, done.stderr[-3000:]
        rows.append(comparable_rows(results, "threads"))
    assert [len(rows[0][t]) for t in ("runs", "steps")] == [4, 4 * 2]
    assert_same_results(rows[1], rows[0])
