"""Quality of every eviction method on the embedded model at 25% and 50% of the prompt.

Runs the runner (shared full prefill, teacher-forced decode with per-step KL, free-running answer)
on embedded NIAH (single needle) samples; each record is appended to a JSONL file as it finishes
(rerun to resume), then summarised: mean score with a 95% Wilson interval, the full cache's score
on the same samples, the paired difference to it with a 95% normal interval over samples (clipped to [-1, 1]), and the
mean KL(full || method) over decode steps.

    .venv/bin/python benchmarks/eviction_quality.py OUT.jsonl [--samples N] [--context T] [--steps S]
    .venv/bin/python benchmarks/eviction_quality.py OUT.jsonl --summary
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict

METHODS = ["streaming", "h2o", "keyformer", "snapkv", "pyramidkv", "adakv", "tova", "knorm", "random"]


def configs():
    from kvcompress.methods import method_config

    runs = [("full", method_config("full"))]
    for fraction in (0.25, 0.5):
        runs += [(f"{name} {fraction}", method_config(name, budget=fraction)) for name in METHODS]
        runs.append((f"keyformer tau=1..1 {fraction}", method_config("keyformer", budget=fraction, tau_end=1.0)))
    return runs


def run(out, samples, context, steps):
    import kvcompress
    from kvcompress.runner import RunContext, run_sample

    done = set()
    if os.path.exists(out):
        done = {(r["sample_id"], r["cell"]) for r in map(json.loads, open(out))}
    model, tok = kvcompress.load_model()
    params = {"variant": "single", "context_tokens": context, "num_samples": samples, "seed": 5}
    context_ = RunContext("smollm2-135m", "embedded", "niah", params, steps)
    cells = configs()
    for sample in kvcompress.load_dataset("niah", tokenizer=tok, **params):
        todo = [(cell, cfg) for cell, cfg in cells if (sample["id"], cell) not in done]
        if not todo:
            continue
        records = run_sample(model, tok, sample, [cfg for _, cfg in todo], context_)
        with open(out, "a") as f:
            for (cell, _), record in zip(todo, records):
                kl = [s["kl"] for s in record.steps]
                f.write(json.dumps({
                    "sample_id": sample["id"], "cell": cell, "status": record.run["status"], "score": record.run["score"],
                    "kl_mean": sum(kl) / len(kl) if kl else None, "budget_tokens": record.run.get("budget_tokens"),
                    "prediction": record.run["prediction"], "error": record.run["error"],
                }) + "\n")
        print(f"sample {sample['id']}: {len(todo)} runs", flush=True)


def wilson(p, n, z=1.96):
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def summary(out):
    rows = [r for r in map(json.loads, open(out))]
    errors = [r for r in rows if r["status"] != "ok"]
    by_cell = defaultdict(dict)
    for r in rows:
        if r["status"] == "ok":
            by_cell[r["cell"]][r["sample_id"]] = r
    full = by_cell.pop("full", {})
    print("| config | n | score | 95% CI | full (same samples) | paired diff | 95% CI of diff | KL mean |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- | ---: |")
    for cell, runs in sorted(by_cell.items(), key=lambda kv: (kv[0].split()[-1], kv[0])):
        ids = [i for i in runs if i in full]
        n = len(ids)
        if not n:
            continue
        score = sum(runs[i]["score"] for i in ids) / n
        ceiling = sum(full[i]["score"] for i in ids) / n
        diffs = [runs[i]["score"] - full[i]["score"] for i in ids]
        mean = sum(diffs) / n
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else float("nan")
        half = 1.96 * sd / math.sqrt(n)
        lo, hi = wilson(score, n)
        kl = sum(runs[i]["kl_mean"] for i in ids) / n
        d_lo, d_hi = max(-1.0, mean - half), min(1.0, mean + half)  # a difference of scores in [0, 1]
        print(f"| {cell} | {n} | {score:.2f} | [{lo:.2f}, {hi:.2f}] | {ceiling:.2f} | {mean:+.2f} | [{d_lo:+.2f}, {d_hi:+.2f}] | {kl:.4f} |")
    if errors:
        print(f"\n{len(errors)} runs not ok, e.g. {errors[0]['cell']}: {errors[0]['error'][:200]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args.pop(0)

    def option(name, default):
        if name in args:
            at = args.index(name)
            value = int(args[at + 1])
            del args[at : at + 2]
            return value
        return default

    if "--summary" in args:
        summary(out)
    else:
        run(out, option("--samples", 25), option("--context", 1024), option("--steps", 8))
        summary(out)
