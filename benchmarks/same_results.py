"""Do two versions of the library give the same results? Real runs on the embedded model (CPU),
every result column dumped, then compared.

A change meant to be speed only (issue #13: the host cost of a decode step) must leave every
score, KL, token, kept-token count and `live_kv_bytes` of every step as it was. `dump` runs one
language-modelling sample (400-token context, 150 teacher-forced decode steps, so KIVI's
paper-policy flushes and eviction happen many times) through the runner with KIVI (2/4 bits, paper
and grouped policies, R 128 and 32), StreamingLLM, H2O, Keyformer (attention and proxy scores),
SnapKV and TOVA at budget 0.5, and writes every column of the run, step and evidence rows except
the timings. `compare` prints the columns that differ. `method_peak_bytes` and `peak_memory_bytes`
are measured allocator peaks: they move between two runs of the same code, and fewer or other
temporaries move them without any result changing, so they are reported apart.

    python benchmarks/same_results.py dump before.json     # on the old code
    python benchmarks/same_results.py dump after.json      # on the new code
    python benchmarks/same_results.py compare before.json after.json
"""

from __future__ import annotations

import json
import sys

TIMINGS = {"step_ms", "decode_tok_s", "prefill_s", "created_at"}
MEASURED = {"method_peak_bytes", "peak_memory_bytes"}


def dump(path: str) -> None:
    import kvcompress
    from kvcompress.datasets import load_dataset
    from kvcompress.methods import method_config
    from kvcompress.runner import RunContext, run_sample

    model, tokenizer = kvcompress.load_model("smollm2-135m")
    params = {"context_tokens": 400, "continuation_tokens": 150, "num_samples": 1, "seed": 3}
    sample = load_dataset("lm", tokenizer=tokenizer, **params)[0]
    context = RunContext("smollm2-135m", "fp", "lm", params, 150)
    methods = [method_config("kivi", bits=2), method_config("kivi", bits=4), method_config("kivi", bits=2, residual=32),
               method_config("kivi", bits=2, residual_policy="grouped"), method_config("streaming", budget=0.5),
               method_config("h2o", budget=0.5), method_config("keyformer", budget=0.5),
               method_config("keyformer", budget=0.5, score="proxy"), method_config("snapkv", budget=0.5),
               method_config("tova", budget=0.5)]
    out = {}
    for record in run_sample(model, tokenizer, sample, methods, context):
        run = {k: v for k, v in record.run.items() if k not in TIMINGS}
        steps = [{k: v for k, v in s.items() if k not in TIMINGS} for s in record.steps]
        out[run["run_id"]] = {"run": run, "steps": steps, "evidence": record.evidence}
    with open(path, "w") as f:
        json.dump(out, f, sort_keys=True, default=str)
    print(f"{len(out)} runs, {sum(len(v['steps']) for v in out.values())} step rows -> {path}")


def compare(before_path: str, after_path: str) -> int:
    """Runs are matched by config label (a method revision changes a run's id, not its label); per
    run and column: how many values differ and, for numbers, the largest absolute difference."""
    before, after = (_by_label(json.load(open(p))) for p in (before_path, after_path))
    if before.keys() != after.keys():
        print(f"different runs: {sorted(before.keys() ^ after.keys())}")
        return 1
    differ = 0
    for label, a in before.items():
        b = after[label]
        if a["run"]["run_id"] != b["run"]["run_id"]:
            print(f"id {label}: run id {a['run']['run_id']} -> {b['run']['run_id']} (configuration changed)")
        changes: dict[str, list] = {}
        for column in sorted((set(a["run"]) | set(b["run"])) - TIMINGS - {"run_id", "config"}):
            x, y = a["run"].get(column), b["run"].get(column)
            if x != y:
                kind = "measured" if column in MEASURED else "RESULT"
                differ += kind == "RESULT"
                print(f"{kind} {label}: runs.{column} {x} -> {y}")
        for x, y in zip(a["steps"], b["steps"]):
            for column in sorted((set(x) | set(y)) - {"run_id"}):
                if x.get(column) != y.get(column):
                    changes.setdefault(column, []).append((x.get(column), y.get(column)))
        for column, pairs in changes.items():
            differ += len(pairs)
            numeric = [abs(p - q) for p, q in pairs if isinstance(p, (int, float)) and isinstance(q, (int, float))]
            largest = f", largest |difference| {max(numeric):.3g}" if numeric else ""
            print(f"RESULT {label}: steps.{column} differs in {len(pairs)} of {len(a['steps'])} rows{largest}")
        if len(a["steps"]) != len(b["steps"]) or a["evidence"] != b["evidence"]:
            differ += 1
            print(f"RESULT {label}: step count or evidence rows differ")
    steps = sum(len(v["steps"]) for v in before.values())
    print(f"{len(before)} runs, {steps} step rows: {differ} result values differ")
    return 1 if differ else 0


def _by_label(dumped: dict) -> dict:
    return {v["run"].get("config_label", run_id): v for run_id, v in dumped.items()}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
