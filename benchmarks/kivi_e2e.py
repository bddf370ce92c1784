"""End-to-end decode speed of every cache through the drop-in API, on a GPU (the lent H200).

A random-weight mlx-lm Llama with the Llama-3.1-8B shape (hidden 4096, 32 heads, 8 KV heads, head_dim
128, intermediate 14336, vocab 128256; speed does not depend on the weights' values), fp16, batch 1.
Each cache comes from `kvcompress.make_cache(model, method, ...)`: the classes the sweep uses. The
prompt is prefilled in 2048-token chunks (mlx-lm's default), then `--steps` greedy decode steps
after `--warmup` steps, timed two ways: synchronously per step (as the runner times `step_ms`; the
host time to build a step's graph is reported too) and pipelined as `mlx_lm.generate` runs (the
next step's graph built while the GPU runs this one). Also: resident KV MiB after prefill
(`kvcompress.memory.live_kv_bytes`), prefill seconds (each cache first runs a throw-away 2k prefill
so JIT compilation and kernel self-tests stay out of the timings) and which kernel paths ran.

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/kivi_e2e.py --contexts 8192 32768`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from kvcompress.kernels import dispatch  # noqa: E402
from kvcompress.memory import live_kv_bytes  # noqa: E402
from host_graph import classes_at, rebuilt  # noqa: E402

CACHES = {
    "full": ("full", {}),
    "kivi bits=2": ("kivi", {"bits": 2}),
    "kivi bits=4": ("kivi", {"bits": 4}),
    "kivi bits=2 grouped": ("kivi", {"bits": 2, "residual_policy": "grouped"}),
    "streaming budget=0.5": ("streaming", {"budget": 0.5}),
    "h2o budget=0.5": ("h2o", {"budget": 0.5}),
    "keyformer budget=0.5": ("keyformer", {"budget": 0.5}),
    "snapkv budget=0.5": ("snapkv", {"budget": 0.5}),
    "pyramidkv budget=0.5": ("pyramidkv", {"budget": 0.5}),
    "adakv budget=0.5": ("adakv", {"budget": 0.5}),
    "tova budget=0.5": ("tova", {"budget": 0.5}),
    "knorm budget=0.5": ("knorm", {"budget": 0.5}),
    "random budget=0.5": ("random", {"budget": 0.5}),
}


def llama8b_shaped(layers: int):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=4096, num_hidden_layers=layers, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, vocab_size=128256,
        rope_theta=500000.0, tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    # small weights keep activations finite through 32 random layers
    model.update(tree_map(lambda p: (p * 0.02).astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    return model


def prefill(model, caches, prompt, chunk=2048) -> tuple[mx.array, float]:
    mx.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompt) - 1, chunk):
        model(mx.array(prompt[i : min(i + chunk, len(prompt) - 1)])[None], cache=caches)
        mx.eval([c.state for c in caches])
    logits = model(mx.array(prompt[-1:])[None], cache=caches)
    mx.eval(logits)
    mx.synchronize()
    return logits, time.perf_counter() - start


def step(model, caches, token):
    return mx.argmax(model(token.reshape(1, 1), cache=caches)[0, -1])


def decode_sync(model, caches, token, steps, warmup):
    """Per-step synchronous decode, as the runner times it: (median ms/step, median ms to build
    the step's graph on the host before the GPU runs it)."""
    times, build = [], []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(token.reshape(1, 1), cache=caches)
        t1 = time.perf_counter()
        token = mx.argmax(logits[0, -1])
        mx.eval(token)
        if s >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
            build.append(1e3 * (t1 - t0))
    return statistics.median(times), statistics.median(build), token


def decode_pipelined(model, caches, token, steps):
    """As mlx_lm.generate_step: the next step's graph is built while the GPU runs this one."""
    y = step(model, caches, token)
    mx.async_eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        next_y = step(model, caches, y)
        mx.async_eval(next_y)
        y.item()
        y = next_y
    y.item()
    return 1e3 * (time.perf_counter() - t0) / steps


def make_caches(model, method, params, classes=None):
    caches = kvcompress.make_cache(model, method, **params)
    return caches if classes is None or method == "full" else [rebuilt(c, classes) for c in caches]


def measure(model, label, method, params, T, steps, warmup, classes=None):
    # a throw-away run of this cache first: kernels compile and self-test outside the timings
    warm = make_caches(model, method, params, classes)
    logits, _ = prefill(model, warm, list(range(2100)))
    decode_sync(model, warm, mx.argmax(logits[0, -1]), 2, 0)
    del warm, logits
    gc.collect()
    caches = make_caches(model, method, params, classes)
    prompt = [int(t) for t in mx.random.randint(0, 128256, (T,), key=mx.random.key(T)).tolist()]
    dispatch.reset_paths()
    mx.reset_peak_memory()
    logits, prefill_s = prefill(model, caches, prompt)
    kv_mib = live_kv_bytes(caches) / 2**20
    ms, build_ms, token = decode_sync(model, caches, mx.argmax(logits[0, -1]), steps, warmup)
    pipelined_ms = decode_pipelined(model, caches, token, steps)
    paths = ",".join(f"{k.split('/')[0]}={v}" for k, v in dispatch.paths_used().items()) or "-"
    peak = mx.get_peak_memory() / 2**30
    return dict(label=label, T=T, ms=ms, build_ms=build_ms, pipelined_ms=pipelined_ms, tok_s=1e3 / ms,
                kv_mib=kv_mib, prefill_s=prefill_s, peak_gib=peak, paths=paths)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--caches", nargs="+", default=list(CACHES), help=f"labels from {list(CACHES)}")
    parser.add_argument("--skip", nargs="*", default=[], help="label@context pairs to skip, e.g. 'h2o budget=0.5@32768'")
    parser.add_argument("--against", metavar="REV", help="also run every compressed cache with its class as git "
                        "revision REV had it (host_graph.py's classes_at), in the same process: before/after ratios")
    args = parser.parse_args()
    classes = classes_at(args.against) if args.against else None
    print("mlx", mx.__version__, mx.default_device(), f"{args.layers} layers, Llama-3.1-8B shape, fp16", flush=True)
    model = llama8b_shaped(args.layers)
    print(f"weights {sum(p.nbytes for _, p in __import__('mlx.utils').utils.tree_flatten(model.parameters())) / 2**30:.1f} GiB", flush=True)
    prefill(model, kvcompress.make_cache(model, "full"), list(range(2100)))  # JIT warm-up, not timed
    rows = []
    header = ("| cache | context | decode ms/step | host graph ms | pipelined ms/step | tok/s | x full tok/s "
              "| pipelined x full | KV MiB | prefill s | x full prefill | peak GiB | kernels |")
    for T in args.contexts:
        full = None
        runs = [(label, None) for label in args.caches]
        if classes:
            runs += [(label, args.against) for label in args.caches if label != "full"]
        for label, revision in runs:
            if f"{label}@{T}" in args.skip:
                continue
            method, params = CACHES[label]
            t = time.time()
            try:
                r = measure(model, label, method, params, T, args.steps, args.warmup, classes if revision else None)
                if revision:
                    r["label"] = label = f"{label} @ {revision}"
            except Exception as exc:  # report and go on: one device call should bring back every row it can
                print(f"FAILED {label} @ {T}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                gc.collect()
                continue
            if label == "full":
                full = r
            nan = float("nan")
            r["x_full"] = full["ms"] / r["ms"] if full else nan
            r["x_full_pipelined"] = full["pipelined_ms"] / r["pipelined_ms"] if full else nan
            r["x_full_prefill"] = r["prefill_s"] / full["prefill_s"] if full else nan
            rows.append(r)
            print(f"{label} @ {T}: {r['ms']:.2f} ms/step (host graph {r['build_ms']:.2f}, pipelined {r['pipelined_ms']:.2f}), "
                  f"{r['kv_mib']:.0f} MiB, prefill {r['prefill_s']:.2f} s, peak {r['peak_gib']:.1f} GiB, {r['paths']} "
                  f"[{time.time() - t:.0f} s]", flush=True)
            gc.collect()
    print("\n" + header + "\n|" + "---|" * 13)
    for r in rows:
        print(f"| {r['label']} | {r['T']} | {r['ms']:.2f} | {r['build_ms']:.2f} | {r['pipelined_ms']:.2f} | {r['tok_s']:.1f} | "
              f"{r['x_full']:.2f} | {r['x_full_pipelined']:.2f} | {r['kv_mib']:.0f} | {r['prefill_s']:.2f} | "
              f"{r['x_full_prefill']:.2f} | {r['peak_gib']:.1f} | {r['paths']} |")


if __name__ == "__main__":
    main()
