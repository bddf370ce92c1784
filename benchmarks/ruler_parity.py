"""RULER parity: full-cache scores of our `ruler` generator against RULER's own samples, same model.

RULER's samples are the ones kept in tests/data/ruler_reference (made once with RULER's generator;
that folder's README says how). Both go through the runner's own path: `runner.reference` (the
prompt of `datasets.sample_prompt`, full-cache greedy decode to EOS or the task's answer budget)
and `datasets.score`, so only the sample text differs. Every (generator, task, sample) result is
appended to a JSONL file, so a rerun resumes; the table is printed from that file.

    python benchmarks/ruler_parity.py --results /tmp/ruler-parity.jsonl            # run, then table
    python benchmarks/ruler_parity.py --results /tmp/ruler-parity.jsonl --table    # table only
    python benchmarks/ruler_parity.py --results /tmp/ruler-parity.jsonl --features /tmp/niah-single-3.jsonl

--features writes niah_single_3's samples feature by feature (tokenizer only, seconds): per sample of
each generator its value's and key's tokens, context tokens, the needle's depth and answer budget;
the features table joins them with the scores and prompt lengths of --results.

Scores: mean with a 95% Wilson interval (as the QUALITY.md ceiling table), n samples each. RULER's
generator drops an essay haystack by 500 words when a redrawn sample overflows (niah.py's retry
loop), which at 1024 tokens halves a sample (~400 tokens): the last column leaves those out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from pathlib import Path

import kvcompress  # noqa: F401  (first: preloads OpenBLAS before mlx)
from kvcompress import datasets
from kvcompress.datasets.ruler import OFFLINE_TASKS, Ruler, answer_budget
from kvcompress.datasets.ruler_reference import load_ruler_samples
from kvcompress.model import load_model, load_tokenizer
from kvcompress.runner import reference

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "ruler_reference"
CONTEXT_TOKENS = 1024
HALF_LENGTH = 0.5  # a RULER sample under half of max_seq_length was cut by its 500-word retry
NEEDLE = re.compile(r"One of the special magic uuids for (.+?) is: (\S+)\.")


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def samples(generator: str, task: str, n: int, seed: int, tokenizer) -> list[dict]:
    if generator == "ruler":
        return load_ruler_samples(task, REFERENCE_DIR / f"{task}.jsonl", tokenizer)[:n]
    return Ruler(task=task, context_tokens=CONTEXT_TOKENS, num_samples=n, seed=seed).load(tokenizer).to_list()


def run(results: Path, tasks: list[str], generators: list[str], n: int, seed: int) -> None:
    done = set()
    if results.exists():
        done = {(r["generator"], r["task"], r["sample_id"]) for r in map(json.loads, results.open())}
    model, tokenizer = load_model()
    eos = set(tokenizer.eos_token_ids)
    for task in tasks:
        for generator in generators:
            for sample in samples(generator, task, n, seed, tokenizer):
                if (generator, task, sample["id"]) in done:
                    continue
                start = time.perf_counter()
                ref = reference(model, tokenizer, sample, [], None)
                prediction = tokenizer.decode([t for t in ref.tokens if t not in eos])
                meta = json.loads(sample["metadata"])
                row = {"generator": generator, "task": task, "sample_id": sample["id"], "seed": seed,
                       "prompt_tokens": len(ref.prompt), "ruler_length": meta.get("ruler_length"),
                       "score": datasets.score(sample, prediction), "prediction": prediction,
                       "answers": sample["answers"], "seconds": round(time.perf_counter() - start, 2)}
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{generator:5} {task:16} {sample['id']:32} {row['score']:.2f} {row['seconds']:6.1f}s",
                      flush=True)


def cell(scores: list[float]) -> str:
    if not scores:
        return "-"
    mean = sum(scores) / len(scores)
    low, high = wilson(mean, len(scores))
    return f"{mean:.2f} [{low:.2f}, {high:.2f}] (n={len(scores)})"


def table(results: Path, tasks: list[str]) -> str:
    rows = [json.loads(line) for line in results.open()]
    lines = ["| task | ours | RULER's | RULER's, half-length samples left out |", "|---|---|---|---|"]
    for task in tasks:
        ours = [r["score"] for r in rows if r["task"] == task and r["generator"] == "ours"]
        theirs = [r for r in rows if r["task"] == task and r["generator"] == "ruler"]
        whole = [r["score"] for r in theirs if r["ruler_length"] >= HALF_LENGTH * CONTEXT_TOKENS]
        lines.append(f"| {task} | {cell(ours)} | {cell([r['score'] for r in theirs])} | {cell(whole)} |")
    return "\n".join(lines)


def features(path: Path, n: int, seed: int) -> None:
    """niah_single_3's samples of both generators, one row each (the task of issue #44's gap)."""
    tokenizer = load_tokenizer()

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    raw = [json.loads(line) for line in (REFERENCE_DIR / "niah_single_3.jsonl").open()][:n]
    budgets = {"ours": [answer_budget("niah_single_3")] * n,  # RULER's: its length less its prompt
               "ruler": [r["length"] - tokens(r["input"] + r["answer_prefix"]) for r in raw]}
    with path.open("w") as f:
        for generator in ("ours", "ruler"):
            for sample, budget in zip(samples(generator, "niah_single_3", n, seed, tokenizer), budgets[generator]):
                needle = NEEDLE.search(sample["context"])
                context = tokens(sample["context"])
                f.write(json.dumps({"generator": generator, "sample_id": sample["id"],
                                    "value_tokens": tokens(" " + needle.group(2)),
                                    "key_tokens": tokens(" " + needle.group(1)), "context_tokens": context,
                                    "needle_depth": tokens(sample["context"][:needle.start()]) / context,
                                    "answer_budget": budget}) + "\n")


def features_table(path: Path, results: Path) -> str:
    """niah_single_3 per generator: the features' means or medians and ranges, with the full cache's
    score and prompt lengths from the parity results (joined by sample id)."""
    rows = [json.loads(line) for line in path.open()]
    scored = {(r["generator"], r["sample_id"]): r for r in map(json.loads, results.open())
              if r["task"] == "niah_single_3"}
    cells: dict[str, list[str]] = {}
    for generator in ("ours", "ruler"):
        mine = [r for r in rows if r["generator"] == generator]
        runs = [scored[(generator, r["sample_id"])] for r in mine]
        depths = [r["needle_depth"] for r in mine]
        wrong = sorted(r["needle_depth"] for r, run in zip(mine, runs) if run["score"] < 1)
        budgets, prompts = [r["answer_budget"] for r in mine], [run["prompt_tokens"] for run in runs]
        correct = sum(run["score"] for run in runs)
        for name, value in [
                ("value tokens, mean", f"{statistics.mean(r['value_tokens'] for r in mine):.1f}"),
                ("key tokens, mean", f"{statistics.mean(r['key_tokens'] for r in mine):.1f}"),
                ("answer budget", f"{min(budgets)}-{max(budgets)}" if min(budgets) < max(budgets) else f"{budgets[0]}"),
                ("prompt tokens on our chat path", f"{min(prompts)}-{max(prompts)}"),
                ("haystack, median context tokens", f"{statistics.median(r['context_tokens'] for r in mine):.0f}"),
                ("needle depth (token fraction of the context)",
                 f"median {statistics.median(depths):.2f}, range {min(depths):.2f}-{max(depths):.2f}"),
                ("depths of the wrong answers", ", ".join(f"{d:.2f}" for d in wrong) or "-"),
                ("full-cache score", f"{correct / len(runs):.2f} ({correct:g}/{len(runs)})")]:
            cells.setdefault(name, []).append(value)
    return "\n".join(["| feature | ours | RULER's |", "|---|---|---|",
                      *(f"| {name} | {' | '.join(values)} |" for name, values in cells.items())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True, help="JSONL of per-sample results (appended)")
    parser.add_argument("--tasks", nargs="+", default=list(OFFLINE_TASKS), choices=OFFLINE_TASKS)
    parser.add_argument("--generators", nargs="+", default=["ours", "ruler"], choices=["ours", "ruler"])
    parser.add_argument("-n", type=int, default=25, help="samples per task and generator")
    parser.add_argument("--seed", type=int, default=1, help="our generator's seed (QUALITY.md uses 1)")
    parser.add_argument("--table", action="store_true", help="print the table from --results only")
    parser.add_argument("--features", type=Path, default=None,
                        help="write niah_single_3's features here and print their table (needs --results' scores)")
    args = parser.parse_args()
    if args.features:
        features(args.features, args.n, args.seed)
        print(features_table(args.features, args.results))
        return
    if not args.table:
        run(args.results, args.tasks, args.generators, args.n, args.seed)
    print(table(args.results, args.tasks))


if __name__ == "__main__":
    main()
