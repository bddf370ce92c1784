"""GPU time of a scoring method's decode attention per layer: the scored_attention kernels (each
variant) against what they replace and against the full cache's SDPA, in one process.

Per call, in a graph of 32 independent calls (as a 32-layer step; inputs rotate over 8 buffers so
L2 does not hold them), median of `--repeats` evaluations:
  sdpa             cuDNN SDPA over the same slots (the output alone; what a window method pays)
  sdpa + mlx ops   SDPA, then the scores' own logits (q @ K^T), softmax, column sum, add: the path
                   before the kernels (H2O)
  kernels ...      scored_attention_fused: plain (H2O's update in the launch) or with Keyformer's
                   noise, choosing the slot to evict (evicts), with one load of C consecutive
                   channels per lane (vec: VEC_LOADS) or not, 4 or 8 slots per warp step (unroll: MAX_UNROLL)

    python benchmarks/scored_attention_speed.py [--slots 16385] [--rows 8] [--group 4] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from kvcompress.kernels import scored_attention as kernel  # noqa: E402
from kvcompress.kernels.evict import evict_slot_fused  # noqa: E402
from kvcompress.methods.eviction.scoring.prompt_scores import folded_logits  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=16385)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    R, G, D, n = args.rows, args.group, args.head_dim, args.slots
    allocated = -(-n // 256) * 256
    scale = D**-0.5
    backend = "cuda" if mx.cuda.is_available() else "metal"
    buffers = [mx.random.normal((R, allocated, D)).astype(mx.float16) for _ in range(8)]
    queries = [mx.random.normal((R, G, D)).astype(mx.float16) for _ in range(32)]
    scores = mx.random.uniform(shape=(R, n))
    noise = kernel.random_noise(R, G, allocated)
    mx.eval(buffers, queries, scores, noise.streams, noise.positions)

    def per_call(build) -> float:
        mx.eval(build())
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            mx.eval(build())
            times.append(time.perf_counter() - start)
        return statistics.median(times) / 32 * 1e6

    def sdpa(i):
        K, V = buffers[i % 8], buffers[(i + 1) % 8]
        return mx.fast.scaled_dot_product_attention(queries[i].reshape(1, R * G, 1, D), K.reshape(1, R, allocated, D)[:, :, :n],
                                                    V.reshape(1, R, allocated, D)[:, :, :n], scale=scale)

    def mlx_ops(i):
        logits = folded_logits(queries[i][:, :, None], buffers[i % 8][:, :n], scale)
        return [sdpa(i), scores + mx.softmax(logits, axis=-1, precise=True).sum(axis=(1, 2))]

    evict = kernel.EvictAt(noise.positions, 4, allocated - 64)

    def kernels(i, vec=kernel.VEC_LOADS, noisy=False, evicts=False, unroll=kernel.MAX_UNROLL):
        return kernel.scored_attention_fused(queries[i], buffers[i % 8], buffers[(i + 1) % 8], n, scale, scores,
                                             noise if noisy else None, evict if evicts else None, backend,
                                             vec_loads=vec, max_unroll=unroll)

    print(f"mlx {mx.__version__} {mx.default_device()}, {R} rows x {G} heads, D {D}, float16, {n} slots; us per call")
    rows = [("sdpa", lambda: [sdpa(i) for i in range(32)]),
            ("sdpa + mlx ops (H2O before)", lambda: [mlx_ops(i) for i in range(32)])]
    def kernels_then_evict_slot(i):  # the slot chosen by its own launch, as before EVICT
        out, logits, sums, _ = kernels(i)
        return [out, evict_slot_fused(sums, noise.positions[:, :n], 4, allocated - 64, backend)]

    rows.append(("kernels + evict_slot", lambda: [kernels_then_evict_slot(i) for i in range(32)]))
    # the defaults, then each knob turned the other way (the loads, the unroll; 8 and per-channel loads
    # were the first kernels' choice)
    variants = [dict(), dict(noisy=True), dict(evicts=True), dict(noisy=True, evicts=True),
                dict(vec=not kernel.VEC_LOADS), dict(unroll=12 - kernel.MAX_UNROLL),
                dict(vec=not kernel.VEC_LOADS, unroll=12 - kernel.MAX_UNROLL),
                # 2 slots a step: at 8 heads (--group 8) 126 registers a thread against the
                # default's 136 (scripts/cuda_compile_check.py), more warps per SM
                dict(unroll=2)]
    for options in variants:
        name = "kernels " + " ".join(f"{k}={v}" for k, v in options.items())
        rows.append((name, lambda options=options: [kernels(i, **options) for i in range(32)]))
    for rnd in range(2):  # twice: the second round shows the noise of the measurement
        for name, build in rows:
            print(f"round {rnd}  {name:30s} {per_call(build):7.1f}", flush=True)


if __name__ == "__main__":
    main()
