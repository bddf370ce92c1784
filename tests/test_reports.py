"""The SQL reports (sql/*.sql), the terminal and HTML renderings and the Prefect artifacts, on fixture
Parquet written by kvcompress.results.write_run. Every aggregate is recomputed here in plain Python
from the rows the fixture wrote, and must match what DuckDB returns."""

import kvcompress  # noqa: F401  (first: preloads OpenBLAS before anything imports mlx)

import io
import json
import math
import random
import re
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from kvcompress.results import write_run

MODEL = "tiny"
# (dataset, task, context_tokens, binary score?) - ruler scores are 0/1, longbench's fractional
CELLS = [("ruler", "niah", 1024, True), ("longbench", "qa", 2048, False)]
# (method, budget, bits, tau_init, tau_end, kv ratio to full, base KL per step in nats)
CONFIGS = [
    ("full", None, None, None, None, 1.0, 0.0),
    ("snapkv", 0.25, None, None, None, 0.25, 0.08),
    ("snapkv", 0.5, None, None, None, 0.5, 0.04),
    ("kivi", None, 2.0, None, None, 0.125, 0.06),
    ("kivi", None, 4.0, None, None, 0.25, 0.02),
    ("keyformer", 0.5, None, 1.0, 2.0, 0.5, 0.03),
]
EXTRA_IN_S2 = ("kivi", None, 3.0, None, None, 0.1875, 0.05)  # present in sweep s2 only
FULL_SAMPLES = [f"x{i}" for i in range(5)]
METHOD_SAMPLES = FULL_SAMPLES[:4]  # the full cache also ran x4: a ceiling must not count it
STEPS = 4
DEPTHS = [0.0, 0.31, 0.35, 0.97, 1.0]  # ruler samples' evidence_depth: 1.0 falls in the last tenth
Z95 = 1.959963984540054


def config_key(row):
    return (row["method"], row["budget"], row["bits"], row["tau_init"], row["tau_end"])


def build_fixture(root: str) -> tuple[list[dict], list[dict]]:
    """Write two sweeps; return (run rows, step rows), each with sweep_id and method added."""
    all_runs, all_steps = [], []
    for sweep_index, sweep_id in enumerate(["s1", "s2"]):
        rng = random.Random(1000 + sweep_index)
        created = datetime(2024, 1 + sweep_index, 1, tzinfo=timezone.utc)
        configs = CONFIGS + ([EXTRA_IN_S2] if sweep_id == "s2" else [])
        for method, budget, bits, tau_init, tau_end, ratio, kl_base in configs:
            for dataset, task, context, binary in CELLS:
                samples = FULL_SAMPLES if method == "full" else METHOD_SAMPLES
                for sample_index, sample_id in enumerate(samples):
                    full_bytes = context * 1000
                    score = float(rng.randint(0, 1)) if binary else rng.randint(0, 8) / 8
                    run_id = f"{sweep_id}-{method}-{budget}-{bits}-{tau_init}-{dataset}-{sample_id}"
                    run = dict(
                        run_id=run_id, model=MODEL, dataset=dataset, task=task, sample_id=sample_id,
                        context_tokens=context, prompt_tokens=context - 10, budget=budget, bits=bits,
                        tau_init=tau_init, tau_end=tau_end, score=score, status="ok", error=None,
                        prefill_s=round(rng.uniform(0.5, 2.0), 3), decode_tok_s=round(rng.uniform(5, 50), 2),
                        live_kv_bytes=int(full_bytes * ratio) + 8 * sample_index, full_kv_bytes=full_bytes,
                        tokens_kept=int(context * ratio), peak_memory_bytes=10**8 + rng.randint(0, 10**6),
                        decode_steps=STEPS, prediction="p", config="{}",
                        created_at=created + timedelta(minutes=sample_index),
                    )
                    steps = [
                        dict(run_id=run_id, step=step, position=context + step, ref_token=7, token=7,
                             top1_agree=method == "full" or rng.random() < 0.7,
                             kl=kl_base * (step + 1) + 0.01 * sample_index if method != "full" else 0.0,
                             logit_cosine=1.0 - kl_base, nll=1.5 + kl_base * step, tokens_kept=run["tokens_kept"],
                             live_kv_bytes=run["live_kv_bytes"], step_ms=round(rng.uniform(10, 40), 2))
                        for step in range(STEPS)
                    ]
                    # evidence: every layer held all of it when the answer was right, half otherwise
                    kept = 1.0 if score >= 1 or method == "full" else 0.5
                    run["evidence_kept"] = kept
                    run["evidence_depth"] = DEPTHS[sample_index] if dataset == "ruler" else None
                    evidence = [dict(run_id=run_id, layer=layer, stage=stage, kept_min=kept, kept_mean=kept,
                                     key_rel_err=0.0, value_rel_err=0.0)
                                for stage in ("compressed", "final") for layer in range(2)]
                    write_run(root, sweep_id, method, run, steps, evidence)
                    all_runs.append(dict(run, sweep_id=sweep_id, method=method))
                    all_steps += [dict(s, sweep_id=sweep_id, method=method) for s in steps]
        # a failed run: its perfect score must not count anywhere
        failed = dict(all_runs[-1], run_id=f"{sweep_id}-failed", sample_id="x9", score=1.0, status="error",
                      error="boom", method="snapkv", budget=0.5)
        write_run(root, sweep_id, "snapkv", {k: v for k, v in failed.items() if k not in ("sweep_id", "method")},
                  [dict(all_steps[-1], run_id=failed["run_id"], kl=99.0)])
    return all_runs, all_steps


# speed measurements of sweep s2: (config_label, method, batch, kv budget or None, bytes per sequence)
SPEED = [("full", "full", 2, 2**30, 2**29), ("kivi bits=2", "kivi", 8, 2**30, 2**27),
         ("snapkv budget=0.5", "snapkv", 4, 2**30, 2**28), ("full", "full", 1, None, None),
         ("kivi bits=2", "kivi", 1, None, None)]
SPEED_ROUNDS = 3


def speed_fixture_rows() -> list[dict]:
    """The speed table's rows of sweep s2 (as kvcompress.speed.measurement_rows writes them), and an
    error row that must count nowhere."""
    rng = random.Random(7)
    rows = []
    for label, method, batch, budget, per_sequence in SPEED:
        run_id = f"speed-{method}-{batch}-{budget}"
        for rnd in range(SPEED_ROUNDS):
            decode_ms = round(rng.uniform(10, 40), 2)
            pipelined_ms = round(rng.uniform(8, 30), 2)
            rows.append(dict(run_id=run_id, model="m", dtype="float16", device="gpu: test", context_tokens=1024,
                             batch=batch, kv_budget_bytes=budget, kv_bytes_per_sequence=per_sequence, round=rnd,
                             status="ok", error=None, decode_steps=8, decode_ms=decode_ms,
                             decode_tok_s=batch * 1e3 / decode_ms, host_ms=1.0, pipelined_ms=pipelined_ms,
                             pipelined_tok_s=batch * 1e3 / pipelined_ms, prefill_s=0.5 + rnd if rnd < 2 else None,
                             live_kv_bytes=batch * (per_sequence or 2**20), peak_memory_bytes=2**31, weight_bytes=2**30,
                             kernels="{}", config_label=label, config="{}",
                             created_at=datetime(2024, 2, 1, tzinfo=timezone.utc), method=method))
    rows.append(dict(rows[-1], run_id="speed-kivi4", round=None, status="error", error="does not fit", batch=0,
                     decode_tok_s=1e9, config_label="kivi bits=4"))
    return rows


