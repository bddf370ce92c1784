"""A results tree or a grid file from someone else (a shared bucket, a colleague's YAML) cannot make a
command write outside its root, count a foreign file as a run, crash a report, exhaust memory, or
leave a half-written report; a storage failure is one line (issue 49). Each test is one attack or
fault, against the real parts: DuckDB over hive partitions, a real S3 API (moto), real processes."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvcompress.errors import ConfigError
from kvcompress.results import RUNS_SCHEMA, finished_run_ids, scan, write_run
from kvcompress_reports import connect, run_report
from tests.test_cli import kvcompress, one_line_error
from tests.test_results import make_run, make_steps
from s3_server import moto_server

PART = ("sweep_id=sw", "method=full")


def _results(root: Path, *run_ids: str, sweep: str = "sw") -> Path:
    for rid in run_ids:
        write_run(str(root), sweep, "full", make_run(rid, "full", 1.0, 1000, config_label="full"),
                  make_steps(rid, [0.0] * 2, [True] * 2))
    return root


def _rename_sweep(root: Path, sweep: str, hostile: str) -> None:
    """What an attacker with write access to a shared bucket does: a real run under a hostile directory name."""
    for table in ("runs", "steps", "evidence"):
        source = root / table / f"sweep_id={sweep}"
        if source.exists():
            source.rename(root / table / f"sweep_id={hostile}")


@pytest.mark.parametrize("hostile", ["ABSOLUTE", "..%2F..%2Fclimbed", "..%2F..", "%2E%2E"])
def test_hostile_partition_names_cannot_move_a_report_outside_the_root(tmp_path, hostile):
    root = _results(tmp_path / "results", "good")
    outside = tmp_path / "outside" / "pwned"
    if hostile == "ABSOLUTE":  # DuckDB decodes %2F: the sweep id would read as this absolute path
        hostile = quote(str(outside), safe="")
    _results(root, "evil", sweep="newest")  # written last: the sweep `report` shows by default
    _rename_sweep(root, "newest", hostile)
    done = kvcompress("report", "--results", str(root))
    assert done.returncode == 0, done.stderr
    assert f"warning: skipping {root / 'runs' / f'sweep_id={hostile}' / 'method=full' / 'evil.parquet'}" in done.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")) == ["results/html/sw.html"]
    assert not outside.parent.exists()
    done = kvcompress("check", "--results", str(root))
    assert done.returncode == 1
    assert f"{root / 'runs' / f'sweep_id={hostile}' / 'method=full' / 'evil.parquet'}: directory 'sweep_id=" in done.stdout
    assert "3 problem(s)" in done.stdout  # the run's runs, steps and evidence files


def test_a_hostile_sweep_name_given_on_the_command_line_is_refused(tmp_path):
    root = _results(tmp_path / "results", "good")
    line = one_line_error(kvcompress("report", "--results", str(root), "--sweep", "../../x"))
    assert line.startswith("error: --sweep: expected 1-128 characters")
    assert not list(tmp_path.rglob("*.html"))


def test_a_foreign_one_row_parquet_is_not_a_finished_run(tmp_path):
    root = _results(tmp_path / "results", "good", "foreign", "copied")
    runs = root.joinpath("runs", *PART)
    pq.write_table(pa.table({"x": [1]}), runs / "foreign.parquet")  # one row, not a run at all
    shutil.copy(runs / "good.parquet", runs / "copied.parquet")  # a whole run, but another run's
    assert finished_run_ids(str(root), "sw") == {"good"}  # the next sweep reruns both
    problems = {Path(p.path).name: p.reason for p in scan(str(root))}
    assert problems == {"foreign.parquet": "runs file is not of the runs table: column x is not one of it",
                        "copied.parquet": "runs file holds run 'good', not 'copied'"}


def test_a_foreign_file_with_a_string_score_is_named_and_the_report_goes_on(tmp_path):
    root = _results(tmp_path / "results", "a", "b")
    row = make_run("evil", "full", 1.0, 1000, config_label="full")
    schema = RUNS_SCHEMA.set(RUNS_SCHEMA.get_field_index("score"), pa.field("score", pa.string()))
    pq.write_table(pa.Table.from_pylist([{**row, "score": "high"}], schema=schema),
                   root.joinpath("runs", *PART, "evil.parquet"))
    with pytest.warns(UserWarning, match=r"skipping .*evil\.parquet: column score is string, the runs table's double"):
        con = connect(str(root))
    columns, rows = run_report(con, "summary")
    assert [r[columns.index("runs")] for r in rows] == [2]
    done = kvcompress("report", "--results", str(root), "--no-html")
    assert done.returncode == 0 and "evil.parquet: column score is string" in done.stderr, done.stderr


def test_a_full_disk_leaves_the_previous_html_report_whole(tmp_path):
    root = _results(tmp_path / "results", "a")
    assert kvcompress("report", "--results", str(root)).returncode == 0
    page = root / "html" / "sw.html"
    before = page.read_bytes()
    limit = len(before) // 3

    def small_disk():  # writes past `limit` bytes fail with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run([sys.executable, "-m", "kvcompress_flows.cli", "report", "--results", str(root)],
                          capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0] == f"error: cannot write {page}: File too large", done.stderr
    assert page.read_bytes() == before
    assert sorted(p.name for p in page.parent.iterdir()) == ["sw.html"]  # no temp file left behind


@pytest.fixture(scope="module")
def s3_with_credential_checks(tmp_path_factory):
    """A second moto server that checks every request's credentials (it knows none, as a store
    knows none of a wrong secret)."""
    log = tmp_path_factory.mktemp("moto-auth") / "moto.log"
    with moto_server(log, env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        yield endpoint


def test_report_with_a_wrong_secret_is_one_line(s3_with_credential_checks):
    url = f"s3://kvcompress/x?endpoint_override={s3_with_credential_checks}&scheme=http"
    env = {"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG1", "AWS_SECRET_ACCESS_KEY": "wrong-secret-" + "x" * 20,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    for command in ("report", "check"):
        done = kvcompress(command, "--results", url, env=env)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"error: results {url!r}: ") and "wrong-secret" not in done.stderr


def _grid(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


GRID = """name: big
datasets:
  - name: passkey
    context_tokens: [256]
    num_samples: {samples}
