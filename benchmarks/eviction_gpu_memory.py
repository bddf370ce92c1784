"""Prefill peak memory, KV bytes and decode speed of any cache on a CUDA GPU (the lent H200).

Eight random-weight Llama-3.1-8B-shaped layers (hidden 4096, 32 query / 8 KV heads, D = 128,
MLP 14336, vocab 32000), fp16, batch 1, through the drop-in API: `kvcompress.make_cache`, the prompt
in 2048-token chunks (each chunk's logits evaluated with the caches' state), its last token alone,
then decode steps. Per (method, context): the MLX peak above the weights during prefill (and its
ratio to the full cache's: `full` first), the KV bytes held after it, and the median decode ms/step.
Cells are skipped once `--budget-s` seconds have passed (so one device call ends in time); the
table says which ran, and a cell that raises (out of memory, a ConfigError) says so.

Methods are specs: `NAME` or `NAME:KEY=VALUE,KEY=VALUE`, values as int, float, true/false or text; a
quantizer for an eviction method's kept tokens is `quantize=NAME/KEY=VALUE/...`. Eviction methods
given without a budget get 0.5 (half the prompt). `--methods` defaults to every eviction method;
`--quantizers` is every quantizer (issue 40) with `full` and the composition SnapKV 0.5 + KIVI-4.

    source /tmp/mlx-cuda-env.sh && python3 benchmarks/eviction_gpu_memory.py 8192 32768 [--budget-s 300]
        [--methods full h2o snapkv:budget=0.25 ...] [--quantizers]
    python benchmarks/eviction_gpu_memory.py 2048 --quantizers --layers 2 --narrow   # a CPU check (float32)

`--narrow` keeps the attention geometry (what the caches see) with a 512-wide residual stream and
MLP and a 1024-token vocabulary: seconds per cell on a CPU, where MLX's attention materializes each
chunk's [B, H_q, L, T] scores for every cache alike (the GPU's fused kernel does not).
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
if "--narrow" not in sys.argv:
    os.environ.setdefault("KVCOMPRESS_BLAS", "reference")  # no OpenBLAS needed on the GPU machine

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from kvcompress.errors import ConfigError  # noqa: E402
from kvcompress.memory import live_kv_bytes  # noqa: E402
from kvcompress.methods import method_config  # noqa: E402

METHODS = ["full", "streaming", "h2o", "keyformer", "snapkv", "pyramidkv", "adakv", "tova", "knorm", "random"]
QUANTIZERS = ["full", "kivi:bits=2", "kivi:bits=4", "turboquant:bits=2.5", "turboquant:bits=3", "turboquant:bits=3.5",
              "turboquant:bits=4", "qjl", "kvquant:bits=3", "kvquant:bits=4", "mlx-quant",
              "snapkv:budget=0.5,quantize=kivi/bits=4"]
CHUNK, DECODE_STEPS, LAYERS = 2048, 16, 8


def parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_spec(spec: str):
    """`NAME[:KEY=VALUE,...]` -> a validated method config (ConfigError naming the field otherwise).
    `quantize=NAME/KEY=VALUE/...` is the quantizer of an eviction method's kept tokens."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"method spec {spec!r}: expected KEY=VALUE after the name, got {item!r}")
        if key == "quantize":
            q_name, *q_items = value.split("/")
            value = {"name": q_name, **{k: parse_value(v) for k, _, v in (i.partition("=") for i in q_items)}}
        params[key] = value if isinstance(value, dict) else parse_value(value)
    if "budget" not in params and "budget" in method_config(name).params():
        params["budget"] = 0.5
    return method_config(name, **params)


