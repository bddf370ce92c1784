"""Renderings of report rows: the one-screen answer, terminal tables (rich), Markdown, CSV, JSON,
and JSON scalars for Prefect artifacts.

The one screen (`screen`) is what a user asks first: per config and task of one sweep, the score
with its 95% interval, the paired difference from the full cache, KL, top-1 agreement, resident
KV bytes relative to the full cache, decode speed, and which configs are on the score/memory
Pareto front. Everything else is a named report (`kvcompress report --all`, `--report NAME`).
"""

from __future__ import annotations

import csv
import io
import json
import math
from datetime import date, datetime
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .db import DEFAULT_REPORTS, connect, run_report

SCREEN_WIDTH = 120  # the one-screen report fits this many columns


def format_cell(value) -> str:
    """How every report shows a value: '-' for missing, 4 significant digits for floats."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _number(value, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def table(columns: list[str], rows: list[tuple], title: str | None = None) -> Table:
    """A rich table of a report: numbers right-aligned, 4 significant digits for floats."""
    out = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for i, name in enumerate(columns):
        numeric = any(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows)
        out.add_column(name, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        out.add_row(*(format_cell(v) for v in row))
    return out


def to_text(*renderables, width: int = SCREEN_WIDTH) -> str:
    """Renderables as plain text, `width` columns wide (no colour codes)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, soft_wrap=False)
    for r in renderables:
        console.print(r)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


def format_table(columns: list[str], rows: list[tuple]) -> str:
    """A report as a plain-text table at its natural width (wide reports are not folded)."""
    return to_text(table(columns, rows), width=100_000)


def format_markdown(columns: list[str], rows: list[tuple]) -> str:
    """A GitHub-flavoured Markdown table, cells formatted as in the terminal."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(v).replace("|", "\\|") for v in row) + " |" for row in rows]
    return "\n".join(lines)


def format_csv(columns: list[str], rows: list[tuple]) -> str:
    """CSV with a header row; missing values are empty, floats at full precision."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([["" if v is None else v for v in row] for row in rows])
    return out.getvalue().rstrip("\n")


