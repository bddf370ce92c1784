"""End-to-end decode speed of every cache through the drop-in API, on a GPU (the lent H200).

A random-weight mlx-lm Llama with the Llama-3.1-8B shape (hidden 4096, 32 heads, 8 KV heads, head_dim
128, intermediate 14336, vocab 128256; speed does not depend on the weights' values), fp16, batch 1
(`--batch B`: B different prompts of the same length decoded together; tok/s counts all B).
Each cache comes from `kvcompress.make_cache(model, method, ...)`: the classes the sweep uses. The
prompt is prefilled in 2048-token chunks (mlx-lm's default) into every cache, each decodes
`--warmup` greedy steps, and then in each of `--rounds` rounds every cache in turn (the order
rotated per round) decodes `--steps` steps timed two ways: synchronously per step (as the runner
times `step_ms`; the host time to build a step's graph is reported too) and pipelined as
`mlx_lm.generate` runs (the next step's graph built while the GPU runs this one). Taking turns
puts the machine's drift (clocks, host load: single runs moved by up to 1.5x between calls) on
every cache alike; x full is the ratio to the full cache's time in the same round (median and
range over the rounds). Also: resident KV MiB after prefill (`kvcompress.memory.live_kv_bytes`),
prefill seconds (an untimed full-cache prefill at each context first, and each cache first runs a
throw-away 2k prefill, so JIT compilation, kernel self-tests and the first long prefill's slowness stay
out of the timings; `--prefill-rounds` timed prefills per cache, taking turns as the
decode rounds do, x full per round), peak memory (the weights plus this cache's prefill) and which
kernel paths ran.

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/e2e.py --contexts 8192 32768`
(`python -m benchmarks e2e --gpu` runs the documented tables; `--tiny`: a small Llama, a CPU smoke run).
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
from mlx.utils import tree_flatten, tree_map  # noqa: E402
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
    "snapkv budget=0.5": ("snapkv", {"budget": 0.5}),
    "pyramidkv budget=0.5": ("pyramidkv", {"budget": 0.5}),
    "adakv budget=0.5": ("adakv", {"budget": 0.5}),
    "tova budget=0.5": ("tova", {"budget": 0.5}),
    "knorm budget=0.5": ("knorm", {"budget": 0.5}),
    "random budget=0.5": ("random", {"budget": 0.5}),
}


def llama8b_shaped(layers: int, tiny: bool = False):
    """Random weights of Llama-3.1-8B's shape, or (tiny) a small Llama for a smoke run on a CPU."""
    shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256)
    if tiny:
        shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=32, vocab_size=4096)
    args = llama.ModelArgs(model_type="llama", num_hidden_layers=layers, rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False, **shape)
    mx.random.seed(0)
    model = llama.Model(args)
    # small weights keep activations finite through 32 random layers
    model.update(tree_map(lambda p: (p * 0.02).astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    return model


def prefill(model, caches, prompt, chunk=2048) -> tuple[mx.array, float]:
    """prompt: token ids [T] or [B, T]; returns (logits of the last position [B, 1, vocab], seconds)."""
    prompt = mx.array(prompt)
    prompt = prompt[None] if prompt.ndim == 1 else prompt  # [B, T]
    T = prompt.shape[1]
    mx.synchronize()
    start = time.perf_counter()
    for i in range(0, T - 1, chunk):
        model(prompt[:, i : min(i + chunk, T - 1)], cache=caches)
        mx.eval([c.state for c in caches])
        # as mlx_lm.generate after each chunk: without it, MLX's CUDA allocator can be left releasing
        # its buffer cache on every cache miss, with synchronizing frees, for as long as the process runs
        # (docs/learned.md, "MLX's allocator after a long prefill")
        mx.clear_cache()
    logits = model(prompt[:, -1:], cache=caches)
    mx.eval(logits)
    mx.synchronize()
    return logits, time.perf_counter() - start


def greedy(logits):
    """[B, S, vocab] -> the next token of each sequence [B]."""
    return mx.argmax(logits[:, -1], axis=-1)


def step(model, caches, token):
    return greedy(model(token.reshape(-1, 1), cache=caches))


def decode_sync(model, caches, token, steps, warmup):
    """Per-step synchronous decode, as the runner times it: (median ms/step, median ms to build
    the step's graph on the host before the GPU runs it)."""
    times, build = [], []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(token.reshape(-1, 1), cache=caches)
        t1 = time.perf_counter()
        token = greedy(logits)
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
        y.tolist()
        y = next_y
    y.tolist()
    return 1e3 * (time.perf_counter() - t0) / steps


def prepare(model, label, method, params, T, warmup, batch=1) -> dict:
    """One cache prefilled with `batch` T-token prompts and decoded `warmup` steps, kept for the rounds."""
    # a throw-away run of this cache first: kernels compile and self-test outside the timings
    warm = kvcompress.make_cache(model, method, **params)
    logits, _ = prefill(model, warm, list(range(2100)))
    decode_sync(model, warm, greedy(logits), 2, 0)
    del warm, logits
    gc.collect()
    caches = kvcompress.make_cache(model, method, **params)
    prompt = prompts(model, batch, T)
    dispatch.reset_paths()
    resident = mx.get_active_memory()  # the weights and the caches prepared before this one
    mx.reset_peak_memory()
    logits, prefill_s = prefill(model, caches, prompt)
    peak = mx.get_peak_memory() - resident + weight_bytes(model)  # as if this cache were alone
    kv_mib = live_kv_bytes(caches) / 2**20
    _, _, token = decode_sync(model, caches, greedy(logits), 1, warmup)
    paths = ",".join(f"{k.split('/')[0]}={v}" for k, v in dispatch.paths_used().items()) or "-"
    return dict(label=label, T=T, batch=batch, caches=caches, token=token, kv_mib=kv_mib, prefill_s=[prefill_s],
                peak_gib=peak / 2**30, paths=paths, ms=[], build_ms=[], pipelined_ms=[],
                remake=lambda: kvcompress.make_cache(model, method, **params))


def prompts(model, batch: int, T: int) -> mx.array:
    """`batch` random T-token prompts [batch, T], the same for every cache."""
    return mx.random.randint(0, model.args.vocab_size, (batch, T), key=mx.random.key(T))


def prefill_again(model, run: dict) -> None:
    """One more timed prefill of the run's prompts into fresh caches of its kind (then dropped)."""
    caches = run["remake"]()
    _, seconds = prefill(model, caches, prompts(model, run["batch"], run["T"]))
    run["prefill_s"].append(seconds)
    del caches
    gc.collect()
    mx.clear_cache()


def weight_bytes(model) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def decode_round(model, run: dict, steps: int) -> None:
    """`steps` synchronous steps, then `steps` pipelined ones, appended to the run's lists."""
    ms, build_ms, run["token"] = decode_sync(model, run["caches"], run["token"], steps, 0)
    run["ms"].append(ms)
    run["build_ms"].append(build_ms)
    run["pipelined_ms"].append(decode_pipelined(model, run["caches"], run["token"], steps))


def ratio(full: list[float], other: list[float]) -> tuple[float, float, float]:
    """full / other per round (the same round's times): (median, min, max)."""
    per_round = [f / o for f, o in zip(full, other)]
    return statistics.median(per_round), min(per_round), max(per_round)


def spread(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (tok/s counts all)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per cache per round (each way)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every cache, taking turns")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prefill-rounds", type=int, default=3, help="timed prefills per cache, taking turns "
                        "(one prefill carries the machine's drift: the ratio moved 1.4-1.8x between runs)")
    parser.add_argument("--tiny", action="store_true", help="a small random Llama instead (a smoke run on a CPU)")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), help=f"labels from {list(CACHES)}")
    parser.add_argument("--skip", nargs="*", default=[], help="label@context pairs to skip, e.g. 'h2o budget=0.5@32768'")
    args = parser.parse_args()
    if "full" not in args.caches:
        parser.error("--caches must include full (every ratio is against it)")
    for flag, value in (("--batch", args.batch), ("--prefill-rounds", args.prefill_rounds), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} must be an integer >= 1, got {value}")
    shape = "a tiny Llama" if args.tiny else "Llama-3.1-8B shape"
    print("mlx", mx.__version__, mx.default_device(), f"{args.layers} layers, {shape}, fp16, batch {args.batch}",
          flush=True)
    model = llama8b_shaped(args.layers, args.tiny)
    print(f"weights {weight_bytes(model) / 2**30:.1f} GiB", flush=True)
    prefill(model, kvcompress.make_cache(model, "full"), list(range(2100)))  # JIT warm-up, not timed
    rows = []
    for T in args.contexts:
        # an untimed prefill at this length first: the process's first one runs ~2x slower (H200, 32k:
        # 2.77 s, then 1.27-1.57 s), and the cache timed first (the full cache) would pay for it
        prefill(model, kvcompress.make_cache(model, "full"), prompts(model, args.batch, T))
        gc.collect()
        runs = []
        for label in args.caches:
            if f"{label}@{T}" in args.skip:
                continue
            method, params = CACHES[label]
            t = time.time()
            try:
                run = prepare(model, label, method, params, T, args.warmup, args.batch)
            except Exception as exc:  # report and go on: one device call should bring back every row it can
                print(f"FAILED {label} @ {T}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                gc.collect()
                continue
            runs.append(run)
            print(f"{run['label']} @ {T}: {run['kv_mib']:.0f} MiB, prefill {run['prefill_s'][0]:.2f} s, "
                  f"peak {run['peak_gib']:.1f} GiB, {run['paths']} [{time.time() - t:.0f} s]", flush=True)
        full = next((run for run in runs if run["label"] == "full"), None)
        if full is None:
            print(f"no full cache at {T}: no ratios", flush=True)
            continue
        # every cache takes its turn in every round, the order rotated each round, so drift in the
        # machine (clocks, host load) falls on all of them alike; ratios are per round
        for rnd in range(1, args.prefill_rounds):
            for run in runs[rnd % len(runs):] + runs[: rnd % len(runs)]:
                prefill_again(model, run)
            print(f"prefill round {rnd}: " + ", ".join(f"{r['label']} {r['prefill_s'][-1]:.2f}" for r in runs), flush=True)
        for rnd in range(args.rounds):
            for run in runs[rnd % len(runs):] + runs[: rnd % len(runs)]:
                decode_round(model, run, args.steps)
            print(f"round {rnd}: " + ", ".join(f"{r['label']} {r['ms'][-1]:.2f}/{r['pipelined_ms'][-1]:.2f}" for r in runs),
                  flush=True)
        for run in runs:
            run["x_full"] = ratio(full["ms"], run["ms"])
            run["x_full_pipelined"] = ratio(full["pipelined_ms"], run["pipelined_ms"])
            run["x_full_prefill"] = ratio(run["prefill_s"], full["prefill_s"])  # time, not speed: run / full
            rows.append(run)
            run.pop("caches")
            run.pop("remake")
        del runs
        gc.collect()
    print(f"\nmedian over {args.rounds} rounds of {args.steps} steps each way and {args.prefill_rounds} prefills; "
          "x full: per-round ratios, median (min-max)")
    print("| cache | context | decode ms/step | host graph ms | pipelined ms/step | tok/s | x full tok/s "
          "| pipelined x full | KV MiB | prefill s | x full prefill | peak GiB | kernels |\n|" + "---|" * 13)
    for r in rows:
        ms, build, pipelined = (statistics.median(r[k]) for k in ("ms", "build_ms", "pipelined_ms"))
        print(f"| {r['label']} | {r['T']} | {ms:.2f} | {build:.2f} | {pipelined:.2f} | {r['batch'] * 1e3 / ms:.1f} | "
              f"{spread(r['x_full'])} | {spread(r['x_full_pipelined'])} | {r['kv_mib']:.0f} | {statistics.median(r['prefill_s']):.2f} | "
              f"{spread(r['x_full_prefill'])} | {r['peak_gib']:.1f} | {r['paths']} |")


if __name__ == "__main__":
    main()