def build_speed_fixture(root: str) -> None:
    from kvcompress.results import write_speed

    for run_id, rows in group(speed_fixture_rows(), lambda r: r["run_id"]).items():
        write_speed(root, "s2", rows[0]["method"], [{k: v for k, v in r.items() if k != "method"} for r in rows])


@pytest.fixture(scope="module")
def fixture_results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("results"))
    runs, steps = build_fixture(root)
    build_speed_fixture(root)
    return root, runs, steps


@pytest.fixture(scope="module")
def con(fixture_results):
    from kvcompress_reports import connect

    return connect(fixture_results[0])


def report_records(con, name):
    from kvcompress_reports import run_report

    columns, rows = run_report(con, name)
    return [dict(zip(columns, r)) for r in rows]


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def wilson(p, n):
    """Wilson score interval at 95%, straight from the formula."""
    denominator = 1 + Z95**2 / n
    centre = (p + Z95**2 / (2 * n)) / denominator
    half = Z95 / denominator * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n**2))
    return centre - half, centre + half


def quantile(values, q):
    """Linear interpolation between closest ranks (what quantile_cont does), without numpy."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def group(rows, key):
    groups = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return groups


def ok_runs(runs):
    return [r for r in runs if r["status"] == "ok"]


def full_score(runs, r):
    matches = [f["score"] for f in ok_runs(runs) if f["method"] == "full" and (f["sweep_id"], f["model"], f["dataset"],
               f["task"], f["context_tokens"], f["sample_id"]) == (r["sweep_id"], r["model"], r["dataset"], r["task"],
               r["context_tokens"], r["sample_id"])]
    return mean(matches) if matches else None


def run_step_means(steps):
    by_run = group(steps, lambda s: s["run_id"])
    return {rid: (mean(s["kl"] for s in ss), mean(1.0 if s["top1_agree"] else 0.0 for s in ss))
            for rid, ss in by_run.items()}


approx = lambda v: pytest.approx(v, rel=1e-12, abs=1e-12)  # noqa: E731


def test_summary_matches_python_aggregates(fixture_results, con):
    _, runs, steps = fixture_results
    per_run = run_step_means(steps)
    expected = group(ok_runs(runs), lambda r: (r["sweep_id"], *config_key(r), r["dataset"], r["task"], r["context_tokens"]))
    got = report_records(con, "summary")
    assert len(got) == len(expected) == 2 * len(CELLS) * len(CONFIGS) + len(CELLS)
    for row in got:
        key = (row["sweep_id"], *config_key(row), row["dataset"], row["task"], row["context_tokens"])
        cell = expected[key]
        n = len(cell)
        p = mean(r["score"] for r in cell)
        assert row["runs"] == n == (5 if row["method"] == "full" else 4)  # NULL config fields group as equal
        assert row["score_mean"] == approx(p)
        low, high = wilson(p, n)
        assert (row["score_ci_low"], row["score_ci_high"]) == (approx(low), approx(high))
        assert 0 <= row["score_ci_low"] <= p <= row["score_ci_high"] <= 1
        fulls = [full_score(runs, r) for r in cell]
        assert row["score_full_mean"] == approx(mean(fulls))
        assert row["score_vs_full"] == approx(mean(r["score"] - f for r, f in zip(cell, fulls)))
        assert row["kl_mean"] == approx(mean(per_run[r["run_id"]][0] for r in cell))
        assert row["top1_agree"] == approx(mean(per_run[r["run_id"]][1] for r in cell))
        assert row["live_kv_bytes"] == int(mean(r["live_kv_bytes"] for r in cell))  # CAST rounds; fixture is exact
        assert row["kv_ratio_to_full"] == approx(mean(r["live_kv_bytes"] / r["full_kv_bytes"] for r in cell))
        assert row["decode_tok_s"] == approx(mean(r["decode_tok_s"] for r in cell))
    # the ceiling is over the SAME samples: the full cache's own mean also counts x4, the ceiling does not
    full_s1 = [r for r in ok_runs(runs) if r["sweep_id"] == "s1" and r["method"] == "full" and r["dataset"] == "ruler"]
    snap = next(r for r in got if (r["sweep_id"], r["method"], r["budget"], r["dataset"]) == ("s1", "snapkv", 0.25, "ruler"))
    assert snap["score_full_mean"] == approx(mean(r["score"] for r in full_s1 if r["sample_id"] in METHOD_SAMPLES))


def test_leaderboard_ranks_configs_by_task_averaged_score_with_cis(fixture_results, con):
    """leaderboard.sql + its paired statistics, recomputed from the fixture's runs: per sweep and
    config, the mean over task cells of the cell's mean score, the cells' Wilson intervals combined
    (one cell: exactly its Wilson interval), n, the compression ratio, the paired difference from the
    full cache with the bootstrap CI and verdict of kvcompress.stats.compare over the pooled runs, and
    the rank by score (ties: smaller KV first)."""
    from kvcompress.stats import compare

    _, runs, _ = fixture_results
    got = report_records(con, "leaderboard")
    configs = group(ok_runs(runs), lambda r: (r["sweep_id"], *config_key(r)))
    assert len(got) == len(configs) == 2 * len(CONFIGS) + 1
    for row in got:
        members = configs[(row["sweep_id"], *config_key(row))]
        cells = group(members, lambda r: (r["dataset"], r["task"], r["context_tokens"]))
        assert row["tasks"] == len(cells) == 2 and row["n"] == len(members)
        means = [mean(r["score"] for r in cell) for cell in cells.values()]
        assert row["score_mean"] == approx(mean(means))
        bounds = [wilson(p, len(cell)) for p, cell in zip(means, cells.values())]
        below = math.sqrt(sum((p - low) ** 2 for p, (low, _) in zip(means, bounds))) / len(bounds)
        above = math.sqrt(sum((high - p) ** 2 for p, (_, high) in zip(means, bounds))) / len(bounds)
        assert row["score_ci_low"] == approx(max(mean(means) - below, 0.0))
        assert row["score_ci_high"] == approx(min(mean(means) + above, 1.0))
        assert row["score_ci_low"] <= row["score_mean"] <= row["score_ci_high"]
        ratio = mean(mean(r["live_kv_bytes"] / r["full_kv_bytes"] for r in cell) for cell in cells.values())
        assert row["kv_ratio_to_full"] == approx(ratio) and row["compression_ratio"] == approx(1 / ratio)
        diffs = [mean(r["score"] - full_score(runs, r) for r in cell) for cell in cells.values()]
        assert row["diff_vs_full"] == approx(mean(diffs))
        if row["method"] == "full":
            assert row["diff_vs_full_ci_low"] is None and row["vs_full"] is None
            continue
        # in paired.sql's order (the seeded bootstrap resamples by position)
        pairs = sorted(members, key=lambda r: (r["dataset"], r["task"], r["context_tokens"], r["sample_id"]))
        stats = compare([r["score"] for r in pairs], [full_score(runs, r) for r in pairs])
        assert (row["diff_vs_full_ci_low"], row["diff_vs_full_ci_high"], row["mcnemar_p_vs_full"], row["vs_full"]) == (
            approx(stats.ci_low), approx(stats.ci_high), stats.mcnemar_p, stats.verdict)
        assert stats.mcnemar_p is None  # longbench's scores are fractional: no exact test over the pooled runs
    for sweep_id in ("s1", "s2"):
        ranked = [r for r in got if r["sweep_id"] == sweep_id]
        assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
        keys = [(-r["score_mean"], r["kv_ratio_to_full"]) for r in ranked]
        assert keys == sorted(keys)


def test_screen_shows_the_ranked_leaderboard_and_says_what_tilde_means(fixture_results, con):
    from kvcompress_reports.render import SCREEN_WIDTH, screen, to_text

    text = to_text(*screen(con, "s2"))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= SCREEN_WIDTH
    assert any(line.startswith("~: not distinguishable from the full cache at this n (the paired 95% CI spans 0")
               for line in lines)
    start = lines.index("Leaderboard: configs ranked by their score averaged over 2 task cells")
    ranked = [r for r in report_records(con, "leaderboard") if r["sweep_id"] == "s2"]
    table = [line for line in lines[start + 3:start + 3 + len(ranked)]]
    for line, r in zip(table, ranked):
        assert line.split()[0] == str(r["rank"]) and r["config_label"] in line
        assert f"{r['score_mean']:.2f} ({r['score_ci_low']:.2f}-{r['score_ci_high']:.2f})" in line
        if r["method"] != "full":
            assert f"{r['diff_vs_full']:+.2f} ({r['diff_vs_full_ci_low']:+.2f}..{r['diff_vs_full_ci_high']:+.2f})" in line
            assert line.endswith("~") == (r["vs_full"] == "not distinguishable")


def test_pareto_front_membership(fixture_results, con):
    _, runs, _ = fixture_results
    cells = group(ok_runs(runs), lambda r: (r["sweep_id"], r["dataset"], r["context_tokens"]))
    got = report_records(con, "pareto")
    assert len(got) == sum(len({config_key(r) for r in rs}) for rs in cells.values())
    fronts, dominated = 0, 0
    for (sweep_id, dataset, context), rows in cells.items():
        points = {k: (mean(r["score"] for r in rs), mean(r["live_kv_bytes"] for r in rs))
                  for k, rs in group(rows, config_key).items()}
        for k, (score, live) in points.items():
            beaten_by = sum(1 for s, b in points.values() if s >= score and b <= live and (s > score or b < live))
            row = next(r for r in got if (r["sweep_id"], r["dataset"], r["context_tokens"], *config_key(r)) ==
                       (sweep_id, dataset, context, *k))
            assert row["dominated_by"] == beaten_by
            assert row["on_front"] == (beaten_by == 0)
            assert row["score_mean"] == approx(score)
            assert row["live_kv_bytes"] == round(live)
            n = len(group(rows, config_key)[k])
            assert (row["score_ci_low"], row["score_ci_high"]) == tuple(approx(v) for v in wilson(score, n))
            fronts += beaten_by == 0
            dominated += beaten_by > 0
    assert fronts >= 2 * len(cells) and dominated >= len(cells)  # the fixture exercises both outcomes
    assert {r["protocol"] for r in got} == {"query_aware"}  # runs without a protocol were query-aware


def test_degradation_by_step(fixture_results, con):
    _, runs, steps = fixture_results
    ok_ids = {r["run_id"] for r in ok_runs(runs)}
    expected = group([s for s in steps if s["run_id"] in ok_ids],
                     lambda s: (s["sweep_id"], *config_key(next(r for r in runs if r["run_id"] == s["run_id"])), s["step"]))
    got = report_records(con, "degradation")
    assert len(got) == len(expected)
    for row in got:
        cell = expected[(row["sweep_id"], *config_key(row), row["step"])]
        assert row["runs"] == len(cell)
        assert row["kl_mean"] == approx(mean(s["kl"] for s in cell))
        assert row["kl_max"] == approx(max(s["kl"] for s in cell))
        assert row["top1_agree"] == approx(mean(1.0 if s["top1_agree"] else 0.0 for s in cell))
    # the fixture's KL grows linearly with the step: kl_mean(step) = base * (step + 1) + 0.01 * mean sample index
    snap = {r["step"]: r["kl_mean"] for r in got if (r["sweep_id"], r["method"], r["budget"]) == ("s1", "snapkv", 0.25)}
    assert snap == {step: approx(0.08 * (step + 1) + 0.01 * 1.5) for step in range(STEPS)}
    assert all(r["kl_max"] < 99 for r in got)  # the failed run's steps are excluded
    assert {r["protocol"] for r in got} == {"query_aware"}


def test_speed_memory_percentiles(fixture_results, con):
    _, runs, steps = fixture_results
    steps_of = group(steps, lambda s: s["run_id"])
    expected = group(ok_runs(runs), lambda r: (r["sweep_id"], *config_key(r), r["dataset"], r["context_tokens"]))
    got = report_records(con, "speed_memory")
    assert len(got) == len(expected)
    for row in got:
        cell = expected[(row["sweep_id"], *config_key(row), row["dataset"], row["context_tokens"])]
        step_ms = [s["step_ms"] for r in cell for s in steps_of[r["run_id"]]]
        assert len(step_ms) == len(cell) * STEPS
        assert row["decode_ms_p50"] == approx(quantile(step_ms, 0.5))
        assert row["decode_ms_p90"] == approx(quantile(step_ms, 0.9))
        assert row["prefill_s_mean"] == approx(mean(r["prefill_s"] for r in cell))
        assert row["live_kv_bytes"] == round(mean(r["live_kv_bytes"] for r in cell))
        assert row["full_kv_bytes"] == round(mean(r["full_kv_bytes"] for r in cell))
        assert row["kv_ratio_to_full"] == approx(mean(r["live_kv_bytes"] / r["full_kv_bytes"] for r in cell))
        assert row["peak_memory_bytes_max"] == max(r["peak_memory_bytes"] for r in cell)


def test_throughput_at_equal_kv_memory(con):
    """Per group (context x budget, or batch), each cache's tok/s and its ratio to the full cache's in
    the same round: median, min and max over the rounds, recomputed here from the rows."""
    import statistics

    rows = [r for r in speed_fixture_rows() if r["status"] == "ok"]
    got = report_records(con, "throughput")
    keys = [(r["kv_budget_gib"], r["config_label"], r["batch"]) for r in got]
    assert sorted(keys, key=str) == sorted([(None, "full", 1), (None, "kivi bits=2", 1), (1.0, "full", 2),
                                            (1.0, "kivi bits=2", 8), (1.0, "snapkv budget=0.5", 4)], key=str)
    assert keys[0] == (None, "full", 1) and keys[2] == (1.0, "full", 2)  # given batches first; full first
    for row in got:
        budget = None if row["kv_budget_gib"] is None else round(row["kv_budget_gib"] * 2**30)
        same_group = [r for r in rows if r["kv_budget_bytes"] == budget and (budget or r["batch"] == row["batch"])]
        mine = sorted((r for r in same_group if r["config_label"] == row["config_label"]), key=lambda r: r["round"])
        full = {r["round"]: r for r in same_group if r["method"] == "full"}
        ratios = [r["decode_tok_s"] / full[r["round"]]["decode_tok_s"] for r in mine]
        pipelined = [r["pipelined_tok_s"] / full[r["round"]]["pipelined_tok_s"] for r in mine]
        assert row["rounds"] == SPEED_ROUNDS and row["sweep_id"] == "s2"
        assert row["decode_tok_s"] == approx(statistics.median(r["decode_tok_s"] for r in mine))
        assert (row["decode_tok_s_min"], row["decode_tok_s_max"]) == approx(
            (min(r["decode_tok_s"] for r in mine), max(r["decode_tok_s"] for r in mine)))
        assert (row["x_full"], row["x_full_min"], row["x_full_max"]) == approx(
            (statistics.median(ratios), min(ratios), max(ratios)))
        assert row["x_full_pipelined"] == approx(statistics.median(pipelined))
        assert row["prefill_s"] == approx(1.0)  # the median of two timed prefills, 0.5 and 1.5
        assert row["live_kv_gib"] == approx(mine[0]["live_kv_bytes"] / 2**30)
    assert not any(r["config_label"] == "kivi bits=4" for r in got)  # its error row counts nowhere


def test_compare_sweeps_explicit_and_default(fixture_results, con):
    _, runs, _ = fixture_results
    cells = group(ok_runs(runs), lambda r: (r["sweep_id"], *config_key(r), r["dataset"], r["task"], r["context_tokens"]))

    def check(rows, a, b):
        keys = {k[1:] for k in cells if k[0] in (a, b)}
        assert len(rows) == len(keys)
        for row in rows:
            assert (row["sweep_a"], row["sweep_b"]) == (a, b)
            key = (*config_key(row), row["dataset"], row["task"], row["context_tokens"])
            side = {s: cells.get((s, *key)) for s in (a, b)}
            for s, suffix in ((a, "_a"), (b, "_b")):
                if side[s] is None:
                    assert row["runs" + suffix] is None and row["score_mean" + suffix] is None
                    continue
                p, n = mean(r["score"] for r in side[s]), len(side[s])
                assert row["runs" + suffix] == n
                assert row["score_mean" + suffix] == approx(p)
                assert row["score_ci_low" + suffix] == approx(wilson(p, n)[0])
                assert row["live_kv_bytes" + suffix] == approx(mean(r["live_kv_bytes"] for r in side[s]))
            if side[a] and side[b]:
                pa, pb = (mean(r["score"] for r in side[s]) for s in (a, b))
                assert row["score_delta"] == approx(pb - pa)
                (la, ha), (lb, hb) = wilson(pa, len(side[a])), wilson(pb, len(side[b]))
                assert row["score_delta_beyond_ci"] == (ha < lb or hb < la)
            else:
                assert row["score_delta"] is None
        return rows

    default = check(report_records(con, "compare_sweeps"), "s1", "s2")  # newest two by created_at
    assert sum(r["runs_a"] is None for r in default) == len(CELLS)  # kivi bits=3 exists in s2 only
    con.execute("SET VARIABLE sweep_a = 's2'")
    con.execute("SET VARIABLE sweep_b = 's1'")
    try:
        swapped = check(report_records(con, "compare_sweeps"), "s2", "s1")
    finally:
        con.execute("RESET VARIABLE sweep_a")
        con.execute("RESET VARIABLE sweep_b")
    assert sorted(r["score_delta"] for r in swapped if r["score_delta"] is not None) == \
        sorted(-r["score_delta"] for r in default if r["score_delta"] is not None)


def test_depth_report_bins_evidence_depth_by_context_length(fixture_results, con):
    _, runs, _ = fixture_results
    placed = [r for r in ok_runs(runs) if r["evidence_depth"] is not None]
    expected = group(placed, lambda r: (r["sweep_id"], *config_key(r), r["dataset"], r["task"], r["context_tokens"],
                                        min(math.floor(10 * r["evidence_depth"]), 9) / 10))
    got = report_records(con, "depth")
    assert len(got) == len(expected) and {r["dataset"] for r in got} == {"ruler"}  # longbench has no depth
    for row in got:
        cell = expected[(row["sweep_id"], *config_key(row), row["dataset"], row["task"], row["context_tokens"],
                         row["depth_low"])]
        p = mean(r["score"] for r in cell)
        assert row["depth_high"] == pytest.approx(row["depth_low"] + 0.1)
        assert (row["runs"], row["protocol"]) == (len(cell), "query_aware")
        assert row["score_mean"] == approx(p)
        assert (row["score_ci_low"], row["score_ci_high"]) == tuple(approx(v) for v in wilson(p, len(cell)))
        fulls = [full_score(runs, r) for r in cell]
        assert row["score_full_mean"] == approx(mean(fulls))
        assert row["score_vs_full"] == approx(mean(r["score"] - f for r, f in zip(cell, fulls)))
    # 0.31 and 0.35 share a tenth; 0.97 and 1.0 (x4 runs only under the full cache) share the last
    snap = [r for r in got if (r["sweep_id"], r["method"], r["budget"]) == ("s1", "snapkv", 0.25)]
    assert [(r["depth_low"], r["runs"]) for r in snap] == [(0.0, 1), (0.3, 2), (0.9, 1)]
    full = [r for r in got if (r["sweep_id"], r["method"]) == ("s1", "full")]
    assert [(r["depth_low"], r["runs"]) for r in full] == [(0.0, 1), (0.3, 2), (0.9, 2)]


def test_depth_report_reads_results_written_before_evidence_depth(tmp_path):
    """Older results have no evidence_depth column: the report falls back to the depth the sweep
    pinned (dataset_params.depth) and leaves out runs with random depths."""
    import pyarrow as pa

    from kvcompress.results import RUNS_SCHEMA, write_table
    from kvcompress_reports import connect, run_report
    from tests.test_results import make_run

    old_schema = pa.schema([f for f in RUNS_SCHEMA if f.name != "evidence_depth"])
    root = str(tmp_path / "results")
    for rid, pinned, score in (("a", 0.25, 1.0), ("b", 0.25, 0.0), ("c", None, 1.0)):
        run = make_run(rid, "full", score, 1000, config=json.dumps({"dataset_params": {"depth": pinned}}))
        write_table(root, "runs/sweep_id=old/method=full", rid,
                    pa.Table.from_pylist([{k: v for k, v in run.items() if k in old_schema.names}], schema=old_schema))
    columns, rows = run_report(connect(root), "depth")
    (row,) = [dict(zip(columns, r)) for r in rows]
    assert (row["depth_low"], row["depth_high"], row["runs"], row["score_mean"]) == (0.2, 0.3, 2, 0.5)


def same_rows(a: list[tuple], b: list[tuple]) -> bool:
    """Equal up to float rounding (sums may add in another order), whatever the row order."""
    def key(row):
        return repr(tuple(round(v, 3) + 0.0 if isinstance(v, float) else v for v in row))
    def close(x, y):
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) if isinstance(x, float) else x == y
    return len(a) == len(b) and all(len(x) == len(y) and all(map(close, x, y))
                                    for x, y in zip(sorted(a, key=key), sorted(b, key=key)))


def test_every_report_reads_an_object_store_offline(fixture_results, s3_results):
    """The fixture's results on a real S3 API server: every report returns the rows it returns from
    the disk, and DuckDB never loaded (or downloaded) its network extension to get them."""
    from kvcompress_reports import connect, report_names, run_report
    from kvcompress_reports.regression import compare

    s3, prefix, _ = s3_results
    remote = connect(s3.upload(Path(fixture_results[0]), prefix))
    local = connect(fixture_results[0])
    for name in [n for n in report_names() if n != "regression"]:  # regression reads compare's view: below
        remote_columns, remote_rows = run_report(remote, name)
        local_columns, local_rows = run_report(local, name)
        assert remote_columns == local_columns, name
        assert same_rows(remote_rows, local_rows), name
    assert remote.sql("SELECT * FROM runs").columns == local.sql("SELECT * FROM runs").columns
    assert sorted(remote.sql("SELECT * FROM steps").fetchall()) == sorted(local.sql("SELECT * FROM steps").fetchall())
    regression = [compare(c, "s1", "s2") for c in (remote, local)]
    assert same_rows(*([tuple(r.values()) for r in t.to_pylist()] for t in regression))
    assert remote.sql("SELECT loaded, installed FROM duckdb_extensions() WHERE extension_name = 'httpfs'").fetchall() \
        == [(False, False)]


def test_render_reports_prints_every_report(fixture_results):
    from kvcompress_reports import DEFAULT_REPORTS
    from kvcompress_reports.render import render_reports

    text = render_reports(fixture_results[0])
    titles = re.findall(r"^== (\w+) \((\d+) rows\)$", text, flags=re.M)
    assert [t for t, _ in titles] == list(DEFAULT_REPORTS) == ["leaderboard", "summary", "paired", "evidence", "pareto",
                                                               "degradation", "speed_memory", "throughput",
                                                               "compare_sweeps"]
    assert all(int(n) > 0 for _, n in titles)
    assert "score_ci_low" in text and "decode_ms_p50" in text


def _png_pixels(data: bytes):
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(data), format="png")


CHROMIUM = "/usr/bin/chromium"


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium, offline; --virtual-time-budget lets the page's scripts finish first."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium)")
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=10000", *args],
        check=True, timeout=120, capture_output=True, text=True,
    )


def rendered(tmp_path, page: Path, fragment: str = "") -> tuple[str, dict]:
    """The page's DOM once its scripts ran, and what it says each panel drew (#shown); fails on
    any error the page caught (#errors) or Chromium logged from the page's console."""
    done = chromium(tmp_path, "--dump-dom", page.resolve().as_uri() + fragment)
    dom = done.stdout
    errors = re.search(r'<pre id="errors"[^>]*>(.*?)</pre>', dom, flags=re.S).group(1)
    assert errors == "", errors
    assert not re.search(r"CONSOLE|Uncaught", done.stderr), done.stderr
    assert 'data-status="rendered"' in dom  # report.js ran to its end
    shown = re.search(r'<pre id="shown"[^>]*>(.*?)</pre>', dom, flags=re.S).group(1)
    return dom, json.loads(shown.replace("&quot;", '"').replace("&amp;", "&"))


def embedded_data(text: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text).group(1))


