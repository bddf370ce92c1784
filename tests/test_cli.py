"""The `kvcompress` command line: one-line errors before any work, `check [--repair]`, remote binding."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_results import _broken_results

ROOT = Path(__file__).resolve().parent.parent


def kvcompress(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcompress_flows.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The CLI's contract for bad input: exit status 2 and one `error:` line, no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("results, message", [
    ("ftp://host/kv", "error: results: unsupported location 'ftp://host/kv' (ftp://)"),
    ("/etc/hostname/results", "error: results: cannot write to '/etc/hostname/results'"),
    ("s3://bucket/kv?endpoint_override=127.0.0.1:9&scheme=http", "error: results: cannot write to 's3://bucket/kv"),
])
def test_bad_results_root_fails_once_before_any_work(tmp_path, results, message):
    done = kvcompress("sweep", "smoke", "--results", results, env={"PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path)})
    assert one_line_error(done).startswith(message)
    assert "starting a temporary local Prefect server" not in done.stderr  # failed before any flow or model


@pytest.mark.parametrize("sweep_id", ["../../../../ESCAPED", "a/b", "lr=0.1", "<script>"])
def test_hostile_sweep_id_is_refused_even_in_a_dry_run(tmp_path, sweep_id):
    done = kvcompress("sweep", "smoke", "--dry-run", "--sweep-id", sweep_id, "--results", str(tmp_path / "r"))
    assert one_line_error(done).startswith("error: --sweep-id: expected 1-128 characters of [A-Za-z0-9._-]")
    assert not list(tmp_path.rglob("*")) and not list(tmp_path.parent.rglob("ESCAPED"))


def test_hostile_grid_name_is_refused(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("name: ../../x\ndatasets: [{name: passkey, context_tokens: [256]}]\nmethods: [{name: full}]\n")
    done = kvcompress("sweep", str(grid), "--dry-run")
    assert "name: expected 1-128 characters" in done.stderr and done.returncode == 2


def test_malformed_yaml_names_file_and_line(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("name: ok\ndatasets:\n  - name: passkey\n   context_tokens: [256]\n")
    line = one_line_error(kvcompress("sweep", str(grid), "--dry-run"))
    assert line.startswith(f"error: grid: malformed YAML at {grid}:4:4: ") and line.endswith("(nothing was run)")


def test_context_beyond_the_model_window_is_an_error_unless_opted_in(tmp_path):
    grid = tmp_path / "grid.yaml"
    body = "datasets: [{name: passkey, context_tokens: [8704]}]\nmethods: [{name: full}]\n"
    grid.write_text("name: long\n" + body)
    done = kvcompress("sweep", str(grid), "--dry-run")
    assert done.returncode == 2
    assert "context_tokens: expected at most 8192 (the context window of smollm2-135m), got 8704" in done.stderr
    grid.write_text("name: long\nallow_beyond_window: true\n" + body)
    done = kvcompress("sweep", str(grid), "--dry-run")
    assert done.returncode == 0, done.stderr


def test_report_errors_are_one_line_with_a_hint(tmp_path):
    assert one_line_error(kvcompress("report", "--results", str(tmp_path / "nothing"))).startswith(
        f"error: results: no runs under '{tmp_path / 'nothing'}': run `kvcompress sweep` first")
    root, _, _ = _broken_results(tmp_path)
    line = one_line_error(kvcompress("report", "--results", str(root), "--report", "nosuch"))
    assert line.startswith("error: --report: expected a .sql file or one of [") and "'summary'" in line


def test_report_warns_about_broken_files_and_check_repair_moves_them(tmp_path):
    root, runs, _ = _broken_results(tmp_path)
    done = kvcompress("report", "--results", str(root), "--sql", "summary")
    assert done.returncode == 0, done.stderr
    assert f"warning: skipping {runs / 'notes.parquet'}: not readable Parquet" in done.stderr
    done = kvcompress("check", "--results", str(root))
    assert done.returncode == 1 and f"{runs / 'notes.parquet'}: runs file is not readable Parquet" in done.stdout
    assert "7 problem(s)" in done.stdout
    done = kvcompress("check", "--results", str(root), "--repair")
    assert done.returncode == 0 and "moved 13 file(s)" in done.stdout
    done = kvcompress("check", "--results", str(root))
    assert done.returncode == 0 and "every run reads back whole" in done.stdout
    done = kvcompress("report", "--results", str(root), "--sql", "summary")
    assert done.returncode == 0 and "warning" not in done.stderr


def _interface_address() -> str | None:
    """This machine's address on a non-loopback interface (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.skipif(_interface_address() is None, reason="no non-loopback interface to reach the server through")
