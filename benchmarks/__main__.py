"""The benchmark suites: `python -m benchmarks SUITE [SUITE ...] [--gpu] [--quick]`; and
`python -m benchmarks tables [--check]`: every published table, written from the stored results
(benchmarks/tables.py).

Each suite runs the scripts behind the documented tables, each in a process of its own (one
benchmark's JIT, allocator or buffer-cache state must not time the next; docs/learned.md, "How to
measure"), with the arguments those tables were made with:

  quality   RULER / passkey scores per method (benchmarks/QUALITY.md): the grids run resumably into
            --results, then the tables; the RULER parity table; the quantizers' next-token KL on the
            embedded model (docs/methods.md)
  e2e       decode and prefill per cache: the 32-layer Llama-8B shape on a GPU (docs/gpus.md), the
            embedded model on a CPU; how much of a step attention is
  kernels   each kernel against its reference or yardstick: KIVI quantize-and-pack against a copy,
            KIVI / scored / prompt-scoring attention against SDPA, TurboQuant's decode attention
            against its MLX reference and SDPA, the eviction kernels against MLX;
            on a CPU the C++ KIVI kernel, the batched eviction update and the BLAS
  memory    resident KV bytes per cache and prefill peaks per eviction method; eviction x quantization
            (bytes and KL against the full cache)
  workers   a sweep inline, with 1 and 2 Prefect shard workers, and on 2 Dask processes, on this machine

Without --gpu the CPU variant runs; --quick shrinks every size to a smoke run of seconds to a minute
(`make benchmarks` runs every CPU suite so). --dry-run prints the commands only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRIDS = HERE / "grids"
EVERY_CACHE = ["full", "kivi bits=2", "kivi bits=4", "streaming budget=0.5", "snapkv budget=0.5",
               "tova budget=0.5", "h2o budget=0.5", "keyformer budget=0.5"]


def quality(gpu: bool, quick: bool, results: Path) -> list[list[str]]:
    if quick:
        return [["run_grid.py", str(GRIDS / "quick.yaml"), "--results", str(results)],
                ["quality_tables.py", "--results", str(results), "--pivot"],
                ["ruler_parity.py", "--results", str(results / "ruler-parity.jsonl"), "-n", "1",
                 "--tasks", "niah_single_2"],
                ["quantizer_kl.py", "--quick"]]
    grids = [str(GRIDS / "quality_fixes.yaml"), str(GRIDS / "quality_ceiling.yaml")]
    # on a GPU 24 processes share it (the embedded model is small); resumable: rerun until every run is in
    runs = ([["gpu_grid.sh", "540", "24", *grids]] if gpu
            else [["run_grid.py", grid, "--interleave", "--results", str(results)] for grid in grids])
    return runs + [["quality_tables.py", "--results", str(results), "--pivot", "--protocols"],
                   ["ruler_parity.py", "--results", str(results / "ruler-parity.jsonl")],
                   ["quantizer_kl.py"]]


def e2e(gpu: bool, quick: bool, results: Path) -> list[list[str]]:
    if quick:
        return [["decode_cpu.py", "512"],
                ["e2e.py", "--tiny", "--layers", "4", "--contexts", "512", "--steps", "2", "--rounds", "1",
                 "--warmup", "1", "--prefill-rounds", "1", "--caches", "full", "kivi bits=2", "h2o budget=0.5"],
                ["step_budget.py", "--tiny", "--layers", "4", "--context", "512", "--batches", "1", "--steps", "2",
                 "--rounds", "1"]]
    if not gpu:
        return [["decode_cpu.py"]]
    return [["e2e.py", "--contexts", "32768", "--prefill-rounds", "1", "--caches", *EVERY_CACHE],
            ["e2e.py", "--contexts", "131072", "--prefill-rounds", "1", "--caches",
             *[c for c in EVERY_CACHE if not c.startswith("keyformer")]],
            ["e2e.py", "--batch", "4", "--contexts", "32768", "--prefill-rounds", "2", "--caches", *EVERY_CACHE],
            ["step_budget.py"],
            ["step_budget.py", "--context", "131072", "--batches", "1"]]


def kernels(gpu: bool, quick: bool, results: Path) -> list[list[str]]:
    if gpu:
        return [["kernel_scaling.py", "--contexts", "8192", "16384", "32768", "131072"],
                ["scored_attention_speed.py"],
                ["turboquant_speed.py", "--contexts", "8192", "32768"],
                ["prompt_passes_speed.py"],
                ["evict_gpu.py"]]
    if quick:
        return [["matmul_gflops.py", "--sizes", "256", "--runs", "2", "--contexts", "128", "--decode-steps", "4"],
                ["kivi_cpu.py", "attention", "--contexts", "512", "--repeat", "4"],
                ["eviction_update.py", "h2o", "streaming", "--n-kept", "256", "--rows", "3"]]
    return [["matmul_gflops.py"], ["kivi_cpu.py", "attention"], ["eviction_update.py"]]


def memory(gpu: bool, quick: bool, results: Path) -> list[list[str]]:
    if gpu:
        return [["eviction_gpu_memory.py", "32768", "131072", "--budget-s", "540"],
                ["eviction_gpu_memory.py", "8192", "32768", "--quantizers", "--budget-s", "150"]]
    composition = ["--context", "256", "--continuation", "4", "--samples", "1"] if quick else []
    return [["kivi_cpu.py", "memory"], ["eviction_cpu_8k.py", *(["1024"] if quick else []), "full", "h2o", "snapkv"],
            ["composition_cpu.py", *composition]]


def workers(gpu: bool, quick: bool, results: Path) -> list[list[str]]:
    return [["workers.py", "2" if quick else "6"]]


SUITES = {suite.__name__: suite for suite in (quality, e2e, kernels, memory, workers)}


def command(step: list[str]) -> list[str]:
    script = str(HERE / step[0])
    return (["bash", script] if script.endswith(".sh") else [sys.executable, script]) + step[1:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tables"]:  # the published tables, from the stored results (benchmarks/tables.py)
        sys.path.insert(0, str(HERE))
        import tables

        return tables.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="+", choices=list(SUITES), metavar="SUITE",
                        help=f"one or more of: {', '.join(SUITES)}")
    parser.add_argument("--gpu", action="store_true", help="the GPU variant (MLX CUDA; the documented H200 tables)")
    parser.add_argument("--quick", action="store_true", help="smoke-run sizes (CPU: seconds to a minute a suite)")
    parser.add_argument("--results", type=Path, default=None,
                        help="quality: where the grids' runs accumulate (default: results-quality, "
                             "or a temporary folder with --quick)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    # the scripts import the library of the checkout they are in, whatever is installed
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as scratch:
        results = args.results or (Path(scratch) if args.quick else Path("results-quality"))
        if args.gpu and "quality" in args.suites:
            env["KV_RESULTS"] = str(results)  # gpu_grid.sh's results folder
        for suite in args.suites:
            for step in SUITES[suite](args.gpu, args.quick, results):
                cmd = command(step)
                shown = ["python" if c == sys.executable else os.path.relpath(c) if c.startswith(str(HERE)) else c
                         for c in cmd]
                print(f"\n== {suite}: {shlex.join(shown)}", flush=True)
                if args.dry_run:
                    continue
                start = time.perf_counter()
                rc = subprocess.run(cmd, env=env).returncode
                print(f"== {step[0]}: {time.perf_counter() - start:.0f} s", flush=True)
                if rc:
                    print(f"== {step[0]} failed (exit {rc})", file=sys.stderr)
                    return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
