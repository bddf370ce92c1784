"""Prompt scoring speed (kvcompress/methods/prompt_scores.py): this tree's `accumulated_attention`
against another revision's (default: main), one layer of the Llama-3.1-8B shape.

Random post-RoPE queries [8 KV heads, 4 query heads each, T, 128] and keys [8, T, 128] score a
T-token prompt as a prefill does: in chunks of --chunk queries (mlx-lm's default 2048; 0 = one
call), each chunk over all keys so far. Timed per method: H2O (no transform) and Keyformer (its own
transform through a real EvictionCache, as `_score_prompt_queries` calls it); new = this tree's MLX
tiles, and on CUDA also this tree's tensor-core kernels (kvcompress/kernels/prompt_scores.py, what
the cache takes there; `--cache` times the cache with them). Both versions run
interleaved in one process (medians of --reps), so the ratio old/new is measured under one load.
`--cache` also times `EvictionCache.from_prefill` (scoring, selection, the cache's own work) with
each version patched in, and, for scale, the layer's causal attention (SDPA) over the prompt:
what a full cache spends on the same layer's prompt attention. `--model N` times the embedded
model's whole prefill of an N-token essay prompt (mlx-lm's generate_step, chunks of 2048) through
`kvcompress.make_cache` for full, h2o and keyformer (budget 0.5), each version patched in.

    python benchmarks/prompt_scores_speed.py                          # CPU: 1024 2048, float32
    python benchmarks/prompt_scores_speed.py --tokens 8192 32768 --dtype float16 --cache   # GPU
    python benchmarks/prompt_scores_speed.py --tokens --model 1024 --reps 1         # CPU, the real model

On a GPU the new version compiles its per-element chain (`fused`); --fused on/off overrides that.
`--against tiles` compares this tree's MLX tiles (old) with its kernels, no other revision needed.
Where the tree has no git history (a device copy), pass the old file: `git show
46240b4:kvcompress/methods/prompt_scores.py > old_prompt_scores.py` beforehand, then
`--against old_prompt_scores.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's kvcompress, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcompress  # noqa: E402  (BLAS preload before mlx)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from timing import interleaved_median_ms  # noqa: E402

from kvcompress.kernels import dispatch  # noqa: E402

from kvcompress.methods import eviction, prompt_scores  # noqa: E402
from kvcompress.methods.eviction import EvictionCache  # noqa: E402
from kvcompress.methods.h2o import H2O  # noqa: E402
from kvcompress.methods.keyformer import Keyformer  # noqa: E402

R, G, D = 8, 4, 128  # KV heads, query heads per KV head, head dim (Llama-3.1-8B)
REPO = Path(__file__).resolve().parent.parent


def tiles_only(q, k, scale, transform=None, tile=None, fused=None):
    """This tree's MLX tiles, the prompt kernels bypassed (the default tile made explicit)."""
    elements = prompt_scores.GPU_TILE_ELEMENTS if mx.default_device() == mx.gpu else prompt_scores.TILE_ELEMENTS
    tile = tile or prompt_scores.tile_shape(q.shape[0] * q.shape[1], q.shape[2], k.shape[1], elements)
    return prompt_scores.accumulated_attention(q, k, scale, transform, tile=tile, fused=fused)


