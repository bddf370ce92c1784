"""Run a sweep grid shard by shard in this process, without Prefect (long measurements on one
machine). Resumable: finished runs are skipped, so a killed run picks up where it stopped.

    python benchmarks/run_grid.py benchmarks/grids/quality.yaml --results results-quality

A speed grid (`kind: speed`, docs/speed.md) runs its groups one after another in this process, as
the `speed` flow does (where Prefect is not installed, e.g. the lent GPU machine).

Several processes split one grid with `--workers N --worker I` (shard i goes to worker i mod N after
the interleaved ordering), e.g. N processes sharing one GPU; `--deadline S` starts no shard after S
seconds, so a time-limited job ends cleanly and the next one resumes.
"""

from __future__ import annotations

import argparse
import time

import kvcompress  # noqa: F401  (first: OpenBLAS before MLX)
from kvcompress.execute import check_speed_plan, execute_shard, execute_speed_group
from kvcompress.sweep import SpeedSpec, load_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("grid")
    parser.add_argument("--results", default="results")
    parser.add_argument("--sweep-id", default=None)
    parser.add_argument("--interleave", action="store_true",
                        help="sample 0 of every dataset, then sample 1, ...: a stopped run has every cell at similar n")
    parser.add_argument("--workers", type=int, default=1, help="processes splitting the grid")
    parser.add_argument("--worker", type=int, default=0, help="this process's index, 0 .. workers-1")
    parser.add_argument("--deadline", type=float, default=None, help="start no shard after this many seconds")
    args = parser.parse_args()
    if not 0 <= args.worker < args.workers:
        parser.error(f"--worker: expected 0 .. {args.workers - 1}, got {args.worker}")
    spec = load_spec(args.grid)
    if isinstance(spec, SpeedSpec):
        run_speed(spec, args.results, args.sweep_id or spec.name)
        return
    shards = spec.shards()
    if args.interleave:
        shards = sorted(shards, key=lambda s: s.sample_index)  # stable: dataset order within an index
    mine = [(i, shard) for i, shard in enumerate(shards) if i % args.workers == args.worker]
    start = time.time()
    for i, shard in mine:
        if args.deadline is not None and time.time() - start > args.deadline:
            print(f"deadline: {args.deadline:.0f} s passed, stopping before shard {i + 1}", flush=True)
            break
        counts = execute_shard(shard, spec.model, spec.decode_steps, args.sweep_id or spec.name,
                               args.results, spec.run_timeout_s)
        print(f"[{time.time() - start:7.0f} s] shard {i + 1}/{len(shards)} {shard.dataset} "
              f"{shard.dataset_params.get('context_tokens')} #{shard.sample_index}: {counts}", flush=True)


def run_speed(spec: SpeedSpec, results: str, sweep_id: str) -> None:
    """Every group of a speed grid, one after another (resumable: finished measurements are skipped)."""
    start = time.time()
    plan = spec.plan()
    check_speed_plan(plan)
    for group in plan.groups:
        counts = execute_speed_group(plan, group, sweep_id, results,
                                     lambda line: print(f"[{time.time() - start:7.0f} s] {line}", flush=True))
        print(f"[{time.time() - start:7.0f} s] {group.describe()}: {counts}", flush=True)


if __name__ == "__main__":
    main()
