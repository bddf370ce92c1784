"""Keyformer per-step cache update: batched over rows vs a per-head loop (CPU).

One decode step = update_and_fetch (append) + attention (output, Gumbel-softmax score update,
one eviction with compaction), timed on caches already at capacity. "batched" is one cache whose
rows are all B*H_kv heads; "loop" is one single-head cache per row, stepped in a Python loop (what
a per-head implementation costs). GQA 3 queries per KV head, D = 64 (the embedded model's shape).

    .venv/bin/python benchmarks/keyformer_update.py
"""

from __future__ import annotations

import time

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn

from kvcompress.methods.keyformer import Keyformer, KeyformerCache

REP, D = 3, 64


def steady_cache(cfg, rows, n_kept, rope):
    """A cache at capacity after its prompt, holding n_kept random tokens per row."""
    cache = KeyformerCache(cfg, 0, rows, D, rope, D**-0.5)
    cache.batch = 1
    keys = mx.random.normal((rows, n_kept, D))
    cache.state = keys, mx.random.normal((rows, n_kept, D)), mx.random.uniform(shape=(rows, n_kept)), mx.broadcast_to(
        mx.arange(n_kept, dtype=mx.int32), (rows, n_kept)
    )
    cache.position = cache.offset = cache.prompt_len = n_kept
    cache.capacity, cache.recent = cfg.resolve(n_kept)
    mx.eval(cache.state)
    return cache


def step(cache, k, v, q):
    cache.update_and_fetch(k, v)
    out = cache.attention(q, None, None, scale=D**-0.5, mask=None)
    mx.eval(out, *cache.state)


def median_ms(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    rope = nn.RoPE(D, base=100000.0)
    cfg = Keyformer(budget=1.0)
    print(f"{'n_kept':>6} {'B*H_kv':>6} {'batched_ms':>10} {'loop_ms':>8} {'loop/batched':>12}")
    for n_kept in (512, 2048, 8192):
        for rows in (3, 8, 32):
            reps = 7 if n_kept * rows < 100_000 else 3
            k = mx.random.normal((1, rows, 1, D))
            v = mx.random.normal((1, rows, 1, D))
            q = mx.random.normal((1, rows * REP, 1, D))
            batched = steady_cache(cfg, rows, n_kept, rope)
            batched_ms = median_ms(lambda: step(batched, k, v, q), reps)
            del batched
            heads = [steady_cache(cfg, 1, n_kept, rope) for _ in range(rows)]

            def loop():
                for h, cache in enumerate(heads):
                    step(cache, k[:, h : h + 1], v[:, h : h + 1], q[:, h * REP : (h + 1) * REP])

            loop_ms = median_ms(loop, reps)
            del heads
            print(f"{n_kept:>6} {rows:>6} {batched_ms:>10.2f} {loop_ms:>8.2f} {loop_ms / batched_ms:>12.2f}")


if __name__ == "__main__":
    main()
