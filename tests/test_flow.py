"""The sweep flow through a real Prefect server, deployment and process worker; the CLI in-process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from kvcompress_flows.local_server import stop_process_group

ROOT = Path(__file__).resolve().parent.parent
PREFECT = [sys.executable, "-m", "prefect"]


def prefect(*args: str, env: dict) -> str:
    done = subprocess.run([*PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def read_table(root: Path, table: str) -> list[dict]:
    return ds.dataset(root / table, partitioning="hive", format="parquet").to_table().to_pylist()


def online_workers(pool: str) -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {w.name for w in client.read_workers_for_work_pool(pool) if w.status.value == "ONLINE"}


def start_worker(pool: str, name: str, env: dict, log: Path, limit: int | None = None) -> subprocess.Popen:
    """A process worker in its own process group, returned once the server lists it online."""
    command = [*PREFECT, "worker", "start", "--pool", pool, "--name", name]
    if limit is not None:
        command += ["--limit", str(limit)]
    worker = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while name not in online_workers(pool):
        if worker.poll() is not None or time.monotonic() > deadline:
            stop_process_group(worker)
            pytest.fail(f"worker {name} did not come online:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return worker


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory):
    """Work pool + deployments from prefect.yaml + one process worker, on the session's server."""
    env = {**os.environ, "KVCOMPRESS_HOME": str(ROOT)}
    for pool in ("kvcompress", "kvcompress-shards"):
        prefect("work-pool", "create", pool, "--type", "process", env=env)
    prefect("--no-prompt", "deploy", "--all", env=env)
    # the worker asks for scheduled runs every second (Prefect's default: 10 s), so each deployment run
    # below starts at once instead of waiting out the poll
    worker = start_worker("kvcompress", "sweep-worker", {**env, "PREFECT_WORKER_QUERY_SECONDS": "1"},
                          tmp_path_factory.mktemp("worker") / "worker.log")
    yield env
    stop_process_group(worker)


@pytest.fixture(scope="module")
def smoke_run(deployed, tmp_path_factory) -> tuple[Path, str]:
    """`prefect deployment run sweep/default` on the smoke grid: (results root, flow run id)."""
    results = tmp_path_factory.mktemp("smoke") / "results"
    out = prefect("deployment", "run", "sweep/default", "--param", "grid=smoke", "--param", f"results={results}",
                  "--watch", env=deployed)
    assert "Completed" in out
    return results, re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def test_deployment_run_completes_and_writes_queryable_results(smoke_run):
    results, _ = smoke_run
    runs = read_table(results, "runs")
    assert sorted(r["method"] for r in runs) == ["full", "mlx-quant", "streaming"]
    assert all(r["status"] == "ok" and r["sweep_id"] == "smoke" for r in runs)
    steps = read_table(results, "steps")
    assert len(steps) == 3 * 4  # smoke grid: 4 decode steps per run
    # the full cache, derived from the shared prefill, reproduces the reference exactly
    assert all(s["kl"] == 0.0 and s["top1_agree"] for s in steps if s["method"] == "full")

    from kvcompress_reports import connect, run_report

    columns, rows = run_report(connect(str(results)), "summary")
    summary = {r[columns.index("method")]: dict(zip(columns, r)) for r in rows}
    for run in runs:  # the SQL aggregates equal what we compute from the Parquet ourselves
        mine = [s for s in steps if s["run_id"] == run["run_id"]]
        row = summary[run["method"]]
        assert row["kl_mean"] == pytest.approx(sum(s["kl"] for s in mine) / len(mine), abs=1e-5)
        assert row["live_kv_bytes"] == run["live_kv_bytes"]
        assert row["kv_ratio_to_full"] == pytest.approx(run["live_kv_bytes"] / run["full_kv_bytes"], abs=1e-4)
    assert summary["mlx-quant"]["kv_ratio_to_full"] < 0.2 < summary["streaming"]["kv_ratio_to_full"] < 0.6


