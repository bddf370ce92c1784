"""Wall time of one sweep inline, with 1 and 2 Prefect shard workers, and on a 2-process local Dask
cluster, on this machine (one run each).

Starts its own Prefect server (temp PREFECT_HOME, 127.0.0.1), the work pools and deployments,
then runs the same grid four times under different sweep ids and checks the results are identical.
Usage: python benchmarks/workers.py [num_samples]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HOME = Path(tempfile.mkdtemp(prefix="kvc-bench-prefect-"))
os.environ.update(PREFECT_HOME=str(HOME), PREFECT_SERVER_ANALYTICS_ENABLED="false", KVCOMPRESS_HOME=str(ROOT),
                  HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PREFECT_WORKER_QUERY_SECONDS="1")
PREFECT = [sys.executable, "-m", "prefect"]

import kvcompress  # noqa: E402,F401
import pyarrow.dataset as ds  # noqa: E402

from kvcompress_flows.local_server import LocalServer, stop_process_group  # noqa: E402


def main(num_samples: int = 6) -> None:
    with LocalServer() as api:
        os.environ["PREFECT_API_URL"] = api
        from kvcompress_flows.sweep import sweep

        for pool in ("kvcompress", "kvcompress-shards"):
            subprocess.run([*PREFECT, "work-pool", "create", pool, "--type", "process"], cwd=ROOT, check=True,
                           capture_output=True)
        subprocess.run([*PREFECT, "--no-prompt", "deploy", "--all"], cwd=ROOT, check=True, capture_output=True)
        grid = {"name": "bench", "decode_steps": 8,
                "datasets": [{"name": "niah", "params": {"variant": "single"}, "context_tokens": [512],
                              "num_samples": num_samples}],
                "methods": [{"name": "full"}, {"name": "mlx-quant", "grid": {"bits": [4]}},
                            {"name": "streaming", "grid": {"budget": [0.5]}}]}
        results = tempfile.mkdtemp(prefix="kvc-bench-results-")
        wall = {}
        start = time.perf_counter()
        sweep(grid=grid, results=results, sweep_id="inline")
        wall["inline"] = time.perf_counter() - start
        for n in (1, 2):
            workers = [subprocess.Popen([*PREFECT, "worker", "start", "--pool", "kvcompress-shards", "--limit", "1"],
                                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True) for _ in range(n)]
            start = time.perf_counter()
            sweep(grid=grid, results=results, sweep_id=f"workers-{n}", distribute=True)
            wall[f"{n} Prefect worker{'s' * (n > 1)}"] = time.perf_counter() - start
            for w in workers:
                stop_process_group(w)
        start = time.perf_counter()  # the cluster's start and stop included, as a user waits for them
        sweep(grid=grid, results=results, sweep_id="dask-2", dask="local:2")
        wall["Dask local:2"] = time.perf_counter() - start
        runs = ds.dataset(f"{results}/runs", partitioning="hive").to_table().to_pylist()
        by_sweep = {}
        for r in runs:
            by_sweep.setdefault(r["sweep_id"], {})[r["run_id"]] = (r["score"], r["prediction"], r["live_kv_bytes"])
        print(f"\nsweep: {num_samples} shards x 3 methods, niah 512 tokens, 8 decode steps, {os.cpu_count()} cores")
        print("engine               wall_s  speedup")
        for engine, seconds in wall.items():
            print(f"{engine:<19}  {seconds:6.1f}  {wall['inline'] / seconds:6.2f}x")
        same = all(rows == by_sweep["inline"] for rows in by_sweep.values())
        print(f"identical results: {same} ({len(by_sweep['inline'])} runs each)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
