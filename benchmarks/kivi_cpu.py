"""KIVI on CPU: measured KV memory at 4096 tokens, and decode step time at 2k/4k/8k context.

`.venv/bin/python benchmarks/kivi_cpu.py` prints three tables (ratios from one run):
1. memory at 4096 tokens for one layer of the embedded model (3 KV heads, D = 64) and of a
   Llama-3.1-8B layer (8 KV heads, D = 128): live bytes (sum of the arrays held), MLX's active-memory
   delta, and the ratio against the fp16 and fp32 full caches; KIVI (G = 32, R = 128) and mlx-lm's
   QuantizedKVCache (per-token keys, G = 64, its default) in the same sweep;
2. one layer's decode attention time at 2k/4k/8k (SmolLM2's 9/3/64 and Llama-8B's 32/8/128 heads);
3. decode step time of the embedded SmolLM2-135M (fp32, 30 layers, the whole model) at 2k/4k/8k
   context: full cache, KIVI-2, KIVI-4, K4V2, mlx-lm QuantizedKVCache 4/8. Caches are filled with
   random post-RoPE keys/values (step time does not depend on the values; an 8k CPU prefill would
   take minutes); methods take turns step by step; median of 12 steps after 2 warm-up steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcompress  # noqa: E402  (BLAS preload before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

from kvcompress.memory import layer_live_kv_bytes  # noqa: E402
from kvcompress.model import model_info  # noqa: E402
from kvcompress.methods.quantization.kivi import KiviCache  # noqa: E402

CACHES = {
    "full": lambda: KVCache(),
    "KIVI-2": lambda: KiviCache(2, 2, 32, 128),
    "KIVI-4": lambda: KiviCache(4, 4, 32, 128),
    "K4V2": lambda: KiviCache(4, 2, 32, 128),
    "KIVI-8": lambda: KiviCache(8, 8, 32, 128),
    "mlx-quant-2": lambda: QuantizedKVCache(group_size=64, bits=2),
    "mlx-quant-4": lambda: QuantizedKVCache(group_size=64, bits=4),
    "mlx-quant-8": lambda: QuantizedKVCache(group_size=64, bits=8),
}


def fill(cache, keys, values):
    if isinstance(cache, KiviCache):
        cache.from_prefill(keys, values, None)
    else:
        cache.update_and_fetch(keys, values)
    mx.eval([a for a in _arrays(cache)])


def _arrays(cache):
    if isinstance(cache, KiviCache):
        return [a for a in cache.state[:8] if a is not None]
    state = cache.state
    flat = []
    for s in state:
        if isinstance(s, mx.array):
            flat.append(s)
        elif isinstance(s, (tuple, list)):
            flat.extend(s)
    return flat


def memory_table(T=4096):
    print(f"\n## KV memory at {T} tokens, one layer (live bytes = arrays held; active = MLX counter delta)")
    print(f"{'layer':16} {'dtype':8} {'cache':12} {'live KiB':>9} {'active KiB':>10} {'vs fp16 full':>12} {'vs fp32 full':>12}")
    for layer, H, D in (("SmolLM2 (3x64)", 3, 64), ("Llama-8B (8x128)", 8, 128)):
        for dtype in (mx.float16, mx.float32):
            fp16_full = 2 * T * H * D * 2
            for name, make in CACHES.items():
                gc.collect()
                start = mx.get_active_memory()
                keys = mx.random.normal((1, H, T, D), key=mx.random.key(1)).astype(dtype)
                values = mx.random.normal((1, H, T, D), key=mx.random.key(2)).astype(dtype)
                cache = make()
                fill(cache, keys, values)
                del keys, values
                gc.collect()
                active = mx.get_active_memory() - start
                live = layer_live_kv_bytes(cache)
                print(f"{layer:16} {str(dtype).split('.')[-1]:8} {name:12} {live / 1024:9.0f} {active / 1024:10.0f} "
                      f"{fp16_full / live:12.2f} {2 * fp16_full / live:12.2f}")
                del cache


def attention_table(contexts=(2048, 4096, 8192), repeat=40):
    """One layer's decode attention (1 query token) on packed/full caches, interleaved, median."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    names = ["full", "KIVI-2", "KIVI-4", "K4V2", "mlx-quant-4", "mlx-quant-8"]
    for n_q, H, D in ((9, 3, 64), (32, 8, 128)):
        print(f"\n## One layer's decode attention, fp32 CPU, {n_q} query heads, {H} KV heads, D = {D}: us/call")
        print(f"{'context':>8} " + " ".join(f"{n:>11}" for n in names) + "   KIVI-2/full  KIVI-4/full")
        for T in contexts:
            keys = mx.random.normal((1, H, T, D), key=mx.random.key(1))
            values = mx.random.normal((1, H, T, D), key=mx.random.key(2))
            new_k, new_v = keys[:, :, -1:], values[:, :, -1:]
            q = mx.random.normal((1, n_q, 1, D), key=mx.random.key(3))
            calls = {}
            for name in names:
                cache = CACHES[name]()
                fill(cache, keys[:, :, :-1], values[:, :, :-1])
                fetched = cache.update_and_fetch(new_k, new_v)
                mx.eval(fetched)
                if name == "full":
                    calls[name] = lambda f=fetched: mx.fast.scaled_dot_product_attention(q, *f, scale=D**-0.5)
                elif name.startswith("mlx-quant"):
                    calls[name] = lambda f=fetched, c=cache: quantized_scaled_dot_product_attention(
                        q, *f, scale=D**-0.5, mask=None, group_size=c.group_size, bits=c.bits)
                else:
                    calls[name] = lambda f=fetched, c=cache: c.attention(q, *f, scale=D**-0.5, mask=None)
            times = {name: [] for name in names}
            for _ in range(repeat + 3):
                for name in names:
                    t = time.perf_counter()
                    mx.eval(calls[name]())
                    times[name].append(1e6 * (time.perf_counter() - t))
            row = {name: statistics.median(times[name][3:]) for name in names}
            print(f"{T:>8} " + " ".join(f"{row[n]:11.0f}" for n in names)
                  + f"   {row['KIVI-2'] / row['full']:11.2f}  {row['KIVI-4'] / row['full']:11.2f}")