def _json_value(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def format_json(reports: dict[str, tuple[list[str], list[tuple]]]) -> str:
    """{report name: [row records]} as JSON."""
    return json.dumps({name: [{c: _json_value(v) for c, v in zip(columns, row)} for row in rows]
                       for name, (columns, rows) in reports.items()}, indent=1)


def render_reports(results: str | None = None, reports=DEFAULT_REPORTS, baseline: str | None = None) -> str:
    """Every report as a plain-text table, titled with its name and row count."""
    con = connect(results, baseline)
    parts = []
    for name in reports:
        columns, rows = run_report(con, name)
        parts.append(f"== {Path(name).stem} ({len(rows)} rows)\n{format_table(columns, rows)}")
    return "\n\n".join(parts)


def _records(con, name: str, sweep_id: str) -> list[dict]:
    columns, rows = run_report(con, name)
    return [r for r in (dict(zip(columns, row)) for row in rows) if r.get("sweep_id") == sweep_id]


def _config(label: str) -> tuple[str, str]:
    """(config without the protocol, protocol short name) from a config_label."""
    suffix = " protocol=query_agnostic"
    if suffix in label:
        return label.replace(suffix, ""), "agnostic"
    return label, "aware"


NOT_DISTINGUISHABLE = "~"
ON_FRONT = "◆"
# each one line of the screen (<= SCREEN_WIDTH)
TILDE_LINE = (f"{NOT_DISTINGUISHABLE}: not distinguishable from the full cache at this n (the paired 95% CI spans 0, "
              "or McNemar p >= 0.05 for 0/1 scores)")
TOK_S_LINE = ("tok/s: single runs on a shared machine, not a speed measurement (it swings many-fold); "
              "speed: kvcompress sweep speed-cpu")


def screen(con, sweep_id: str) -> list:
    """The one-screen report of `sweep_id`: one row per config x protocol x task with the score
    and its 95% interval, the paired difference from the full cache, fidelity, memory and speed,
    and a mark on the configs of each dataset's score/memory Pareto front (`pareto.sql`)."""
    summary = _records(con, "summary", sweep_id)
    if not summary:  # a speed sweep (kind: speed) has no runs, only measurements
        return speed_screen(con, sweep_id)
    paired = {(r["protocol"], r["dataset"], r["task"], r["context_tokens"], r["config_label"]): r
              for r in _records(con, "paired", sweep_id)}
    front = {(r["dataset"], r["context_tokens"], r["config_label"])
             for r in _records(con, "pareto", sweep_id) if r["on_front"]}
    # a task run at several context lengths shows the length (else the task name says it all)
    several = len({(r["dataset"], r["task"], r["context_tokens"]) for r in summary}) > len(
        {(r["dataset"], r["task"]) for r in summary})
    protocols = {r["protocol"] for r in summary}
    qualified = len({r["task"] for r in summary}) < len({(r["dataset"], r["task"]) for r in summary})

    out = Table(title=f"Sweep {sweep_id}  (vs full: paired difference, {NOT_DISTINGUISHABLE} not distinguishable; "
                      f"{ON_FRONT} Pareto front of score vs KV bytes)",
                title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    out.add_column("  config", overflow="fold", min_width=24)
    out.add_column("task", overflow="fold")
    if several:
        out.add_column("ctx", justify="right")
    for name in ("n", "score (95% CI)", "vs full", "KL", "top-1", "KV/full", "tok/s"):
        out.add_column(name, justify="right", no_wrap=True)
    protocol_shown = None
    for r in summary:
        config, _ = _config(r["config_label"])
        if len(protocols) > 1 and r["protocol"] != protocol_shown:  # a heading row per protocol
            protocol_shown = r["protocol"]
            out.add_row(f"{r['protocol']}:")
        task = f"{r['dataset']}/{r['task']}" if qualified else r["task"]
        diff = paired.get((r["protocol"], r["dataset"], r["task"], r["context_tokens"], r["config_label"]), {})
        ci = (f" ({_number(r['score_ci_low'], '.2f')}-{_number(r['score_ci_high'], '.2f')})"
              if r["score_ci_low"] is not None else "")
        if r["method"] == "full":
            versus = ""
        else:
            mark = NOT_DISTINGUISHABLE if diff.get("vs_full") == "not distinguishable" else " "
            versus = _number(diff.get("diff_vs_full"), "+.2f") + mark
        on_front = (r["dataset"], r["context_tokens"], r["config_label"]) in front
        if r["quantizes_nothing"]:  # not a point of its own (summary.sql)
            config += " (quantizes nothing)"
        out.add_row(f"{ON_FRONT if on_front else ' '} {config}", task,
                    *([str(r["context_tokens"])] if several else []), str(r["runs"]),
                    _number(r["score_mean"], ".2f") + ci, versus, _number(r["kl_mean"], ".2g"),
                    _number(r["top1_agree"], ".2f"), _number(r["kv_ratio_to_full"], ".2f"),
                    _number(r["decode_tok_s"], ".1f"))
    return [out, Text(TILDE_LINE + "\n" + TOK_S_LINE), *leaderboard_table(con, sweep_id), *kernel_footnote(summary)]


def _interval(low, high) -> str:
    return f" ({_number(low, '+.2f')}..{_number(high, '+.2f')})" if low is not None else ""


def leaderboard_table(con, sweep_id: str) -> list:
    """The ranked leaderboard (leaderboard.sql): per protocol, each config by its task-averaged score
    with its CI, n, KV relative to the full cache, and its paired difference from the full cache with
    the bootstrap CI."""
    rows = _records(con, "leaderboard", sweep_id)
    if not rows:
        return []
    protocols = {r["protocol"] for r in rows}
    cells = max(r["tasks"] for r in rows)
    out = Table(title=f"Leaderboard: configs ranked by their score averaged over {cells} task cell{'s' * (cells > 1)}",
                title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    out.add_column("#", justify="right")
    out.add_column("config", overflow="fold", min_width=24)
    for name in ("KV/full", "n", "score (95% CI)", "vs full (paired 95% CI)"):
        out.add_column(name, justify="right", no_wrap=True)
    protocol_shown = None
    for r in rows:
        if len(protocols) > 1 and r["protocol"] != protocol_shown:
            protocol_shown = r["protocol"]
            out.add_row("", f"{r['protocol']}:")
        score = _number(r["score_mean"], ".2f") + (
            f" ({_number(r['score_ci_low'], '.2f')}-{_number(r['score_ci_high'], '.2f')})" if r["score_ci_low"] is not None else "")
        if r["method"] == "full":
            versus = ""
        else:
            mark = NOT_DISTINGUISHABLE if r["vs_full"] == "not distinguishable" else " "
            versus = _number(r["diff_vs_full"], "+.2f") + _interval(r["diff_vs_full_ci_low"], r["diff_vs_full_ci_high"]) + mark
        out.add_row(str(r["rank"]), _config(r["config_label"])[0], _number(r["kv_ratio_to_full"], ".2f"), str(r["n"]),
                    score, versus)
    return [out]


def kernel_footnote(summary: list[dict]) -> list:
    """A line per config whose runs recorded kernel paths (summary.sql's `kernels`): which path, fused
    or the MLX reference, produced its numbers."""
    paths: dict[str, set[str]] = {}
    for r in summary:
        if r.get("kernels"):
            paths.setdefault(r["config_label"], set()).update(r["kernels"].split(" | "))
    if not paths:
        return []
    return [Text("kernels (path per config, from config.kernels; a line per set of paths):\n" + "\n".join(
        f"  {label}: {one}" for label, p in sorted(paths.items()) for one in sorted(p)))]


def speed_screen(con, sweep_id: str) -> list:
    """The one-screen report of a speed sweep: per model, context and KV budget (or batch), each
    cache's batch, KV, decode tok/s and x full (median over the rounds, min-max), prefill seconds
    (`throughput.sql`)."""
    rows = _records(con, "throughput", sweep_id)
    models = ", ".join(sorted({f"{r['model']} {r['dtype']} on {r['device']}" for r in rows}))
    out = Table(title=f"Speed sweep {sweep_id}: {models}\n(tok/s: sequences x steps a second, median over the "
                      "rounds (min-max); x full: the per-round ratio to the full cache's, synchronous and pipelined)",
                title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    out.add_column("config", overflow="fold", min_width=20)
    for name in ("ctx", "KV budget", "batch", "KV MiB", "tok/s", "x full", "pipelined", "prefill s"):
        out.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        budget = _number(r["kv_budget_gib"], ".3g") + " GiB" if r["kv_budget_gib"] is not None else "-"
        out.add_row(r["config_label"], str(r["context_tokens"]), budget, str(r["batch"]),
                    _number(r["live_kv_gib"] * 1024, ".4g"),
                    f"{_number(r['decode_tok_s'], '.1f')} ({_number(r['decode_tok_s_min'], '.1f')}-"
                    f"{_number(r['decode_tok_s_max'], '.1f')})",
                    f"{_number(r['x_full'], '.2f')} ({_number(r['x_full_min'], '.2f')}-{_number(r['x_full_max'], '.2f')})",
                    _number(r["x_full_pipelined"], ".2f"), _number(r["prefill_s"], ".2f"))
    return [out]


def artifact_cell(value):
    """Table artifacts take JSON scalars; floats rounded as shown in the terminal."""
    if isinstance(value, float):
        return None if math.isnan(value) else float(format_cell(value))
    return value if isinstance(value, (int, str, bool)) or value is None else str(value)
