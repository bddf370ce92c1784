"""Wall time of one sweep inline, with 1 and 2 Prefect shard workers, and on a 2-process local Dask
cluster, on this machine (one run each).

Starts its own Prefect server (temp PREFECT_HOME, 127.0.0.1), the work pools and deployments,
then runs the same grid four times under different sweep ids and checks the results are identical.
Each engine's wall time is a row of --jsonl (benchmarks/tables.py publishes the table from the
archived rows); the table is printed from the rows.

    python benchmarks/workers.py [num_samples] [--jsonl PATH]
    python benchmarks/workers.py --jsonl PATH --table    # the table only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFECT = [sys.executable, "-m", "prefect"]


def run(path: Path, num_samples: int) -> None:
    # a Prefect of its own, set before Prefect is imported (here: not when tables.py imports `table`)
    os.environ.update(PREFECT_HOME=tempfile.mkdtemp(prefix="kvc-bench-prefect-"),
                      PREFECT_SERVER_ANALYTICS_ENABLED="false", KVCOMPRESS_HOME=str(ROOT), HF_HUB_OFFLINE="1",
                      HF_DATASETS_OFFLINE="1", PREFECT_WORKER_QUERY_SECONDS="1")
    sys.path.insert(0, str(ROOT))
    import kvcompress  # noqa: F401  (first: preloads OpenBLAS before mlx)
    import pyarrow.dataset as ds

    from kvcompress_flows.local_server import LocalServer, stop_process_group

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
        wall = {}  # engine -> (sweep id, seconds)
        start = time.perf_counter()
        sweep(grid=grid, results=results, sweep_id="inline")
        wall["inline"] = ("inline", time.perf_counter() - start)
        for n in (1, 2):
            workers = [subprocess.Popen([*PREFECT, "worker", "start", "--pool", "kvcompress-shards", "--limit", "1"],
                                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True) for _ in range(n)]
            start = time.perf_counter()
            sweep(grid=grid, results=results, sweep_id=f"workers-{n}", distribute=True)
            wall[f"{n} Prefect worker{'s' * (n > 1)}"] = (f"workers-{n}", time.perf_counter() - start)
            for w in workers:
                stop_process_group(w)
        start = time.perf_counter()  # the cluster's start and stop included, as a user waits for them
        sweep(grid=grid, results=results, sweep_id="dask-2", dask="local:2")
        wall["Dask local:2"] = ("dask-2", time.perf_counter() - start)
        runs = ds.dataset(f"{results}/runs", partitioning="hive").to_table().to_pylist()
        by_sweep = {}
        for r in runs:
            by_sweep.setdefault(r["sweep_id"], {})[r["run_id"]] = (r["score"], r["prediction"], r["live_kv_bytes"])
        with path.open("w") as f:
            for engine, (sweep_id, seconds) in wall.items():
                f.write(json.dumps({"engine": engine, "sweep_id": sweep_id, "wall_s": seconds,
                                    "num_samples": num_samples, "methods": 3, "runs": len(by_sweep[sweep_id]),
                                    "identical_to_inline": by_sweep[sweep_id] == by_sweep["inline"],
                                    "cpu_count": os.cpu_count()}) + "\n")


def table(path: Path) -> str:
    """Wall seconds per engine, and whether its results equal the inline sweep's."""
    lines = ["| engine | wall s | x inline | runs | results identical to inline |", "|---|---|---|---|---|"]
    rows = [json.loads(line) for line in path.open()]
    inline = next(r["wall_s"] for r in rows if r["engine"] == "inline")
    for r in rows:
        lines.append(f"| {r['engine'].replace('local:2', '`local:2`')} | {r['wall_s']:.1f} | "
                     f"{inline / r['wall_s']:.2f} | {r['runs']} | {'yes' if r['identical_to_inline'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("num_samples", type=int, nargs="?", default=6, help="shards: one niah sample each")
    parser.add_argument("--jsonl", type=Path, default=None, help="write the rows here (default: a temporary file)")
    parser.add_argument("--table", action="store_true", help="print the table of --jsonl, measure nothing")
    args = parser.parse_args()
    if args.table and args.jsonl is None:
        parser.error("--table prints the table of --jsonl PATH: name the rows to read")
    path = args.jsonl or Path(tempfile.mkdtemp(prefix="kvc-bench-workers-")) / "workers.jsonl"
    if not args.table:
        run(path, args.num_samples)
    print(table(path))


if __name__ == "__main__":
    main()
