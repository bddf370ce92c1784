"""KIVI on a CUDA GPU (the lent H200): kernel exactness, quantize-and-pack bandwidth, decode attention.

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/kivi_gpu.py [sections]`
(sections: exact attn bandwidth decode; default: all). Needs only mlx and mlx-lm. Prints:
1. the fused CUDA quantize-and-pack kernel vs the plain MLX reference (run on the CPU stream, and on
   the GPU stream), bit for bit, over dtypes x bits x group sizes x layouts x shapes x input kinds;
   every output is poisoned twice (two init values) so an unwritten element cannot pass;
2. quantize-and-pack bandwidth on [32, 4096, 128] fp16 ((bytes read + written) / median time)
   against a measured copy ceiling, the MLX reference path and mx.quantize;
3a. the fused decode attention kernel (kvcompress/kernels/kivi_attention.py) and the quantized_matmul
   reference against dequantize-then-attend in float32 on the CPU (relative L2 error);
3b. decode attention at 32k context, 8 KV heads, 32 query heads, D = 128, fp16, 32 layers per timed
   step: KIVI-2 / KIVI-4 / K4V2 on codes -- the fused kernel (several tiles-per-block settings) and the
   quantized_matmul reference -- vs the full cache (mx.fast.scaled_dot_product_attention); each layer's
   queries wait for the layer before's output (timing.chained), as in a model;
4. one decode step of the caches alone (update_and_fetch, then attention) at 32k, 32 layers.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcompress  # noqa: E402,F401  (BLAS preload; harmless on GPU)
import mlx.core as mx  # noqa: E402
from kvcompress.attention import reference_attention  # noqa: E402
from kvcompress.kernels.kivi_attention import (  # noqa: E402
    decode_attention,
    decode_attention_fused,
    decode_attention_reference,
)
from kvcompress.kernels.kivi_quant import quantize_pack_kernel, quantize_pack_reference  # noqa: E402
from kvcompress.methods.kivi import KiviCache  # noqa: E402
from timing import chained, median_eval_ms, median_ms  # noqa: E402


def make_input(kind: str, shape, dtype, key):
    if kind == "normal":
        x = mx.random.normal(shape, key=key)
    elif kind == "outlier":  # a few channels 20x larger, as in KIVI's key statistics
        x = mx.random.normal(shape, key=key) * mx.where(mx.arange(shape[-1]) % 17 == 3, 20.0, 1.0)
    elif kind == "ties":  # multiples of 1/2 in [0, 7.5]: exact .5 ties on the code grid
        x = mx.random.randint(0, 16, shape, key=key).astype(mx.float32) / 2
    else:  # "constant" rows: scale 0
        x = mx.broadcast_to(mx.random.normal(shape[:-1] + (1,), key=key), shape)
    return x.astype(dtype)


def exactness_table():
    print("\n## 1. fused CUDA quantize-and-pack vs MLX reference (bit-exact)")
    # small enough that the CPU-stream reference (emulated fp16/bf16) stays fast
    shapes_tok = [(1, 1, 1, 128), (1, 8, 7, 128), (2, 3, 33, 256)]  # groups along the last axis
    shapes_ch = [(1, 1, 1, 64), (1, 8, 3, 128), (2, 3, 2, 96)]  # dim 2 counts groups of G tokens
    kinds = ["normal", "outlier", "ties", "constant"]
    rows, key = [], mx.random.key(0)
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        for bits in (2, 3, 4, 8):
            for G in (32, 64, 128):
                for per_channel in (False, True):
                    n = exact_cpu = exact_gpu = 0
                    shapes = shapes_ch if per_channel else shapes_tok
                    for shape in shapes:
                        if per_channel:
                            shape = shape[:2] + (shape[2] * G, shape[3])
                        elif shape[-1] % G:
                            continue
                        for kind in kinds:
                            key, sub = mx.random.split(key)
                            x = make_input(kind, shape, dtype, sub)
                            mx.eval(x)
                            outs = []
                            for poison in (3.0, 5.0):
                                outs.append(quantize_pack_kernel(x, bits, G, per_channel, "cuda", init_value=poison))
                            with mx.stream(mx.cpu):
                                ref_cpu = quantize_pack_reference(x, bits, G, per_channel)
                                mx.eval(ref_cpu)
                            ref_gpu = quantize_pack_reference(x, bits, G, per_channel)
                            mx.eval(outs, ref_gpu)
                            n += 1
                            exact_cpu += all(mx.array_equal(o, r).item() for out in outs for o, r in zip(out, ref_cpu))
                            exact_gpu += all(mx.array_equal(o, r).item() for o, r in zip(outs[0], ref_gpu))
                    rows.append((str(dtype).split(".")[-1], bits, G, "per-channel" if per_channel else "per-token", n, exact_cpu, exact_gpu))
    print(f"{'dtype':9} {'bits':>4} {'G':>4} {'layout':12} {'cases':>5} {'exact_vs_cpu_ref':>16} {'exact_vs_gpu_ref':>16}")
    for r in rows:
        print(f"{r[0]:9} {r[1]:>4} {r[2]:>4} {r[3]:12} {r[4]:>5} {r[5]:>16} {r[6]:>16}")
    total, cpu_ok, gpu_ok = (sum(r[i] for r in rows) for i in (4, 5, 6))
    print(f"TOTAL cases {total}: bit-exact vs CPU reference {cpu_ok}, vs GPU reference {gpu_ok}")


def bandwidth_table(shape=(32, 4096, 128), big_shape=(1024, 1024, 256)):
    print(f"\n## 2. quantize-and-pack bandwidth, {list(shape)} fp16, G = 32 (8 rotating inputs)")
    xs = [mx.random.normal(shape, key=mx.random.key(i)).astype(mx.float16) for i in range(8)]
    big = mx.random.normal(big_shape, key=mx.random.key(99)).astype(mx.float16)  # 512 MiB
    mx.eval(xs, big)
    copy_ms = median_ms(lambda: big * 1, repeat=20)
    ceiling = 2 * big.nbytes / copy_ms / 1e6  # GB/s
    print(f"copy ceiling (x * 1 on {big.nbytes // 2**20} MiB fp16): {ceiling:.0f} GB/s read+write")
    print(f"{'path':38} {'bits':>4} {'ms/call':>8} {'GB/s':>8} {'% ceiling':>9}")
    n = xs[0].size
    # one eval runs all 8 inputs, so the per-call host sync (~0.2 ms) does not hide the kernel time
    for bits in (2, 4):
        moved = xs[0].nbytes + n * bits // 8 + 2 * (n // 32) * 2
        cases = [
            ("kivi cuda kernel, per-token (values)", lambda x: quantize_pack_kernel(x, bits, 32, False, "cuda")),
            ("kivi cuda kernel, per-channel (keys)", lambda x: quantize_pack_kernel(x, bits, 32, True, "cuda")),
            ("kivi MLX reference, per-token", lambda x: quantize_pack_reference(x, bits, 32, False)),
            ("kivi MLX reference, per-channel", lambda x: quantize_pack_reference(x, bits, 32, True)),
            ("mx.quantize (per-token, affine)", lambda x: mx.quantize(x, group_size=32, bits=bits)),
        ]
        for name, fn in cases:
            ms = median_ms(lambda: [fn(x) for x in xs], repeat=20) / len(xs)
            gbs = moved / ms / 1e6
            print(f"{name:38} {bits:>4} {ms:8.3f} {gbs:8.0f} {100 * gbs / ceiling:8.1f}%")


def check_attention():
    print("\n## 3a. attention on codes vs dequantize-then-attend (float32 on the CPU), fp16, 8 KV heads, D 128, rel. L2 error")
    key = mx.random.key(7)
    print(f"{'codes':6} {'L':>2} {'rows':>4} {'fused':>9} {'reference':>9}")
    for kb, vb in ((2, 2), (4, 2), (4, 4), (8, 8)):
        k1, k2, k3 = mx.random.split(key, 3)
        keys = mx.random.normal((1, 8, 1000, 128), key=k1).astype(mx.float16)
        values = mx.random.normal((1, 8, 1000, 128), key=k2).astype(mx.float16)
        for L, mask in ((1, None), (2, "causal")):  # one decode step; two positions (speculative decoding)
            cache = KiviCache(kb, vb, 32, 128)
            cache.from_prefill(keys[:, :, : 1000 - L], values[:, :, : 1000 - L], None)
            view = cache.update_and_fetch(keys[:, :, 1000 - L :], values[:, :, 1000 - L :])
            q = mx.random.normal((1, 32, L, 128), key=k3).astype(mx.float16)
            fused = decode_attention_fused(q, *view, 128**-0.5, L > 1, kb, vb, 32, "cuda")
            refp = decode_attention_reference(q, *view, 128**-0.5, mask, kb, vb, 32)
            with mx.stream(mx.cpu):
                kd, vd = cache._dequantize_sides(*view)
                ref = reference_attention(q.astype(mx.float32), kd.astype(mx.float32), vd.astype(mx.float32), 128**-0.5, mask)
                mx.eval(ref)
            errs = [(mx.linalg.norm(o.astype(mx.float32) - ref) / mx.linalg.norm(ref)).item() for o in (fused, refp)]
            print(f"K{kb}V{vb}   {L:>2} {32 * L // 8:>4} {errs[0]:9.2e} {errs[1]:9.2e}")


def decode_table(T=32768, layers=32):
    print(f"\n## 3b. decode attention, {T} context, 8 KV heads, 32 query heads, D = 128, fp16, {layers} layers/step")
    scale = 128**-0.5
    qs = [mx.random.normal((1, 32, 1, 128), key=mx.random.key(1000 + i)).astype(mx.float16) for i in range(layers)]
    full = []
    for i in range(layers):
        k = mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i)).astype(mx.float16)
        v = mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i + 1)).astype(mx.float16)
        full.append((k, v))
    mx.eval(full, qs)
    full_bytes = sum(k.nbytes + v.nbytes for k, v in full)
    def sdpa():  # each layer waits for the one before, as in a model (timing.chained)
        return chained(lambda i, q: mx.fast.scaled_dot_product_attention(q, *full[i], scale=scale), qs)

    full_ms, full_eval = median_ms(sdpa, repeat=30), median_eval_ms(sdpa)
    print("ms/step: graph built and evaluated; eval ms: evaluation of a graph built beforehand (GPU + MLX encoding);")
    print("GB/s and speedup from eval ms")
    print(f"{'cache':8} {'path':22} {'ms/step':>8} {'eval ms':>8} {'us/layer':>9} {'KV MiB':>8} {'x smaller':>9} {'GB/s':>7} {'speedup':>8}")
    print(f"{'full':8} {'mx.fast SDPA':22} {full_ms:8.3f} {full_eval:8.3f} {1e3 * full_eval / layers:9.1f} {full_bytes / 2**20:8.0f} "
          f"{1.0:9.2f} {full_bytes / full_eval / 1e6:7.0f} {1.0:8.2f}")
    for kb, vb in ((2, 2), (4, 4), (4, 2)):
        caches, views = [], []
        for k, v in full:
            c = KiviCache(kb, vb, 32, 128)
            c.from_prefill(k[:, :, : T - 1], v[:, :, : T - 1], None)
            views.append(c.update_and_fetch(k[:, :, T - 1 :], v[:, :, T - 1 :]))
            caches.append(c)
            mx.eval(c.state[:8], views[-1])
        live = sum(c.live_kv_bytes for c in caches)
        name = f"KIVI-{kb}" if kb == vb else f"K{kb}V{vb}"
        paths = {
            "reference (qmm)": lambda q, vw: decode_attention_reference(q, *vw, scale, None, kb, vb, 32),
            "fused (dispatch)": lambda q, vw: decode_attention(q, *vw, scale, None, kb, vb, 32),
        }
        for tpb in (1, 2, 4):
            paths[f"fused tiles/block={tpb}"] = (
                lambda q, vw, tpb=tpb: decode_attention_fused(q, *vw, scale, False, kb, vb, 32, "cuda", tiles_per_block=tpb))
        for path, fn in paths.items():
            step = lambda: chained(lambda i, q: fn(q, views[i]), qs)  # noqa: E731
            ms, ev = median_ms(step, repeat=30), median_eval_ms(step)
            print(f"{name:8} {path:22} {ms:8.3f} {ev:8.3f} {1e3 * ev / layers:9.1f} {live / 2**20:8.0f} {full_bytes / live:9.2f} "
                  f"{live / ev / 1e6:7.0f} {full_eval / ev:8.2f}")
        del caches, views


def step_table(T=32768, layers=32, steps=40):
    print(f"\n## 4. one decode step of the caches alone (no model), {T} context, 8 KV heads, 32 query heads, D 128, fp16, {layers} layers")
    from mlx_lm.models.cache import KVCache

    scale = 128**-0.5
    new_k = [mx.random.normal((1, 8, 1, 128), key=mx.random.key(3000 + i)).astype(mx.float16) for i in range(steps)]
    q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(77)).astype(mx.float16)
    mx.eval(new_k, q)
    print(f"{'cache':22} {'update ms':>9} {'update+attn ms':>14} {'host graph ms':>13}")
    for label in ("full", "kivi-2 paper", "kivi-2 grouped", "kivi-4 paper"):
        caches = []
        for i in range(layers):
            k = mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i)).astype(mx.float16)
            v = mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i + 1)).astype(mx.float16)
            if label == "full":
                c = KVCache()
                c.update_and_fetch(k, v)
            else:
                bits = 4 if "kivi-4" in label else 2
                c = KiviCache(bits, bits, 32, 128, "grouped" if "grouped" in label else "paper")
                c.from_prefill(k, v, None)
            mx.eval(c.state)
            caches.append(c)
            del k, v

        def run(attend):
            times, build = [], []
            for s in range(steps):
                t0 = time.perf_counter()
                outs = []
                for c in caches:
                    kk, vv = c.update_and_fetch(new_k[s], new_k[s])
                    if attend:
                        if label == "full":
                            outs.append(mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale))
                        else:
                            outs.append(c.attention(q, kk, vv, scale=scale, mask=None))
                    else:
                        outs.append(c.keys)
                t1 = time.perf_counter()
                mx.eval(outs)
                mx.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
                build.append(1e3 * (t1 - t0))
            return statistics.median(times[5:]), statistics.median(build[5:])

        upd, _ = run(False)
        both, build = run(True)
        print(f"{label:22} {upd:9.3f} {both:14.3f} {build:13.3f}")
        del caches


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    print("mlx", mx.__version__, mx.default_device(), "cuda" if mx.cuda.is_available() else "no cuda")
    parts = sys.argv[1:] or ["exact", "attn", "bandwidth", "decode", "step"]
    sections = (("exact", exactness_table), ("attn", check_attention), ("bandwidth", bandwidth_table),
                ("decode", decode_table), ("step", step_table))
    for part, fn in sections:
        if part in parts:
            t = time.time()
            try:
                fn()
            except Exception as e:  # report and go on: one device call should bring back every table it can
                print(f"FAILED {part}: {type(e).__name__}: {e}")
            print(f"[{part}: {time.time() - t:.1f} s]")
