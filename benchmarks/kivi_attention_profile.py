"""One KIVI decode-attention problem at the Llama-8B shape (8 KV heads, 32 query heads, D 128, fp16),
run a few times for a profiler (`ncu -k regex:kivi_decode`) to read: the fused kernel and, with
--reference, the quantized_matmul path.

Usage (a GPU with MLX CUDA): python benchmarks/kivi_attention_profile.py [--tokens 32768] [--bits 2] [--calls 3]
    [--tensor-cores [--steps N]]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompress.kernels import kivi_attention  # noqa: E402
import mlx.core as mx  # noqa: E402

from kvcompress.methods.kivi import KiviCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--module", default=None, help="another kivi_attention.py file to run instead")
    parser.add_argument("--tensor-cores", action="store_true", help="the tensor-core kernel (kivi_attention_mma.py)")
    parser.add_argument("--steps", type=int, default=None, help="its steps per warp (default: its own choice)")
    parser.add_argument("--one-launch", action="store_true", help="its blocks and the scalar tail's in one launch")
    args = parser.parse_args()
    module = kivi_attention
    if args.module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("kivi_attention_other", args.module)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    T = args.tokens
    k = mx.random.normal((1, 8, T, 128), key=mx.random.key(0)).astype(mx.float16)
    v = mx.random.normal((1, 8, T, 128), key=mx.random.key(1)).astype(mx.float16)
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(2)).astype(mx.float16)
    cache = KiviCache(args.bits, args.bits, 32, 128)
    cache.from_prefill(k[:, :, : T - 1], v[:, :, : T - 1], None)
    view = cache.update_and_fetch(k[:, :, T - 1 :], v[:, :, T - 1 :])
    mx.eval(view)
    for _ in range(args.calls):
        extra = dict(tensor_cores=args.tensor_cores, steps_per_warp=args.steps, one_launch=args.one_launch)
        out = module.decode_attention_fused(q, *view, 128**-0.5, False, args.bits, args.bits, 32, "cuda", **extra)
        mx.eval(out)
    want = kivi_attention.decode_attention_reference(q, *view, 128**-0.5, None, args.bits, args.bits, 32)
    err = (mx.linalg.norm((out - want).astype(mx.float32)) / mx.linalg.norm(want.astype(mx.float32))).item()
    print(f"rel. L2 vs reference: {err:.2e}")


if __name__ == "__main__":
    main()
