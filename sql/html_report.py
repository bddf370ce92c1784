"""One self-contained, interactive HTML file per sweep: plots drawn in the page by plotly.js (inlined
once, so the file opens offline and can be mailed or attached as is) and every report as a table.

The views, each filtered in the page by task, protocol and method (the URL hash holds the choice:
`SWEEP.html#task=ruler/niah_single_2&protocol=query_aware&methods=snapkv,kivi`):
- ranking: the leaderboard table (leaderboard.sql), configs ranked by their task-averaged score with
  its CI, n, compression ratio and paired difference from the full cache;
- leaderboard: per task, each config's paired score difference vs the full cache (or its score)
  against its compression ratio, with 95% CI bands; a line joins only the configs of one family
  (same method and parameters, only the budget differs);
- paired: each config's paired difference vs the full cache with its bootstrap CI, per task;
- depth: score by evidence depth, a column per config (and context length), one heatmap per task;
- evidence kept vs score; KL and top-1 agreement vs decode step; the quality/memory Pareto front;
- throughput (speed sweeps): decode tok/s against the KV memory each cache's batch holds.

The numbers are the SQL reports' own (`sweep_reports`); Python only joins the paired rows with the
summary of the same cell (the method, the compression ratio, the Wilson interval) and embeds the
rows as JSON for the page's script, `report.js`.
"""

from __future__ import annotations

import html
import json
import math
import os
import pathlib
import re
import uuid
from datetime import datetime, timezone
from importlib import resources

from kvcompress.errors import StorageError, check

from .db import DEFAULT_REPORTS, sweep_ids, sweep_reports
from .render import format_cell