def test_config_family_drops_only_the_budget():
    from kvcompress_reports.html_report import config_family

    assert config_family("snapkv budget=0.25") == config_family("snapkv budget=0.5") == "snapkv"
    assert config_family("keyformer budget=0.5 tau=1.0..2.0 score=proxy protocol=query_agnostic") == \
        "keyformer tau=1.0..2.0 score=proxy protocol=query_agnostic"
    assert config_family("kivi bits=2") != config_family("kivi bits=4")  # bits is not the budget
    assert config_family("snapkv budget=64 window_size=8") != config_family("snapkv budget=64")


def test_html_report_is_self_contained_and_joins_only_families(fixture_results, tmp_path):
    from kvcompress_reports import connect, run_report
    from kvcompress_reports.html_report import write_html

    page = write_html(fixture_results[0], str(tmp_path / "report.html"))
    text = page.read_text()
    # self-contained: plotly.js inlined once, no file, script, style or font fetched at view time
    assert text.count("plotly.js v") == 1 and text.count("<script") == 4
    ours = re.sub(r"<script>/\*\*\n\* plotly\.js v.*?</script>", "", text, flags=re.S)  # all but plotly.js
    assert len(ours) < len(text) - 4_000_000 and not re.search(r"<script[^>]* src=|<link|<img|@import|url\(|https?://", ours)
    assert text.count("<table>") == 10 and "sweep s2" in text  # every report; default: the newest sweep
    data = embedded_data(text)
    assert data["methods"] == ["full", "keyformer", "kivi", "snapkv"] and data["protocols"] == ["query_aware"]
    assert data["tasks"] == ["longbench/qa", "ruler/niah"]
    columns, rows = run_report(connect(fixture_results[0]), "summary")
    summary = {(r["dataset"], r["config_label"]): r for r in (dict(zip(columns, row)) for row in rows)
               if r["sweep_id"] == "s2"}
    assert len(data["leaderboard"]) == len(summary)
    for r in data["leaderboard"]:  # the paired difference, placed at the summary's compression ratio
        cell = summary[(r["dataset"], r["config_label"])]
        assert r["method"] == cell["method"] and r["compression_ratio"] == approx(1 / cell["kv_ratio_to_full"])
        assert r["diff_vs_full_ci_low"] <= r["diff_vs_full"] <= r["diff_vs_full_ci_high"]
    families = group(data["leaderboard"], lambda r: (r["dataset"], r["family"]))
    assert {len(members) for (dataset, family), members in families.items() if family == "snapkv"} == {2}
    assert all(len(members) == 1 for (_, family), members in families.items() if family.startswith("kivi"))
    assert {r["dataset"] for r in data["depth"]} == {"ruler"}


