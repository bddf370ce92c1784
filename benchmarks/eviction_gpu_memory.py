"""Prefill peak memory and decode speed of every eviction method on a CUDA GPU (the lent H200).

Eight random-weight Llama-3.1-8B-shaped layers (hidden 4096, 32 query / 8 KV heads, D = 128,
MLP 14336), fp16, batch 1, through the drop-in API: `kvcompress.make_cache`, the prompt in
2048-token chunks, its last token alone, then decode steps. Per (context, method): the MLX peak
above the weights during prefill, the KV bytes held after it, and the median decode ms/step.
Budgets are 50% of the prompt. Cells are skipped once `--budget-s` seconds have passed (so one
device call ends in time); the table says which ran.

    source /tmp/mlx-cuda-env.sh && python3 benchmarks/eviction_gpu_memory.py 8192 32768 [--budget-s 300]
        [--methods full,h2o,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("KVCOMPRESS_BLAS", "reference")  # no OpenBLAS needed on the GPU machine

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from kvcompress.memory import live_kv_bytes  # noqa: E402

METHODS = ["full", "streaming", "h2o", "keyformer", "snapkv", "pyramidkv", "adakv", "tova", "knorm", "random"]
CHUNK, DECODE_STEPS, LAYERS = 2048, 16, 8


def model_8b_shape():
    args = llama.ModelArgs(
        model_type="llama", hidden_size=4096, num_hidden_layers=LAYERS, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=32000, rope_theta=500000.0,
    )
    model = llama.Model(args)
    model.update(nn.utils.tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    return model


def one_cell(model, method, tokens):
    T = tokens.shape[1]
    params = {} if method == "full" else {"budget": 0.5}
    cache = kvcompress.make_cache(model, method, max_tokens=DECODE_STEPS, **params)
    mx.synchronize()
    mx.clear_cache()
    weights = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for begin in range(0, T - 1, CHUNK):
        mx.eval(model(tokens[:, begin : min(T - 1, begin + CHUNK)], cache=cache), [c.state for c in cache])
    logits = model(tokens[:, T - 1 :], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    mx.synchronize()
    prefill_s = time.perf_counter() - start
    peak = mx.get_peak_memory() - weights
    kv = live_kv_bytes(cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    times = []
    for _ in range(DECODE_STEPS):
        t = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token, [c.state for c in cache])
        mx.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    del cache, logits
    mx.clear_cache()
    return {"context": T, "method": method, "prefill_peak_gib": peak / 2**30, "kv_after_prefill_gib": kv / 2**30,
            "prefill_s": prefill_s, "decode_ms_step": statistics.median(times[2:])}


def main(contexts, budget_s, methods=METHODS):
    print(f"device: {mx.default_device()}, {LAYERS} layers of the Llama-3.1-8B shape, fp16, chunks of {CHUNK}", flush=True)
    model = model_8b_shape()
    warm = mx.random.randint(0, 32000, (1, 4096))
    one_cell(model, "h2o", warm)  # JIT warm-up
    one_cell(model, "full", warm)
    started = time.perf_counter()
    rows = []
    print("| context | method | prefill peak above weights (GiB) | vs full | KV after prefill (GiB) | prefill s | decode ms/step |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for T in contexts:
        tokens = mx.random.randint(0, 32000, (1, T), key=mx.random.key(T))
        full_peak = None  # ratios need "full" first in --methods
        for method in methods:
            if time.perf_counter() - started > budget_s:
                print(f"| {T} | {method} | skipped (time budget) | | | | |", flush=True)
                continue
            try:
                row = one_cell(model, method, tokens)
            except Exception as error:  # out of memory shows here; the table records it
                print(f"| {T} | {method} | {type(error).__name__}: {str(error)[:80]} | | | | |", flush=True)
                mx.clear_cache()
                continue
            full_peak = row["prefill_peak_gib"] if method == "full" else full_peak
            ratio = row["prefill_peak_gib"] / full_peak if full_peak else float("nan")
            rows.append(row)
            print(f"| {T} | {method} | {row['prefill_peak_gib']:.2f} | {ratio:.2f} | {row['kv_after_prefill_gib']:.3f} | "
                  f"{row['prefill_s']:.1f} | {row['decode_ms_step']:.2f} |", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "eviction_gpu_memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="prefill peak and decode speed of every eviction method (GPU)")
    parser.add_argument("contexts", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip cells once this many seconds have passed")
    parser.add_argument("--methods", type=lambda text: text.split(","), default=METHODS,
                        help="comma-separated, full first for the ratios")
    args = parser.parse_args()
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; expected some of {METHODS}")
    main(args.contexts, args.budget_s, args.methods)
