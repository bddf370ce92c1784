"""TurboQuant decode attention per layer on a GPU: the fused kernel (kernels/turboquant_attention.py)
against the MLX reference it replaces, and against SDPA on a full fp16 cache of the same shape.

One decode step's attention call per layer, as the model makes it: TurboQuantCache.attention with the
step's own token fresh (its exact part merged by log-sum-exp), 8 KV heads, 32 query heads (4 rows a
KV head), D 128, fp16 queries; the path chosen with KVCOMPRESS_KERNELS (fused / reference). Each
layer's queries wait for the layer before's output (`chained`, as in a model), over enough layers
that their codes exceed the GPU's L2; median of the evaluations.

Usage (a GPU with MLX CUDA or Metal): python benchmarks/turboquant_speed.py [--contexts 8192 32768] [--bits 2 4]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcompress.kernels import dispatch  # noqa: E402  (kvcompress first: it picks the CPU BLAS)
import mlx.core as mx  # noqa: E402

from kvcompress.methods.quantization.turboquant import TurboQuantCache  # noqa: E402
from timing import chained, median_eval_ms  # noqa: E402

KV_HEADS, QUERY_HEADS, D = 8, 32, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--bits", type=int, nargs="*", default=[2, 4], choices=[2, 3, 4],
                        help="TurboQuant widths (integer; keys with QJL)")
    parser.add_argument("--layers", type=int, default=None, help="layers a timing (default: enough to exceed the L2)")
    args = parser.parse_args()
    if dispatch.gpu_backend() is None:
        raise SystemExit("needs MLX's CUDA or Metal back-end (these are GPU kernel timings)")
    print(f"device {mx.default_device()} ({dispatch.gpu_backend()}), MLX {mx.__version__}")
    print(f"\n## TurboQuant decode attention per layer: {KV_HEADS} KV heads, {QUERY_HEADS} query heads, D {D}, fp16")
    print("| tokens | cache | path | layers | ms/layer | live MiB/layer | x full SDPA | rel. L2 vs reference |")
    print("|---|---|---|---|---|---|---|---|")
    scale = D**-0.5
    for T in args.contexts:
        full_bytes = 2 * KV_HEADS * T * D * 2
        full_layers = args.layers or max(4, (1024 << 20) // full_bytes)
        kv = [(mx.random.normal((1, KV_HEADS, T, D), key=mx.random.key(2 * i)).astype(mx.float16),
               mx.random.normal((1, KV_HEADS, T, D), key=mx.random.key(2 * i + 1)).astype(mx.float16))
              for i in range(full_layers)]
        qs = [mx.random.normal((1, QUERY_HEADS, 1, D), key=mx.random.key(100 + i)).astype(mx.float16)
              for i in range(full_layers)]
        mx.eval(kv, qs)
        full_ms = median_eval_ms(lambda: chained(lambda i, q: mx.fast.scaled_dot_product_attention(
            q, *kv[i], scale=scale), qs)) / full_layers
        print(f"| {T} | full fp16 | SDPA | {full_layers} | {full_ms:.3f} | {full_bytes / 2**20:.0f} | 1.00 | - |")
        for bits in args.bits:
            layers = args.layers or max(4, (512 << 20) // (full_bytes * bits // 16))  # the codes' bytes over the GPU's L2
            caches, fresh = [], []
            for i in range(layers):
                k, v = kv[i % full_layers]
                cache = TurboQuantCache(bits, bits, seed=i)
                cache.update_and_fetch(k[:, :, : T - 1], v[:, :, : T - 1])
                cache.update_and_fetch(k[:, :, T - 1 :], v[:, :, T - 1 :])  # the step's own token
                fresh.append(cache._fresh)
                mx.eval(cache.arrays)
                caches.append(cache)
            live = sum(c.live_kv_bytes for c in caches) / layers

            def step(i, q):
                caches[i]._fresh = fresh[i]  # every evaluation is the same decode call
                return caches[i].attention(q, caches[i], caches[i], scale, None)

            outs, times = {}, {}
            for path in ("reference", "fused"):
                os.environ[dispatch.ENV] = path
                outs[path] = step(0, qs[0])
                mx.eval(outs[path])
                times[path] = median_eval_ms(lambda: chained(step, [qs[i % full_layers] for i in range(layers)])) / layers
            want = outs["reference"].astype(mx.float32)
            err = (mx.linalg.norm(outs["fused"].astype(mx.float32) - want) / mx.linalg.norm(want)).item()
            for path in ("reference", "fused"):
                print(f"| {T} | turboquant bits={bits} | {path} | {layers} | {times[path]:.3f} | {live / 2**20:.1f} | "
                      f"{full_ms / times[path]:.2f} | {'-' if path == 'reference' else f'{err:.1e}'} |")
            print(f"| {T} | turboquant bits={bits} | fused / reference | | {times['fused'] / times['reference']:.3f} | | | |")
    os.environ.pop(dispatch.ENV, None)


if __name__ == "__main__":
    main()