def test_html_report_in_headless_chromium(fixture_results, tmp_path):
    from kvcompress_reports.html_report import write_html

    page = write_html(fixture_results[0], str(tmp_path / "report.html"))
    dom, shown = rendered(tmp_path, page)
    assert shown["filters"] == {"task": "all", "protocol": "query_aware", "methods": ["full", "keyformer", "kivi", "snapkv"],
                                "y": "diff"}
    panels = ["longbench/qa @ 2048 tokens", "ruler/niah @ 1024 tokens"]
    assert list(shown["leaderboard"]) == panels == list(shown["paired"]) == list(shown["evidence"])
    # a line per family: the two snapkv budgets share one, each kivi bits and the keyformer config stand alone
    assert shown["leaderboard"][panels[1]] == ["keyformer tau=1..2", "kivi bits=2", "kivi bits=3", "kivi bits=4",
                                               "snapkv", "full cache"]
    assert shown["paired"][panels[1]][-2:] == ["snapkv budget=0.25", "snapkv budget=0.5"]  # budgets by value
    # one heatmap per needle task, a column per config (it was one heatmap per config and task)
    assert shown["depth"] == {"ruler/niah": sorted({c["config_label"] for c in embedded_data(page.read_text())["depth"]},
                                                   key=lambda label: (label.split()[0], label))}
    assert len(shown["depth"]["ruler/niah"]) == len(CONFIGS) + 1
    # the ranked table: every config of the protocol, in leaderboard.sql's rank order
    ranking = [r for r in embedded_data(page.read_text())["ranking"] if r["protocol"] == "query_aware"]
    assert shown["ranking"] == [r["config_label"] for r in sorted(ranking, key=lambda r: r["rank"])]
    assert len(ranking) == len(CONFIGS) + 1 and ">rank</th>" in dom
    assert dom.count('class="main-svg"') >= 2 * (2 + 2 + len(shown["depth"]) + 2 + 1 + 2)  # plotly drew every panel
    assert 'class="legendtext"' in dom and ">kivi bits=3<" in dom
    assert shown["throughput"] == {"m @ 1024 tokens": ["full", "kivi bits=2", "snapkv budget=0.5"]}

    # the filters: the hash picks a task, methods and the y axis; the DOM shows only those traces
    dom, shown = rendered(tmp_path, page, "#task=ruler/niah&protocol=query_aware&methods=snapkv,full&y=score")
    assert shown["filters"]["task"] == "ruler/niah" and shown["filters"]["y"] == "score"
    assert shown["leaderboard"] == {panels[1]: ["snapkv", "full cache"]}
    assert shown["paired"] == {panels[1]: ["snapkv budget=0.25", "snapkv budget=0.5"]}
    assert shown["throughput"] == {"m @ 1024 tokens": ["full", "snapkv budget=0.5"]}
    assert shown["depth"] == {"ruler/niah": ["full", "snapkv budget=0.25", "snapkv budget=0.5"]}
    assert {label.split()[0] for label in shown["ranking"]} == {"full", "snapkv"}
    assert list(shown["pareto"]) == ["ruler @ 1024 tokens"] and "kivi bits=2" not in shown["degradation"][
        "KL and top-1 agreement vs decode step (all tasks)"]
    legend = set(re.findall(r'class="legendtext"[^>]*>([^<]*)<', dom))
    assert "snapkv" in legend and not any(name.startswith(("kivi", "keyformer")) for name in legend)
    assert '<option value="ruler/niah" selected="">' in dom  # the controls show the hash's choice
    assert '<input type="checkbox" value="kivi">' in dom and '<input type="checkbox" value="snapkv" checked="">' in dom

    # what a person sees at 1400 px: drawn, with dark text and lines
    shot = tmp_path / "shot.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", "--hide-scrollbars", page.resolve().as_uri())
    pixels = _png_pixels(shot.read_bytes())
    assert pixels.shape[:2] == (2000, 1400)
    gray = pixels[..., :3].mean(axis=-1)
    assert gray.var() > 1e-3  # not blank
    assert (gray < 0.5).mean() > 0.005  # text and plot lines drawn in dark ink


