"""Wall time of one distributed sweep with 1 vs 2 shard workers on this machine (one run each).

Starts its own Prefect server (temp PREFECT_HOME, 127.0.0.1), the work pools and deployments,
then runs the same grid twice under different sweep ids and checks the results are identical.
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
        for n in (1, 2):
            workers = [subprocess.Popen([*PREFECT, "worker", "start", "--pool", "kvcompress-shards", "--limit", "1"],
                                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True) for _ in range(n)]
            start = time.perf_counter()
            sweep(grid=grid, results=results, sweep_id=f"workers-{n}", distribute=True)
            wall[n] = time.perf_counter() - start
            for w in workers:
                stop_process_group(w)
        runs = ds.dataset(f"{results}/runs", partitioning="hive").to_table().to_pylist()
        one = {r["run_id"]: (r["score"], r["prediction"], r["live_kv_bytes"]) for r in runs if r["sweep_id"] == "workers-1"}
        two = {r["run_id"]: (r["score"], r["prediction"], r["live_kv_bytes"]) for r in runs if r["sweep_id"] == "workers-2"}
        print(f"\ndistributed sweep: {num_samples} shards x 3 methods, niah 512 tokens, 8 decode steps, {os.cpu_count()} cores")
        print("workers  wall_s  speedup")
        for n, seconds in wall.items():
            print(f"{n:>7}  {seconds:6.1f}  {wall[1] / seconds:6.2f}x")
        print(f"identical results: {one == two} ({len(one)} runs each)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
