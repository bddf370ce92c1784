"""End-to-end decode speed of every cache through the drop-in API, on a GPU (the lent H200).

A random-weight mlx-lm Llama with the Llama-3.1-8B shape (hidden 4096, 32 heads, 8 KV heads, head_dim
128, intermediate 14336, vocab 128256; speed does not depend on the weights' values), fp16, batch 1.
Each cache comes from `kvcompress.make_cache(model, method, ...)`: the classes the sweep uses. The
prompt is prefilled in 2048-token chunks (mlx-lm's default), then `--steps` greedy decode steps
after `--warmup` steps; reported: median decode ms/step and tok/s, resident KV MiB after prefill
(`kvcompress.memory.live_kv_bytes`), prefill seconds (the first prefill of a process pays JIT
compilation, so a throw-away prefill runs first), and which kernel paths ran.

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

CACHES = {
    "full": ("full", {}),
    "kivi bits=2": ("kivi", {"bits": 2}),
    "kivi bits=4": ("kivi", {"bits": 4}),
    "kivi bits=2 grouped": ("kivi", {"bits": 2, "residual_policy": "grouped"}),
    "streaming budget=0.5": ("streaming", {"budget": 0.5}),
    "h2o budget=0.5": ("h2o", {"budget": 0.5}),
    "keyformer budget=0.5": ("keyformer", {"budget": 0.5}),
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


def measure(model, label, method, params, T, steps, warmup):
    caches = kvcompress.make_cache(model, method, **params)
    prompt = [int(t) for t in mx.random.randint(0, 128256, (T,), key=mx.random.key(T)).tolist()]
    dispatch.reset_paths()
    mx.reset_peak_memory()
    logits, prefill_s = prefill(model, caches, prompt)
    kv_mib = live_kv_bytes(caches) / 2**20
    token = mx.argmax(logits[0, -1]).reshape(1, 1)
    times = []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(token, cache=caches)
        token = mx.argmax(logits[0, -1]).reshape(1, 1)
        mx.eval(token)
        if s >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
    ms = statistics.median(times)
    paths = ",".join(f"{k.split('/')[0]}={v}" for k, v in dispatch.paths_used().items()) or "-"
    peak = mx.get_peak_memory() / 2**30
    return dict(label=label, T=T, ms=ms, tok_s=1e3 / ms, kv_mib=kv_mib, prefill_s=prefill_s, peak_gib=peak, paths=paths)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--caches", nargs="+", default=list(CACHES), help=f"labels from {list(CACHES)}")
    parser.add_argument("--skip", nargs="*", default=[], help="label@context pairs to skip, e.g. 'h2o budget=0.5@32768'")
    args = parser.parse_args()
    print("mlx", mx.__version__, mx.default_device(), f"{args.layers} layers, Llama-3.1-8B shape, fp16", flush=True)
    model = llama8b_shaped(args.layers)
    print(f"weights {sum(p.nbytes for _, p in __import__('mlx.utils').utils.tree_flatten(model.parameters())) / 2**30:.1f} GiB", flush=True)
    prefill(model, kvcompress.make_cache(model, "full"), list(range(2100)))  # JIT warm-up, not timed
    rows = []
    header = f"| cache | context | decode ms/step | tok/s | x full tok/s | KV MiB | prefill s | peak GiB | kernels |"
    for T in args.contexts:
        full_tok_s = None
        for label in args.caches:
            if f"{label}@{T}" in args.skip:
                continue
            method, params = CACHES[label]
            t = time.time()
            try:
                r = measure(model, label, method, params, T, args.steps, args.warmup)
            except Exception as exc:  # report and go on: one device call should bring back every row it can
                print(f"FAILED {label} @ {T}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                gc.collect()
                continue
            if label == "full":
                full_tok_s = r["tok_s"]
            r["x_full"] = r["tok_s"] / full_tok_s if full_tok_s else float("nan")
            rows.append(r)
            print(f"{label} @ {T}: {r['ms']:.2f} ms/step, {r['kv_mib']:.0f} MiB, prefill {r['prefill_s']:.2f} s, "
                  f"peak {r['peak_gib']:.1f} GiB, {r['paths']} [{time.time() - t:.0f} s]", flush=True)
            gc.collect()
    print("\n" + header + "\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['T']} | {r['ms']:.2f} | {r['tok_s']:.1f} | {r['x_full']:.2f} | {r['kv_mib']:.0f} | "
              f"{r['prefill_s']:.2f} | {r['peak_gib']:.1f} | {r['paths']} |")


if __name__ == "__main__":
    main()