# document.documentElement.scrollHeight of the fixture's page at 1400 x 2000 in this Chromium, before
# the heatmaps were combined and the report tables folded (commit 6a65b3b: one heatmap per config
# and task, every report table open)
OLD_PAGE_HEIGHT = 8904
# runs `body` once the page says it rendered, and again after it (the `then` callback); puts what
# `report()` returns in <pre id="probe">
PROBE = """<script>
const settled = next => { const wait = () => document.body.dataset.status === "rendered" ? next() : setTimeout(wait, 50);
                          setTimeout(wait, 50); };
const report = data => { const p = document.createElement("pre"); p.id = "probe";
                         p.textContent = JSON.stringify(data); document.body.append(p); };
window.addEventListener("load", () => settled(() => { %s }));
</script>"""
# 20 filter changes in one tick (every box off, then on, then off again...), then what the page shows
BURST = """
  const boxes = [...document.querySelectorAll("#filters input[type=checkbox]")];
  for (let i = 0; i < 20; i++) {
    const box = boxes[i % boxes.length];
    box.checked = !box.checked;
    box.dispatchEvent(new Event("change"));
  }
  settled(() => report({checked: boxes.filter(b => b.checked).map(b => b.value)}));
"""


def probed(tmp_path, page: Path, body: str, name: str) -> Path:
    out = tmp_path / name
    out.write_text(page.read_text().replace("</body></html>", PROBE % body + "</body></html>"))
    return out