def test_server_binds_loopback_by_default_and_serves_other_machines_only_with_an_auth_string(tmp_path):
    """The multi-machine recipe of docs/many-machines.md as far as one box allows: the script's
    server bound with PREFECT_SERVER_HOST=0.0.0.0 refuses to start without an auth string; with one,
    a client without it gets 401 and one with it gets through, the script's own clients and a worker
    started with http://HOST:PORT/api (HOST an interface address, not loopback) pass it, and
    `kvcompress` without it fails in one line. Without the variable that address is refused. The
    auth string is in no log."""
    from kvcompress_flows.local_server import free_port, healthy, stop_process_group

    address, port = _interface_address(), free_port()
    auth = f"kvcompress:{secrets.token_hex(16)}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "VENV": str(Path(sys.executable).parent.parent)}
    remote_url = f"http://{address}:{port}/api"
    script = ["bash", "scripts/prefect_local.sh"]
    worker_log = tmp_path / "worker.log"
    try:
        subprocess.run([*script, "server"], cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
        assert healthy(env["PREFECT_API_URL"]) and not healthy(remote_url)  # loopback only
        subprocess.run([*script, "stop"], cwd=ROOT, env=env, check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 60
        while healthy(env["PREFECT_API_URL"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        refused = subprocess.run([*script, "server"], cwd=ROOT, env={**env, "PREFECT_SERVER_HOST": "0.0.0.0"},
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and "PREFECT_SERVER_API_AUTH_STRING" in refused.stderr, refused.stderr
        assert not healthy(env["PREFECT_API_URL"])
        served = {**env, "PREFECT_SERVER_HOST": "0.0.0.0", "PREFECT_SERVER_API_AUTH_STRING": auth}
        subprocess.run([*script, "server"], cwd=ROOT, env=served, check=True, capture_output=True, timeout=300)
        assert healthy(remote_url)  # health is open; everything else wants the string
        assert _api_status(remote_url, None) == 401 and _api_status(remote_url, "kvcompress:wrong") == 401
        assert _api_status(remote_url, auth) == 200
        subprocess.run([*script, "pool"], cwd=ROOT, env=served, check=True, capture_output=True, timeout=300)
        line = one_line_error(kvcompress("sweep", "smoke", "--results", str(tmp_path / "r"),
                                         env={"PREFECT_API_URL": remote_url}))
        assert line.startswith(f"error: PREFECT_API_URL={remote_url} requires an auth string: PREFECT_API_AUTH_STRING")
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "kvcompress-shards",
                                   "--limit", "1", "--name", "remote"], cwd=ROOT, start_new_session=True,
                                  env={**env, "PREFECT_API_URL": remote_url, "PREFECT_API_AUTH_STRING": auth},
                                  stdout=worker_log.open("w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not _worker_online(remote_url, "kvcompress-shards", "remote", auth):
                assert worker.poll() is None and time.monotonic() < deadline
                time.sleep(1)
        finally:
            stop_process_group(worker)
    finally:
        subprocess.run([*script, "stop"], cwd=ROOT, env=env, capture_output=True, timeout=60)
    for log in [worker_log, *(tmp_path / "home").glob("*.log")]:
        assert auth.split(":")[1] not in log.read_text(errors="replace"), log


def _api_status(api_url: str, auth: str | None) -> int:
    """The HTTP status of one authenticated API call (listing work pools) sent with `auth`."""
    import urllib.error
    import urllib.request

    from kvcompress_flows.local_server import auth_headers

    request = urllib.request.Request(f"{api_url}/work_pools/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json",
                                              **auth_headers({"PREFECT_API_AUTH_STRING": auth} if auth else {})})
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def _worker_online(api_url: str, pool: str, name: str, auth: str | None = None) -> bool:
    import json
    import urllib.request

    from kvcompress_flows.local_server import auth_headers

    request = urllib.request.Request(f"{api_url}/work_pools/{pool}/workers/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json",
                                              **auth_headers({"PREFECT_API_AUTH_STRING": auth} if auth else {})})
    try:
        workers = json.load(urllib.request.urlopen(request, timeout=5))
    except OSError:
        return False
    return any(w["name"] == name and w.get("status") == "ONLINE" for w in workers)


def test_progress_bar_follows_the_in_process_sweep(monkeypatch, capsys):
    """On a terminal, `kvcompress sweep` shows a rich progress bar fed by the flow's shard progress."""
    from kvcompress_flows import cli
    from kvcompress_flows.sweep import PROGRESS_LISTENERS

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with cli.progress_bar():
        (listener,) = PROGRESS_LISTENERS
        listener(0, 3, "sweep s")
        listener(3, 3, "passkey #2: {'ran': 3}")
    assert PROGRESS_LISTENERS == []
    err = capsys.readouterr().err
    assert "3/3" in err and "passkey #2" in err


def test_progress_bar_counts_each_run_with_an_eta(monkeypatch, capsys):
    """With the plan's run count, the bar advances per run as each one ends (kvcompress.execute's
    RUN_LISTENERS, skipped runs of a resumed sweep included) and shows an ETA."""
    from kvcompress.execute import RUN_LISTENERS
    from kvcompress_flows import cli
    from kvcompress_flows.sweep import PROGRESS_LISTENERS

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with cli.progress_bar(runs=5):
        (ended,) = RUN_LISTENERS
        ended("passkey #0", "skipped")
        ended("full", "ok")
        ended("snapkv budget=0.25", "ok")
    assert RUN_LISTENERS == [] and PROGRESS_LISTENERS == []
    err = capsys.readouterr().err
    assert "runs" in err and "3/5" in err and "snapkv budget=0.25: ok" in err and "ETA" in err


NIGHTLY = "import sys; from kvcompress_flows.sweep import sweep; sweep('smoke', sys.argv[1], sys.argv[2], nightly=True)"


@pytest.mark.slow  # three sweeps of the smoke grid on the embedded model
def test_sweep_resume_check_reports_and_nightly_regression_on_an_object_store(s3_results, tmp_path, monkeypatch):
    """Issue 42 as a user would try it: results on a real S3 API server (credentials and region from
    the usual AWS variables, the endpoint from URL options), flows on a Prefect server that wants an
    auth string. A sweep writes there and ends completed, its rerun skips every finished run, a
    nightly sweep compares itself with it, `check [--repair]`, every report and the HTML report read
    from there; no credential shows in any output, log, artifact, stored object or HTML report."""
    import json
    import urllib.request

    import pyarrow.parquet as pq

    from kvcompress.results import _filesystem
    from kvcompress_flows.local_server import LocalServer, auth_headers
    from tests.s3_server import AWS_ENV, BUCKET

    s3, prefix, url = s3_results
    auth = f"kvcompress:{secrets.token_hex(16)}"
    monkeypatch.setenv("PREFECT_SERVER_API_AUTH_STRING", auth)
    server = LocalServer(log=tmp_path / "server.log")
    api = server.start()
    monkeypatch.delenv("PREFECT_SERVER_API_AUTH_STRING")
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth, "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_LOGGING_TO_API_ENABLED": "true"}
    outputs = []

    def run(*command: str, code: int = 0) -> str:
        done = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == code, done.stdout + done.stderr
        return done.stdout + done.stderr

    first, second = "smoke-20261128-020000", "smoke-20261129-020000"
    cli = ("-m", "kvcompress_flows.cli")
    try:
        assert f"sweep {first}: 3 of 3 runs finished" in run(*cli, "sweep", "smoke", "--results", url, "--sweep-id", first)
        assert "{'skipped': 3, 'ran': 0, 'failed': 0}" in run(*cli, "sweep", "smoke", "--results", url, "--sweep-id", first)
        run("-c", NIGHTLY, url, second)
        fs, _ = _filesystem(url)
        regression = pq.read_table(f"{BUCKET}/{prefix}/regressions/sweep_id={second}/regression.parquet",
                                   filesystem=fs).to_pylist()
        assert len(regression) == 3 and not any(r["regressed"] for r in regression)  # same code, same numbers
        report = run(*cli, "report", "--results", url, "--all", "--html", str(tmp_path / "report.html"))
        assert "== compare_sweeps (3 rows)" in report and "== paired (6 rows)" in report  # 3 configs, 2 sweeps
        assert "every run reads back whole" in run(*cli, "check", "--results", url)
        key = f"{prefix}/runs/sweep_id={second}/method=full/"
        key += s3.keys(key)[0].rsplit("/", 1)[1]
        body = s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
        s3.client().put_object(Bucket=BUCKET, Key=key, Body=body[: len(body) // 2])  # a writer cut off half-way
        assert "1 problem(s)" in run(*cli, "check", "--results", url, code=1)
        assert "moved 3 file(s)" in run(*cli, "check", "--results", url, "--repair")
        assert "every run reads back whole" in run(*cli, "check", "--results", url)
        logs, artifacts = (json.load(urllib.request.urlopen(urllib.request.Request(
            f"{api}/{what}/filter", data=b'{"limit": 200}', method="POST",
            headers={"Content-Type": "application/json", **auth_headers({"PREFECT_API_AUTH_STRING": auth})})))
            for what in ("logs", "artifacts"))
    finally:
        server.stop()
    assert any(f"sweep {second}: 3 of 3 runs finished" in log["message"] for log in logs)  # the flows logged here
    assert {f"sweep-{first}-summary", f"sweep-{second}-regression"} <= {a["key"] for a in artifacts}
    texts = [*outputs, (tmp_path / "server.log").read_text(), json.dumps(logs), json.dumps(artifacts),
             *(p.read_text() for p in tmp_path.glob("*.html")),
             *(s3.client().get_object(Bucket=BUCKET, Key=k)["Body"].read().decode("latin-1") for k in s3.keys(prefix))]
    assert len(list(tmp_path.glob("*.html"))) == 2  # the CLI sweep's (in the working directory: results are remote), --html
    for secret in (auth.split(":")[1], AWS_ENV["AWS_SECRET_ACCESS_KEY"], AWS_ENV["AWS_ACCESS_KEY_ID"]):
        assert not [text[:200] for text in texts if secret in text]


TINY_GRID = ("name: tiny\nmodel: smollm2-135m\ndecode_steps: 2\n"
             "datasets: [{name: passkey, context_tokens: [256], num_samples: 1}]\nmethods: [{name: full}]\n")


def timed_sweep(tmp_path: Path, env: dict, interrupt_on: str | None = None) -> tuple[int, list[tuple[float, str]], float]:
    """`kvcompress sweep` on a one-run grid in a subprocess: (exit status, (time, line) of its output, time
    of its exit). `interrupt_on`: send one SIGINT (Ctrl-C) when a line contains it."""
    import signal

    (tmp_path / "tiny.yaml").write_text(TINY_GRID)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_LOGGING_TO_API_ENABLED": "true", **env}  # as outside the tests: logs go to the API
    proc = subprocess.Popen([sys.executable, "-m", "kvcompress_flows.cli", "sweep", "tiny.yaml", "--results",
                             str(tmp_path / "results")], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if interrupt_on is not None and interrupt_on in line:
                proc.send_signal(signal.SIGINT)
                interrupt_on = None
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, lines, time.monotonic()


def test_a_sweep_without_a_server_exits_within_seconds_of_its_report(tmp_path):
    """Issue 50, items 1 and 2: the sweep's temporary server stops only after Prefect's log and event
    queues were sent (left queued, they were sent at exit to the stopped server: ~70 s of retries, then
    `--- Error logging to API ---`); and a configured server on this machine that does not answer (as
    after `make demo`, whose Makefile exports PREFECT_API_URL) gets a temporary one instead of a failure."""
    from kvcompress_flows.local_server import free_port

    gone = f"http://127.0.0.1:{free_port()}/api"
    code, lines, exited = timed_sweep(tmp_path, {"PREFECT_API_URL": gone})
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    assert f"PREFECT_API_URL={gone} does not answer: starting a temporary local Prefect server" in output
    assert lines[-1][1].startswith("More: ")  # the report's last line is the last thing printed
    assert exited - lines[-1][0] < 15, output[-2000:]  # measured: 1-2 s; 70 s before
    assert "Error logging to API" not in output


def test_ctrl_c_ends_a_sweep_at_once_with_one_line(tmp_path):
    code, lines, exited = timed_sweep(tmp_path, {"PREFECT_API_URL": ""}, interrupt_on="Beginning flow run")
    output = "\n".join(line for _, line in lines)
    interrupted = next(t for t, line in lines if "Beginning flow run" in line)
    assert code == 130 and exited - interrupted < 15, output[-3000:]
    assert lines[-1][1] == "interrupted: finished runs are kept; the same command resumes the rest"
    assert "Traceback" not in output and "Error logging to API" not in output


def test_a_ctrl_c_that_the_flow_engine_swallows_still_ends_the_sweep():
    """Seen under load: a Ctrl-C landing in Prefect's flow-run set-up was caught there and the sweep ran
    to its end (exit 0). The CLI remembers it: the sweep's next step, or the flow's return, raises it."""
    import signal

    from kvcompress_flows import interrupt

    steps, before = [], signal.getsignal(signal.SIGINT)  # (a pytest-xdist worker ignores SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with interrupt.remembered():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises here, at once
            except KeyboardInterrupt:
                steps.append("swallowed")  # as the engine does
            interrupt.check()  # the sweep's next step
            steps.append("ran on")
    assert steps == ["swallowed"]
    assert signal.getsignal(signal.SIGINT) == before
    interrupt.check()  # outside the block: forgotten


@pytest.mark.parametrize("model, reason", [
    ("smollm2-360m", "not in the local Hugging Face cache"),  # a hub id: offline, only the cache can have it
    ("./models/no-such-dir", "no such file or directory"),
])
def test_a_model_that_does_not_exist_fails_validation_before_any_server(tmp_path, model, reason):
    """Issue 50, item 5: `--dry-run` and the real run both refuse it in one line naming the grid's `model:`
    key (it passed `--dry-run`; the run started a Prefect server and failed 27 s later naming `name_or_path`)."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(TINY_GRID.replace("model: smollm2-135m", f"model: {model}"))
    env = {"PREFECT_API_URL": "", "HF_HUB_OFFLINE": "1"}
    for args in (["--dry-run"], []):
        line = one_line_error(kvcompress("sweep", str(grid), "--results", str(tmp_path / "results"), *args, env=env))
        assert line.startswith(f"error: model: expected 'smollm2-135m' (embedded), an mlx-lm model directory or a "
                               f"Hugging Face hub id, got '{model}'") and reason in line, line
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("columns, width", [("200", 100), ("60", 60)])
def test_methods_shows_allowed_values_wrapped_to_the_terminal(columns, width):
    """Issue 50, item 10: no allowed values, two descriptions cut mid-sentence, lines up to 256 characters."""
    from kvcompress import list_methods

    done = kvcompress("methods", env={"COLUMNS": columns})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= width
    text = " ".join(" ".join(lines).split())
    for m in list_methods():
        assert f"{m['name']}: {m['doc']}" in text  # whole: its first paragraph, up to its full stop
    assert "bits: code width of keys and values (2, 3, 4, 8); key_bits / value_bits override it per side" in text
    assert "pooling: \"max\" (paper) or \"avg\"" in text


def test_the_demo_refuses_a_server_of_another_checkout(prefect_server, tmp_path):
    """Issue 50, item 8: `make demo` (scripts/prefect_local.sh server) deployed into any server answering at
    PREFECT_API_URL; one that keeps its state under another PREFECT_HOME is another checkout's."""
    script = ["bash", str(ROOT / "scripts" / "prefect_local.sh"), "server"]
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "VENV": str(Path(sys.executable).parent.parent)}
    ours = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0 and ours.stdout.strip() == f"prefect server: already up at {prefect_server}", ours.stderr
    other = tmp_path / "other-checkout" / ".prefect"
    theirs = subprocess.run(script, env={**env, "PREFECT_HOME": str(other)}, capture_output=True, text=True, timeout=120)
    assert theirs.returncode == 2, theirs.stdout + theirs.stderr
    assert theirs.stderr.startswith(f"error: the Prefect server at {prefect_server} is not this checkout's: its "
                                    f"PREFECT_HOME is {os.environ['PREFECT_HOME']}, this checkout's {other}; stop it")
