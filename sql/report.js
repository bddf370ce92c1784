// The HTML report's views (sql/html_report.py writes the page): each one drawn with plotly.js from
// the report rows in #report-data, under the filters at the top of the page. The URL hash holds the
// filters (#task=ruler/niah_single_2&protocol=query_aware&methods=snapkv,kivi&y=score), so a view
// can be linked and a headless browser told what to show; #shown lists what each panel drew.
"use strict";

const DATA = JSON.parse(document.getElementById("report-data").textContent);
// no mode bar: it floats over the legend above the plot; dragging zooms, a double click resets
const PLOT_CONFIG = {displayModeBar: false, responsive: true};
const DASHES = ["solid", "dash", "dot", "dashdot", "longdash"];
const SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "cross"];
const state = {task: "all", protocol: null, methods: new Set(), y: "diff"};
let shown = {};  // section -> panel title -> the configs (or families) it drew

// --- filters ------------------------------------------------------------------------------------

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  state.task = DATA.tasks.includes(params.get("task")) ? params.get("task") : "all";
  const preferred = DATA.protocols.includes("query_aware") ? "query_aware" : DATA.protocols[0];
  state.protocol = DATA.protocols.includes(params.get("protocol")) ? params.get("protocol") : preferred;
  state.methods = new Set(params.has("methods")
    ? params.get("methods").split(",").filter(m => DATA.methods.includes(m)) : DATA.methods);
  state.y = params.get("y") === "score" ? "score" : "diff";
}

function writeHash() {
  const params = new URLSearchParams({task: state.task, protocol: state.protocol,
                                      methods: [...state.methods].join(","), y: state.y});
  history.replaceState(null, "", "#" + params.toString());
}

function select(id, label, options, value, onChange) {
  const wrap = document.createElement("label");
  wrap.textContent = label + " ";
  const box = document.createElement("select");
  box.id = id;
  for (const [optionValue, text] of options) {
    box.add(new Option(text, optionValue, optionValue === value, optionValue === value));
  }
  box.addEventListener("change", () => onChange(box.value));
  wrap.append(box);
  return wrap;
}

function buildFilters() {
  const bar = document.getElementById("filters");
  bar.replaceChildren(
    select("filter-task", "task", [["all", "all tasks"], ...DATA.tasks.map(t => [t, t])], state.task,
           value => { state.task = value; changed(); }),
    select("filter-protocol", "protocol", DATA.protocols.map(p => [p, p]), state.protocol,
           value => { state.protocol = value; changed(); }),
    select("filter-y", "leaderboard y", [["diff", "paired difference vs full"], ["score", "score"]], state.y,
           value => { state.y = value; changed(); }));
  const methods = document.createElement("span");
  methods.className = "methods";
  methods.append("methods ");
  for (const method of DATA.methods) {
    const wrap = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.value = method;
    box.checked = box.defaultChecked = state.methods.has(method);  // default: the attribute, as the DOM shows it
    box.addEventListener("change", () => {
      if (box.checked) state.methods.add(method); else state.methods.delete(method);
      changed();
    });
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = DATA.colors[method];
    wrap.append(box, swatch, method);
    methods.append(wrap);
  }
  bar.append(methods);
}

function changed() {
  writeHash();
  requestRender();
}

const taskOf = r => `${r.dataset}/${r.task}`;

// A row passes when its protocol, method and task (or, for per-dataset reports, its dataset) are
// the chosen ones; rows without such a column are not filtered on it.
function passes(r) {
  if (r.protocol !== undefined && r.protocol !== state.protocol) return false;
  if (r.method !== undefined && !state.methods.has(r.method)) return false;
  if (state.task === "all") return true;
  if (r.task !== undefined) return taskOf(r) === state.task;
  if (r.dataset !== undefined) return r.dataset === state.task.slice(0, state.task.indexOf("/"));
  return true;
}

// --- helpers ------------------------------------------------------------------------------------

function groupBy(rows, keyOf) {
  const groups = new Map();
  for (const r of rows) {
    const key = keyOf(r);
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(r);
  }
  return new Map([...groups.entries()].sort((a, b) => compare(a[0], b[0])));
}