def test_html_report_survives_a_burst_of_filter_changes_and_is_half_as_tall(fixture_results, tmp_path):
    """Issue 50 (4): 20 filter changes in one tick made plotly.js reject ('_redrawFromAutoMarginCount')
    into a wall of errors. The page now draws once per animation frame, after the previous drawing's
    plots settled: no error, the final filters drawn. And the page is less than half as tall."""
    from kvcompress_reports.html_report import write_html

    page = write_html(fixture_results[0], str(tmp_path / "report.html"))
    dom, shown = rendered(tmp_path, probed(tmp_path, page, BURST, "burst.html"))  # no error caught or logged
    probe = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom).group(1))
    # 20 toggles of 4 boxes: each box flipped 5 times, so every method is off; the views say so
    assert probe["checked"] == [] and shown["filters"]["methods"] == [] and shown["ranking"] == []
    assert shown["leaderboard"] == {} and shown["depth"] == {}

    height = probed(tmp_path, page, "report({height: document.documentElement.scrollHeight});", "height.html")
    done = chromium(tmp_path, "--window-size=1400,2000", "--dump-dom", height.resolve().as_uri())
    measured = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', done.stdout).group(1))["height"]
    assert 2000 < measured < OLD_PAGE_HEIGHT / 2


def test_html_report_shows_script_errors_on_the_page(tmp_path):
    """The page's error channel works: a script that throws lands in #errors (so the test above,
    which asserts #errors is empty, would see a broken report)."""
    from kvcompress_reports.html_report import CATCH_ERRORS

    page = tmp_path / "broken.html"
    page.write_text(f'<!DOCTYPE html><html><body><pre id="errors" hidden></pre><script>{CATCH_ERRORS}</script>'
                    "<script>console.error('drawn badly'); undefinedFunction();</script></body></html>")
    dom = chromium(tmp_path, "--dump-dom", page.resolve().as_uri()).stdout
    errors = re.search(r'<pre id="errors"[^>]*>(.*?)</pre>', dom, flags=re.S).group(1)
    assert "drawn badly" in errors and "undefinedFunction is not defined" in errors


