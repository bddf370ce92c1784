"""One self-contained HTML file per sweep: every report as a table plus three PNG plots embedded as
base64 (score vs compression ratio, KL and top-1 agreement vs decode step, the quality/memory Pareto
front). No external file, script or font: it opens offline and can be mailed or attached as is."""

from __future__ import annotations

import base64
import html
import io
import pathlib
from datetime import datetime, timezone

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or in a flow worker
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kvcompress.errors import check  # noqa: E402

from .db import DEFAULT_REPORTS, sweep_ids, sweep_reports  # noqa: E402
from .render import format_cell  # noqa: E402

PANEL_INCHES = (4.6, 3.4)
STYLE = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px; color: #1b1b1b; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0 16px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; } th { background: #f0f3f7; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #eee; margin: 6px 0; }
.note { color: #555; font-size: 13px; }
.scroll { overflow-x: auto; }
td { white-space: nowrap; }
"""


def write_html(results: str | None, path: str, sweep_id: str | None = None, baseline: str | None = None) -> pathlib.Path:
    """Write the HTML report of `sweep_id` (default: the sweep with the newest run) to `path`."""
    sweeps = sweep_ids(results)
    sweep_id = sweep_id or sweeps[0]
    check(sweep_id in sweeps, "sweep_id", f"one of {sweeps}", sweep_id)
    reports = sweep_reports(results, sweep_id, DEFAULT_REPORTS, baseline)
    plots = [
        ("Score difference vs the full cache (paired, 95% bootstrap CI)", paired_png(reports["paired"])),
        ("Evidence kept vs score", evidence_png(reports["evidence"])),
        ("Score vs compression ratio", score_vs_compression_png(reports["pareto"])),
        ("KL and top-1 agreement vs decode step", degradation_png(reports["degradation"])),
        ("Quality vs memory Pareto front", pareto_png(reports["pareto"])),
    ]
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kvcompress report: {html.escape(sweep_id)}</title><style>{STYLE}</style></head><body>",
        f"<h1>kvcompress report: sweep {html.escape(sweep_id)}</h1>",
        f'<p class="note">Generated {generated}. Scores carry 95% Wilson intervals (score_ci_low..'
        "score_ci_high) and the full cache's score on the same samples (score_full_mean). The paired "
        "report compares every config with the full cache (and a baseline) sample by sample: mean "
        "difference, paired bootstrap 95% CI, exact McNemar p for 0/1 scores, n; a CI that spans 0 "
        "reads \"not distinguishable\".</p>",
    ]
    for title, png in plots:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(f'<img alt="{html.escape(title)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">')
    for name, (columns, rows) in reports.items():
        parts.append(f"<h2>{html.escape(name)} <span class='note'>({len(rows)} rows)</span></h2>")
        parts.append(html_table(columns, rows))
    parts.append("</body></html>")
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


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


def _records(report: tuple[list[str], list[tuple]]) -> list[dict]:
    columns, rows = report
    return [dict(zip(columns, r)) for r in rows]


def _method_colors(records: list[dict]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(sorted({r["method"] for r in records}))}


def _panels(records: list[dict]):
    """One figure with a panel per (dataset, context_tokens): yields (axes, title, records)."""
    cells = sorted({(r["dataset"], r["context_tokens"]) for r in records})
    columns = max(1, min(3, len(cells)))
    rows = max(1, -(-len(cells) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows),
                             squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    panels = [(ax, f"{d} @ {c} tokens", [r for r in records if (r["dataset"], r["context_tokens"]) == (d, c)])
              for ax, (d, c) in zip(axes.flat, cells)]
    if not cells:
        axes[0, 0].text(0.5, 0.5, "no data", ha="center", va="center")
    return fig, panels


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def score_vs_compression_png(pareto: tuple[list[str], list[tuple]]) -> bytes:
    """Mean score vs compression ratio (1 / kv_ratio_to_full), one line per method, 95% Wilson
    error bars, the full cache's score as a dashed ceiling."""
    records = _records(pareto)
    colors = _method_colors(records)
    fig, panels = _panels(records)
    for ax, title, cell in panels:
        for method in sorted({r["method"] for r in cell}):
            points = sorted(((1.0 / r["kv_ratio_to_full"], r) for r in cell
                             if r["method"] == method and r["kv_ratio_to_full"]), key=lambda p: p[0])
            xs = [x for x, _ in points]
            ys = [r["score_mean"] for _, r in points]
            low = [r["score_mean"] - r["score_ci_low"] if r["score_ci_low"] is not None else 0.0 for _, r in points]
            high = [r["score_ci_high"] - r["score_mean"] if r["score_ci_high"] is not None else 0.0 for _, r in points]
            ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, color=colors[method], label=method)
            if method == "full" and ys:
                ax.axhline(ys[0], color=colors[method], linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set(title=title, xlabel="compression ratio (full bytes / live bytes)", ylabel="score_mean")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


def degradation_png(degradation: tuple[list[str], list[tuple]]) -> bytes:
    """kl_mean and top1_agree by decode step, one line per config."""
    records = _records(degradation)
    colors = _method_colors(records)
    fig, (kl_ax, agree_ax) = plt.subplots(1, 2, figsize=(2 * PANEL_INCHES[0] + 1, PANEL_INCHES[1] + 0.6))
    labels = sorted({r["config_label"] for r in records})
    styles = ["-", "--", ":", "-."]
    for i, label in enumerate(labels):
        line = sorted(((r["step"], r) for r in records if r["config_label"] == label), key=lambda p: p[0])
        method = line[0][1]["method"]
        style = dict(color=colors[method], linestyle=styles[i % len(styles)], marker=".", label=label)
        kl_ax.plot([s for s, _ in line], [r["kl_mean"] for _, r in line], **style)
        agree_ax.plot([s for s, _ in line], [r["top1_agree"] for _, r in line], **style)
    kl_ax.set(title="KL(full || method) by decode step", xlabel="decode step", ylabel="kl_mean (nats)")
    agree_ax.set(title="top-1 agreement with the full cache", xlabel="decode step", ylabel="top1_agree",
                 ylim=(-0.05, 1.05))
    for ax in (kl_ax, agree_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    agree_ax.legend(fontsize=7, loc="lower left")
    return _png(fig)


def pareto_png(pareto: tuple[list[str], list[tuple]]) -> bytes:
    """Every config's mean score vs live KV bytes; the non-dominated ones joined as the front."""
    records = _records(pareto)
    colors = _method_colors(records)
    fig, panels = _panels(records)
    for ax, title, cell in panels:
        for r in cell:
            ax.scatter(r["live_kv_bytes"] / 2**20, r["score_mean"], color=colors[r["method"]],
                       edgecolor="black" if r["on_front"] else "none", s=60 if r["on_front"] else 25,
                       alpha=1.0 if r["on_front"] else 0.45, zorder=3)
        front = sorted((r["live_kv_bytes"] / 2**20, r["score_mean"], r["config_label"]) for r in cell if r["on_front"])
        ax.step([x for x, _, _ in front], [y for _, y, _ in front], where="post", color="black", linewidth=1,
                label="Pareto front")
        labels: dict[tuple, list[str]] = {}  # configs at the same point share one annotation
        for x, y, label in front:
            labels.setdefault((x, y), []).append(label)
        for (x, y), names in labels.items():
            ax.annotate(" / ".join(names), (x, y), fontsize=6, xytext=(3, -9), textcoords="offset points")
        for method, color in colors.items():
            if any(r["method"] == method for r in cell):
                ax.scatter([], [], color=color, label=method)
        ax.set(title=title, xlabel="live_kv_bytes (MiB)", ylabel="score_mean")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)



def paired_png(paired: tuple[list[str], list[tuple]]) -> bytes:
    """Per config the mean paired score difference vs the full cache with its 95% bootstrap CI,
    one panel per dataset/task/context/protocol cell; 0 (no difference) as a vertical line."""
    records = [r for r in _records(paired) if r["diff_vs_full"] is not None and r["config_label"] != "full"]
    cells = sorted({(r["dataset"], r["task"], r["context_tokens"], r["protocol"]) for r in records})
    columns = max(1, min(2, len(cells)))
    rows = max(1, -(-len(cells) // columns))
    height = max(2.0, 0.28 * max((sum(1 for r in records if (r["dataset"], r["task"], r["context_tokens"],
                                                                  r["protocol"]) == c) for c in cells), default=1))
    fig, axes = plt.subplots(rows, columns, figsize=((PANEL_INCHES[0] + 3.2) * columns, (height + 1) * rows),
                             squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    if not cells:
        axes[0, 0].text(0.5, 0.5, "no paired data", ha="center", va="center")
    for ax, cell in zip(axes.flat, cells):
        cell_rows = sorted((r for r in records if (r["dataset"], r["task"], r["context_tokens"], r["protocol"]) == cell),
                           key=lambda r: r["config_label"])
        ys = list(range(len(cell_rows)))
        for y, r in zip(ys, cell_rows):
            resolved = r["vs_full"] in ("better", "worse")  # CI excludes 0 (and McNemar p < 0.05 for 0/1)
            ax.errorbar(r["diff_vs_full"], y, xerr=[[r["diff_vs_full"] - r["diff_vs_full_ci_low"]],
                                                    [r["diff_vs_full_ci_high"] - r["diff_vs_full"]]],
                        fmt="o", capsize=3, color="tab:red" if resolved else "tab:gray")
        ax.axvline(0.0, color="black", linewidth=1)
        ax.set_yticks(ys, [f"{r['config_label']} (n={r['n']})" for r in cell_rows], fontsize=7)
        dataset, task, context, protocol = cell
        ax.set(title=f"{task} @ {context} ({protocol})", xlabel="score - full score (red: resolved)")
        ax.grid(alpha=0.3, axis="x")
    return _png(fig)


def evidence_png(evidence: tuple[list[str], list[tuple]]) -> bytes:
    """Per config and cell, mean evidence kept (x) against mean score (y): a config that loses the
    needle and fails sits bottom-left; one that keeps it and still fails, top-left of its kept."""
    records = [r for r in _records(evidence) if r["evidence_kept_mean"] is not None]
    fig, ax = plt.subplots(figsize=(PANEL_INCHES[0] + 2.5, PANEL_INCHES[1] + 0.5))
    cmap = plt.get_cmap("tab10")
    tasks = sorted({(r["task"], r["protocol"]) for r in records})
    for i, (task, protocol) in enumerate(tasks):
        cell = [r for r in records if (r["task"], r["protocol"]) == (task, protocol)]
        ax.scatter([r["evidence_kept_mean"] for r in cell], [r["score_mean"] for r in cell], color=cmap(i % 10),
                   marker="o" if protocol == "query_aware" else "^", label=f"{task} ({protocol})")
        for r in cell:
            ax.annotate(r["config_label"], (r["evidence_kept_mean"], r["score_mean"]), fontsize=5,
                        xytext=(3, 2), textcoords="offset points")
    if not records:
        ax.text(0.5, 0.5, "no evidence recorded", ha="center", va="center")
    ax.set(xlabel="evidence kept (mean over layers, heads, runs)", ylabel="score_mean", xlim=(-0.05, 1.05),
           ylim=(-0.05, 1.05))
    ax.grid(alpha=0.3)
    if records:
        ax.legend(fontsize=6, loc="lower right")
    return _png(fig)
