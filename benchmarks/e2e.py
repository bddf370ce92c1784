"""End-to-end decode speed of every cache through the drop-in API, on a GPU (the lent H200).

A random-weight mlx-lm Llama with the Llama-3.1-8B shape (`kvcompress.shapes`: hidden 4096, 32 heads, 8 KV heads, head_dim
128, intermediate 14336, vocab 128256; speed does not depend on the weights' values), fp16, batch 1
(`--batch B`: B different prompts of the same length decoded together; tok/s counts all B).
Each cache comes from `kvcompress.make_cache(model, method, ...)`: the classes the sweep uses. The
prompt is prefilled in 2048-token chunks (mlx-lm's default) into every cache, each decodes
`--warmup` greedy steps, and then in each of `--rounds` rounds every cache in turn (the order
rotated per round) decodes `--steps` steps timed two ways: synchronously per step (as the runner
times `step_ms`; the host time to build a step's graph is reported too) and pipelined as
`mlx_lm.generate` runs (the next step's graph built while the GPU runs this one). Taking turns
puts the machine's drift (clocks, host load: single runs moved by up to 1.5x between calls) on
every cache alike; x full is the ratio to the full cache's time in the same round (median and
range over the rounds). Also: resident KV MiB after prefill (`kvcompress.memory.live_kv_bytes`),
prefill seconds (an untimed full-cache prefill at each context first, and each cache first runs a
throw-away 2k prefill, so JIT compilation, kernel self-tests and the first long prefill's slowness stay
out of the timings; `--prefill-rounds` timed prefills per cache, taking turns as the
decode rounds do, x full per round), peak memory (the weights plus this cache's prefill) and which
kernel paths ran. The measurement itself is `kvcompress/speed.py`, which the speed sweep runs too
(`docs/speed.md`: batches, KV-memory budgets, results in the `speed` table); this script prints one
table without writing results.

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/e2e.py --contexts 8192 32768`
(`python -m benchmarks e2e --gpu` runs the documented tables; `--tiny`: a small Llama, a CPU smoke run).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402

from kvcompress import speed  # noqa: E402
from kvcompress.shapes import random_model  # noqa: E402

CACHES = {
    "full": ("full", {}),
    "kivi bits=2": ("kivi", {"bits": 2}),
    "kivi bits=4": ("kivi", {"bits": 4}),
    "kivi bits=2 grouped": ("kivi", {"bits": 2, "residual_policy": "grouped"}),
    "streaming budget=0.5": ("streaming", {"budget": 0.5}),
    "h2o budget=0.5": ("h2o", {"budget": 0.5}),
    "keyformer budget=0.5": ("keyformer", {"budget": 0.5}),
    "snapkv budget=0.5": ("snapkv", {"budget": 0.5}),
    "pyramidkv budget=0.5": ("pyramidkv", {"budget": 0.5}),
    "adakv budget=0.5": ("adakv", {"budget": 0.5}),
    "tova budget=0.5": ("tova", {"budget": 0.5}),
    "knorm budget=0.5": ("knorm", {"budget": 0.5}),
    "random budget=0.5": ("random", {"budget": 0.5}),
}


def spread(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (tok/s counts all)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per cache per round (each way)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every cache, taking turns")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prefill-rounds", type=int, default=3, help="timed prefills per cache, taking turns "
                        "(one prefill carries the machine's drift: the ratio moved 1.4-1.8x between runs)")
    parser.add_argument("--tiny", action="store_true", help="a small random Llama instead (a smoke run on a CPU)")
    parser.add_argument("--shape", default=None, help="another mlx-lm shape (kvcompress.shapes.SHAPES or a config.json)")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), help=f"labels from {list(CACHES)}")
    parser.add_argument("--skip", nargs="*", default=[], help="label@context pairs to skip, e.g. 'h2o budget=0.5@32768'")
    args = parser.parse_args()
    if "full" not in args.caches:
        parser.error("--caches must include full (every ratio is against it)")
    for flag, value in (("--batch", args.batch), ("--prefill-rounds", args.prefill_rounds), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} must be an integer >= 1, got {value}")
    shape = args.shape or ("tiny-llama" if args.tiny else "llama-3.1-8b")
    print("mlx", mx.__version__, mx.default_device(), f"{args.layers} layers, {shape} shape, fp16, batch {args.batch}",
          flush=True)
    model = random_model(shape, "float16", args.layers)
    print(f"weights {speed.weight_bytes(model) / 2**30:.1f} GiB", flush=True)
    speed.prefill(model, kvcompress.make_cache(model, "full"), list(range(2100)))  # JIT warm-up, not timed
    rows = []
    for T in args.contexts:
        # an untimed prefill at this length first: the process's first one runs ~2x slower (H200, 32k:
        # 2.77 s, then 1.27-1.57 s), and the cache timed first (the full cache) would pay for it
        speed.prefill(model, kvcompress.make_cache(model, "full"), speed.prompts(model, args.batch, T))
        gc.collect()
        runs = []
        for label in args.caches:
            if f"{label}@{T}" in args.skip:
                continue
            method, params = CACHES[label]
            t = time.time()
            try:
                run = speed.prepare(model, label, lambda m=method, p=params: kvcompress.make_cache(model, m, **p), T,
                                    args.batch, args.warmup)
            except Exception as exc:  # report and go on: one device call should bring back every row it can
                print(f"FAILED {label} @ {T}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                gc.collect()
                continue
            runs.append(run)
            paths = ",".join(f"{k.split('/')[0]}={v}" for k, v in run.kernels.items()) or "-"
            print(f"{run.label} @ {T}: {run.live_kv_bytes / 2**20:.0f} MiB, prefill {run.prefill_s[0]:.2f} s, "
                  f"peak {run.peak_memory_bytes / 2**30:.1f} GiB, {paths} [{time.time() - t:.0f} s]", flush=True)
        full = next((run for run in runs if run.label == "full"), None)
        if full is None:
            print(f"no full cache at {T}: no ratios", flush=True)
            continue
        speed.take_turns(model, runs, args.steps, args.rounds, args.prefill_rounds, lambda line: print(line, flush=True))
        rows += [(run, speed.ratio(full.decode_ms, run.decode_ms), speed.ratio(full.pipelined_ms, run.pipelined_ms),
                  speed.ratio(run.prefill_s, full.prefill_s))  # prefill: time, not speed: run / full
                 for run in runs]
        del runs
        gc.collect()
    print(f"\nmedian over {args.rounds} rounds of {args.steps} steps each way and {args.prefill_rounds} prefills; "
          "x full: per-round ratios, median (min-max)")
    print("| cache | context | decode ms/step | host graph ms | pipelined ms/step | tok/s | x full tok/s "
          "| pipelined x full | KV MiB | prefill s | x full prefill | peak GiB | kernels |\n|" + "---|" * 13)
    for r, x_full, x_pipelined, x_prefill in rows:
        ms, build, pipelined = (statistics.median(v) for v in (r.decode_ms, r.host_ms, r.pipelined_ms))
        paths = ",".join(f"{k.split('/')[0]}={v}" for k, v in r.kernels.items()) or "-"
        print(f"| {r.label} | {r.T} | {ms:.2f} | {build:.2f} | {pipelined:.2f} | {r.batch * 1e3 / ms:.1f} | "
              f"{spread(x_full)} | {spread(x_pipelined)} | {r.live_kv_bytes / 2**20:.0f} | "
              f"{statistics.median(r.prefill_s):.2f} | {spread(x_prefill)} | {r.peak_memory_bytes / 2**30:.1f} | {paths} |")

if __name__ == "__main__":
    main()