def test_publish_artifacts_to_a_real_prefect_server(fixture_results):
    from prefect import flow
    from prefect.artifacts import Artifact
    from prefect.testing.utilities import prefect_test_harness

    from kvcompress_tasks.report import publish_artifacts

    @flow
    def publish(results: str, sweep_id: str) -> dict[str, str]:
        return publish_artifacts(results, sweep_id)

    with prefect_test_harness(server_startup_timeout=60):
        keys = publish(fixture_results[0], "s2")
        assert keys == {name: f"sweep-s2-{name.replace('_', '-')}" for name in
                        ["leaderboard", "summary", "paired", "evidence", "pareto", "degradation", "speed_memory",
                         "compare_sweeps"]}
        stored = {name: Artifact.get(key) for name, key in keys.items()}
    summary = stored["summary"]
    assert summary.type == "table"
    table = json.loads(summary.data) if isinstance(summary.data, str) else summary.data
    assert len(table) == len(CONFIGS) * len(CELLS) + len(CELLS)  # s2 only, with its extra kivi bits=3
    assert {row["sweep_id"] for row in table} == {"s2"}
    for name in ["pareto", "degradation", "speed_memory", "compare_sweeps"]:
        assert stored[name].type == "markdown"
        assert stored[name].data.startswith(f"### {name}\n\n| ")
    assert "| s1 | s2 |" in stored["compare_sweeps"].data  # s2 set against the sweep before it


def test_write_html_names_the_bad_sweep_or_empty_root(fixture_results, tmp_path):
    from kvcompress.errors import ConfigError
    from kvcompress_reports.html_report import write_html

    with pytest.raises(ConfigError, match=r"sweep_id: expected one of \['s2', 's1'\], got 'nope'"):
        write_html(fixture_results[0], str(tmp_path / "r.html"), sweep_id="nope")
    with pytest.raises(ConfigError, match="results: no runs under .*: run `kvcompress sweep` first"):
        write_html(str(tmp_path / "empty"), str(tmp_path / "r.html"))
    assert not (tmp_path / "r.html").exists()


def test_html_report_handles_configs_tied_on_compression_ratio(tmp_path):
    """Two keyformer tau schedules at the same budget share a ratio (the default sweep has them)."""
    from kvcompress.results import write_run as write
    from kvcompress_reports.html_report import write_html as html
    from tests.test_results import make_run, make_steps

    root = str(tmp_path / "results")
    for rid, tau_end in (("k1", 1.0), ("k2", 2.0)):
        write(root, "tie", "keyformer", make_run(rid, "keyformer", 1.0, 500, budget=0.5, tau_init=1.0, tau_end=tau_end),
              make_steps(rid, [0.1, 0.2], [True, True]))
    write(root, "tie", "full", make_run("f", "full", 1.0, 1000), make_steps("f", [0.0, 0.0], [True, True]))
    data = embedded_data(html(root, str(tmp_path / "report.html")).read_text())
    tied = [r for r in data["leaderboard"] if r["method"] == "keyformer"]
    assert [r["compression_ratio"] for r in tied] == [2.0, 2.0]  # same ratio, two families: never one line
    assert sorted(r["family"] for r in tied) == ["keyformer tau=1..1", "keyformer tau=1..2"]


def test_paired_report_matches_the_summary_and_names_unresolved_differences(fixture_results):
    from kvcompress_reports import connect, run_report

    con = connect(fixture_results[0])
    columns, rows = run_report(con, "paired")
    paired = [dict(zip(columns, r)) for r in rows]
    s_columns, s_rows = run_report(con, "summary")
    summary = {(r["sweep_id"], r["dataset"], r["task"], r["context_tokens"], r["config_label"]): r
               for r in (dict(zip(s_columns, row)) for row in s_rows)}
    assert paired and len(paired) == len(summary)
    for p in paired:
        s = summary[(p["sweep_id"], p["dataset"], p["task"], p["context_tokens"], p["config_label"])]
        assert p["n"] == s["runs"] and p["score_mean"] == pytest.approx(s["score_mean"])
        assert p["diff_vs_full"] == pytest.approx(s["score_vs_full"])
        assert p["diff_vs_full_ci_low"] <= p["diff_vs_full"] <= p["diff_vs_full_ci_high"]
        unresolved = p["diff_vs_full_ci_low"] <= 0 <= p["diff_vs_full_ci_high"] or (
            p["mcnemar_p_vs_full"] is not None and p["mcnemar_p_vs_full"] >= 0.05)
        assert (p["vs_full"] == "not distinguishable") == unresolved
        assert p["n_baseline"] == 0 and p["vs_baseline"] is None  # no baseline set
    assert any(p["vs_full"] == "not distinguishable" for p in paired if p["config_label"] != "full")
    with_baseline = connect(fixture_results[0], baseline="full")
    columns, rows = run_report(with_baseline, "paired")
    for p in (dict(zip(columns, r)) for r in rows):
        assert p["n_baseline"] == p["n"] and p["diff_vs_baseline"] == pytest.approx(p["diff_vs_full"])


def test_evidence_report_splits_scores_by_evidence_kept(fixture_results):
    from kvcompress_reports import connect, run_report

    columns, rows = run_report(connect(fixture_results[0]), "evidence")
    records = [dict(zip(columns, r)) for r in rows]
    assert records
    for r in records:
        if r["evidence_kept_when_correct"] is not None:
            assert r["evidence_kept_when_correct"] == 1.0
        if r["evidence_kept_when_wrong"] is not None and r["config_label"] != "full":
            assert r["evidence_kept_when_wrong"] == 0.5
        assert r["runs_all_kept"] + r["runs_some_lost"] == r["runs"]
        if r["runs_some_lost"] and r["config_label"] != "full":
            assert r["score_when_some_lost"] < 1.0


