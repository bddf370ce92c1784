"""Markdown tables for the closing notes from a results root: full-cache scores with Wilson 95%
intervals, paired differences vs the full cache (bootstrap 95% CI, exact McNemar p), and evidence
survival vs correctness.

    python benchmarks/quality_tables.py --results results-quality [--baseline 'h2o budget=0.5']
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default="results")
    parser.add_argument("--baseline", default=None)
    args = parser.parse_args()
    con = connect(args.results, args.baseline)
    print("## Scores (Wilson 95% CI)\n")
    print(table(con, "summary", SUMMARY))
    print("\n## Paired differences vs the full cache\n")
    print(table(con, "paired", PAIRED, lambda r: r["config_label"] != "full"))
    print("\n## Evidence kept vs correctness\n")
    print(table(con, "evidence", EVIDENCE))


if __name__ == "__main__":
    main()
