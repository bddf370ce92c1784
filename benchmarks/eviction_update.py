"""Per-step cache update of every eviction method: batched over rows vs a per-row loop (CPU).

One decode step = update_and_fetch (append) + attention (output, score update, one eviction with
compaction where the method evicts while decoding), timed on caches already at capacity. "batched"
is one cache whose rows are all B*H_kv heads; "loop" is one single-row cache per head stepped in a
Python loop (what a per-head implementation costs). GQA 3 queries per KV head, D = 64 (the
embedded model's shape); n_kept 512 / 2048 / 8192 x rows 3 / 8 / 32 (issue #3's table). Median of
`REPS` steps after one warm-up, batched and loop steps taking turns (a change in the machine's load
hits both alike: the CPU is shared; its load average is printed first and last).

First, a small table answering: does MLX write into a buffer in place? A one-token write into a
[32, n, 64] float32 buffer per row (scatter, `mx.put_along_axis`; slice assignment `a[:, i] = x`)
when the buffer's only reference is handed over, the same scatter while a second reference is
alive, and a plain full copy (`a + 0`) for scale. The cache relies on the first kind.

    .venv/bin/python benchmarks/eviction_update.py [method ...] [--n-kept 512 2048 8192] [--rows 3 8 32]
"""

from __future__ import annotations

import argparse
import os
import sys

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from kvcompress.methods import REGISTRY, method_config
from kvcompress.methods.eviction.base import Eviction, EvictionCache
from timing import interleaved_median_ms  # benchmarks/timing.py (this script's folder)

REP, D = 3, 64
REPS = 7


def steady_cache(cfg, rows, n_kept, rope):
    """A cache right after its prompt was compressed, holding n_kept random tokens per row."""
    cache = EvictionCache(cfg, 0, 1, rows, D, rope, D**-0.5)
    cache.batch = 1
    cache.position = cache.offset = cache.prompt_len = n_kept
    cache.capacity, cache.recent = cfg.resolve(n_kept)
    cache.held_limit, cache.answer_start = cache.capacity, cache.prompt_len
    keys, values = mx.random.normal((rows, n_kept, D)), mx.random.normal((rows, n_kept, D))
    positions = mx.broadcast_to(mx.arange(n_kept, dtype=mx.int32), (rows, n_kept)) + 0
    scores = None if cfg.decode == "grow" else mx.random.uniform(shape=(rows, n_kept))
    cache.state = (keys, values, scores, positions, None, None, cache.meta_state)  # as a loaded cache
    mx.eval(cache.state[:4])
    return cache


def step(cache, k, v, q):
    keys, values = cache.update_and_fetch(k, v)
    out = cache.attention(q, keys, values, scale=D**-0.5, mask=None)
    mx.eval(out, *cache.state[:4])


def in_place_table(rows=32):
    print("| n slots | scatter, sole reference ms | slice assign, sole reference ms | scatter, 2nd reference alive ms | full copy ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in (512, 8192):
        state = {"buffer": mx.random.normal((rows, n, D))}
        token = mx.random.normal((rows, 1, D))
        slot = mx.random.randint(0, n, (rows, 1, 1)).astype(mx.int32)
        mx.eval(state["buffer"], token, slot)

        def scatter():
            state["buffer"] = mx.put_along_axis(state.pop("buffer"), slot, token, axis=1)
            mx.eval(state["buffer"])

        def assign():
            buffer = state.pop("buffer")
            buffer[:, 5:6] = token
            state["buffer"] = buffer
            mx.eval(buffer)

        def scatter_held():
            held = state["buffer"]  # alive while the scatter runs: MLX must copy
            state["buffer"] = mx.put_along_axis(held, slot, token, axis=1)
            mx.eval(state["buffer"])

        def copy():
            state["buffer"] = state.pop("buffer") + 0
            mx.eval(state["buffer"])

        times = interleaved_median_ms(scatter, assign, scatter_held, copy, reps=9)
        print(f"| {n} | " + " | ".join(f"{t:.3f}" for t in times) + " |")
    print()


def main(names, n_kept_sizes=(512, 2048, 8192), row_counts=(3, 8, 32)):
    rope = nn.RoPE(D, base=100000.0)
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}, cores: {os.cpu_count()}")
    in_place_table()
    print("| method | n_kept | B*H_kv | batched ms | loop ms | loop / batched |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        cfg = method_config(name, budget=1.0)
        for n_kept, rows in [(n, r) for n in n_kept_sizes for r in row_counts]:
            k = mx.random.normal((1, rows, 1, D))
            v = mx.random.normal((1, rows, 1, D))
            q = mx.random.normal((1, rows * REP, 1, D))
            batched = steady_cache(cfg, rows, n_kept, rope)
            heads = [steady_cache(cfg, 1, n_kept, rope) for _ in range(rows)]

            def loop():
                for h, cache in enumerate(heads):
                    step(cache, k[:, h : h + 1], v[:, h : h + 1], q[:, h * REP : (h + 1) * REP])

            batched_ms, loop_ms = interleaved_median_ms(lambda: step(batched, k, v, q), loop, reps=REPS)
            del batched, heads
            print(f"| {name} | {n_kept} | {rows} | {batched_ms:.2f} | {loop_ms:.2f} | {loop_ms / batched_ms:.2f} |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=sorted(n for n, c in REGISTRY.items() if issubclass(c, Eviction)))
    parser.add_argument("--n-kept", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[3, 8, 32])
    args = parser.parse_args()
    main(args.methods, args.n_kept, args.rows)