def test_report_fits_one_screen_and_points_to_the_rest(fixture_results, tmp_path):
    """`kvcompress report`: the newest sweep's summary and Pareto front in <= 120 columns and one
    screen, the HTML report's path, and how to get every other report."""
    from kvcompress_reports import connect, run_report
    from tests.test_cli import kvcompress

    root, runs, _ = fixture_results
    done = kvcompress("report", "--results", root, "--html", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 50 and max(len(line) for line in lines) <= 120, done.stdout
    assert lines[0].startswith("Sweep s2") and "◆ Pareto front of score vs KV bytes" in lines[0]
    # the Pareto front (pareto.sql's on_front) is marked on its configs' rows
    front = {line[2:].split("  ")[0] for line in lines if line.startswith("◆ ")}
    con = connect(root)
    columns, rows = run_report(con, "pareto")
    expected = {r[columns.index("config_label")] for r in rows
                if r[columns.index("sweep_id")] == "s2" and r[columns.index("on_front")]}
    assert front == expected and "kivi bits=2" in front
    assert f"HTML report (interactive): {tmp_path / 'r.html'}" in done.stdout
    assert (tmp_path / "r.html").exists() and "--all" in lines[-2] and "s1" in lines[-1]
    # one row per config x task of s2, scores as in the runs
    s2 = [r for r in runs if r["sweep_id"] == "s2" and r["status"] == "ok"]
    full_niah = [r["score"] for r in s2 if r["method"] == "full" and r["task"] == "niah"]
    row = next(line for line in lines if line[2:].split()[:2] == ["full", "niah"])
    assert f"{sum(full_niah) / len(full_niah):.2f} (" in row
    configs = {(r["method"], r["budget"], r["bits"], r["tau_init"], r["task"]) for r in s2}
    main = lines[:next(i for i, line in enumerate(lines) if line.startswith("Leaderboard:"))]  # then the ranked table
    assert sum(line[2:].split()[:1] in (["full"], ["kivi"], ["snapkv"], ["keyformer"]) for line in main) == len(configs)


def test_report_formats_for_scripts(fixture_results):
    import csv
    import io
    import json

    from tests.test_cli import kvcompress

    root = fixture_results[0]
    done = kvcompress("report", "--results", root, "--report", "summary", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert done.returncode == 0 and len(rows) == 26 and {"config_label", "score_ci_low"} <= set(rows[0])
    done = kvcompress("report", "--results", root, "--format", "json", "--sweep", "s1")
    data = json.loads(done.stdout)
    assert set(data) == {"summary", "pareto"} and {r["sweep_id"] for r in data["summary"]} == {"s1"}
    done = kvcompress("report", "--results", root, "--format", "markdown", "--report", "pareto")
    assert done.stdout.startswith("### pareto\n\n| sweep_id | dataset |")
    done = kvcompress("report", "--results", root, "--all", "--no-html")
    titles = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert titles == ["leaderboard", "summary", "paired", "evidence", "pareto", "degradation", "speed_memory", "throughput",
                      "compare_sweeps"]


def test_summary_and_screen_show_each_configs_kernel_paths(tmp_path):
    """config.kernels (dispatch.paths_used(), as the runner records it) becomes summary's `kernels`
    column and a footnote on the one-screen report; a config run on two machines lists both paths."""
    from kvcompress.results import write_run
    from kvcompress_reports import connect, run_report
    from kvcompress_reports.render import screen, to_text
    from tests.test_results import make_run, make_steps

    root = str(tmp_path / "results")
    cpu = {"kivi_decode_attention/cpu/float32": "fused", "kivi_quantize_pack/cpu/float32": "reference"}
    gpu = {"kivi_decode_attention/cuda/float16": "fused", "kivi_quantize_pack/cuda/float16": "fused"}
    runs = [("f0", "full", "full", None), ("k0", "kivi", "kivi bits=2", cpu), ("k1", "kivi", "kivi bits=2", gpu),
            ("k2", "kivi", "kivi bits=2", cpu), ("old", "snapkv", "snapkv budget=0.5", None)]
    for rid, method, label, kernels in runs:
        config = json.dumps({"method": {"name": method}, **({"kernels": kernels} if kernels is not None else {})})
        if rid == "f0":
            config = json.dumps({"kernels": {}})  # no kernel ran
        run = make_run(rid, method, 1.0, 500, config=config, config_label=label, sample_id=rid[-1])
        write_run(root, "k", method, run, make_steps(rid, [0.1], [True]))
    columns, rows = run_report(connect(root), "summary")
    kernels = {r[columns.index("config_label")]: r[columns.index("kernels")] for r in rows}
    assert kernels == {
        "full": None, "snapkv budget=0.5": None,
        "kivi bits=2": "kivi_decode_attention/cpu/float32 fused, kivi_quantize_pack/cpu/float32 reference | "
                       "kivi_decode_attention/cuda/float16 fused, kivi_quantize_pack/cuda/float16 fused"}
    text = to_text(*screen(connect(root), "k"))
    assert text.endswith("kernels (path per config, from config.kernels; a line per set of paths):\n"
                         "  kivi bits=2: kivi_decode_attention/cpu/float32 fused, kivi_quantize_pack/cpu/float32 reference\n"
                         "  kivi bits=2: kivi_decode_attention/cuda/float16 fused, kivi_quantize_pack/cuda/float16 fused")


def test_a_quantizer_that_quantized_nothing_is_labelled_and_off_the_front(tmp_path):
    """Issue 48, item 5: SnapKV 25% + KIVI with a 128-token residual on a 512-token prompt keeps 96
    tokens, all in full precision: the eviction's score in a few bytes less. The reports say so and keep
    it off the front (it would push SnapKV alone off); results written before runs.quantized_tokens
    read it as NULL."""
    import pyarrow as pa

    from kvcompress.results import RUNS_SCHEMA, write_table
    from kvcompress_reports import connect, run_report
    from tests.test_results import make_run

    root = str(tmp_path / "results")
    label_nothing, label_quantized = "snapkv budget=0.25 + kivi bits=4 residual=128", "snapkv budget=0.25 + kivi bits=4"
    cells = [  # (method, config_label, budget, bits, score, live bytes, quantized_tokens)
        ("full", "full", None, None, 1.0, 4000, None),
        ("snapkv", "snapkv budget=0.25", 0.25, None, 0.5, 1000, None),
        ("snapkv", label_nothing, 0.25, 4.0, 0.5, 999, 0),
        ("snapkv", label_quantized, 0.25, 4.0, 0.4, 400, 64),
    ]
    for i, (method, label, budget, bits, score, live, quantized) in enumerate(cells):
        for sample in ("s0", "s1"):
            run = make_run(f"r{i}{sample}", method, score, live, full=4000, sample_id=sample, budget=budget, bits=bits,
                           config_label=label, quantized_tokens=quantized)
            write_run(root, "new", method, run, [], [])
    old_schema = pa.schema([f for f in RUNS_SCHEMA if f.name != "quantized_tokens"])
    old = make_run("old", "kivi", 0.5, 500, config_label="kivi bits=2", bits=2.0)
    write_table(root, "runs/sweep_id=old/method=kivi", "old",
                pa.Table.from_pylist([{k: v for k, v in old.items() if k in old_schema.names}], schema=old_schema))

    con = connect(root)
    columns, rows = run_report(con, "pareto")
    front = {r["config_label"]: r for r in (dict(zip(columns, row)) for row in rows) if r["sweep_id"] == "new"}
    assert front[label_nothing]["on_front"] is False and front[label_nothing]["note"] == "quantizes nothing"
    assert front["snapkv budget=0.25"]["on_front"] is True  # not dominated by its own points in more bytes
    assert front[label_quantized]["on_front"] is True and front[label_quantized]["note"] is None
    assert [r for r in front.values() if r["on_front"]] == [front[label_quantized], front["snapkv budget=0.25"],
                                                          front["full"]]
    columns, rows = run_report(con, "summary")
    summary = {(r["sweep_id"], r["config_label"]): r["quantizes_nothing"] for r in (dict(zip(columns, row)) for row in rows)}
    assert summary == {("new", "full"): None, ("new", "snapkv budget=0.25"): None, ("new", label_nothing): True,
                       ("new", label_quantized): False, ("old", "kivi bits=2"): None}

    # a root of older results only: no file has the column
    old_root = str(tmp_path / "old")
    write_table(old_root, "runs/sweep_id=old/method=kivi", "old",
                pa.Table.from_pylist([{k: v for k, v in old.items() if k in old_schema.names}], schema=old_schema))
    con = connect(old_root)
    for report in ("summary", "pareto"):
        columns, rows = run_report(con, report)
        assert len(rows) == 1 and dict(zip(columns, rows[0]))["config_label"] == "kivi bits=2", report
    assert con.execute("SELECT quantized_tokens FROM runs").fetchall() == [(None,)]
