"""fp32 matmul GFLOP/s with the BLAS kvcompress loads vs the mlx wheel's own, and model tok/s.

The mlx-cpu wheel links a netlib reference BLAS (kvcompress/_blas.py); this prints what the
project gets, the same matmuls in a subprocess with `KVCOMPRESS_BLAS=reference`, their ratio, and
the embedded model's prefill and decode speed (fp32) at a few context lengths.

    .venv/bin/python benchmarks/matmul_gflops.py [--sizes 1024 2048] [--contexts 256 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kvcompress  # noqa: E402  (loads the optimized BLAS before mlx)
from kvcompress import _blas  # noqa: E402

import mlx.core as mx  # noqa: E402


def matmul_gflops(n: int, runs: int) -> float:
    """Median GFLOP/s of an n x n fp32 matmul (2 n^3 flops), after one warm-up."""
    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a, b, a @ b)
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(a @ b)
        seconds.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(seconds) / 1e9


def matmul_table(sizes: list[int], runs: int) -> dict[int, float]:
    return {n: matmul_gflops(n, runs) for n in sizes}


def reference_table(sizes: list[int], runs: int) -> dict[int, float]:
    """The same measurement in a fresh process that keeps the wheel's own BLAS."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["KVCOMPRESS_BLAS"] = "reference"
    command = [sys.executable, __file__, "--matmul-only", "--sizes", *map(str, sizes), "--runs", str(runs)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return {int(n): gflops for n, gflops in json.loads(out.splitlines()[-1]).items()}


def model_speed(contexts: list[int], decode_steps: int) -> list[tuple[int, float, float]]:
    """(context tokens, prefill tok/s, decode tok/s) for the embedded model in float32."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvcompress.embedded import essays_dir
    from kvcompress.model import load_model

    model, tokenizer = load_model("smollm2-135m", dtype="float32")
    text = "".join(p.read_text() for p in sorted(essays_dir().glob("*.txt"))[:4])
    tokens = tokenizer.encode(text)
    rows = []
    for context in contexts:
        prompt = mx.array(tokens[:context])[None]
        mx.eval(model(prompt[:, :16]))  # warm-up
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        logits = model(prompt, cache=cache)
        mx.eval(logits, [c.state for c in cache])
        prefill_s = time.perf_counter() - start
        token = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(decode_steps):
            token = model(token, cache=cache)[:, -1:].argmax(-1)
            mx.eval(token)
        decode_s = time.perf_counter() - start
        rows.append((context, context / prefill_s, decode_steps / decode_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--matmul-only", action="store_true", help="print one JSON line (used for the subprocess)")
    args = parser.parse_args()

    if args.matmul_only:
        print(json.dumps(matmul_table(args.sizes, args.runs)))
        return

    optimized = matmul_table(args.sizes, args.runs)
    reference = reference_table(args.sizes, max(1, min(args.runs, 3)))  # ~5 s per 2048 run
    print(f"fp32 matmul GFLOP/s (median of {args.runs}; reference: median of {max(1, min(args.runs, 3))})")
    print(f"kvcompress BLAS: {_blas.loaded or 'mlx wheel (reference)'}")
    print(f"{'n':>6} {'kvcompress':>12} {'mlx wheel':>12} {'ratio':>8}")
    for n in args.sizes:
        print(f"{n:>6} {optimized[n]:>12.1f} {reference[n]:>12.1f} {optimized[n] / reference[n]:>7.1f}x")

    print(f"\nsmollm2-135m fp32, kvcompress BLAS (decode: {args.decode_steps} greedy steps after the prefill)")
    print(f"{'context':>8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for context, prefill, decode in model_speed(args.contexts, args.decode_steps):
        print(f"{context:>8} {prefill:>14.1f} {decode:>13.1f}")


if __name__ == "__main__":
    main()