// Numbers by value; text naturally ("512 tokens" before "1024 tokens"), budgets by value ("snapkv
// budget=0.25" before "snapkv budget=0.5", which a digit-by-digit order would swap).
function compare(a, b) {
  if (typeof a === "number" && typeof b === "number") return a - b;
  const budget = text => Number((String(text).match(/ budget=(\S+)/) || [null, NaN])[1]);
  const rest = text => String(text).replace(/ budget=\S+/, "");
  return rest(a).localeCompare(rest(b), undefined, {numeric: true}) || (budget(a) - budget(b))
    || String(a).localeCompare(String(b));
}

function translucent(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

// A method's configs (or families) told apart by dash and marker, the method by its colour.
function styles(rows, keyOf) {
  const out = new Map();
  for (const [, members] of groupBy(rows, r => r.method)) {
    [...new Set(members.map(keyOf))].sort(compare).forEach((key, i) => out.set(key, {
      color: DATA.colors[members[0].method], dash: DASHES[i % DASHES.length], symbol: SYMBOLS[i % SYMBOLS.length]}));
  }
  return out;
}

// Horizontal, above the plot area: plotly grows the top margin to fit it, so it never covers the
// data or an axis title, however many entries wrap onto more lines.
const LEGEND = {orientation: "h", x: 0, xanchor: "left", y: 1.02, yanchor: "bottom", font: {size: 11}};

function note(container, text) {
  const p = document.createElement("p");
  p.className = "note empty";
  p.textContent = text;
  container.append(p);
}

// The Plotly promises of the render in progress: the next render waits for them all before it purges
// a plot (purging one whose auto-margin redraw is still pending throws in plotly.js).
let drawing = [];

// One plot per group of rows: `draw(rows)` returns {traces, layout, items}; items go to #shown.
function panels(section, rows, keyOf, draw, emptyText) {
  const container = document.getElementById(section);
  for (const div of container.querySelectorAll(".js-plotly-plot")) Plotly.purge(div);
  container.replaceChildren();
  shown[section] = {};
  if (rows.length === 0) return note(container, emptyText);
  for (const [title, members] of groupBy(rows, keyOf)) {
    const {traces, layout, items} = draw(members);
    const panel = document.createElement("div");
    panel.className = "panel";
    const heading = document.createElement("h3");  // the title in the page, not in the plot's margins
    heading.textContent = title;
    const plot = document.createElement("div");
    panel.append(heading, plot);
    container.append(panel);
    // 380 px unless a view says (plotly's 450 default made a page of many short panels needlessly tall)
    drawing.push(Plotly.newPlot(plot, traces, {height: 380, margin: {t: 8, r: 16, b: 16, l: 16}, font: {size: 11},
                                               legend: LEGEND, ...layout}, PLOT_CONFIG));
    shown[section][title] = items;
  }
}

const fmt = v => (v === null || v === undefined ? "-" : Number(v).toPrecision(3));
const cellOf = r => `${taskOf(r)} @ ${r.context_tokens} tokens`;

// --- views --------------------------------------------------------------------------------------

// The ranked leaderboard (leaderboard.sql): every config of the chosen protocol and methods by its
// score averaged over the sweep's tasks (the task filter does not apply: the rank is over all tasks).
function ranking() {
  const container = document.getElementById("ranking");
  container.replaceChildren();
  const rows = DATA.ranking.filter(r => r.protocol === state.protocol && state.methods.has(r.method));
  shown.ranking = rows.map(r => r.config_label);
  if (rows.length === 0) return note(container, "No config passes the filters.");
  const two = v => (v === null || v === undefined ? "-" : Number(v).toFixed(2));
  const signed = v => (v === null || v === undefined ? "-" : (v >= 0 ? "+" : "") + Number(v).toFixed(2));
  const table = document.createElement("table");
  const head = table.createTHead().insertRow();
  for (const name of ["rank", "config", "compression", "KV/full", "tasks", "n", "score (95% CI)",
                      "vs full: paired difference (95% CI)", "verdict"]) {
    const th = document.createElement("th");
    th.textContent = name;
    head.append(th);
  }
  const body = table.createTBody();
  for (const r of rows) {
    const resolved = r.vs_full === "better" || r.vs_full === "worse";
    const cells = [
      [r.rank, true], [r.config_label, false], [r.compression_ratio === null ? "-" : `${fmt(r.compression_ratio)}x`, true],
      [two(r.kv_ratio_to_full), true], [r.tasks, true], [r.n, true],
      [`${two(r.score_mean)}` + (r.score_ci_low === null ? "" : ` (${two(r.score_ci_low)}-${two(r.score_ci_high)})`), true],
      [r.method === "full" ? "" : `${signed(r.diff_vs_full)}` + (r.diff_vs_full_ci_low === null ? ""
        : ` (${signed(r.diff_vs_full_ci_low)}..${signed(r.diff_vs_full_ci_high)})`), true],
      [r.method === "full" ? "reference" : (resolved ? r.vs_full : "~ not distinguishable"), false],
    ];
    const tr = body.insertRow();
    for (const [text, numeric] of cells) {
      const td = tr.insertCell();
      td.textContent = String(text);
      if (numeric) td.className = "num";
    }
    if (resolved) tr.className = "resolved";
  }
  const wrap = document.createElement("div");
  wrap.className = "scroll";
  wrap.append(table);
  container.append(wrap);
}

// Per task, the paired difference vs the full cache (or the score) against the compression ratio.
// One line per family: the configs of one method that differ only in the budget.
function leaderboard() {
  const score = state.y === "score";
  const fullRows = DATA.leaderboard.filter(r => r.method === "full" && r.protocol === state.protocol);
  const rows = DATA.leaderboard.filter(r => r.method !== "full" && r.compression_ratio !== null && passes(r));
  panels("leaderboard", rows, cellOf, cell => {
    const style = styles(cell, r => r.family);
    const traces = [];
    for (const [family, members] of groupBy(cell, r => r.family)) {
      const points = [...members].sort((a, b) => a.compression_ratio - b.compression_ratio);
      const x = points.map(r => r.compression_ratio);
      const y = points.map(r => score ? r.score_mean : r.diff_vs_full);
      const low = points.map(r => score ? r.score_ci_low : r.diff_vs_full_ci_low);
      const high = points.map(r => score ? r.score_ci_high : r.diff_vs_full_ci_high);
      const {color, dash, symbol} = style.get(family);
      const hasCi = low.every(v => v !== null) && high.every(v => v !== null);
      if (points.length > 1 && hasCi) {  // the 95% band: along the high ends, back along the low ends
        traces.push({x: [...x, ...[...x].reverse()], y: [...high, ...[...low].reverse()], fill: "toself",
                     mode: "lines", fillcolor: translucent(color, 0.14), line: {width: 0}, hoverinfo: "skip",
                     showlegend: false, legendgroup: family, name: `${family} 95% CI`, type: "scatter"});
      }
      traces.push({
        x, y, name: family, legendgroup: family, type: "scatter",
        mode: points.length > 1 ? "lines+markers" : "markers",
        line: {color, dash, width: 2}, marker: {color, symbol, size: 8},
        error_y: points.length === 1 && hasCi
          ? {type: "data", symmetric: false, array: [high[0] - y[0]], arrayminus: [y[0] - low[0]], color} : undefined,
        customdata: points.map((r, i) => [r.config_label, fmt(low[i]), fmt(high[i]), r.n, r.vs_full || "-"]),
        hovertemplate: "%{customdata[0]}<br>compression %{x:.3g}x<br>" + (score ? "score" : "score - full")
          + " %{y:.3f} [%{customdata[1]}, %{customdata[2]}]<br>n=%{customdata[3]}, vs full: %{customdata[4]}<extra></extra>",
      });
    }
    // the full cache: 0 by definition for the difference, its score on the same samples otherwise
    const full = fullRows.find(r => cellOf(r) === cellOf(cell[0]));
    const reference = score ? (full ? full.score_mean : null) : 0;
    if (reference !== null) {
      const ratios = cell.map(r => r.compression_ratio);
      traces.push({type: "scatter", mode: "lines", name: "full cache", line: {color: "#333", dash: "dash", width: 1},
                   x: [Math.min(1, ...ratios), Math.max(...ratios)], y: [reference, reference],
                   hovertemplate: `full cache: ${fmt(reference)}<extra></extra>`});
    }
    return {
      traces,
      items: traces.filter(t => t.showlegend !== false).map(t => t.name),
      layout: {
        xaxis: {type: "log", dtick: Math.log10(2), title: {text: "compression ratio (full bytes / live bytes)"},
                automargin: true},
        yaxis: {title: {text: score ? "score (95% Wilson CI)" : "score - full cache (paired, 95% CI)"},
                automargin: true, zeroline: false},
      },
    };
  }, "No config with a compression ratio passes the filters.");
}

// Per task, every config's paired difference vs the full cache with its bootstrap CI.
function paired() {
  const rows = DATA.leaderboard.filter(r => r.method !== "full" && r.diff_vs_full !== null && passes(r));
  panels("paired", rows, cellOf, cell => {
    const ordered = [...cell].sort((a, b) => compare(a.config_label, b.config_label));
    const traces = [["resolved (CI excludes 0)", "#d62728", r => r.vs_full === "better" || r.vs_full === "worse"],
                    ["not distinguishable", "#7f7f7f", r => !(r.vs_full === "better" || r.vs_full === "worse")]]
      .map(([name, color, keep]) => {
        const members = ordered.filter(keep);
        return {
          type: "scatter", mode: "markers", name, marker: {color, size: 8},
          x: members.map(r => r.diff_vs_full), y: members.map(r => `${r.config_label} (n=${r.n})`),
          error_x: {type: "data", symmetric: false, color,
                    array: members.map(r => r.diff_vs_full_ci_high - r.diff_vs_full),
                    arrayminus: members.map(r => r.diff_vs_full - r.diff_vs_full_ci_low)},
          customdata: members.map(r => [fmt(r.diff_vs_full_ci_low), fmt(r.diff_vs_full_ci_high), fmt(r.mcnemar_p_vs_full)]),
          hovertemplate: "%{y}<br>score - full %{x:.3f} [%{customdata[0]}, %{customdata[1]}]"
            + "<br>McNemar p %{customdata[2]}<extra></extra>",
        };
      });
    return {
      traces,
      items: ordered.map(r => r.config_label),
      layout: {
        height: 150 + 24 * ordered.length,
        xaxis: {title: {text: "score - full cache score (paired, 95% bootstrap CI)"}, automargin: true,
                zeroline: true, zerolinecolor: "#333", zerolinewidth: 1},
        yaxis: {automargin: true, type: "category", categoryorder: "array",
                categoryarray: ordered.map(r => `${r.config_label} (n=${r.n})`).reverse()},
      },
    };
  }, "No paired difference passes the filters.");
}

// Score by evidence depth (rows) and config x context length (columns): one heatmap per task, a
// column per config (per config and length when the sweep ran several lengths).
function depth() {
  const rows = DATA.depth.filter(passes);
  panels("depth", rows, taskOf, cell => {
    const several = new Set(cell.map(r => r.context_tokens)).size > 1;
    const columnOf = r => (several ? `${r.config_label} @ ${r.context_tokens}` : r.config_label);
    const configs = [...new Set(cell.map(r => r.config_label))].sort(compare);
    const columns = [...new Set(cell.map(columnOf))].sort((a, b) => compare(a, b));
    const tenths = [...new Set(cell.map(r => r.depth_low))].sort((a, b) => a - b);
    const at = new Map(cell.map(r => [`${r.depth_low}|${columnOf(r)}`, r]));
    const z = tenths.map(d => columns.map(c => (at.get(`${d}|${c}`) || {score_mean: null}).score_mean));
    const customdata = tenths.map(d => columns.map(c => {
      const r = at.get(`${d}|${c}`);
      return r ? [r.runs, fmt(r.score_full_mean), `${r.depth_low.toFixed(1)}-${r.depth_high.toFixed(1)}`, r.context_tokens]
               : [0, "-", "-", "-"];
    }));
    const unitRange = cell.every(r => r.score_ci_low !== null);
    return {
      traces: [{
        type: "heatmap", x: columns, y: tenths.map(d => `${d.toFixed(1)}-${(d + 0.1).toFixed(1)}`), z,
        customdata, colorscale: [[0, "#d73027"], [0.5, "#fee08b"], [1, "#1a9850"]],  // red: lost, green: found
        zmin: unitRange ? 0 : undefined, zmax: unitRange ? 1 : undefined,  // scores in [0, 1]: one scale for all
        texttemplate: "%{z:.2f}", colorbar: {title: {text: "score"}, thickness: 12}, xgap: 2,
        hovertemplate: "%{x}<br>depth %{customdata[2]}, %{customdata[3]} tokens<br>score %{z:.3f} (n=%{customdata[0]})"
          + "<br>full cache %{customdata[1]}<extra></extra>",
      }],
      items: configs,
      layout: {
        height: 200 + 24 * tenths.length,
        xaxis: {type: "category", tickangle: -30, automargin: true},
        yaxis: {type: "category", title: {text: "evidence depth"}, automargin: true},
      },
    };
  }, "No run with a recorded evidence depth passes the filters (runs.evidence_depth: needle tasks).");
}

// Per task, each config's mean evidence kept against its score; the config is in the hover text.
function evidence() {
  const rows = DATA.evidence.filter(r => r.evidence_kept_mean !== null && passes(r));
  panels("evidence", rows, cellOf, cell => {
    const traces = [...groupBy(cell, r => r.method)].map(([method, members]) => ({
      type: "scatter", mode: "markers", name: method, marker: {color: DATA.colors[method], size: 9},
      x: members.map(r => r.evidence_kept_mean), y: members.map(r => r.score_mean),
      text: members.map(r => `${r.config_label} (n=${r.runs})`),
      hovertemplate: "%{text}<br>evidence kept %{x:.3f}, score %{y:.3f}<extra></extra>",
    }));
    return {
      traces,
      items: cell.map(r => r.config_label).sort(compare),
      layout: {xaxis: {title: {text: "evidence kept (mean over layers, heads, runs)"}, range: [-0.05, 1.05], automargin: true},
               yaxis: {title: {text: "score"}, automargin: true}},
    };
  }, "No run that records evidence passes the filters.");
}

// KL and top-1 agreement by decode step, one line per config (over every task of the sweep).
function degradation() {
  const rows = DATA.degradation.filter(passes);
  panels("degradation", rows, () => "KL and top-1 agreement vs decode step (all tasks)", all => {
    const style = styles(all, r => r.config_label);
    const traces = [];
    for (const [label, members] of groupBy(all, r => r.config_label)) {
      const line = [...members].sort((a, b) => a.step - b.step);
      const {color, dash, symbol} = style.get(label);
      const common = {type: "scatter", mode: "lines+markers", legendgroup: label, name: label,
                      line: {color, dash}, marker: {color, symbol, size: 6}, x: line.map(r => r.step)};
      traces.push({...common, y: line.map(r => r.kl_mean),
                   hovertemplate: `${label}<br>step %{x}: KL %{y:.4g} nats<extra></extra>`});
      traces.push({...common, y: line.map(r => r.top1_agree), xaxis: "x2", yaxis: "y2", showlegend: false,
                   hovertemplate: `${label}<br>step %{x}: top-1 agreement %{y:.3f}<extra></extra>`});
    }
    return {
      traces,
      items: traces.filter(t => t.showlegend !== false).map(t => t.name),
      layout: {
        height: 460,
        xaxis: {domain: [0, 0.45], title: {text: "decode step"}, dtick: 1, automargin: true},
        yaxis: {title: {text: "kl_mean (nats)"}, automargin: true},
        xaxis2: {domain: [0.55, 1], anchor: "y2", title: {text: "decode step"}, dtick: 1, automargin: true},
        yaxis2: {anchor: "x2", title: {text: "top-1 agreement with the full cache"}, range: [-0.05, 1.05], automargin: true},
      },
    };
  }, "No decode step passes the filters.");
}

// Per dataset and context length, score against live KV bytes; the front joins the configs that
// no other config of the cell beats on both (pareto.sql, over every config of the cell).
function pareto() {
  const rows = DATA.pareto.filter(passes);
  const cellOfPareto = r => `${r.dataset} @ ${r.context_tokens} tokens`;
  panels("pareto", rows, cellOfPareto, cell => {
    const traces = [...groupBy(cell, r => r.method)].map(([method, members]) => ({
      type: "scatter", mode: "markers", name: method,
      marker: {color: DATA.colors[method], size: members.map(r => (r.on_front ? 11 : 7)),
               opacity: members.map(r => (r.on_front ? 1 : 0.55)),
               line: {color: "#000", width: members.map(r => (r.on_front ? 1.5 : 0))}},
      x: members.map(r => r.live_kv_bytes / 2 ** 20), y: members.map(r => r.score_mean),
      text: members.map(r => `${r.config_label}${r.on_front ? " (on the front)" : ""}${r.note ? ` (${r.note})` : ""}`),
      hovertemplate: "%{text}<br>%{x:.3g} MiB, score %{y:.3f}<extra></extra>",
    }));
    const front = DATA.pareto.filter(r => r.on_front && cellOfPareto(r) === cellOfPareto(cell[0]))
      .sort((a, b) => a.live_kv_bytes - b.live_kv_bytes || b.score_mean - a.score_mean);
    traces.unshift({type: "scatter", mode: "lines", name: "Pareto front (all configs)", line: {color: "#000", width: 1, shape: "hv"},
                    x: front.map(r => r.live_kv_bytes / 2 ** 20), y: front.map(r => r.score_mean),
                    text: front.map(r => r.config_label), hovertemplate: "front: %{text}<extra></extra>"});
    return {
      traces,
      items: cell.map(r => r.config_label).sort(compare),
      layout: {xaxis: {title: {text: "live KV (MiB)"}, automargin: true}, yaxis: {title: {text: "score"}, automargin: true}},
    };
  }, "No config passes the filters.");
}

// Speed sweeps: per model and context length, decode tok/s against the KV memory of each cache's
// batch, one line per config over its budgets (or batches); bars span the rounds' min and max.
function throughput() {
  const rows = DATA.throughput.filter(r => r.decode_tok_s !== null && passes(r));
  panels("throughput", rows, r => `${r.model} @ ${r.context_tokens} tokens`, cell => {
    const style = styles(cell, r => r.config_label);
    const traces = [];
    for (const [label, members] of groupBy(cell, r => r.config_label)) {
      const points = [...members].sort((a, b) => a.live_kv_gib - b.live_kv_gib);
      const {color, dash, symbol} = style.get(label);
      traces.push({
        type: "scatter", mode: points.length > 1 ? "lines+markers" : "markers", name: label,
        line: {color, dash, width: 2}, marker: {color, symbol, size: 9},
        x: points.map(r => r.live_kv_gib), y: points.map(r => r.decode_tok_s),
        error_y: {type: "data", symmetric: false, color, array: points.map(r => r.decode_tok_s_max - r.decode_tok_s),
                  arrayminus: points.map(r => r.decode_tok_s - r.decode_tok_s_min)},
        customdata: points.map(r => [r.batch, fmt(r.x_full), fmt(r.x_full_min), fmt(r.x_full_max),
                                     r.kv_budget_gib === null ? "-" : `${fmt(r.kv_budget_gib)} GiB`]),
        hovertemplate: `${label}<br>batch %{customdata[0]} (KV budget %{customdata[4]}), KV %{x:.3g} GiB`
          + "<br>%{y:.1f} tok/s, x full %{customdata[1]} [%{customdata[2]}, %{customdata[3]}]<extra></extra>",
      });
    }
    return {
      traces,
      items: traces.map(t => t.name),
      layout: {xaxis: {title: {text: "KV memory of the batch (GiB)"}, automargin: true, rangemode: "tozero"},
               yaxis: {title: {text: "decode tok/s (all sequences)"}, automargin: true, rangemode: "tozero"}},
    };
  }, "No speed measurement passes the filters (a speed sweep, kind: speed, writes them).");
}

// Draw every view for the current filters. Filter changes may land many in one tick (a "select
// none", fast clicking): `changed` asks for one render per animation frame, and a render first waits
// for the previous one's plots, so plotly.js never purges a plot it is still drawing.
async function render() {
  drawing = [];
  shown = {};
  for (const view of [ranking, leaderboard, paired, depth, evidence, degradation, pareto, throughput]) view();
  document.getElementById("shown").textContent = JSON.stringify({filters: {...state, methods: [...state.methods]}, ...shown});
  await Promise.all(drawing);
  document.body.dataset.status = "rendered";
}

let queued = null;  // the render asked for and not started yet
let rendering = Promise.resolve();

function requestRender() {
  document.body.dataset.status = "rendering";
  if (queued) return queued;
  queued = new Promise(resolve => requestAnimationFrame(resolve)).then(() => {
    queued = null;
    rendering = rendering.then(render, render).catch(e => reportError(`render: ${e && e.stack || e}`));
    return rendering;
  });
  return queued;
}

readHash();
buildFilters();
requestRender();
window.addEventListener("hashchange", () => { readHash(); buildFilters(); requestRender(); });
