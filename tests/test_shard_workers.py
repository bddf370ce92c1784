"""Shard workers as two machines would run them (issue 42, item 3): each with its own working directory,
home, caches, PREFECT_HOME and environment, sharing only the Prefect API (PREFECT_API_URL) and an S3
bucket. The sweep's two shards go one to each; one machine dies (SIGKILL, with the flow run it
executes) mid-shard; the sweep fails at its shard timeout; the rerun finishes every run exactly once;
the rows are an inline sweep's. (This replaces tests/test_flow.py's two-workers and killed-worker
tests, which shared a machine's directory and environment.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from machines import Machine
from result_rows import assert_same_results, comparable_rows
from s3_server import BUCKET

ROOT = Path(__file__).resolve().parent.parent
PREFECT = [sys.executable, "-m", "prefect"]
DOCS = [(ROOT / "docs" / "many-machines.md").read_text()]  # the recipe (the README points to it)
POOL = "kvcompress-shards"
# two shards (one per sample) of two runs each
GRID = {"name": "machines", "decode_steps": 2, "datasets": [{"name": "passkey", "context_tokens": [256], "num_samples": 2}],
        "methods": [{"name": "full"}, {"name": "streaming", "grid": {"budget": [64]}}]}
SHARD_TIMEOUT_S = 60  # from submission; the killed shard never finishes, so the sweep always waits this long


def prefect(*args: str, env: dict) -> None:
    done = subprocess.run([*PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def online_workers() -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {w.name for w in client.read_workers_for_work_pool(POOL) if w.status.value == "ONLINE"}


@pytest.fixture(scope="module")
def shard_deployment(prefect_server):
    """The shard work pool and the `sweep-shard/shard` deployment from prefect.yaml, on the session's server."""
    env = {**os.environ, "KVCOMPRESS_HOME": str(ROOT)}
    created = subprocess.run([*PREFECT, "work-pool", "inspect", POOL], env=env, capture_output=True).returncode != 0
    if created:
        prefect("work-pool", "create", POOL, "--type", "process", env=env)
    prefect("--no-prompt", "deploy", "--name", "shard", env=env)
    yield
    if created:  # as found: tests/test_flow.py creates it itself
        prefect("work-pool", "delete", POOL, env=env)


def start_worker(machine: Machine, name: str) -> None:
    """The worker command of docs/many-machines.md, on `machine`, until the server lists it online."""
    command = ["prefect", "worker", "start", "--pool", POOL, "--limit", "1"]
    assert all(f".venv/bin/{' '.join(command)}" in doc for doc in DOCS)
    machine.start([sys.executable, "-m", *command, "--name", name], until=lambda: name in online_workers())


def flow_run_state(flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.type.value


def wait_final(flow_run_ids: list[str], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while any(flow_run_state(i) not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for i in flow_run_ids):
        assert time.monotonic() < deadline, "a shard flow run did not end"
        time.sleep(0.5)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds a worker's flow runs through /proc")
def test_two_machines_sharing_only_the_api_and_a_bucket_lose_nothing_to_a_killed_worker(
        shard_deployment, prefect_server, s3_results, tmp_path, embedded):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    s3, prefix, url = s3_results
    machines = [Machine(tmp_path, f"machine-{i}", prefect_server) for i in range(2)]
    server_dir = tmp_path / "server-machine"  # where the sweep is started: neither worker's directory
    server_dir.mkdir()
    (server_dir / "grid.yaml").write_text(json.dumps(GRID))
    sweep_cmd = [sys.executable, "-m", "kvcompress_flows.cli", "sweep", "grid.yaml", "--sweep-id", "machines",
                 "--results", url, "--distribute"]  # the README's `kvcompress sweep my-sweep.yaml --distribute --results`
    try:
        for machine in machines:
            start_worker(machine, machine.name)
        parent = subprocess.Popen([*sweep_cmd, "--shard-timeout", str(SHARD_TIMEOUT_S)], cwd=server_dir,
                                  env={**os.environ, "KVCOMPRESS_HOME": str(ROOT)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        # the first machine seen executing a shard dies as soon as the flow run is Running
        deadline, doomed = time.monotonic() + 600, None
        while doomed is None:
            assert time.monotonic() < deadline, "no worker started a shard"
            for machine in machines:
                running = [i for i in machine.flow_runs() if flow_run_state(i) == "RUNNING"]
                if running:
                    doomed, killed_run = machine, running[0]
                    break
            else:
                time.sleep(0.2)
        doomed.die()
        assert flow_run_state(killed_run) == "RUNNING"  # it ended with its machine, not on its own
        out, _ = parent.communicate(timeout=SHARD_TIMEOUT_S + 600)
        assert parent.returncode != 0 and "runs finished; rerun to resume" in out, out[-3000:]
        assert int(out.split("sweep machines: only ")[1].split(" ")[0]) < 4  # the killed shard's runs are missing

        # the surviving machine's shard ends on its own; then the dead machine comes back and the sweep reruns
        with get_client(sync_client=True) as client:
            first_pass = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="machines-")))
        wait_final([str(r.id) for r in first_pass if str(r.id) != killed_run])
        # the sweep was split: the other shard ran on the machine that lived, and completed there
        survivor = next(m for m in machines if m is not doomed)
        survivor_log = (survivor.dir / f"{survivor.name}.log").read_text()
        others = [r for r in first_pass if str(r.id) != killed_run]
        assert others and all(flow_run_state(str(r.id)) == "COMPLETED" for r in others)
        assert all(f"Flow run '{r.name}' submitted to infrastructure" in survivor_log for r in others)
        written_before = set(s3.keys(f"{prefix}/runs/"))
        start_worker(doomed, f"{doomed.name}-rebooted")
        rerun = subprocess.run(sweep_cmd, cwd=server_dir, env={**os.environ, "KVCOMPRESS_HOME": str(ROOT)},
                               capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    finally:
        for machine in machines:
            machine.stop()

    # every run exactly once: four runs objects, each PUT once (the bucket keeps every version ever written)
    runs_keys = s3.keys(f"{prefix}/runs/")
    assert len(runs_keys) == 4 and set(written_before) < set(runs_keys)
    versions = s3.client().list_object_versions(Bucket=BUCKET, Prefix=f"{prefix}/runs/")
    assert sorted(v["Key"] for v in versions["Versions"]) == runs_keys and not versions.get("DeleteMarkers")
    # the rows an inline sweep writes (locally), timings aside
    from kvcompress_flows.sweep import sweep

    inline_root = str(tmp_path / "inline")
    sweep(grid=GRID, results=inline_root, sweep_id="machines")
    assert_same_results(comparable_rows(url, "machines"), comparable_rows(inline_root, "machines"))
    with get_client(sync_client=True) as client:  # no later test's worker should see these shard runs
        for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="machines-"))):
            client.delete_flow_run(r.id)
