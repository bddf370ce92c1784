"""Eviction x quantization on the embedded model (CPU): resident KV bytes over the full cache's and
the next-token KL against the full cache, per configuration (docs/methods.md, "Composition").

The runner's own path (`run_sample` on the essay language-modelling task, query-aware): one full
prefill per sample, each method compresses it (`from_prefill`) and decodes the essay's continuation
teacher-forced; the KL is the mean over the decode steps after the first (the first token's logits
come from the full prefill), the bytes are `live_kv_bytes` at the end over the full cache's. Each
(sample, configuration) is a row of --jsonl (benchmarks/tables.py publishes the table from the
archived rows); the table, means over the samples, is printed from the rows.

    python benchmarks/composition_cpu.py [--context 1024] [--continuation 32] [--samples 3] [--jsonl PATH]
    python benchmarks/composition_cpu.py --jsonl PATH --table    # the table only
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

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


def run(path: Path, args) -> None:
    model, tokenizer = load_model("smollm2-135m")
    params = {"context_tokens": args.context, "continuation_tokens": args.continuation, "num_samples": args.samples,
              "seed": 0}
    context = RunContext("smollm2-135m", "fp", "lm", params, args.continuation)
    configs = methods(args.budget)
    with path.open("w") as f:
        for sample in load_dataset("lm", tokenizer=tokenizer, **params):
            for record in run_sample(model, tokenizer, sample, configs, context):
                run, steps = record.run, record.steps[1:]
                assert run["status"] == "ok", run["error"]
                row = {"sample_id": sample["id"], "config_label": run["config_label"],
                       "context_tokens": args.context, "kl_steps": len(steps),
                       "kl_mean": sum(s["kl"] for s in steps) / len(steps),
                       "live_kv_bytes": run["live_kv_bytes"], "full_kv_bytes": run["full_kv_bytes"]}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"{sample['id']} {row['config_label']:50} {row['kl_mean']:.4f}", flush=True)


def table(path: Path) -> str:
    """Per configuration, in the order measured: bytes over the full cache's and the KL, means over the samples."""
    found: dict[str, list[dict]] = {}
    for row in map(json.loads, path.open()):
        found.setdefault(row["config_label"], []).append(row)
    lines = ["| configuration | resident bytes / full | next-token KL vs full (mean) | samples |",
             "|---|---:|---:|---:|"]
    for label, rows in found.items():
        ratio = sum(r["live_kv_bytes"] / r["full_kv_bytes"] for r in rows) / len(rows)
        kl = sum(r["kl_mean"] for r in rows) / len(rows)
        lines.append(f"| `{label}` | {ratio:.3f} | {kl:.4f} | {len(rows)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--jsonl", type=Path, default=None, help="write the rows here (default: a temporary file)")
    parser.add_argument("--table", action="store_true", help="print the table of --jsonl, measure nothing")
    args = parser.parse_args()
    if args.table and args.jsonl is None:
        parser.error("--table prints the table of --jsonl PATH: name the rows to read")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.jsonl or Path(tmp) / "composition.jsonl"
        if not args.table:
            run(path, args)
            print(f"\n{args.context}-token essay prompts, {args.continuation} teacher-forced steps")
        print("\n" + table(path))


if __name__ == "__main__":
    main()
