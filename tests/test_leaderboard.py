"""benchmarks/leaderboard.py: the statistics against plain references, and the page from real Parquet
written by kvcompress.results and read through the DuckDB views."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcompress.results import write_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import leaderboard  # noqa: E402


def test_holm_matches_its_definition():
    p = [0.01, 0.04, 0.03, 0.005, 0.5]
    # sorted: 0.005*5, 0.01*4, 0.03*3, 0.04*2, 0.5*1, each the running maximum
    expected = {3: 0.025, 0: 0.04, 2: 0.09, 1: 0.09, 4: 0.5}
    assert leaderboard.holm(p) == pytest.approx([expected[i] for i in range(5)])
    assert leaderboard.holm([0.9, 0.8]) == [1.0, 1.0]


def test_spearman_against_pearson_of_ranks_with_ties():
    xs, ys = [1.0, 2.0, 2.0, 5.0, 3.0], [10.0, 30.0, 20.0, 50.0, 40.0]
    # average ranks: xs -> 0, 1.5, 1.5, 4, 3; ys -> 0, 2, 1, 4, 3
    a, b = np.array([0, 1.5, 1.5, 4, 3]), np.array([0, 2, 1, 4, 3])
    assert leaderboard.spearman(xs, ys) == pytest.approx(np.corrcoef(a, b)[0, 1])
    assert leaderboard.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(leaderboard.spearman([1, 1, 1], [1, 2, 3]))


def _row(task_diffs: dict[str, list[float]]) -> leaderboard.Row:
    scores = {t: [(str(i), 1.0 + d, 1.0) for i, d in enumerate(ds)] for t, ds in task_diffs.items()}
    return leaderboard.Row("x", "x", 2.0, scores, 0.5)


def test_stratified_difference_and_its_interval():
    rng = np.random.default_rng(1)
    diffs = {"a": list(rng.choice([0.0, -1.0], size=25, p=[0.4, 0.6])), "b": list(rng.choice([0.0, -1.0], size=20))}
    mean, low, high, p = leaderboard.stratified_diff(_row(diffs), ["a", "b"])
    assert mean == pytest.approx((np.mean(diffs["a"]) + np.mean(diffs["b"])) / 2)
    assert low < mean < high < 0  # clearly worse: the interval excludes 0 and the p-value is small
    assert p < 0.01
    # no difference anywhere: the interval is the point 0 and p = 1
    assert leaderboard.stratified_diff(_row({"a": [0.0] * 10}), ["a"]) == (0.0, 0.0, 0.0, 1.0)
    # a symmetric difference: not distinguishable
    assert leaderboard.stratified_diff(_row({"a": [1.0, -1.0] * 10}), ["a"])[3] > 0.5


def _write(root: Path, config: str, method: str, budget, task: str, sample: int, score: float, kv: int):
    run = {"run_id": f"{config}-{task}-{sample}".replace(" ", "_").replace("=", ""), "model": "m", "dataset": "ruler",
           "task": task, "sample_id": str(sample), "protocol": "query_agnostic", "context_tokens": 4096,
           "budget": budget, "score": score, "status": "ok", "live_kv_bytes": kv, "full_kv_bytes": 1000,
           "config_label": config}
    write_run(str(root), leaderboard.SWEEP, method, run, [])


def test_page_from_real_results(tmp_path):
    tasks = ["niah_single_2", "vt"]
    for task, sample in itertools.product(tasks, range(12)):
        _write(tmp_path, "full", "full", None, task, sample, 1.0, 1000)
        _write(tmp_path, "kvzip budget=0.5", "kvzip", 0.5, task, sample, 1.0, 500)  # lossless here
        _write(tmp_path, "snapkv budget=0.25", "snapkv", 0.25, task, sample, float(sample % 4 == 0), 250)
    _write(tmp_path, "knorm budget=0.5", "knorm", 0.5, "vt", 0, 1.0, 500)  # one task only: no average
    out = tmp_path / "leaderboard.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "leaderboard.py"), "--results", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    lines = {line.split(" | ")[0].strip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert "| full | 1x | 1.00 | 1.000 |" in page
    kvzip, snapkv = lines["kvzip budget=0.5"], lines["snapkv budget=0.25"]
    assert " 2x | 0.500 | 1.000 | +0.000 [+0.000, +0.000] | 1 | n.d. |" in kvzip
    assert "95.5" in kvzip  # kvpress's published KVzip 2x (Llama-3.1-8B), beside ours
    assert " 4x | 0.250 | 0.250 | -0.750 [" in snapkv and snapkv.split(" | ")[6] == "W"
    assert "(n=12)" in snapkv
    assert "not every task measured" in lines["knorm budget=0.5"]
    # the check mode: equal now, different after an edit
    check = [sys.executable, str(ROOT / "benchmarks" / "leaderboard.py"), "--results", str(tmp_path), "--out", str(out),
             "--check"]
    assert subprocess.run(check, capture_output=True, cwd=ROOT).returncode == 0
    out.write_text(page.replace("1.000", "0.999", 1))
    assert subprocess.run(check, capture_output=True, cwd=ROOT).returncode == 1


def test_the_committed_page_is_what_the_archives_give():
    # docs/leaderboard.md is never edited by hand: regenerating it from benchmarks/results changes nothing
    archives = sorted((ROOT / "benchmarks" / "results").glob("leaderboard-*.tar.xz"))
    assert archives, "benchmarks/results holds no leaderboard archive for docs/leaderboard.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "leaderboard.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
