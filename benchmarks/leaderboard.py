"""docs/leaderboard.md from the leaderboard sweep's stored results (never edited by hand).

    python benchmarks/leaderboard.py [--archive benchmarks/results/leaderboard-*.tar.xz ...] [--results DIR]
                                     [--out docs/leaderboard.md] [--check]

Per model, protocol and context length, one row per config (method x compression):

- per task, the mean score and n; the RULER average (the mean of the per-task means, as kvpress's
  leaderboard averages RULER's tasks);
- the paired difference of that average against the full cache on the same samples, with a 95%
  stratified percentile bootstrap interval (samples resampled within each task, seeded) and a
  stratified sign-flip randomization p-value (the sign of each sample's difference flipped at
  random, within tasks; two-sided; seeded);
- a verdict after Holm's step-down correction over every config of the block (Holm 1979): `worse` /
  `better` where the adjusted p < 0.05, `n.d.` (not distinguishable) otherwise;
- resident KV bytes against the full cache's (`live_kv_bytes / full_kv_bytes`, measured);
- kvpress's published RULER-4k score for the same method and compression ratio where there is one
  (benchmarks/data/kvpress_leaderboard.csv: each value with its source), and per ratio the Spearman
  rank correlation between our ordering of the methods and theirs.

An archive (`benchmarks/gpu_grid.sh`'s `results.tar.xz`) holds a results root and `manifest.json`
(commit, date, device, MLX version), which heads the page. `--check` exits 1 if the page differs
from what the archives give (tests/test_leaderboard.py runs it on the committed archives).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import tarfile
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KVPRESS = HERE / "data" / "kvpress_leaderboard.csv"
SWEEP = "leaderboard"
RESAMPLES = 10_000
SEED = 0
ALPHA = 0.05
MIN_N = 10  # below this many samples per task a block is flagged as no verdict

# our method name -> kvpress's press name (evaluation/evaluate_registry.py)
KVPRESS_NAMES = {"random": "random", "streaming": "streaming_llm", "knorm": "knorm", "h2o": "observed_attention",
                 "tova": "tova", "snapkv": "snapkv", "pyramidkv": "pyramidkv", "keydiff": "keydiff",
                 "expected_attention": "expected_attention", "adakv": "adakv_expected_attention_e2",
                 "criticalkv": "criti_snapkv", "kvzip": "kvzip", "duoattention": "duo_attention"}


@dataclass
class Row:
    config: str
    method: str
    ratio: float | None  # compression ratio: 1 / budget for eviction, 1 / bytes ratio otherwise
    scores: dict[str, list[tuple[str, float, float]]]  # task -> [(sample_id, score, full score)]
    kv_ratio: float | None


def load_runs(results: Path) -> list[dict]:
    """Finished runs of the leaderboard sweep with the full cache's score on the same sample."""
    from kvcompress_reports import connect  # the reports layer (DuckDB over the Parquet files)

    con = connect(str(results))
    query = f"""SELECT model, protocol, context_tokens, task, sample_id, config_label, method, budget, bits,
                       score, score_full, live_kv_bytes, full_kv_bytes
                FROM run_scores WHERE sweep_id = '{SWEEP}' AND score IS NOT NULL"""
    cursor = con.execute(query)
    columns = [c[0] for c in cursor.description]
    return [dict(zip(columns, r)) for r in cursor.fetchall()]


def rows_by_block(runs: list[dict]) -> dict[tuple, list[Row]]:
    blocks: dict[tuple, dict[str, Row]] = defaultdict(dict)
    bytes_ratio: dict[tuple, list[float]] = defaultdict(list)
    for r in runs:
        block = (r["model"], r["protocol"], r["context_tokens"])
        row = blocks[block].get(r["config_label"])
        if row is None:
            row = blocks[block][r["config_label"]] = Row(r["config_label"], r["method"], None, defaultdict(list), None)
            if r["budget"] is not None and r["budget"] <= 1 and "quantize" not in r["config_label"]:
                row.ratio = 1 / r["budget"]
        if r["score_full"] is not None:
            row.scores[r["task"]].append((r["sample_id"], r["score"], r["score_full"]))
        if r["live_kv_bytes"] and r["full_kv_bytes"]:
            bytes_ratio[(block, r["config_label"])].append(r["live_kv_bytes"] / r["full_kv_bytes"])
    for block, rows in blocks.items():
        for row in rows.values():
            for samples in row.scores.values():
                samples.sort()  # by sample id: DuckDB's row order varies, the seeded resampling must not
            ratios = bytes_ratio.get((block, row.config))
            row.kv_ratio = float(np.mean(ratios)) if ratios else None
            if row.ratio is None and row.kv_ratio and row.method != "full":
                row.ratio = 1 / row.kv_ratio
    return {block: sorted(rows.values(), key=lambda r: (r.method != "full", r.ratio or 0, r.config))
            for block, rows in blocks.items()}


