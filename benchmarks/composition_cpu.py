"""Eviction x quantization on the embedded model (CPU): resident KV bytes over the full cache's and
the next-token KL against the full cache, per configuration (docs/methods.md, "Composition").

The runner's own path (`run_sample` on the essay language-modelling task, query-aware): one full
prefill per sample, each method compresses it (`from_prefill`) and decodes the essay's continuation
teacher-forced; the KL is the mean over the decode steps after the first (the first token's logits
come from the full prefill), the bytes are `live_kv_bytes` at the end over the full cache's.

    python benchmarks/composition_cpu.py [--context 1024] [--continuation 32] [--samples 3]
"""

from __future__ import annotations

import argparse

import kvcompress  # noqa: F401  (loads the optimized BLAS before mlx)
from kvcompress import load_dataset, load_model
from kvcompress.methods import method_config
from kvcompress.runner import RunContext, run_sample

QUANTIZERS = {"none": None, "kivi-4": {"name": "kivi", "bits": 4}, "kivi-2": {"name": "kivi", "bits": 2},
              "turboquant-3": {"name": "turboquant", "bits": 3},
              "turboquant-3 mse keys": {"name": "turboquant", "bits": 3, "qjl": False}, "qjl": {"name": "qjl"}}


def methods(budget: float) -> list:
    configs = [method_config("full")]
    configs += [method_config(q.pop("name"), **q) for q in (dict(v) for v in QUANTIZERS.values() if v)]
    for eviction in ("snapkv", "adakv"):
        configs += [method_config(eviction, budget=budget, quantize=q) for q in QUANTIZERS.values()]
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    params = {"context_tokens": args.context, "continuation_tokens": args.continuation, "num_samples": args.samples,
              "seed": 0}
    context = RunContext("smollm2-135m", "fp", "lm", params, args.continuation)
    configs = methods(args.budget)
    totals: dict[str, list[tuple[float, float]]] = {c.label(): [] for c in configs}
    for sample in load_dataset("lm", tokenizer=tokenizer, **params):
        for record in run_sample(model, tokenizer, sample, configs, context):
            run, steps = record.run, record.steps[1:]
            assert run["status"] == "ok", run["error"]
            kl = sum(s["kl"] for s in steps) / len(steps)
            totals[run["config_label"]].append((run["live_kv_bytes"] / run["full_kv_bytes"], kl))
    print(f"\n{args.samples} essay samples, {args.context}-token prompts, {args.continuation} teacher-forced steps\n")
    print("| configuration | resident bytes / full | next-token KL vs full (mean) |")
    print("|---|---:|---:|")
    for label, rows in totals.items():
        ratio = sum(r for r, _ in rows) / len(rows)
        kl = sum(k for _, k in rows) / len(rows)
        print(f"| `{label}` | {ratio:.3f} | {kl:.4f} |")


if __name__ == "__main__":
    main()
