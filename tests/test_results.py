"""Parquet results: atomic per-run files, resume bookkeeping, concurrent writers, DuckDB views."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvcompress.errors import ConfigError
from kvcompress.results import (RUNS_SCHEMA, STEPS_SCHEMA, configs_without_ok_run, finished_run_ids, quarantine,
                                run_id, scan, validate_sweep_id, write_run, write_table)
from kvcompress_reports import connect, run_report


def make_run(rid: str, method: str, score: float, live: int, full: int = 1000, **extra) -> dict:
    row = {name: None for name in RUNS_SCHEMA.names}
    row.update(run_id=rid, model="m", dataset="passkey", task="passkey", sample_id="s0", context_tokens=512,
               prompt_tokens=510, score=score, status="ok", live_kv_bytes=live, full_kv_bytes=full,
               decode_tok_s=10.0, config="{}", created_at=datetime.now(timezone.utc))
    row.update(extra)
    return row


def make_steps(rid: str, kls: list[float], agree: list[bool]) -> list[dict]:
    return [
        {"run_id": rid, "step": i, "position": 510 + i, "ref_token": 1, "token": 1 if a else 2, "top1_agree": a,
         "kl": kl, "logit_cosine": 1.0, "nll": 0.5, "tokens_kept": 100, "live_kv_bytes": 10, "step_ms": 5.0}
        for i, (kl, a) in enumerate(zip(kls, agree))
    ]


def test_run_id_is_stable_and_order_free():
    assert run_id({"a": 1, "b": [1, 2]}) == run_id({"b": [1, 2], "a": 1})
    assert run_id({"a": 1}) != run_id({"a": 2})
    assert len(run_id({})) == 16


def test_configs_without_an_ok_run_are_named_with_an_error(tmp_path):
    root = str(tmp_path)
    rows = [("a", "full", "full", "ok", None), ("b", "kivi", "kivi bits=2", "error", "kernel failed"),
            ("c", "kivi", "kivi bits=2", "timeout", "run_timeout_s"), ("d", "h2o", "h2o budget=0.5", "error", "x"),
            ("e", "h2o", "h2o budget=0.5", "ok", None)]
    for rid, method, label, status, error in rows:
        write_run(root, "sw", method, make_run(rid, method, 1.0, 10, config_label=label, status=status, error=error), [])
    write_run(root, "other", "kivi", make_run("f", "kivi", 1.0, 10, config_label="kivi bits=2"), [])  # another sweep
    broken = configs_without_ok_run(root, "sw")
    assert list(broken) == ["kivi bits=2"] and broken["kivi bits=2"] in ("error: kernel failed", "timeout: run_timeout_s")
    assert configs_without_ok_run(root, "other") == {}


def test_write_run_is_partitioned_atomic_and_typed(tmp_path):
    root = str(tmp_path)
    write_run(root, "sw", "streaming", make_run("r1", "streaming", 1.0, 500, budget=0.5), make_steps("r1", [0.1], [True]))
    runs_file = tmp_path / "runs" / "sweep_id=sw" / "method=streaming" / "r1.parquet"
    steps_file = tmp_path / "steps" / "sweep_id=sw" / "method=streaming" / "r1.parquet"
    assert runs_file.exists() and steps_file.exists()
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # no temp files left
    assert pq.read_schema(runs_file).equals(RUNS_SCHEMA, check_metadata=False)
    assert pq.read_schema(steps_file).equals(STEPS_SCHEMA, check_metadata=False)
    assert finished_run_ids(root, "sw") == {"r1"}
    assert finished_run_ids(root, "other") == set()


def test_summary_report_aggregates_match_python(tmp_path):
    root = str(tmp_path)
    cells = {  # run id -> (method, budget, score, live bytes, per-step KL, per-step agreement)
        "a": ("full", None, 1.0, 1000, [0.0, 0.0], [True, True]),
        "b": ("streaming", 0.5, 1.0, 500, [0.2, 0.4], [True, False]),
        "c": ("streaming", 0.5, 0.0, 520, [0.6, 0.8], [False, False]),
    }
    for rid, (method, budget, score, live, kls, agree) in cells.items():
        write_run(root, "sw", method, make_run(rid, method, score, live, budget=budget, sample_id=rid),
                  make_steps(rid, kls, agree))
    write_run(root, "sw", "streaming", make_run("d", "streaming", 0.0, 1, budget=0.5, status="error"), [])
    columns, rows = run_report(connect(root), "summary")
    got = {(r[columns.index("method")]): dict(zip(columns, r)) for r in rows}
    stream = got["streaming"]
    assert stream["runs"] == 2  # the error run is excluded
    assert stream["score_mean"] == 0.5
    assert math.isclose(stream["kl_mean"], (0.3 + 0.7) / 2)
    assert math.isclose(stream["top1_agree"], 0.25)
    assert stream["live_kv_bytes"] == 510
    assert math.isclose(stream["kv_ratio_to_full"], 0.51)
    assert got["full"]["kl_mean"] == 0.0 and got["full"]["kv_ratio_to_full"] == 1.0


def _writer(root: str, sweep: str, count: int) -> None:
    for i in range(count):
        rid = f"{sweep}-{i}"
        write_run(root, sweep, "full", make_run(rid, "full", 1.0, 1000), make_steps(rid, [0.0] * 3, [True] * 3))
        write_run(root, "shared", "full", make_run(f"same-{i}", "full", 1.0, 1000), make_steps(f"same-{i}", [0.0], [True]))


def test_two_concurrent_sweeps_lose_nothing(tmp_path):
    root = str(tmp_path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(root, s, 25)) for s in ("x", "y")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    con = connect(root)
    counts = dict(con.sql("SELECT sweep_id, count(*) FROM runs GROUP BY ALL").fetchall())
    assert counts == {"x": 25, "y": 25, "shared": 25}  # same run written twice: still exactly once
    assert con.execute("SELECT count(*) FROM steps WHERE sweep_id = 'x'").fetchall()[0][0] == 75
    assert not [p for p in tmp_path.rglob("*.tmp")]


HOSTILE_SWEEP_IDS = ["../../../../ESCAPED", "..", "a/b", "lr=0.1", "budget=0.5", "<script>alert(1)</script>", "",
                     ".hidden", "x" * 129, "a..b", "tab\there"]


@pytest.mark.parametrize("name", HOSTILE_SWEEP_IDS)
def test_hostile_sweep_ids_are_refused_and_nothing_is_written(tmp_path, name):
    root = tmp_path / "results"
    with pytest.raises(ConfigError, match=r"sweep_id: expected 1-128 characters of \[A-Za-z0-9._-\]"):
        validate_sweep_id(name)
    with pytest.raises(ConfigError, match="sweep_id"):
        write_run(str(root), name, "full", make_run("r1", "full", 1.0, 1000), make_steps("r1", [0.0], [True]))
    assert not list(tmp_path.rglob("*"))  # nothing inside the root, nothing beside it


def test_valid_sweep_ids_pass():
    for name in ["default", "nightly-20261130-020000", "a.b_c-1", "x" * 128]:
        assert validate_sweep_id(name) == name


def test_writer_refuses_a_path_outside_the_root(tmp_path):
    table = pa.Table.from_pylist(make_steps("r1", [0.0], [True]), schema=STEPS_SCHEMA)
    with pytest.raises(ConfigError, match="outside the results root"):
        write_table(str(tmp_path / "results"), "../elsewhere", "r1", table)
    with pytest.raises(ConfigError, match="outside the results root"):
        write_table(str(tmp_path / "results"), "steps", "../../r1", table)
    assert not list(tmp_path.rglob("*.parquet"))


def _broken_results(tmp_path):
    """Five runs of sweep `sw`: one whole, a truncated runs file, a truncated steps file, a steps
    file with fewer rows than its run wrote, a truncated evidence file; plus a stray text file
    named *.parquet."""
    root = tmp_path / "results"
    for rid in ("good", "cut-runs", "cut-steps", "short-steps", "cut-evidence"):
        write_run(str(root), "sw", "full", make_run(rid, "full", 1.0, 1000), make_steps(rid, [0.0] * 3, [True] * 3))
    part = ("sweep_id=sw", "method=full")
    runs, steps = root.joinpath("runs", *part), root.joinpath("steps", *part)
    for path in (runs / "cut-runs.parquet", steps / "cut-steps.parquet",
                 root.joinpath("evidence", *part, "cut-evidence.parquet")):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a write killed half-way
    pq.write_table(pa.Table.from_pylist(make_steps("short-steps", [0.0], [True]), schema=STEPS_SCHEMA),
                   steps / "short-steps.parquet")
    (runs / "notes.parquet").write_text("not parquet at all")
    return root, runs, steps


def test_resume_trusts_only_runs_whose_files_read_back_whole(tmp_path):
    root, _, _ = _broken_results(tmp_path)
    assert finished_run_ids(str(root), "sw") == {"good"}  # the others are rerun


def test_reports_skip_unreadable_files_with_one_warning_each(tmp_path):
    root, runs, steps = _broken_results(tmp_path)
    with pytest.warns(UserWarning) as caught:
        con = connect(str(root))
    warned = sorted(str(w.message).split(":")[0] for w in caught)
    evidence = root / "evidence" / "sweep_id=sw" / "method=full" / "cut-evidence.parquet"
    assert warned == sorted(f"skipping {p}" for p in (runs / "cut-runs.parquet", runs / "notes.parquet",
                                                      steps / "cut-steps.parquet", evidence))
    assert sorted(r[0] for r in con.execute("SELECT run_id FROM runs").fetchall()) == \
        ["cut-evidence", "cut-steps", "good", "short-steps"]
    columns, rows = run_report(con, "summary")
    assert rows  # the reports still run


def test_scan_lists_broken_files_and_quarantine_moves_them_aside(tmp_path):
    root, runs, steps = _broken_results(tmp_path)
    problems = {p.path: p.reason for p in scan(str(root))}
    assert problems == {
        str(runs / "cut-runs.parquet"): "runs file is not readable Parquet with one row",
        str(runs / "cut-steps.parquet"): "its steps file is missing or not readable Parquet",
        str(runs / "short-steps.parquet"): "steps file holds 1 rows, the run wrote 3",
        str(runs / "notes.parquet"): "runs file is not readable Parquet with one row",
        str(steps / "cut-steps.parquet"): "not readable Parquet",
        str(runs / "cut-evidence.parquet"): "its evidence file is not readable Parquet",
        str(root / "evidence" / "sweep_id=sw" / "method=full" / "cut-evidence.parquet"): "not readable Parquet",
    }
    moved = quarantine(str(root), scan(str(root)))  # each broken run with its steps and evidence files
    assert len(moved) == 13 and all("/_quarantine/" in m for m in moved)
    assert scan(str(root)) == [] and finished_run_ids(str(root), "sw") == {"good"}
    for table in ("runs", "steps", "evidence"):
        assert sorted(p.name for p in (root / table).rglob("*.parquet")) == ["good.parquet"]
    write_run(str(root), "sw", "full", make_run("cut-runs", "full", 1.0, 1000), make_steps("cut-runs", [0.0] * 3, [True] * 3))
    assert finished_run_ids(str(root), "sw") == {"good", "cut-runs"}


def test_stale_temp_files_of_dead_writers_are_listed_and_removed_by_the_next_write(tmp_path):
    root = tmp_path / "results"
    write_run(str(root), "sw", "full", make_run("r1", "full", 1.0, 1000), make_steps("r1", [0.0], [True]))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
    directory = root / "runs" / "sweep_id=sw" / "method=full"
    stale = directory / f".r2.{host}.{dead.pid}.{'0' * 32}.tmp"
    live = directory / f".r2.{host}.{os.getpid()}.{'1' * 32}.tmp"  # a writer still at work
    stale.write_bytes(b"")
    live.write_bytes(b"")
    assert [p.path for p in scan(str(root))] == [str(stale)]
    write_run(str(root), "sw", "full", make_run("r2", "full", 1.0, 1000), make_steps("r2", [0.0], [True]))
    assert not stale.exists() and live.exists()


KILL_WRITER = """
import sys
from tests.test_results import make_run, make_steps
from kvcompress.results import write_run
for i in range(100000):
    rid = f"r{i}"
    write_run(sys.argv[1], "sw", "full", make_run(rid, "full", 1.0, 1000), make_steps(rid, [0.0] * 50, [True] * 50))
