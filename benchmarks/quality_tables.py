"""Markdown tables for the closing notes from a results root: full-cache scores with Wilson 95%
intervals, paired differences vs the full cache (bootstrap 95% CI, exact McNemar p), and evidence
survival vs correctness.

    python benchmarks/quality_tables.py --results results-quality [--baseline 'h2o budget=0.5'] [--pivot]

`--protocols` prints, per config and task, query-aware minus query-agnostic on the same samples
(paired bootstrap 95% CI, exact McNemar p for 0/1 scores).
`--pivot` prints instead one compact table per (sweep, protocol, context): a row per config, a column
per task, each cell "score diff-vs-full [95% CI] verdict" (n in the header), plus evidence kept.
"""

from __future__ import annotations

import argparse

from kvcompress_reports import connect, run_report
from kvcompress_reports.render import format_markdown

SUMMARY = ("sweep_id", "protocol", "task", "context_tokens", "config_label", "runs", "score_mean", "score_ci_low",
           "score_ci_high", "kl_mean", "top1_agree", "kv_ratio_to_full")
PAIRED = ("protocol", "task", "context_tokens", "config_label", "n", "score_mean", "score_full_mean", "diff_vs_full",
          "diff_vs_full_ci_low", "diff_vs_full_ci_high", "mcnemar_p_vs_full", "vs_full")
EVIDENCE = ("protocol", "task", "config_label", "runs", "score_mean", "evidence_kept_mean", "evidence_kept_when_correct",
            "evidence_kept_when_wrong", "runs_all_kept", "score_when_all_kept", "runs_some_lost",
            "score_when_some_lost", "key_rel_err_mean")


def table(con, report: str, keep: tuple[str, ...], where=lambda r: True) -> str:
    columns, rows = run_report(con, report)
    records = [dict(zip(columns, r)) for r in rows]
    records = [r for r in records if where(r)]
    return format_markdown(list(keep), [tuple(r[c] for c in keep) for r in records])


def _config(label: str) -> str:
    return label.replace(" protocol=query_agnostic", "")


def pivot(con) -> str:
    """Compact tables: rows = configs, columns = tasks (markdown; benchmarks/tables.py publishes them)."""
    lines = []
    columns, rows = run_report(con, "paired")
    paired = [dict(zip(columns, r)) for r in rows]
    columns, rows = run_report(con, "evidence")
    evidence = {(r.get("sweep_id"), r["protocol"], r["task"], _config(r["config_label"])): r
                for r in (dict(zip(columns, x)) for x in rows)}
    verdicts = {"worse": "W", "better": "B", "not distinguishable": "n.d."}
    blocks = sorted({(r.get("sweep_id"), r["protocol"], r["context_tokens"]) for r in paired})
    for sweep, protocol, context in blocks:
        cells = [r for r in paired if (r.get("sweep_id"), r["protocol"], r["context_tokens"]) == (sweep, protocol, context)]
        tasks = sorted({r["task"] for r in cells})
        configs = sorted({_config(r["config_label"]) for r in cells}, key=lambda c: (c != "full", c))
        ns = {t: sorted({r["n"] for r in cells if r["task"] == t}) for t in tasks}
        lines.append(f"\n### {sweep}: {protocol}, {context} tokens: score, paired difference vs full [95% CI], verdict\n")
        lines.append("| config | " + " | ".join(f"{t} (n={'/'.join(map(str, ns[t]))})" for t in tasks) + " | evidence kept (mean over tasks) |")
        lines.append("|---" * (len(tasks) + 2) + "|")
        for config in configs:
            row = []
            kept = []
            for task in tasks:
                hit = [r for r in cells if r["task"] == task and _config(r["config_label"]) == config]
                if not hit:
                    row.append("-")
                    continue
                r = hit[0]
                if config == "full":
                    row.append(f"{r['score_mean']:.2f}")
                else:
                    row.append(f"{r['score_mean']:.2f} {r['diff_vs_full']:+.2f} [{r['diff_vs_full_ci_low']:+.2f}, "
                               f"{r['diff_vs_full_ci_high']:+.2f}] {verdicts.get(r['vs_full'], r['vs_full'])}")
                e = evidence.get((sweep, protocol, task, config))
                if e and e["evidence_kept_mean"] is not None:
                    kept.append(e["evidence_kept_mean"])
            row.append(f"{sum(kept) / len(kept):.2f}" if kept else "-")
            lines.append(f"| {config} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def protocols(con) -> str:
    """Query-aware vs query-agnostic, paired on the sample: same config, task, context and sample id (markdown)."""
    from kvcompress.stats import compare

    rows = con.execute("""
        SELECT sweep_id, task, context_tokens, replace(config_label, ' protocol=query_agnostic', '') AS config,
               sample_id, protocol, avg(score) AS score
        FROM run_scores GROUP BY ALL
    """).fetchall()
    cells: dict = {}
    for sweep, task, context, config, sample, protocol, score in rows:
        cells.setdefault((sweep, task, context, config), {}).setdefault(sample, {})[protocol] = score
    lines = ["| sweep | task | context | config | n | aware | agnostic | aware - agnostic [95% CI] | McNemar p | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (sweep, task, context, config), samples in sorted(cells.items(), key=lambda kv: tuple(map(str, kv[0]))):
        # in sample order: the bootstrap resamples positions, so the same pairs in another order (DuckDB
        # returns a GROUP BY in no set order) would give another interval
        both = [(v["query_aware"], v["query_agnostic"]) for _, v in sorted(samples.items()) if len(v) == 2]
        if not both:
            continue
        aware, agnostic = [a for a, _ in both], [b for _, b in both]
        r = compare(aware, agnostic)
        p = "-" if r.mcnemar_p is None else f"{r.mcnemar_p:.3g}"
        verdict = {"better": "aware better", "worse": "agnostic better"}.get(r.verdict, r.verdict)
        lines.append(f"| {sweep} | {task} | {context} | {config} | {r.n} | {sum(aware) / r.n:.2f} | {sum(agnostic) / r.n:.2f} | "
                     f"{r.diff_mean:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}] | {p} | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default="results")
    parser.add_argument("--baseline", default=None)
    parser.add_argument("--pivot", action="store_true", help="compact tables: configs x tasks")
    parser.add_argument("--protocols", action="store_true", help="query-aware vs query-agnostic, paired")
    args = parser.parse_args()
    con = connect(args.results, args.baseline)
    if args.pivot or args.protocols:
        if args.pivot:
            print(pivot(con))
        if args.protocols:
            print(protocols(con))
        return
    print("## Scores (Wilson 95% CI)\n")
    print(table(con, "summary", SUMMARY))
    print("\n## Paired differences vs the full cache\n")
    print(table(con, "paired", PAIRED, lambda r: r["config_label"] != "full"))
    print("\n## Evidence kept vs correctness\n")
    print(table(con, "evidence", EVIDENCE))


if __name__ == "__main__":
    main()