def stratified_diff(row: Row, tasks: list[str]) -> tuple[float, float, float, float]:
    """Mean over tasks of the per-task mean paired difference, its 95% stratified bootstrap interval
    and the stratified sign-flip p-value."""
    diffs = [np.array([s - f for _, s, f in row.scores[t]], dtype=np.float64) for t in tasks]
    mean = float(np.mean([d.mean() for d in diffs]))
    rng = np.random.default_rng(SEED)
    boot = np.zeros(RESAMPLES)
    flips = np.zeros(RESAMPLES)
    for d in diffs:
        boot += d[rng.integers(0, d.size, size=(RESAMPLES, d.size))].mean(axis=1)
        flips += (d * rng.choice([-1.0, 1.0], size=(RESAMPLES, d.size))).mean(axis=1)
    boot /= len(diffs)
    flips /= len(diffs)
    low, high = np.quantile(boot, [0.025, 0.975])
    extreme = np.sum(np.abs(flips) >= abs(mean) - 1e-12)
    p = float((extreme + 1) / (RESAMPLES + 1)) if any(d.any() for d in diffs) else 1.0
    return mean, float(low), float(high), p


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted = [1.0] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho with average ranks for ties."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    a, b = np.array(ranks(xs)), np.array(ranks(ys))
    if a.std() == 0 or b.std() == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def kvpress_scores() -> dict[tuple[str, str, float], tuple[float, str]]:
    """(kvpress model, press, compression ratio kept-fraction form) -> (score, source)."""
    if not KVPRESS.exists():
        return {}
    with KVPRESS.open() as f:
        return {(r["model"], r["press"], round(1 / (1 - float(r["compression_ratio"])), 3)): (float(r["score"]), r["source"])
                for r in csv.DictReader(line for line in f if not line.startswith("#"))}


def ratio_label(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1f}x" if abs(ratio - round(ratio)) > 0.05 else f"{round(ratio)}x"