methods:
  - name: full
  - name: streaming
    grid: {{budget: {budgets}}}
"""


def test_a_huge_grid_is_refused_before_it_is_expanded_even_in_a_dry_run(tmp_path):
    from kvcompress.sweep import SweepError, load_spec

    grid = _grid(tmp_path, GRID.format(samples=10_000_000, budgets="[0.5]"))
    line = one_line_error(kvcompress("sweep", str(grid), "--dry-run", timeout=120))
    assert line == ("error: max_runs: this grid expands to 20,000,000 runs, more than max_runs=100,000; nothing was "
                    "expanded. Shrink the grid, or raise the limit (grid key `max_runs: N`, or --max-runs N) "
                    "(nothing was run)")
    budgets = [round(0.1 + i * 0.001, 3) for i in range(599)]  # 600 cells x 200 samples: 120,000 runs
    grid = _grid(tmp_path, GRID.format(samples=200, budgets=budgets))
    with pytest.raises(SweepError, match="expands to 120,000 runs, more than max_runs=100,000"):
        load_spec(str(grid)).plan()
    done = kvcompress("sweep", str(grid), "--dry-run", "--max-runs", "120000")
    assert done.returncode == 0, done.stderr
    assert '"runs": 120000' in done.stdout.splitlines()[-1]
    grid.write_text(grid.read_text() + "max_runs: 120000\n")
    assert load_spec(str(grid)).plan().runs == 120_000


def test_ten_thousand_method_cells_validate_in_linear_time(tmp_path):
    from kvcompress.sweep import SweepError, load_spec

    def plan_seconds(cells: int) -> float:
        budgets = [64 + i for i in range(cells)]  # distinct token budgets: every cell valid
        spec = load_spec(str(_grid(tmp_path, GRID.format(samples=1, budgets=budgets))))
        start = time.perf_counter()
        assert len(spec.plan().methods) == cells + 1
        return time.perf_counter() - start

    small, large = plan_seconds(1000), plan_seconds(10_000)
    assert large < 30 * small, (small, large)  # linear: ~10x; the pairwise duplicate check was ~100x
    grid = _grid(tmp_path, GRID.format(samples=1, budgets=[64 + i for i in range(10_000)]) +
                 "  - name: streaming\n    grid: {budget: [5000]}\n")
    with pytest.raises(SweepError, match="methods: duplicate cell streaming budget=5000"):
        load_spec(str(grid)).plan()


BOMB_VALUES = """a: &a [x, x, x, x, x, x, x, x, x]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


