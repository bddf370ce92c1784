"""Shared fixtures: offline hub settings, the embedded model, one real Prefect server per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

# Before anything imports prefect or datasets: no network, an isolated Prefect home and API.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_prefect_home = Path(tempfile.mkdtemp(prefix="kvcompress-prefect-"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PREFECT_PORT = _free_port()
os.environ["PREFECT_HOME"] = str(_prefect_home)
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{PREFECT_PORT}/api"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"

import kvcompress  # noqa: E402  (loads the optimized BLAS before mlx)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M, loaded once."""
    return kvcompress.load_model("smollm2-135m")


def _healthy(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect server (SQLite in a temp PREFECT_HOME, 127.0.0.1), started once per session."""
    api = os.environ["PREFECT_API_URL"]
    log = open(_prefect_home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
         "--port", str(PREFECT_PORT), "--no-ui"],
        stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
    )
    deadline = time.monotonic() + 90
    while not _healthy(api):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"Prefect server failed to start:\n{(_prefect_home / 'server.log').read_text()}")
        time.sleep(0.5)
    yield api
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
