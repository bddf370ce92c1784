"""One eviction decode step, the EvictionCache of git revision REV against the current one, in one process.

Layers of random keys and values (default: the embedded SmolLM2-135M's shape: 30 layers, 3 KV heads,
9 query heads, D 64, float32 on the default device), each cache holding `n` tokens as after a slightly
longer prompt; the two versions take turns step by step (so a change in the machine's load hits
both alike), 3 warm-up steps then the median of `--steps`. Prints before/after (> 1: faster now).
`--pipelined`: as mlx_lm.generate decodes, each step's graph is submitted without waiting for the
last (mx.async_eval), so host and device overlap; the versions then take turns in blocks of 4 steps,
timed as a block.

    python benchmarks/evict_step_ab.py --against 46240b4 --tokens 2048 --methods streaming h2o tova keyformer
    python benchmarks/evict_step_ab.py --against DIR --shape 32 8 4 128 --dtype float16 --tokens 16384 --pipelined
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from evict_decode_gpu import ready_caches  # noqa: E402
from host_graph import classes_at  # noqa: E402

from kvcompress.methods import eviction  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="REV", help="git revision (or a tree's directory)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--methods", nargs="+", default=["streaming", "h2o", "tova", "keyformer", "snapkv"])
    parser.add_argument("--shape", type=int, nargs=4, default=[30, 3, 3, 64], metavar=("LAYERS", "H_KV", "GROUP", "D"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--pipelined", action="store_true", help="async_eval steps, timed in blocks of 4")
    args = parser.parse_args()
    layers, H, G, D = args.shape
    dtype = getattr(mx, args.dtype)
    old = classes_at(args.against)["EvictionCache"]
    k = mx.random.normal((1, H, 1, D)).astype(dtype)
    q = mx.random.normal((1, H * G, 1, D)).astype(dtype)
    mx.eval(k, q)

    def steps(caches, count: int, pipelined: bool) -> float:
        """ms per step over `count` steps in a row."""
        start = time.perf_counter()
        for _ in range(count):
            x = q
            for c in caches:
                keys, values = c.update_and_fetch(k, k)
                x = c.attention(x, keys, values, scale=D**-0.5, mask=None)
            (mx.async_eval if pipelined else mx.eval)(x)
        mx.eval(x)
        return (time.perf_counter() - start) * 1e3 / count

    print(f"mlx {mx.__version__} {mx.default_device()}, {layers} layers, {H} KV heads x {G}, D {D}, {args.dtype}, n {args.tokens}")
    for method in args.methods:
        runs = {name: ready_caches(method, args.tokens, layers, H, G, D, dtype, cls)
                for name, cls in (("before", old), ("after", eviction.EvictionCache))}
        times = {name: [] for name in runs}
        block = 4 if args.pipelined else 1
        for i in range(3 + args.steps):
            for name, caches in runs.items():
                spent = steps(caches, block, args.pipelined)
                if i >= 3:
                    times[name].append(spent)
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"{method:<10} before {before:8.2f} ms  after {after:8.2f} ms  before/after {before / after:.2f}", flush=True)


if __name__ == "__main__":
    main()
