"""How much of a decode step the full cache's attention is: the most any KV compression can save.

A random-weight mlx-lm Llama of the Llama-3.1-8B shape (e2e.py's model), mlx-lm's own KVCache
filled with random keys and values (no prefill: the cache's state is set directly), decoded
synchronously as e2e.py times it (median ms a step; the two contexts take turns over rounds). For each batch size:

- the step at a tiny context (16 tokens): everything but attention over a long cache (weights,
  norms, RoPE, the host's graph building);
- the step at `--context` tokens: the difference is what attention over the cache costs a step;
- `layers` chained SDPA calls at `--context` (each layer's queries waiting for the last layer's
  output, as in a model): the attention alone.

A compressed cache can decode faster than the full cache only by less than the attention's share,
and only if its own per-layer work (cache update, kernels, Python) costs less than what it saves.

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/step_budget.py`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcompress  # noqa: E402,F401  (before mlx: on Linux it loads OpenBLAS)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from e2e import decode_sync, llama8b_shaped  # noqa: E402

def filled_caches(args, batch: int, tokens: int) -> list[KVCache]:
    """One mlx-lm KVCache a layer holding `tokens` random keys and values (args: the model's ModelArgs)."""
    shape = (batch, args.num_key_value_heads, tokens, args.head_dim)
    caches = []
    for _ in range(args.num_hidden_layers):
        cache = KVCache()
        keys = (0.5 * mx.random.normal(shape)).astype(mx.float16)
        values = mx.random.normal(shape).astype(mx.float16)
        cache.update_and_fetch(keys, values)
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    return caches


def chained_sdpa_ms(args, batch: int, tokens: int, rounds: int) -> float:
    """Median ms of one SDPA call a layer, each layer's queries waiting on the last one's output."""
    q = mx.random.normal((batch, args.num_attention_heads, 1, args.head_dim)).astype(mx.float16)
    kv = [tuple(mx.random.normal((batch, args.num_key_value_heads, tokens, args.head_dim)).astype(mx.float16)
                for _ in range(2))
          for _ in range(4)]  # 4 distinct caches, reused: the layers' bytes are read from HBM all the same
    mx.eval(q, kv)
    times = []
    for _ in range(rounds):
        mx.synchronize()
        start = time.perf_counter()
        x = q
        for layer in range(args.num_hidden_layers):
            keys, values = kv[layer % 4]
            x = x + 0 * mx.fast.scaled_dot_product_attention(x, keys, values, scale=args.head_dim**-0.5)
        mx.eval(x)
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps a round (each a median)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a small random Llama (a smoke run on a CPU)")
    args = parser.parse_args()
    model = llama8b_shaped(args.layers, tiny=args.tiny)
    print(f"mlx {mx.__version__} {mx.default_device()}, {args.layers} layers, context {args.context}")
    print("| batch | step at 16 tokens ms | step at context ms | attention's share | chained SDPA ms |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        token = mx.zeros((batch,), dtype=mx.int32)
        caches = {tokens: filled_caches(model.args, batch, tokens) for tokens in (16, args.context)}
        ms = {tokens: [] for tokens in caches}
        for _ in range(args.rounds):  # the two contexts take turns: host drift falls on both
            for tokens, layer_caches in caches.items():
                ms[tokens].append(decode_sync(model, layer_caches, token, args.steps, 2)[0])
        short, long = statistics.median(ms[16]), statistics.median(ms[args.context])
        sdpa = chained_sdpa_ms(model.args, batch, args.context, args.steps * args.rounds)
        print(f"| {batch} | {short:.2f} | {long:.2f} | {(long - short) / long:.0%} | {sdpa:.2f} |", flush=True)
        del caches
        mx.clear_cache()


if __name__ == "__main__":
    main()
