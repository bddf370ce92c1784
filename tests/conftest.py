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
# `make test` runs two test processes on two cores: one BLAS thread each (OpenBLAS's default, one a
# core, oversubscribed the cores: model tests ran 10-20% slower); a value set outside wins
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
_prefect_home = Path(tempfile.mkdtemp(prefix="kvcompress-prefect-"))

from kvcompress_flows.local_server import free_port  # noqa: E402  (imports nothing of Prefect)

PREFECT_PORT = free_port()
os.environ["PREFECT_HOME"] = str(_prefect_home)
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{PREFECT_PORT}/api"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"

import kvcompress  # noqa: E402  (loads the optimized BLAS before mlx)
from model_fixtures import tiny_llama  # noqa: E402, F401  (a fixture: pytest finds it here)
from s3_server import s3_results, s3_server  # noqa: E402, F401  (fixtures: a real S3 API server)

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


# Seconds each file of 15 s or more took in a run of `make test` on the 2-core machine (2026-12-08,
# two workers, each file on one worker: `--dist loadfile`; 1341 s wall). The files run longest first
# and the Makefile turns off xdist's own order (by the number of tests a file has), so a worker that
# frees takes the longest file left: the two workers end close together. Only the order depends on
# these figures, never a result.
FILE_SECONDS = {
    "test_cli.py": 302, "test_flow.py": 276, "test_kernel_sources.py": 221, "test_runner.py": 221,
    "test_shard_workers.py": 206, "test_metal_on_cpu.py": 133, "test_attacks.py": 120,
    "test_architectures.py": 111, "test_short_prompts.py": 99, "test_dask_shards.py": 97,
    "test_reports.py": 96, "test_tables.py": 59, "test_readme.py": 48, "test_oneline.py": 45,
    "test_methods.py": 45, "test_generation.py": 40, "test_expected_attention.py": 36, "test_composed.py": 36,
    "test_turboquant.py": 32, "test_install.py": 29, "test_kivi.py": 27, "test_prefill_peak.py": 26,
    "test_kvzip.py": 26, "test_model.py": 25, "test_reference_selection.py": 22, "test_scored_once.py": 20,
    "test_load_prompt_cache.py": 20, "test_speed.py": 18, "test_fromgguf.py": 18, "test_benchmarks.py": 18,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's own order stays