def module_at(rev: str):
    """prompt_scores.py as of git revision `rev` (or the file at path `rev`), loaded as its own module."""
    if Path(rev).is_file():  # a machine without the git history: the old file copied beside the tree
        source = Path(rev).read_text()
    else:
        source = subprocess.run(["git", "show", f"{rev}:kvcompress/methods/prompt_scores.py"], cwd=REPO,
                                check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "prompt_scores_old.py"
    path.write_text(source)
    # named inside kvcompress.methods: its relative imports (..kernels) resolve to this tree's
    spec = importlib.util.spec_from_file_location("kvcompress.methods.prompt_scores_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prefill_cache(config, T: int) -> EvictionCache:
    """A layer's cache with position set as after a T-token prefill (what the transform reads)."""
    cache = EvictionCache(config, 0, 1, R, D, nn.RoPE(D), D**-0.5)
    cache.position = T
    return cache


def scorer_transform(config, cache):
    """Keyformer's transform as `_score_prompt_queries` passes it; None for H2O (no transform)."""
    if config.name == "h2o":
        return None
    scorer = config.scoring()

    def transform(logits, query_positions, key_positions):
        return scorer.transform(cache, logits, query_positions, key_positions[None])

    return transform


def score_prompt(fn, q, k, transform, chunk: int) -> None:
    """Score the prompt in prefill chunks with accumulated_attention `fn`; evaluates the result."""
    T = k.shape[1]
    chunk = chunk or T
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        mx.eval(fn(q[:, :, start:end], k[:, :end], D**-0.5, transform))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 2048])
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float32")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (queries per call); 0: one call")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--against", default="main", help="git revision of the old prompt_scores.py, or its file, "
                        "or 'tiles': this tree's MLX tiles (the prompt kernels bypassed)")
    parser.add_argument("--methods", nargs="+", choices=["h2o", "keyformer"], default=["h2o", "keyformer"])
    parser.add_argument("--fused", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--cache", action="store_true", help="also time from_prefill and the layer's SDPA")
    parser.add_argument("--model", type=int, metavar="TOKENS", help="also time the embedded model's prefill")
    args = parser.parse_args()

    old = SimpleNamespace(accumulated_attention=tiles_only) if args.against == "tiles" else module_at(args.against)
    fused = {"auto": None, "on": True, "off": False}[args.fused]

    def new(q, k, scale, transform):
        return tiles_only(q, k, scale, transform, fused=fused)

    def with_kernels(config, cache):
        """kernels/prompt_scores.py's tensor-core path, as `_score_prompt_queries` takes it on CUDA."""
        def run(q, k, scale, transform):
            cache.position = k.shape[1]  # the chunk's queries are the last ones so far
            noise = config.scoring().prompt_kernel_noise(cache, R, G, q.shape[2])
            return prompt_scores.accumulated_attention(q, k, scale, transform, kernel_noise=noise)
        return run

    cuda = dispatch.gpu_backend() == "cuda"

    dtype = getattr(mx, args.dtype)
    device = mx.default_device()
    print(f"device {device}, {args.dtype}; old = {args.against}, new = this tree (fused: {args.fused}), "
          f"medians of {args.reps}")
    if args.tokens:
        print(f"\naccumulated_attention, one layer: {R} KV heads x {G} query heads, D {D}; "
              f"prefill chunks {args.chunk or 'none'}")
        print("| method | tokens | old ms | new ms (MLX tiles) | old/new | kernels ms | old/kernels |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for T in args.tokens:
        k1, k2 = mx.random.split(mx.random.key(T))
        q = mx.random.normal((R, G, T, D), key=k1).astype(dtype)
        k = (mx.random.normal((R, T, D), key=k2) * 2.0).astype(dtype)
        mx.eval(q, k)
        for name in args.methods:
            config = H2O(budget=0.5) if name == "h2o" else Keyformer(budget=0.5)
            cache = prefill_cache(config, T)
            transform = scorer_transform(config, cache)
            runs = [lambda: score_prompt(old.accumulated_attention, q, k, transform, args.chunk),
                    lambda: score_prompt(new, q, k, transform, args.chunk)]
            if cuda:
                runs.append(lambda: score_prompt(with_kernels(config, cache), q, k, transform, args.chunk))
            old_ms, new_ms, *kernel_ms = interleaved_median_ms(*runs, reps=args.reps)
            kernels = f"{kernel_ms[0]:.1f} | {old_ms / kernel_ms[0]:.2f}" if kernel_ms else "- | -"
            print(f"| {name} | {T} | {old_ms:.1f} | {new_ms:.1f} | {old_ms / new_ms:.2f} | {kernels} |", flush=True)
    if args.cache:
        print("\nThrough a real cache: EvictionCache.from_prefill of one layer (B 1), each version patched in;"
              " SDPA: the same layer's causal attention over the prompt (a full cache's share)")
        print("| method | tokens | SDPA ms | old from_prefill ms | new from_prefill ms | old/new | new/SDPA |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
        for T in args.tokens:
            k1, k2, k3 = mx.random.split(mx.random.key(T + 1), 3)
            q = mx.random.normal((1, R * G, T, D), key=k1).astype(dtype)
            k = (mx.random.normal((1, R, T, D), key=k2) * 2.0).astype(dtype)
            v = mx.random.normal((1, R, T, D), key=k3).astype(dtype)
            mx.eval(q, k, v)

            def sdpa():
                mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal"))

            for name in args.methods:
                config = H2O(budget=0.5) if name == "h2o" else Keyformer(budget=0.5)

                def prefill(fn):
                    def run():
                        # this tree's cache passes kernel_noise (its tensor-core path on CUDA); an
                        # old version does not take it
                        eviction.accumulated_attention = fn if fn is prompt_scores.accumulated_attention else \
                            (lambda *a, kernel_noise=None, **kw: fn(*a, **kw))
                        try:
                            cache = EvictionCache(config, 0, 1, R, D, nn.RoPE(D), D**-0.5)
                            cache.from_prefill(k, v, q)
                            mx.eval(cache.keys, cache.values, cache.scores)
                        finally:
                            eviction.accumulated_attention = prompt_scores.accumulated_attention
                    return run

                sdpa_ms, old_ms, new_ms = interleaved_median_ms(
                    sdpa, prefill(old.accumulated_attention), prefill(prompt_scores.accumulated_attention),
                    reps=args.reps)
                print(f"| {name} | {T} | {sdpa_ms:.1f} | {old_ms:.1f} | {new_ms:.1f} | {old_ms / new_ms:.2f} | "
                      f"{new_ms / sdpa_ms:.1f} |", flush=True)
    if args.model:
        model_prefill(args.model, args.methods, old.accumulated_attention, new, args.reps)


def model_prefill(tokens: int, methods, old, new, reps: int) -> None:
    """The embedded model's prefill through make_cache: full, then each method with old and new."""
    from eviction_cpu_8k import essay_prompt
    from mlx_lm.generate import generate_step

    model, tok = kvcompress.load_model()
    prompt = essay_prompt(tok, tokens)

    def prefill(method, fn=None):
        def run():
            eviction.accumulated_attention = fn or prompt_scores.accumulated_attention
            try:
                cache = kvcompress.make_cache(model, method, **({} if method == "full" else {"budget": 0.5}))
                next(generate_step(prompt, model, max_tokens=1, prompt_cache=cache, prefill_step_size=2048))
            finally:
                eviction.accumulated_attention = prompt_scores.accumulated_attention
        return run

    print(f"\nThe embedded model (SmolLM2-135M as kvcompress.load_model loads it), prefill of a "
          f"{prompt.size}-token prompt through make_cache (budget 0.5), medians of {reps}")
    print("| method | full s | old s | new s | old/new | old/full | new/full |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for name in methods:
        full_ms, old_ms, new_ms = interleaved_median_ms(prefill("full"), prefill(name, old), prefill(name, new),
                                                        reps=reps)
        print(f"| {name} | {full_ms / 1e3:.2f} | {old_ms / 1e3:.2f} | {new_ms / 1e3:.2f} | {old_ms / new_ms:.2f} | "
              f"{old_ms / full_ms:.2f} | {new_ms / full_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