def test_dashboard_shows_the_sweep_summary_artifact_in_headless_chromium(smoke_run):
    """The Prefect UI is on: the summary table artifact of the finished flow run renders there."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("/usr/bin/chromium is not installed (apt-get install -y chromium)")
    _, flow_run_id = smoke_run
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["sweep-smoke-summary"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    dashboard = os.environ["PREFECT_API_URL"].removesuffix("/api")
    page = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--virtual-time-budget=30000", "--dump-dom", f"{dashboard}/artifacts/artifact/{artifact.id}"],
                          capture_output=True, text=True, timeout=300).stdout
    text = " ".join(re.sub(r"<[^>]+>", " ", page).split())
    assert f"Flow Run {flow_run.name}" in text  # the artifact page links the sweep's flow run
    for label in ("full", "mlx-quant bits=4", "streaming budget=0.5"):  # the summary table, rendered
        assert f" {label} " in text, text[:3000]


@pytest.mark.parametrize("param", ["grid=no-such-grid", "sweep_id=../../../../ESCAPED"])
def test_bad_grid_or_sweep_id_fails_before_any_work(deployed, tmp_path, param):
    results = tmp_path / "sub" / "results"
    done = subprocess.run(
        [*PREFECT, "deployment", "run", "sweep/default", "--param", "grid=smoke", "--param", param,
         "--param", f"results={results}", "--watch"],
        cwd=ROOT, env=deployed, capture_output=True, text=True, timeout=600,
    )
    assert "Failed" in done.stdout + done.stderr
    assert not (tmp_path / "sub").exists() and not list(tmp_path.parent.rglob("ESCAPED"))


def processes_with_home(prefect_home: Path) -> list[str]:
    """Command lines of live processes whose environment has PREFECT_HOME=prefect_home (Linux /proc)."""
    needle = f"PREFECT_HOME={prefect_home}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def wait_until_gone(prefect_home: Path, timeout_s: float = 90) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_with_home(prefect_home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds leftover processes through /proc")
def test_killed_sweep_resumes_with_every_run_exactly_once_and_leaves_no_server(tmp_path):
    """SIGKILL the in-process sweep as soon as its first run lands: its temporary Prefect server
    goes with it; rerun, count rows; nothing is left running afterwards."""
    results = tmp_path / "results"
    home = tmp_path / "prefect-home"
    env = {**os.environ, "PREFECT_API_URL": "", "PREFECT_HOME": str(home)}  # in-process: a temporary server
    cmd = [sys.executable, "-m", "kvcompress_flows.cli", "sweep", "smoke", "--results", str(results)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not list(results.glob("runs/**/*.parquet")):
        assert proc.poll() is None and time.monotonic() < deadline, "sweep ended before any run finished"
        time.sleep(0.2)
    assert any("prefect server start" in c for c in processes_with_home(home))  # the temporary server
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_until_gone(home) == []  # the server died with the sweep: nothing listens, nothing orphaned
    assert 1 <= len(list(results.glob("runs/**/*.parquet"))) < 3
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    assert wait_until_gone(home) == []
    runs = read_table(results, "runs")
    assert sorted(r["method"] for r in runs) == ["full", "mlx-quant", "streaming"]
    steps = read_table(results, "steps")
    per_run = {}
    for s in steps:
        per_run.setdefault(s["run_id"], []).append(s["step"])
    assert {r["run_id"] for r in runs} == set(per_run)
    assert all(sorted(v) == [0, 1, 2, 3] for v in per_run.values())  # no duplicate, no lost step rows


def test_shards_no_worker_takes_time_out_and_the_sweep_asks_for_a_rerun(deployed, tmp_path):
    """A distributed sweep waits for its shards until the shard timeout (from submission), then fails
    naming the rerun; the shard runs stay scheduled, for workers that come later."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from kvcompress_flows.sweep import sweep

    grid = {"name": "unattended", "decode_steps": 2, "datasets": [{"name": "passkey", "context_tokens": [256],
            "num_samples": 2}], "methods": [{"name": "full"}]}
    # the shard pool has no worker now (the tests above stopped theirs)
    with pytest.raises(RuntimeError, match=r"sweep unattended: only 0 of 2 runs finished; rerun to resume"):
        sweep(grid=grid, results=str(tmp_path / "results"), distribute=True, shard_timeout_s=3)
    with get_client(sync_client=True) as client:
        shard_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="unattended-")))
        assert sorted(r.name for r in shard_runs) == ["unattended-passkey-0", "unattended-passkey-1"]
        assert all(r.state.is_scheduled() for r in shard_runs)
        for r in shard_runs:  # no later test's worker should take them
            client.delete_flow_run(r.id)
    assert not list((tmp_path / "results").glob("runs/**/*.parquet"))


def test_shard_task_fails_at_once_on_a_config_error(prefect_server, tmp_path):
    """A bad setting fails the same way on every try: the shard task (retries=2) runs once."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    from kvcompress_tasks.sweep import run_shard

    from kvcompress.sweep import Shard

    shard = Shard("passkey", {"context_tokens": 256}, 0, ())

    @flow
    def one_shard() -> tuple[bool, str, str]:
        state = run_shard(shard, "./no/such/model", 2, "s", str(tmp_path), None, return_state=True)
        return state.is_failed(), str(state.message), str(state.state_details.task_run_id)

    failed, message, task_run_id = one_shard()
    assert failed and "name_or_path: expected 'smollm2-135m'" in message
    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 1


def test_sweep_with_a_config_that_never_runs_ok_ends_failed_naming_it(prefect_server, tmp_path, embedded):
    """A method that fails on every sample (here: a group size that does not divide head_dim) must
    not leave a "Completed" sweep whose reports silently lack it."""
    from kvcompress_flows.sweep import sweep

    grid = {"name": "broken", "decode_steps": 3, "datasets": [{"name": "passkey", "context_tokens": [256]}],
            "methods": [{"name": "full"}, {"name": "mlx-quant", "params": {"group_size": 128}}]}
    with pytest.raises(RuntimeError, match=r"1 config\(s\) have no ok run: mlx-quant .*group_size"):
        sweep(grid=grid, results=str(tmp_path))
    runs = read_table(tmp_path, "runs")
    assert sorted(r["status"] for r in runs) == ["error", "ok"]  # both recorded; the report ran first


@pytest.fixture(scope="module")
def user_model_grid(tmp_path_factory) -> Path:
    """A user's own model: a random-weight Gemma 3 (3 sliding-window layers of 16 tokens, 1 global)
    saved as a local mlx-lm directory, and a grid that names it."""
    sys.path.insert(0, str(ROOT / "tests"))
    from arch_models import WINDOW, save_tiny_model

    from kvcompress.model import load_tokenizer

    root = tmp_path_factory.mktemp("user-model")
    save_tiny_model("gemma3_text", root / "gemma3", load_tokenizer()._tokenizer)
    grid = root / "user-model.yaml"
    grid.write_text(f"""
