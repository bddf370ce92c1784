"""Run a sweep grid shard by shard in this process, without Prefect (long measurements on one
machine). Resumable: finished runs are skipped, so a killed run picks up where it stopped.

    python benchmarks/run_grid.py benchmarks/grids/quality_full_1k.yaml --results results-quality
"""

from __future__ import annotations

import argparse
import time

import kvcompress  # noqa: F401  (first: OpenBLAS before MLX)
from kvcompress.execute import execute_shard
from kvcompress.sweep import load_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("grid")
    parser.add_argument("--results", default="results")
    parser.add_argument("--sweep-id", default=None)
    parser.add_argument("--interleave", action="store_true",
                        help="sample 0 of every dataset, then sample 1, ...: a stopped run has every cell at similar n")
    args = parser.parse_args()
    spec = load_spec(args.grid)
    shards = spec.shards()
    if args.interleave:
        shards = sorted(shards, key=lambda s: s.sample_index)  # stable: dataset order within an index
    start = time.time()
    for i, shard in enumerate(shards):
        counts = execute_shard(shard, spec.model, spec.decode_steps, args.sweep_id or spec.name,
                               args.results, spec.run_timeout_s)
        print(f"[{time.time() - start:7.0f} s] shard {i + 1}/{len(shards)} {shard.dataset} "
              f"{shard.dataset_params.get('context_tokens')} #{shard.sample_index}: {counts}", flush=True)


if __name__ == "__main__":
    main()
