"""Where an eviction cache's decode step spends its GPU time, one layer of the Llama-3.1-8B shape.

B 1, 8 KV heads, 32 query heads (a group of 4 per KV head), D 128, fp16; `n` tokens kept (a 50%
budget of a 2n-token context). Each part is timed as 32 layers' worth of work in one graph (each
"layer" its own arrays, 16 sets rotated so L2 cannot hold them), evaluated once: GPU time plus MLX's
encoding, divided by 32, in us per layer. Parts:

- `sdpa 2n`: the full cache's attention at the same context (the yardstick), `sdpa n`: over the kept;
- `logits`: the step's logits (`folded_logits`: q @ keys^T, fp16 product, float32 out), `+ softmax`:
  its probabilities; `logits keys @ q^T`: the orientation folded_logits had before (then a copy);
- `matmul attention`: logits, softmax and probs @ values (the eviction cache's path for every method
  until this benchmark's change; still the path of H2O, TOVA and Keyformer);
- `sdpa + probs`: SDPA for the output plus logits and softmax for the scores (what a scoring method
  would cost with the output from the fused kernel);
- `probs @ values`: the second matmul alone (a reduction over n with 4 x 128 outputs per head);
- `evict_slot`: the one-pass step's choice of slot; `4 writes`: the token's key, value, position and
  score written into the buffers (in place);
- whole cache steps (`EvictionCache.update_and_fetch` + `attention`, as the model calls them) for
  every exact-position method, 32 caches (one per layer) per step, with and without the per-layer
  `mx.async_eval` of the evicted slot; StreamingLLM also without its host-side ring (the kernel path).

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/evict_decode_gpu.py [--tokens 4096 16384]`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("KVCOMPRESS_BLAS", "reference")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from kvcompress.kernels import dispatch  # noqa: E402
from kvcompress.kernels.evict import evict_slot  # noqa: E402
from kvcompress.methods import eviction, method_config  # noqa: E402
from kvcompress.methods.prompt_scores import folded_logits  # noqa: E402

H, G, D = 8, 4, 128
LAYERS, SETS = 32, 16
SCALE = D**-0.5


def median_us(build, repeat=15, warmup=3) -> float:
    """Median us per layer to evaluate the graph `build()` returns (32 layers' work)."""
    times = []
    for i in range(warmup + repeat):
        outs = build()
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e6 / LAYERS)
    times.sort()
    return times[len(times) // 2]


def parts(n: int):
    mx.random.seed(n)
    kv = [(mx.random.normal((1, H, n, D)).astype(mx.float16), mx.random.normal((1, H, n, D)).astype(mx.float16)) for _ in range(SETS)]
    kv2 = [(mx.random.normal((1, H, 2 * n, D)).astype(mx.float16),) * 2 for _ in range(SETS // 2)]
    q = mx.random.normal((1, H * G, 1, D)).astype(mx.float16)
    mx.eval(kv, kv2, q)

    def per_layer(fn, sets):
        return lambda: [fn(*sets[layer % len(sets)]) for layer in range(LAYERS)]

    def logits(k, v):
        return folded_logits(q.reshape(H, G, 1, D), k.reshape(H, n, D), SCALE)

    def probs(k, v):
        return mx.softmax(logits(k, v), axis=-1, precise=True)

    def matmul_attention(k, v):
        p = probs(k, v)
        return (p.astype(v.dtype).reshape(H, G, n) @ v.reshape(H, n, D)).reshape(1, H * G, 1, D)

    def sdpa(k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)

    def sdpa_and_probs(k, v):
        return sdpa(k, v), probs(k, v).sum(axis=(1, 2))

    p_fixed = [mx.softmax(mx.random.normal((H, G, n)), axis=-1).astype(mx.float16) for _ in range(SETS)]
    mx.eval(p_fixed)

    def probs_at_values(layer):
        k, v = kv[layer % SETS]
        return p_fixed[layer % SETS] @ v.reshape(H, n, D)

    def logits_kq(k, v):  # folded_logits before: keys @ q^T, then a transposing copy to [H, G, n]
        return (k.reshape(H, n, D) @ (q.reshape(H, G, D) * SCALE).swapaxes(1, 2)).astype(mx.float32).swapaxes(1, 2) + 0

    p32 = [mx.softmax(mx.random.normal((H, G, 1, n)), axis=-1) for _ in range(SETS)]
    ones = mx.ones((1, G), mx.float32)
    mx.eval(p32, ones)

    def column_sum(layer):
        return p32[layer % SETS].sum(axis=(1, 2))

    def column_sum_matmul(layer):
        return (ones @ p32[layer % SETS].reshape(H, G, n)).reshape(H, n)

    scores = [mx.random.uniform(shape=(H, n + 1)) for _ in range(SETS)]
    positions = [mx.broadcast_to(mx.arange(n + 1, dtype=mx.int32), (H, n + 1)) + 0 for _ in range(SETS)]
    mx.eval(scores, positions)

    def choose(layer):
        return evict_slot(scores[layer % SETS], positions[layer % SETS], 4, n - n // 4)

    rows = {
        "sdpa 2n (full cache)": per_layer(sdpa, kv2),
        "sdpa n": per_layer(sdpa, kv),
        "logits": per_layer(logits, kv),
        "+ softmax": per_layer(probs, kv),
        "matmul attention": per_layer(matmul_attention, kv),
        "sdpa + probs": per_layer(sdpa_and_probs, kv),
        "probs @ values": lambda: [probs_at_values(layer) for layer in range(LAYERS)],
        "evict_slot": lambda: [choose(layer) for layer in range(LAYERS)],
        "logits keys @ q^T": per_layer(logits_kq, kv),
        "column sum .sum": lambda: [column_sum(layer) for layer in range(LAYERS)],
        "column sum ones @": lambda: [column_sum_matmul(layer) for layer in range(LAYERS)],
    }
    out = {}
    for label, build in rows.items():
        out[label] = median_us(build)
        print(f"  n={n:>6} {label:<22} {out[label]:8.1f} us/layer", flush=True)
    return out


def ready_caches(method: str, n: int, layers: int = LAYERS, H: int = H, G: int = G, D: int = D,
                 dtype=mx.float16, cls=None) -> list:
    """`layers` exact-position caches (class `cls`, default EvictionCache) of `method` holding n
    tokens each, as after a slightly longer prompt: selection runs once, then every step evicts."""
    cfg = method_config(method, budget=n)
    rope = nn.RoPE(D, base=500000.0)
    cls = cls or eviction.EvictionCache
    caches = []
    for layer in range(layers):
        c = cls(cfg, layer, layers, H, D, rope, D**-0.5)
        T = n + 64
        keys = mx.random.normal((H, T, D)).astype(dtype)
        values = mx.random.normal((H, T, D)).astype(dtype)
        positions = mx.broadcast_to(mx.arange(T, dtype=mx.int32), (H, T))
        c.batch, c.position = 1, T
        scorer = c.scorer
        score = scorer.score_new(c, keys, positions) if scorer.decode == "fixed" else mx.random.uniform(shape=(H, T))
        c._set(keys, values, score, positions)
        if scorer.window():
            c.window_queries = mx.random.normal((H, G, scorer.window(), D)).astype(dtype)
        c._complete_prompt()
        caches.append(c)
    mx.eval([c.state[:4] for c in caches])
    return caches


def cache_steps(method: str, n: int, per_layer_eval: bool, steps=12, warmup=3, ring_order=True):
    caches = ready_caches(method, n)
    for c in caches:
        c.ring_order = ring_order  # False: StreamingLLM's kernel path (evict_slot, index scatters)
    k = mx.random.normal((1, H, 1, D)).astype(mx.float16)
    q = mx.random.normal((1, H * G, 1, D)).astype(mx.float16)
    mx.eval(k, q)
    times, build = [], []
    for s in range(warmup + steps):
        start = time.perf_counter()
        x = q
        for c in caches:
            keys, values = c.update_and_fetch(k, k)
            x = c.attention(x, keys, values, scale=SCALE, mask=None)  # the next layer's query depends on this one
            if per_layer_eval and isinstance(c.free, mx.array):  # what the one-pass step did before this benchmark
                mx.async_eval(c.free)
        built = time.perf_counter()
        mx.eval(x, [c.state[:4] for c in caches])
        mx.synchronize()
        if s >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
            build.append((built - start) * 1e3)
    times.sort()
    build.sort()
    return times[len(times) // 2], build[len(build) // 2]


def breakdown(method: str, n: int, steps=10, warmup=3):
    """ms per 32-layer step of each stage, no per-layer eval: building the graph on the host, then
    evaluating it (GPU + MLX's encoding); the step split in two graphs (update_and_fetch: the writes;
    attention: attention, scoring, eviction); and probes on the same state that change nothing."""
    caches = ready_caches(method, n)
    k = mx.random.normal((1, H, 1, D)).astype(mx.float16)
    q = mx.random.normal((1, H * G, 1, D)).astype(mx.float16)
    mx.eval(k, q)
    stats = {name: [] for name in ("build", "eval", "writes", "attention", "sdpa only", "evict_slot only", "scores+evict_slot")}

    def timed(name, fn):
        mx.synchronize()
        start = time.perf_counter()
        out = fn()
        mx.eval(out)
        mx.synchronize()
        stats[name].append((time.perf_counter() - start) * 1e3)
        return out

    for s in range(warmup + steps):
        if s % 2 == 0:  # one graph: build, then evaluate
            start = time.perf_counter()
            x = q
            for c in caches:
                keys, values = c.update_and_fetch(k, k)
                x = c.attention(x, keys, values, scale=SCALE, mask=None)
            stats["build"].append((time.perf_counter() - start) * 1e3)
            timed("eval", lambda: [x] + [c.free for c in caches if isinstance(c.free, mx.array)])
        else:  # two graphs
            fetched = timed("writes", lambda: [c.update_and_fetch(k, k) for c in caches])
            timed("attention", lambda: [c.attention(q, kv[0], kv[1], scale=SCALE, mask=None) for c, kv in zip(caches, fetched)]
                  + [c.free for c in caches if isinstance(c.free, mx.array)])
        timed("sdpa only", lambda: [mx.fast.scaled_dot_product_attention(q, *c.held_kv(), scale=SCALE) for c in caches])
        timed("evict_slot only", lambda: [evict_slot(c.scores, c.positions, 4, c.position - 64) for c in caches])
        timed("scores+evict_slot", lambda: [evict_slot(c.scores + 0.5, c.positions, 4, c.position - 64) for c in caches])
    med = {name: sorted(v[warmup // 2:])[len(v[warmup // 2:]) // 2] for name, v in stats.items() if v}
    print(f"  n={n:>6} {method:<10} " + "  ".join(f"{name} {ms:.2f}" for name, ms in med.items()), flush=True)


def full_steps(n: int, steps=12, warmup=3):
    kv = [(mx.random.normal((1, H, 2 * n, D)).astype(mx.float16),) * 2 for _ in range(LAYERS)]
    k = mx.random.normal((1, H, 1, D)).astype(mx.float16)
    q = mx.random.normal((1, H * G, 1, D)).astype(mx.float16)
    mx.eval(kv, k, q)
    times = []
    for s in range(warmup + steps):
        start = time.perf_counter()
        x = q
        for keys, values in kv:
            x = mx.fast.scaled_dot_product_attention(x, keys, values, scale=SCALE)
        mx.eval(x)
        mx.synchronize()
        if s >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--methods", nargs="+", default=["streaming", "h2o", "tova", "keyformer"])
    parser.add_argument("--no-parts", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="only the per-stage breakdown of each method's step")
    args = parser.parse_args()
    print("mlx", mx.__version__, mx.default_device(), f"gpu backend: {dispatch.gpu_backend()}", flush=True)
    for n in args.tokens:
        if args.breakdown:
            for method in args.methods:
                breakdown(method, n)
            continue
        if not args.no_parts:
            parts(n)
        full = full_steps(n)
        print(f"  n={n:>6} full cache, 32 layers of SDPA over {2 * n}: {full:.2f} ms/step", flush=True)
        for method in args.methods:
            for per_layer_eval in (True, False):
                ms, build = cache_steps(method, n, per_layer_eval)
                mode = "async_eval per layer" if per_layer_eval else "no per-layer eval"
                print(f"  n={n:>6} {method:<10} {mode:<22} {ms:7.2f} ms/step (host graph {build:.2f}), x full {full / ms:.2f}", flush=True)
            if method == "streaming":  # the host-side ring (above) against the kernel path it replaces
                ms, build = cache_steps(method, n, False, ring_order=False)
                print(f"  n={n:>6} {method:<10} {'kernel path (no ring)':<22} {ms:7.2f} ms/step (host graph {build:.2f}), "
                      f"x full {full / ms:.2f}", flush=True)


if __name__ == "__main__":
    main()