@pytest.mark.parametrize("where", ["params: {recent: *i}", "grid: {budget: *i}"])
def test_a_yaml_alias_bomb_is_refused_with_a_short_message(tmp_path, where):
    bomb = "aliases:\n" + "".join(f"  {line}\n" for line in BOMB_VALUES.splitlines())
    grid = _grid(tmp_path, f"{bomb}name: bomb\ndatasets: [{{name: passkey}}]\nmethods:\n  - name: snapkv\n    {where}\n")
    assert len(grid.read_bytes()) < 700
    line = one_line_error(kvcompress("sweep", str(grid), "--dry-run", timeout=120))
    assert line.startswith("error: grid: expected at most 1,000,000 values written out, got more") and len(line) < 300


def test_a_long_value_is_cut_in_an_error_message(tmp_path):
    grid = _grid(tmp_path, "name: long\ndatasets: [{name: passkey}]\nmethods:\n  - name: snapkv\n"
                           f"    params: {{recent: {list(range(5000))}}}\n")
    line = one_line_error(kvcompress("sweep", str(grid), "--dry-run"))
    assert "snapkv.recent: expected an int >= 1 (window tokens), got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...]" in line
    assert len(line) < 400  # the whole list, twice, before


def test_the_bind_check_treats_only_loopback_addresses_as_loopback():
    from kvcompress_flows.local_server import require_auth

    for host in ("127.0.0.1", "127.5.5.5", "localhost", "::1"):
        require_auth(host, environ={})
    for host in ("127.0.0.1.invalid", "127.evil.invalid", "0.0.0.0", "::", "192.0.2.1"):  # .invalid never resolves
        with pytest.raises(ConfigError, match=f"PREFECT_SERVER_HOST={host} serves the API beyond this machine"):
            require_auth(host, environ={})
    require_auth("0.0.0.0", environ={"PREFECT_SERVER_API_AUTH_STRING": "kvcompress:x"})


@pytest.mark.parametrize("url", ["s3://AKIAHIDDEN:hidden-secret@bucket/kv",
                                 "s3://bucket/kv?region=us-east-1&secret_key=hidden-secret&access_key=AKIAHIDDEN"])
