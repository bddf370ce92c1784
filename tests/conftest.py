"""Shared fixtures: offline hub settings, the embedded model, one real Prefect server per session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Before anything imports prefect or datasets: no network, an isolated Prefect home and API.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# MLX's CUDA back-end runs float32 matmuls in TF32 (10-bit mantissa) unless told not to; the tests
# compare float32 caches against float64 references and rank near-ties, so they need true float32
# (on the H200 four test_eviction cases failed with TF32 and passed without it)
os.environ.setdefault("MLX_ENABLE_TF32", "0")
_prefect_home = Path(tempfile.mkdtemp(prefix="kvcompress-prefect-"))

from kvcompress_flows.local_server import free_port  # noqa: E402  (imports nothing of Prefect)

PREFECT_PORT = free_port()
os.environ["PREFECT_HOME"] = str(_prefect_home)
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{PREFECT_PORT}/api"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"

import kvcompress  # noqa: E402  (loads the optimized BLAS before mlx)
from model_fixtures import tiny_llama  # noqa: E402, F401  (a fixture: pytest finds it here)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M, loaded once."""
    return kvcompress.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect server with its dashboard (SQLite in a temp PREFECT_HOME, 127.0.0.1), started
    once per session, under the watchdog that stops it with this process however the session ends."""
    from kvcompress_flows.local_server import LocalServer

    server = LocalServer(port=PREFECT_PORT, log=_prefect_home / "server.log", ui=True)
    yield server.start()
    server.stop()
