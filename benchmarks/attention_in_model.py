"""What a cache's attention costs inside the model: a decode step with it and with it left out.

A chained benchmark (`kernel_scaling.py attn`) times attention calls alone; inside a model a layer's
attention also carries its host work, its inputs' handling and whatever the cache does around it.
Here each cache (kivi_e2e.py's model and caches, prefilled with a random prompt) decodes synchronously
in rounds, taking turns with itself with attention replaced by `queries` (same graph otherwise: the
cache's update runs and every cache array is evaluated each step, in both variants). The difference
is the attention's whole cost in the step; the no-attention step against the full cache's is the
cost of the cache's own update.

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/attention_in_model.py`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcompress  # noqa: E402
import kvcompress.attention as hook  # noqa: E402
import mlx.core as mx  # noqa: E402

from host_graph import cache_arrays  # noqa: E402
from kivi_e2e import CACHES, greedy, llama8b_shaped, prefill, prompts  # noqa: E402


class AttentionLeftOut:
    """Within the block, every layer's attention returns its queries (the full cache's SDPA through
    the hook's original, kvcompress caches' `attention` methods)."""

    def __init__(self, caches):
        self.classes = {type(c) for c in caches if hasattr(c, "attention")}

    def __enter__(self):
        self.saved = hook.original_sdpa, {cls: cls.attention for cls in self.classes}
        hook.original_sdpa = lambda queries, *args, **kwargs: queries
        for cls in self.classes:
            cls.attention = lambda self, queries, *args, **kwargs: queries

    def __exit__(self, *exc):
        hook.original_sdpa, methods = self.saved
        for cls, method in methods.items():
            cls.attention = method


def steps_ms(model, caches, token, steps: int):
    """Median ms of `steps` synchronous steps (after 2 untimed), each evaluating the cache's arrays."""
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        token = greedy(model(token.reshape(-1, 1), cache=caches))
        mx.eval(token, [cache_arrays(c) for c in caches])
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), token


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--caches", nargs="+", default=["full", "kivi bits=2"], help=f"labels from {list(CACHES)}")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small random Llama (a smoke run on a CPU)")
    args = parser.parse_args()
    model = llama8b_shaped(args.layers, tiny=args.tiny)
    print(f"mlx {mx.__version__} {mx.default_device()}, {args.layers} layers, batch 1, median ms a step")
    print("| context | cache | step | step without attention | attention | attention us a layer |")
    print("|---|---|---|---|---|---|")
    for T in args.contexts:
        runs = {}
        for label in args.caches:
            method, params = CACHES[label]
            caches = kvcompress.make_cache(model, method, **params)
            logits, _ = prefill(model, caches, prompts(model, 1, T))
            runs[label] = dict(caches=caches, token=greedy(logits), with_attention=[], without=[])
        for _ in range(args.rounds):
            for run in runs.values():
                ms, run["token"] = steps_ms(model, run["caches"], run["token"], args.steps)
                run["with_attention"].append(ms)
                with AttentionLeftOut(run["caches"]):
                    ms, run["token"] = steps_ms(model, run["caches"], run["token"], args.steps)
                run["without"].append(ms)
        for label, run in runs.items():
            step, bare = statistics.median(run["with_attention"]), statistics.median(run["without"])
            print(f"| {T} | {label} | {step:.2f} | {bare:.2f} | {step - bare:.2f} | "
                  f"{1e3 * (step - bare) / args.layers:.0f} |", flush=True)
        del runs
        mx.clear_cache()


if __name__ == "__main__":
    main()