def test_credentials_in_a_results_url_are_refused_before_prefect_sees_them(tmp_path, url):
    done = kvcompress("sweep", "smoke", "--results", url, env={"PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path)})
    line = one_line_error(done)
    assert line.startswith("error: results: credentials in the URL 's3://") and "are refused" in line
    assert "hidden-secret" not in done.stdout + done.stderr and "AKIAHIDDEN" not in done.stdout + done.stderr
    assert not (tmp_path / "prefect.db").exists()  # no Prefect server was started, none was told
    doc = (Path(__file__).resolve().parent.parent / "docs" / "many-machines.md").read_text()
    assert "access_key=" not in doc and "secret_key=" not in doc  # options pyarrow's S3 URLs reject


@pytest.fixture
def custom_code_model(tmp_path) -> Path:
    """A model directory that needs its own code (transformers' trust_remote_code) to load."""
    model = tmp_path / "custom-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "custom", "max_position_embeddings": 2048, '
                                       '"auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomModel"}}')
    (model / "modeling_custom.py").write_text(f"open({str(tmp_path / 'code-ran')!r}, 'w').write('yes')\n")
    return model


def test_a_model_that_needs_custom_code_is_refused_before_the_flow(tmp_path, custom_code_model):
    grid = _grid(tmp_path, f"name: custom\nmodel: {custom_code_model}\ndatasets: [{{name: passkey}}]\n"
                           "methods: [{name: full}]\n")
    line = one_line_error(kvcompress("sweep", str(grid), "--dry-run"))
    assert line.startswith(f"error: model: name_or_path: {custom_code_model} needs custom code (config.json has "
                           "auto_map: trust_remote_code), refused")
    assert not (tmp_path / "code-ran").exists()


def test_prefect_does_not_retry_a_model_that_needs_custom_code(prefect_server, tmp_path, custom_code_model):
    from types import MappingProxyType

    from prefect import flow
    from prefect.client.orchestration import get_client

    from kvcompress.methods import method_config
    from kvcompress.sweep import Shard
    from kvcompress_tasks.sweep import run_shard

    shard = Shard("passkey", MappingProxyType({"context_tokens": 256, "num_samples": 1, "seed": 0}), 0,
                  (method_config("full"),))

    @flow(name="custom-code-shard")
    def one_shard():
        state = run_shard(shard, str(custom_code_model), None, "sw", str(tmp_path / "results"), return_state=True)
        return state.state_details.task_run_id, state.is_failed(), state.message

    task_run_id, failed, message = one_shard()
    assert failed and "needs custom code" in message
    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 1  # no retry
    assert not (tmp_path / "code-ran").exists()
    assert [p.name for p in (tmp_path / "results").rglob("*") if p.is_file()] == []  # no run; its lease given back


SHARD_GRID = {"name": "twice", "decode_steps": 3, "datasets": [{"name": "passkey", "context_tokens": [256]}],
              "methods": [{"name": "full"}, {"name": "streaming", "grid": {"budget": [64, 128]}}]}


def _run_shard_in_a_process(root: str) -> None:
    from kvcompress.execute import execute_shard
    from kvcompress.sweep import load_spec

    spec = load_spec(SHARD_GRID)
    (shard,) = spec.shards()
    print(execute_shard(shard, spec.model, spec.decode_steps, "twice", root), flush=True)


def test_a_shard_launched_twice_at_once_is_computed_once(tmp_path):
    import multiprocessing as mp

    from kvcompress.execute import execute_shard, shard_key
    from kvcompress.leases import ShardLease
    from kvcompress.sweep import load_spec

    root = str(tmp_path / "results")
    spec = load_spec(SHARD_GRID)
    (shard,) = spec.shards()
    first = mp.get_context("spawn").Process(target=_run_shard_in_a_process, args=(root,))
    first.start()
    try:
        lease = ShardLease(root, "twice", shard_key(shard))
        deadline = time.monotonic() + 120
        while lease.owner() is None:  # the first launch holds the shard (it takes the lease before the model)
            assert first.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        assert lease.owner().pid == first.pid
        second = execute_shard(shard, spec.model, spec.decode_steps, "twice", root)  # at once: left to the first
        assert second["ran"] == 0 and second["leased_by"].startswith(f"pid {first.pid} on ")
        waited = execute_shard(shard, spec.model, spec.decode_steps, "twice", root, lease_wait_s=300)
        first.join(60)
    finally:
        first.kill()
    assert first.exitcode == 0
    assert waited == {"skipped": 3, "ran": 0, "failed": 0}  # it waited, then found every run finished
    assert len(finished_run_ids(root, "twice")) == 3 and lease.owner() is None


def test_a_lease_is_stale_when_its_owner_died_or_stopped_renewing(tmp_path):
    import json

    from kvcompress.leases import ShardLease

    root = str(tmp_path / "results")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    path = tmp_path / "results" / "_leases" / "sweep_id=sw" / "k.lease"
    path.parent.mkdir(parents=True)

    def held_by(host: str, pid: int, age_s: float) -> bool:
        path.write_text(json.dumps({"host": host, "pid": pid, "token": "theirs", "at": time.time() - age_s}))
        lease = ShardLease(root, "sw", "k", stale_s=100)
        taken = lease.acquire()
        lease.release()
        return not taken

    import socket

    here = socket.gethostname()
    assert held_by(here, holder.pid, 0) and held_by("other-host", 1, 99)  # alive, or renewed within stale_s
    holder.stdin.close()
    holder.wait()
    assert not held_by(here, holder.pid, 0)  # its process is gone
    assert not held_by("other-host", 1, 101)  # not renewed for stale_s
    assert not path.exists()  # the taker gave it back


def test_a_sweep_whose_prefect_server_dies_fails_fast_in_one_line(tmp_path):
    """Kill -9 the sweep's Prefect server (its temporary one) once the first run lands: the sweep ends
    within the watch's grace, in one error line, and keeps what it finished."""
    import psutil

    from kvcompress_flows.server_watch import GRACE_S

    results = tmp_path / "results"
    env = {**os.environ, "PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path / "prefect-home")}
    proc = subprocess.Popen([sys.executable, "-m", "kvcompress_flows.cli", "sweep", "smoke", "--results", str(results)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not list(results.glob("runs/**/*.parquet")):
            assert proc.poll() is None and time.monotonic() < deadline, "sweep ended before any run finished"
            time.sleep(0.2)
        (server,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "server" in p.cmdline() and "start" in p.cmdline()]
        os.killpg(os.getpgid(server.pid), signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=GRACE_S + 90)  # before: ~220 s, then a 200-line traceback
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - killed < GRACE_S + 60
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("error: the Prefect server at http://127.0.0.1:")
    assert finished_run_ids(str(results), "smoke")  # what finished is kept