def decode_table(contexts=(2048, 4096, 8192), steps=12, warmup=2):
    model, _ = kvcompress.load_model()
    kvcompress.make_cache(model, "full")  # installs the attention hook
    info = model_info(model)
    layers, H, D = info["n_layers"], info["n_kv_heads"], info["head_dim"]
    print(f"\n## Decode step time, embedded SmolLM2-135M fp32 CPU ({layers} layers, {H} KV heads, D = {D}), ms/step")
    names = ["full", "KIVI-2", "KIVI-4", "K4V2", "mlx-quant-4", "mlx-quant-8"]
    print(f"{'context':>8} " + " ".join(f"{n:>11}" for n in names) + "   KIVI-2/full  KIVI-4/full")
    for T in contexts:
        all_caches = {}
        for name in names:
            caches = []
            for i in range(layers):
                keys = mx.random.normal((1, H, T, D), key=mx.random.key(2 * i))
                values = mx.random.normal((1, H, T, D), key=mx.random.key(2 * i + 1))
                cache = CACHES[name]()
                fill(cache, keys, values)
                caches.append(cache)
            all_caches[name] = caches
        # methods take turns step by step, so load from other processes on the machine hits all alike
        times = {name: [] for name in names}
        token = mx.array([[42]])
        for _ in range(warmup + steps):
            for name in names:
                t = time.perf_counter()
                mx.eval(model(token, cache=all_caches[name]))
                times[name].append(1e3 * (time.perf_counter() - t))
        row = {name: statistics.median(times[name][warmup:]) for name in names}
        del all_caches
        gc.collect()
        print(f"{T:>8} " + " ".join(f"{row[n]:11.1f}" for n in names)
              + f"   {row['KIVI-2'] / row['full']:11.2f}  {row['KIVI-4'] / row['full']:11.2f}")


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help="memory, attention and/or decode (default: all three)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192], help="attention and decode")
    parser.add_argument("--repeat", type=int, default=40, help="attention calls timed per cell")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per cell")
    args = parser.parse_args()
    parts = args.parts or ["memory", "attention", "decode"]
    if set(parts) - {"memory", "attention", "decode"}:
        parser.error(f"parts: expected memory, attention and/or decode, got {parts}")
    if "memory" in parts:
        memory_table()
    if "attention" in parts:
        attention_table(args.contexts, args.repeat)
    if "decode" in parts:
        decode_table(args.contexts, args.steps)