PLOT_REPORTS = ("depth",)  # read for the plots, shown as tables too, but not one of `--all`'s
CELL = ("protocol", "dataset", "task", "context_tokens", "config_label")  # one row of summary and paired
# d3's category10: a method keeps its colour in every view
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
STYLE = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 0 24px 24px; color: #1b1b1b; }
h1 { font-size: 22px; margin-top: 20px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0 16px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; } th { background: #f0f3f7; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
.note { color: #555; font-size: 13px; max-width: 1100px; }
.scroll { overflow-x: auto; }
td { white-space: nowrap; }
.filters { position: sticky; top: 0; z-index: 10; background: #fff; padding: 10px 0; border-bottom: 1px solid #ccc;
           display: flex; flex-wrap: wrap; gap: 8px 20px; align-items: center; font-size: 13px; }
.filters select { font-size: 13px; }
.filters .methods label { margin-right: 10px; white-space: nowrap; }
.swatch { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 2px; border-radius: 2px; }
.panels { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
.panels.wide { grid-template-columns: 1fr; }
.panel { border: 1px solid #eee; min-width: 0; }
.panel h3 { font-size: 14px; font-weight: 600; margin: 6px 10px 0; }
tr.resolved td { color: #b00020; }
details.report summary { cursor: pointer; font-size: 15px; margin: 8px 0; }
#errors { color: #b00020; white-space: pre-wrap; }
"""
# First in the page, so it also catches what plotly.js or report.js throw: the error is shown on
# the page (and a headless browser's dumped DOM carries it) instead of a silently empty plot.
CATCH_ERRORS = """
const errors = document.getElementById("errors");
function reportError(text) { errors.hidden = false; errors.textContent += text + "\\n"; }
window.addEventListener("error", e => reportError(`${e.message} (${e.filename}:${e.lineno})`));
window.addEventListener("unhandledrejection", e => reportError(`unhandled rejection: ${e.reason}`));
const consoleError = console.error;
console.error = (...args) => { reportError(args.join(" ")); consoleError(...args); };
"""
SECTIONS = [  # (element id, title, note)
    ("ranking", "Leaderboard table: configs ranked by their score averaged over tasks",
     "Per protocol, every config by its mean score over the sweep's task cells (each cell counts once; the task "
     "filter does not apply), with the cells' 95% Wilson intervals combined, n (runs), the compression ratio "
     "(full cache bytes / live bytes) and the paired difference from the full cache on the same samples with its "
     "bootstrap 95% CI. Red: resolved (the CI excludes 0 and, for 0/1 scores, McNemar p < 0.05); "
     "'~ not distinguishable': not at this n."),
    ("leaderboard", "Leaderboard: score vs compression ratio, paired with the full cache",
     "Per task, each config's mean paired score difference from the full cache on the same samples "
     "(y: 'score' for the score itself) against its compression ratio (full cache bytes / live bytes; log "
     "scale); bands and bars are 95% CIs (paired bootstrap; Wilson for scores). A line joins the configs of "
     "one family: same method and parameters, only the budget differs."),
    ("paired", "Score difference vs the full cache, per config",
     "Paired bootstrap 95% CI; red: resolved (the CI excludes 0 and, for 0/1 scores, McNemar p < 0.05)."),
    ("depth", "Score by evidence depth and context length",
     "The needle test's grid: where the first evidence token sits in the prompt before the question "
     "(runs.evidence_depth, in tenths), a column per config (and context length when the sweep ran several); "
     "one heatmap per task; hover for n and the full cache's score on the same samples."),
    ("evidence", "Evidence kept vs score",
     "A config that loses the needle and fails sits bottom-left; one that keeps it and still fails, top-right "
     "of its kept evidence but low. Hover for the config."),
    ("degradation", "KL and top-1 agreement vs decode step",
     "Over every task of the sweep (the task filter does not apply)."),
    ("pareto", "Quality vs memory Pareto front",
     "Per dataset and context length (every task of the dataset); outlined points are on the front, "
     "which is computed over every config of the cell, whatever the filters show. A quantizer that held no "
     "token as codes (\"quantizes nothing\") is the unquantized config's point and never on the front."),
    ("throughput", "Throughput vs KV memory (speed sweeps)",
     "Per model and context length, each cache's decode tok/s (sequences x steps a second, median over the "
     "rounds, bars: min-max) against the KV its batch holds; under a KV budget each cache runs the largest "
     "batch that fits, so a cache that frees bytes decodes more sequences. A line joins one config's budgets "
     "or batches; hover for the batch and x full (the per-round ratio to the full cache's tok/s)."),
]


def write_html(results: str | None, path: str, sweep_id: str | None = None, baseline: str | None = None) -> pathlib.Path:
    """Write the HTML report of `sweep_id` (default: the sweep with the newest run) to `path`."""
    sweeps = sweep_ids(results)
    sweep_id = sweep_id or sweeps[0]
    check(sweep_id in sweeps, "sweep_id", f"one of {sweeps}", sweep_id)
    reports = sweep_reports(results, sweep_id, DEFAULT_REPORTS + PLOT_REPORTS, baseline)
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kvcompress report: {html.escape(sweep_id)}</title><style>{STYLE}</style></head>",
        '<body data-status="loading">',
        f'<pre id="errors" hidden></pre><script>{CATCH_ERRORS}</script>',
        f"<h1>kvcompress report: sweep {html.escape(sweep_id)}</h1>",
        f'<p class="note">Generated {generated}. Scores carry 95% Wilson intervals (score_ci_low..'
        "score_ci_high) and the full cache's score on the same samples (score_full_mean). The paired "
        "report compares every config with the full cache (and a baseline) sample by sample: mean "
        "difference, paired bootstrap 95% CI, exact McNemar p for 0/1 scores, n; a CI that spans 0 "
        "reads \"not distinguishable\". The filters below choose what every plot shows (the tables at "
        "the end hold every row); the address keeps them, so a view can be linked.</p>",
        '<div id="filters" class="filters"></div>',
    ]
    for section, title, note in SECTIONS:
        wide = " wide" if section in ("degradation", "depth", "ranking") else ""
        parts.append(f'<h2>{html.escape(title)}</h2><p class="note">{html.escape(note)}</p>'
                     f'<div id="{section}" class="panels{wide}"></div>')
    parts.append("<h2>Every report <span class='note'>(all rows of the sweep, not filtered; click to open)</span></h2>")
    for name, (columns, rows) in reports.items():  # folded: the page stays a page of views
        parts.append(f"<details class='report' id='report-{html.escape(name)}'><summary>{html.escape(name)} "
                     f"<span class='note'>({len(rows)} rows)</span></summary>{html_table(columns, rows)}</details>")
    parts += [
        '<pre id="shown" hidden></pre>',
        f'<script type="application/json" id="report-data">{json_text(page_data(reports))}</script>',
        f"<script>{script_text(plotly_js())}</script>",
        f"<script>{script_text(resources.files(__package__).joinpath('report.js').read_text())}</script>",
        "</body></html>",
    ]
    out = pathlib.Path(path)
    write_atomically(out, "\n".join(parts).encode("utf-8"))
    return out


def write_atomically(path: pathlib.Path, data: bytes) -> None:
    """`data` at `path` whole or not at all: a temp file in the same directory renamed over it, so a
    full disk or a killed process leaves the previous file (or none), never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def plotly_js() -> str:
    """plotly.js, as the plotly package ships it (minified, no network at view time)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def script_text(text: str) -> str:
    """JavaScript safe inside <script>: a literal "</script" would end the element early."""
    return re.sub(r"</(script)", r"<\\/\1", text, flags=re.IGNORECASE)


def json_text(data) -> str:
    """JSON safe inside <script>: every "<" escaped, so no "</script" or "<!--" in a label can end it."""
    return json.dumps(data, allow_nan=False).replace("<", "\\u003c")


def html_table(columns: list[str], rows: list[tuple]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(
            f'<td class="num">{html.escape(format_cell(v))}</td>' if isinstance(v, (int, float)) and not isinstance(v, bool)
            else f"<td>{html.escape(format_cell(v))}</td>"
            for v in row
        ) + "</tr>"
        for row in rows
    )
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def config_family(config_label: str) -> str:
    """The configs a leaderboard line may join: the label without its budget (`snapkv budget=0.25
    window=8` -> `snapkv window=8`), so only budgets of one method and parameter set share a line."""
    return re.sub(r" budget=\S+", "", config_label)


def _records(report: tuple[list[str], list[tuple]]) -> list[dict]:
    """Rows as JSON-ready dicts (NaN, which JSON lacks, as null)."""
    columns, rows = report
    return [{c: None if isinstance(v, float) and math.isnan(v) else v for c, v in zip(columns, row)} for row in rows]


def page_data(reports: dict[str, tuple[list[str], list[tuple]]]) -> dict:
    """What report.js draws: the rows of the plotted reports, the paired rows joined with the
    summary row of their cell, the filter choices and a colour per method."""
    summary = {tuple(r[c] for c in CELL): r for r in _records(reports["summary"])}
    leaderboard = []
    for r in _records(reports["paired"]):
        cell = summary[tuple(r[c] for c in CELL)]  # paired and summary group the same runs
        ratio = cell["kv_ratio_to_full"]
        leaderboard.append({**r, "method": cell["method"], "family": config_family(r["config_label"]),
                            "compression_ratio": 1.0 / ratio if ratio else None,
                            "score_ci_low": cell["score_ci_low"], "score_ci_high": cell["score_ci_high"]})
    evidence = [{**r, "method": summary[tuple(r[c] for c in CELL)]["method"]} for r in _records(reports["evidence"])]
    throughput = _records(reports["throughput"])
    methods = sorted({r["method"] for r in summary.values()} | {r["method"] for r in throughput})
    return {
        "tasks": sorted({f"{r['dataset']}/{r['task']}" for r in summary.values()}),
        "protocols": sorted({r["protocol"] for r in summary.values()}),
        "methods": methods,
        "colors": {m: COLORS[i % len(COLORS)] for i, m in enumerate(methods)},
        "leaderboard": leaderboard,
        "ranking": _records(reports["leaderboard"]),
        "evidence": evidence,
        "depth": _records(reports["depth"]),
        "degradation": _records(reports["degradation"]),
        "pareto": _records(reports["pareto"]),
        "throughput": throughput,
    }