name: user-model
model: {root / "gemma3"}
decode_steps: 4
datasets:
  - name: passkey
    context_tokens: [256]
    num_samples: 1
    seed: 0
methods:
  - name: full
  - name: h2o
    grid: {{budget: [0.5]}}
  - name: kivi
    grid: {{bits: [4]}}
""")
    assert WINDOW < 256
    return grid


def check_user_model_runs(results: Path) -> None:
    """Every run ok; the full cache's bytes are what mlx-lm's own cache holds (a window on the
    sliding layers), and the methods compress the global layer only."""
    runs = {r["method"]: r for r in read_table(results, "runs")}
    assert sorted(runs) == ["full", "h2o", "kivi"] and all(r["status"] == "ok" for r in runs.values()), runs
    full = runs["full"]
    per_token = 2 * 2 * 32 * 4  # keys and values, 2 KV heads of 32 dims, float32
    held = full["prompt_tokens"] + full["decode_steps"] - 1  # the last reference token is never fed
    assert full["full_kv_bytes"] == per_token * (1 * held + 3 * 16)  # 1 global layer, 3 windows of 16
    assert full["live_kv_bytes"] == full["full_kv_bytes"]
    # H2O: half the prompt on the global layer (it evicts down to it while decoding), with each
    # token's score and position (float32, int32) per KV head; the windows as they were
    h2o = runs["h2o"]
    assert h2o["live_kv_bytes"] == (per_token + 2 * 8) * round(0.5 * h2o["prompt_tokens"]) + per_token * 3 * 16
    assert runs["kivi"]["live_kv_bytes"] < full["live_kv_bytes"]
    assert json.loads(full["config"])["model"].endswith("gemma3")


def test_a_users_own_windowed_model_runs_through_the_cli_sweep(user_model_grid, tmp_path):
    results = tmp_path / "results"
    env = {**os.environ, "PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path / "prefect-home")}
    cmd = [sys.executable, "-m", "kvcompress_flows.cli", "sweep", str(user_model_grid), "--results", str(results)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    check_user_model_runs(results)


def test_a_users_own_windowed_model_runs_through_the_deployment(deployed, user_model_grid, tmp_path):
    results = tmp_path / "results"
    out = prefect("deployment", "run", "sweep/default", "--param", f"grid={user_model_grid}",
                  "--param", f"results={results}", "--watch", env=deployed)
    assert "Completed" in out
    check_user_model_runs(results)


def test_the_demo_script_shows_a_deployment_runs_progress_and_why_it_failed(deployed, tmp_path):
    """Issue 50, items 3 and 6: `scripts/prefect_local.sh run` (make demo) showed nothing while the sweep ran
    (its progress went to the worker's log only) and, for a failed run, only "Flow run finished in state
    'Failed'." (the reason in the worker's log); a relative grid path is read in the worker's directory."""
    script = ["bash", str(ROOT / "scripts" / "prefect_local.sh"), "run", "default"]
    (tmp_path / "tiny.yaml").write_text("name: tiny\ndecode_steps: 2\ndatasets: [{name: passkey, context_tokens: [256]}]\n"
                                        "methods: [{name: full}, {name: streaming, grid: {budget: [64]}}]\n")
    results = tmp_path / "results"
    done = subprocess.run([*script, "--param", "grid=tiny.yaml", "--param", f"results={results}"], cwd=tmp_path,
                          env=deployed, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (f"ended Failed: Flow run encountered an exception: SweepError: grid: expected a YAML file or one of "
            f"['default', 'leaderboard', 'nightly', 'smoke', 'speed-cpu', 'speed-h200'], got 'tiny.yaml' (a relative path is read "
            f"from the directory of the process that runs the flow, {ROOT}, then KVCOMPRESS_HOME={ROOT}: pass an "
            f"absolute path)") in done.stdout, done.stdout[-3000:]
    done = subprocess.run([*script, "--param", f"grid={tmp_path / 'tiny.yaml'}", "--param", f"results={results}"],
                          cwd=tmp_path, env=deployed, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # a line per run as it finishes (a shard of the default grid runs for minutes), then the final state
    runs = [line.split(" ", 1)[1] for line in lines if " run " in line and " of passkey #0: " in line]
    assert sorted(runs) == ["run 1/2 of passkey #0: full: ok", "run 2/2 of passkey #0: streaming budget=64: ok"]
    assert any("1/1 shards" in line for line in lines)
    assert re.fullmatch(r"flow run [\w-]+: Completed", lines[-1]), lines[-5:]