def render(blocks: dict[tuple, list[Row]], manifests: list[dict]) -> str:
    kvpress = kvpress_scores()
    reference_models = sorted({m for m, _, _ in kvpress})
    out = ["# Leaderboard", "",
           "Generated by `python benchmarks/leaderboard.py` from the stored results archives (do not edit by hand).",
           "Score: RULER's `string_match` per task (passkey: exact match), averaged over the tasks measured;",
           "Δ full: the paired difference of that average against the full cache on the same samples, 95% stratified",
           "bootstrap interval; verdict after Holm's correction over the block's configs (`W` worse, `B` better,",
           "`n.d.` not distinguishable at 0.05); bytes: resident KV bytes / the full cache's, measured.", ""]
    for m in manifests:
        out.append(f"- archive `{m.get('archive')}`: commit {m.get('commit')}, {m.get('date')}, {m.get('device')}, "
                   f"MLX {m.get('mlx')}, worker processes: {m.get('workers')}")
    for (model, protocol, context), rows in sorted(blocks.items()):
        full = next((r for r in rows if r.method == "full"), None)
        tasks = sorted({t for r in rows for t in r.scores})
        out += ["", f"## {model}, {protocol}, {context} tokens", ""]
        if full is None:
            out.append("No full-cache runs: nothing to compare.")
            continue
        complete = [r for r in rows if r.method != "full" and all(r.scores.get(t) for t in tasks)]
        stats = {r.config: stratified_diff(r, tasks) for r in complete}
        adjusted = dict(zip(stats, holm([s[3] for s in stats.values()])))
        ns = {t: max(len(r.scores.get(t, [])) for r in rows) for t in tasks}
        if max(ns.values()) < MIN_N:
            out += [f"**n < {MIN_N} per task**: too few samples for any verdict (a single sample's interval is a "
                    "point, and Holm's correction leaves nothing significant); this block shows that the pipeline "
                    "runs on this model, not a ranking.", ""]
        header = ["config", "ratio", "bytes", "average", "Δ full [95% CI]", "Holm p", "verdict",
                  *[f"{t} (n≤{ns[t]})" for t in tasks], *[f"kvpress {m.split('/')[-1]}" for m in reference_models]]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        full_avg = np.mean([np.mean([f for _, _, f in full.scores[t]]) for t in tasks]) if all(full.scores.get(t) for t in tasks) else math.nan
        out.append("| full | 1x | 1.00 | " + f"{full_avg:.3f} | - | - | - | "
                   + " | ".join(f"{np.mean([s for _, s, _ in full.scores[t]]):.2f} (n={len(full.scores[t])})"
                                if full.scores.get(t) else "-" for t in tasks)
                   + " | " + " | ".join(f"{kvpress[(m, 'no_press', 1.0)][0]:.1f}" if (m, "no_press", 1.0) in kvpress else "-"
                                        for m in reference_models) + " |")
        for r in rows:
            if r.method == "full":
                continue
            cells = [f"{np.mean([s for _, s, _ in r.scores[t]]):.2f} (n={len(r.scores[t])})" if r.scores.get(t) else "-"
                     for t in tasks]
            if r.config in stats:
                mean_diff, low, high, _ = stats[r.config]
                average = np.mean([np.mean([s for _, s, _ in r.scores[t]]) for t in tasks])
                p = adjusted[r.config]
                verdict = "n.d." if p >= ALPHA else ("W" if mean_diff < 0 else "B")
                summary = [f"{average:.3f}", f"{mean_diff:+.3f} [{low:+.3f}, {high:+.3f}]", f"{p:.3g}", verdict]
            else:
                summary = ["-", "- (not every task measured)", "-", "-"]
            press = KVPRESS_NAMES.get(r.method) if "quantize" not in r.config else None
            theirs = [f"{kvpress[(m, press, round(r.ratio, 3))][0]:.1f}"
                      if press and r.ratio and (m, press, round(r.ratio, 3)) in kvpress else "-" for m in reference_models]
            shown = r.config.replace(f" protocol={protocol}", "")  # the block's heading says it
            out.append(f"| {shown} | {ratio_label(r.ratio)} | "
                       + (f"{r.kv_ratio:.3f}" if r.kv_ratio is not None else "-") + " | "
                       + " | ".join(summary + cells + theirs) + " |")
        for m in reference_models:
            lines = []
            for ratio in sorted({round(r.ratio, 3) for r in complete if r.ratio}):
                pairs = [(np.mean([np.mean([s for _, s, _ in r.scores[t]]) for t in tasks]),
                          kvpress[(m, KVPRESS_NAMES[r.method], ratio)][0])
                         for r in complete if r.ratio and round(r.ratio, 3) == ratio and "quantize" not in r.config
                         and r.method in KVPRESS_NAMES and (m, KVPRESS_NAMES[r.method], ratio) in kvpress]
                if len(pairs) >= 3:
                    lines.append(f"{ratio_label(ratio)}: ρ = {spearman(*zip(*pairs)):+.2f} over {len(pairs)} methods")
            out += ["", f"Spearman rank correlation of our average with kvpress's ({m}): "
                    + ("; ".join(lines) if lines else "fewer than 3 methods in common at any ratio") + "."]
    if kvpress:
        sources = sorted({s for _, s in kvpress.values()})
        out += ["", "kvpress's numbers: " + "; ".join(sources) + "."]
    return "\n".join(out) + "\n"


def unpack(archives: list[Path], into: Path) -> tuple[Path, list[dict]]:
    """Every archive's results root merged under `into` (run files are named by run id: no clashes)."""
    manifests = []
    for archive in archives:
        with tarfile.open(archive) as tar:
            tar.extractall(into / archive.stem, filter="data")
        for manifest in sorted((into / archive.stem).rglob("manifest.json")):
            manifests.append({"archive": archive.name, **json.loads(manifest.read_text())})
    roots = [p.parent for p in into.rglob("runs") if p.is_dir()]
    merged = into / "merged"
    for root in roots:
        for f in root.rglob("*.parquet"):
            target = merged / f.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(f)
    return merged, manifests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", nargs="*", type=Path,
                        default=sorted((HERE / "results").glob("leaderboard-*.tar.xz")))
    parser.add_argument("--results", type=Path, help="a results root instead of archives")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "leaderboard.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from the generated page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.results:
            results, manifests = args.results, []
        else:
            results, manifests = unpack(args.archive, Path(tmp))
        page = render(rows_by_block(load_runs(results)), manifests)
    if args.check:
        same = args.out.exists() and args.out.read_text() == page
        print(f"{args.out}: {'up to date' if same else 'differs from the archives: run benchmarks/leaderboard.py'}")
        return 0 if same else 1
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
