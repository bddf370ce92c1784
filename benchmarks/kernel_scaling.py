"""The KIVI kernels on a GPU against their yardsticks: quantize-and-pack against a copy of the same
bytes, decode attention on codes against SDPA on the full cache (docs/gpus.md's tables).

1. quantize-and-pack of [N, 4096, 128] fp16 for N = 32 and 256 (32 and 256 MiB), both layouts, 2, 4
   and 8 bits, G 32, against `x * 1` (a read and a write of the same bytes) at the same size.
2. fused decode attention (8 KV heads, 32 query heads, D 128, fp16, one decode row per query head)
   at 8k / 32k / 128k tokens, against `mx.fast.scaled_dot_product_attention` on the full cache, per
   layer; enough layers that their bytes are ~0.5 GiB or more (more than the GPU's L2 cache). Each
   layer's queries wait for the layer before's output (`chained`), as in a model: layers timed side
   by side overlap on the GPU, and a launch that leaves SMs idle then looks cheap (docs/learned.md,
   "How to measure"). Paths: the scalar kernel, the tensor-core kernel, and the dispatch's default.

Usage (a GPU with MLX CUDA): python benchmarks/kernel_scaling.py [quant] [attn] [--contexts 8192 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcompress.kernels import kivi_attention  # noqa: E402  (kvcompress first: it picks the CPU BLAS)
import mlx.core as mx  # noqa: E402

from kvcompress.kernels.kivi_quant import quantize_pack_kernel  # noqa: E402
from kvcompress.methods.quantization.kivi import KiviCache  # noqa: E402
from timing import chained, median_eval_ms  # noqa: E402


def quant_table() -> None:
    print("\n## quantize-and-pack, [N, 4096, 128] fp16, G 32 (inputs rotate over >= 256 MiB)")
    print("| N | MiB | op | bits | ms/call | GB/s (read + written) | x copy time |")
    print("|---|---|---|---|---|---|---|")
    for n in (32, 256):
        count = max(2, 256 // n)
        xs = [mx.random.normal((n, 4096, 128), key=mx.random.key(i)).astype(mx.float16) for i in range(count)]
        mx.eval(xs)
        size = xs[0].nbytes
        copy_ms = median_eval_ms(lambda: [x * 1 for x in xs]) / count
        print(f"| {n} | {size >> 20} | x * 1 | - | {copy_ms:.3f} | {2 * size / copy_ms / 1e6:.0f} | 1.00 |")
        for bits in (2, 4, 8):
            moved = size + size * bits // 16 + 2 * 2 * (size // 2 // 32)
            for layout, per_channel in (("per token", False), ("per channel", True)):
                ms = median_eval_ms(lambda: [quantize_pack_kernel(x, bits, 32, per_channel, "cuda") for x in xs]) / count
                print(f"| {n} | {size >> 20} | kivi {layout} | {bits} | {ms:.3f} | {moved / ms / 1e6:.0f} | {ms / copy_ms:.2f} |")


def attn_table(contexts: list[int]) -> None:
    print("\n## decode attention per layer: 8 KV heads, 32 query heads, D 128, fp16, KIVI G 32, residual 128")
    print("| tokens | cache | path | layers | us/layer | MiB/layer | GB/s | x full | rel. L2 vs qmm reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    scale = 128**-0.5
    for T in contexts:
        full_bytes = 2 * 8 * T * 128 * 2
        layers = max(4, (512 << 20) // (full_bytes // 5))  # KIVI-2 is ~5x smaller than full
        qs = [mx.random.normal((1, 32, 1, 128), key=mx.random.key(100 + i)).astype(mx.float16) for i in range(layers)]
        full_layers = max(4, (1024 << 20) // full_bytes)
        kv = [(mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i)).astype(mx.float16),
               mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i + 1)).astype(mx.float16)) for i in range(full_layers)]
        mx.eval(qs, kv)
        full_us = 1e3 * median_eval_ms(lambda: chained(lambda i, q: mx.fast.scaled_dot_product_attention(
            q, *kv[i], scale=scale), qs[:full_layers])) / full_layers
        print(f"| {T} | full | SDPA | {full_layers} | {full_us:.1f} | {full_bytes / 2**20:.0f} | "
              f"{full_bytes / full_us / 1e3:.0f} | 1.00 | - |")
        for bits in (2, 4):
            views, live = [], 0
            for i in range(layers):
                k, v = kv[i % full_layers]
                cache = KiviCache(bits, bits, 32, 128)
                cache.from_prefill(k[:, :, : T - 1], v[:, :, : T - 1], None)
                views.append(cache.update_and_fetch(k[:, :, T - 1 :], v[:, :, T - 1 :]))
                mx.eval(views[-1])
                live += cache.live_kv_bytes
            per_layer = live / layers
            # KIVI-2 takes the tensor cores from TENSOR_CORE_MIN_TOKENS on ("default"); KIVI-4 the scalar kernel
            paths = [("scalar kernel", dict(tensor_cores=False)), ("tensor cores", dict(tensor_cores=True)), ("default", {})]
            want = kivi_attention.decode_attention_reference(qs[0], *views[0], scale, None, bits, bits, 32)
            for path, extra in paths:
                us = 1e3 * median_eval_ms(lambda: chained(lambda i, q: kivi_attention.decode_attention_fused(
                    q, *views[i], scale, False, bits, bits, 32, "cuda", **extra), qs)) / layers
                got = kivi_attention.decode_attention_fused(qs[0], *views[0], scale, False, bits, bits, 32, "cuda", **extra)
                err = (mx.linalg.norm((got - want).astype(mx.float32)) / mx.linalg.norm(want.astype(mx.float32))).item()
                print(f"| {T} | KIVI-{bits} | {path} | {layers} | {us:.1f} | {per_layer / 2**20:.1f} | "
                      f"{per_layer / us / 1e3:.0f} | {full_us / us:.2f} | {err:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help="quant and/or attn (default: both)")
    parser.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768, 131072])
    args = parser.parse_args()
    print(f"device {mx.default_device()}, MLX {mx.__version__}")
    parts = args.parts or ["quant", "attn"]
    if set(parts) - {"quant", "attn"}:
        parser.error(f"parts: expected quant and/or attn, got {parts}")
    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA back-end and an NVIDIA GPU (these are mx.fast.cuda_kernel timings)")
    if "quant" in parts:
        quant_table()
    if "attn" in parts:
        attn_table(args.contexts)


if __name__ == "__main__":
    main()
