"""Do the caches' key buffers stay in place across decode steps, synchronous and pipelined?

MLX updates a buffer in place only when nothing else holds it; a cache whose token write found its
buffer still held (by the previous step's kernels, in flight while the next step is built, as
`mlx_lm.generate` pipelines) would copy the whole buffer every step. A random-weight Llama of the
Llama-3.1-8B shape (8 layers, fp16; `--tiny`: a small one, for a CPU), a 16k prompt (600 tiny),
then 12 steps each way; printed: how many distinct data addresses layer 0's key buffer had after
them (1: in place; a mlx-lm KVCache may move once when it grows by its 256-slot step).

    python benchmarks/buffers_in_place.py [--tiny]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from kivi_e2e import greedy, llama8b_shaped, prefill, step  # noqa: E402

CACHES = (("full", {}), ("streaming", {"budget": 0.5}), ("h2o", {"budget": 0.5}), ("tova", {"budget": 0.5}),
          ("keyformer", {"budget": 0.5}))


def address(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    model = llama8b_shaped(2 if args.tiny else 8, args.tiny)
    prompt = list(range(600 if args.tiny else 16384))
    for method, params in CACHES:
        caches = kvcompress.make_cache(model, method, **params)
        logits, _ = prefill(model, caches, prompt)
        y = greedy(logits)
        first = caches[0]
        for mode in ("sync", "pipelined"):
            seen = []
            y = step(model, caches, y)
            mx.async_eval(y)
            for _ in range(args.steps):
                following = step(model, caches, y)
                if mode == "pipelined":  # the next step submitted before this one is waited for
                    mx.async_eval(following)
                    y.item()
                else:
                    following.item()
                seen.append(address(first.keys if method == "full" else first._keys))
                y = following
            y.item()
            print(f"{method:10s} {mode:9s}: {len(set(seen))} distinct key-buffer addresses in {len(seen)} steps",
                  flush=True)


if __name__ == "__main__":
    main()
