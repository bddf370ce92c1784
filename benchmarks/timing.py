"""Timing helpers shared by the benchmarks: medians in milliseconds, MLX work evaluated and (on a GPU)
synchronized inside the timed region."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx


def median_ms(fn, repeat: int = 50, warmup: int = 5) -> float:
    """Median time of building and evaluating fn()'s graph."""
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def median_eval_ms(fn, repeat: int = 30, warmup: int = 5) -> float:
    """Median time to evaluate fn()'s graph, built beforehand: the GPU work and MLX's per-op
    encoding, without the Python that builds the graph."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeat):
        outs = fn()
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def chained(call, queries: list) -> list:
    """call(i, q) for each layer i, its queries made to wait for layer i - 1's output (q + 0 * out: two
    small elementwise ops a layer, the same for every path), as a layer waits for the last in a model.
    Layers built side by side are independent, and MLX's GPU back-ends run them concurrently: a kernel
    that leaves SMs idle then looks cheaper than it is (H200, KIVI-2 at 32k, 16 steps a warp: 68 us a
    layer side by side, 150 chained)."""
    outs, prev = [], None
    for i, q in enumerate(queries):
        if prev is not None:
            q = q + 0 * prev
        prev = call(i, q)
        outs.append(prev)
    return outs


def interleaved_median_ms(*fns, reps: int) -> list[float]:
    """Median ms of each fn (which evaluates its own work), the fns taking turns so that load on a
    shared machine falls on all of them alike; the first round is the warm-up."""
    times = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            if rep:
                spent.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]