def model_8b_shape(layers: int = LAYERS, narrow: bool = False):
    """Llama-3.1-8B's attention (32 query / 8 KV heads, D = 128) on `layers` random layers, fp16 on a
    GPU, float32 on a CPU (MLX's CPU half-precision math is emulated); `narrow`: a 512-wide residual
    stream and MLP, a 1024-token vocabulary."""
    args = llama.ModelArgs(
        model_type="llama", hidden_size=512 if narrow else 4096, num_hidden_layers=layers,
        intermediate_size=1024 if narrow else 14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, vocab_size=1024 if narrow else 32000, rope_theta=500000.0,
    )
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    model = llama.Model(args)
    model.update(nn.utils.tree_map(lambda p: (mx.random.normal(p.shape, key=mx.random.key(0)) * 0.02).astype(dtype),
                                   model.parameters()))
    mx.eval(model.parameters())
    return model


def one_cell(model, config, tokens):
    T = tokens.shape[1]
    cache = kvcompress.make_cache(model, config.name, max_tokens=DECODE_STEPS, **config.params())
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
    return {"context": T, "method": config.label(), "prefill_peak_gib": peak / 2**30, "kv_after_prefill_gib": kv / 2**30,
            "prefill_s": prefill_s, "decode_ms_step": statistics.median(times[2:])}


def main(contexts, budget_s, configs, layers=LAYERS, narrow=False, out_name="eviction_gpu_memory.json"):
    print(f"device: {mx.default_device()}, {layers} layers of the Llama-3.1-8B attention shape"
          f"{' (narrow residual stream and MLP)' if narrow else ''}, chunks of {CHUNK}", flush=True)
    model = model_8b_shape(layers, narrow)
    vocab = model.args.vocab_size
    warm = mx.random.randint(0, vocab, (1, 4096))
    one_cell(model, parse_spec("h2o"), warm)  # JIT warm-up
    one_cell(model, parse_spec("full"), warm)
    started = time.perf_counter()
    rows = []
    print("| method | context | prefill peak above weights (GiB) | x full | KV after prefill (GiB) | prefill s | decode ms/step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for T in contexts:
        tokens = mx.random.randint(0, vocab, (1, T), key=mx.random.key(T))
        full_peak = None  # ratios need "full" first
        for config in configs:
            label = config.label()
            if time.perf_counter() - started > budget_s:
                print(f"| {label} | {T} | skipped (time budget) | | | | |", flush=True)
                continue
            try:
                row = one_cell(model, config, tokens)
            except Exception as error:  # out of memory, or a cache this device cannot run: the table records it
                print(f"| {label} | {T} | {type(error).__name__}: {str(error)[:80]} | | | | |", flush=True)
                mx.clear_cache()
                continue
            full_peak = row["prefill_peak_gib"] if config.name == "full" else full_peak
            ratio = row["prefill_peak_gib"] / full_peak if full_peak else float("nan")
            rows.append(row)
            print(f"| {label} | {T} | {row['prefill_peak_gib']:.3f} | {ratio:.2f} | {row['kv_after_prefill_gib']:.3f} | "
                  f"{row['prefill_s']:.1f} | {row['decode_ms_step']:.2f} |", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, out_name).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="prefill peak, KV bytes and decode speed of any cache (GPU)")
    parser.add_argument("contexts", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip cells once this many seconds have passed")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="method specs (NAME or NAME:KEY=VALUE,...), full first for the ratios; "
                             "default: every eviction method at budget 0.5")
    parser.add_argument("--quantizers", action="store_true", help=f"every quantizer: {' '.join(QUANTIZERS)}")
    parser.add_argument("--layers", type=int, default=LAYERS, help="random Llama-8B-shaped layers")
    parser.add_argument("--narrow", action="store_true", help="a narrow residual stream and MLP (a CPU check)")
    args = parser.parse_args()
    if args.methods and args.quantizers:
        parser.error("--methods and --quantizers: give one")
    specs = QUANTIZERS if args.quantizers else args.methods or METHODS
    try:
        configs = [parse_spec(spec) for spec in specs]  # every spec checked before any work
    except (ConfigError, TypeError) as error:
        parser.error(f"--methods: {error}")
    main(args.contexts, args.budget_s, configs, args.layers, args.narrow,
         "quantizer_gpu_memory.json" if args.quantizers else "eviction_gpu_memory.json")