"""


def test_kill_9_during_writes_leaves_only_whole_runs(tmp_path):
    root = tmp_path / "results"
    writer = subprocess.Popen([sys.executable, "-c", KILL_WRITER, str(root)], cwd=Path(__file__).parent.parent)
    deadline = time.monotonic() + 300
    while len(list(root.glob("runs/**/*.parquet"))) < 20:
        assert writer.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    writer.kill()
    writer.wait()
    finished = finished_run_ids(str(root), "sw")
    assert len(finished) >= 20
    for rid in finished:  # whole: one row, and every step row
        part = root / "steps" / "sweep_id=sw" / "method=full" / f"{rid}.parquet"
        assert pq.read_metadata(part).num_rows == 50
    assert all(p.reason.startswith("stale temporary") for p in scan(str(root)))
    assert connect(str(root)).execute("SELECT count(*) FROM runs").fetchall()[0][0] >= len(finished)


def test_object_store_writes_are_single_puts_and_broken_runs_are_found_and_moved_there(s3_results, tmp_path):
    """On S3 each file is one PUT of the whole file: the versioned bucket, which keeps every object
    ever written, holds no temporary object and no directory marker. Resume, `scan` and `quarantine`
    work there as on a disk."""
    s3, prefix, url = s3_results
    write_run(url, "sw", "full", make_run("r1", "full", 1.0, 1000), make_steps("r1", [0.0] * 3, [True] * 3))
    written = [f"{prefix}/{t}/sweep_id=sw/method=full/r1.parquet" for t in ("evidence", "runs", "steps")]
    assert s3.keys(prefix, versions=True) == written
    assert finished_run_ids(url, "sw") == {"r1"} and scan(url) == []

    local, _, _ = _broken_results(tmp_path)
    broken = s3.upload(local, f"{prefix}-broken")
    problems = {p.path.split("/", 1)[1]: p.reason for p in scan(broken)}  # bucket/key: the key relative to the bucket
    assert problems == {f"{prefix}-broken/{p.relative_to(local)}": reason
                        for p, reason in ((Path(p), r) for p, r in ((q.path, q.reason) for q in scan(str(local))))}
    moved = quarantine(broken, scan(broken))
    assert len(moved) == 13 and all("/_quarantine/" in m for m in moved)
    assert scan(broken) == [] and finished_run_ids(broken, "sw") == {"good"}
