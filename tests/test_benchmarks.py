"""The benchmark suites' entry point (benchmarks/__main__.py): it lists the suites, every step of every
suite names a script that exists, and the smallest suite (the CPU kernels at smoke sizes) runs."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["quality", "e2e", "kernels", "memory", "workers"]


def bench(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_the_suites():
    out = bench("--help")
    assert out.returncode == 0, out.stderr
    for suite in SUITES:
        assert suite in out.stdout


def test_an_unknown_suite_is_refused_by_name():
    out = bench("speed")
    assert out.returncode == 2
    assert "invalid choice: 'speed'" in out.stderr


@pytest.mark.parametrize("variant", [[], ["--quick"], ["--gpu"]])
def test_every_step_names_a_script_that_exists(variant):
    out = bench(*SUITES, "--dry-run", *variant)
    assert out.returncode == 0, out.stderr
    steps = [line.split(": ", 1)[1].split() for line in out.stdout.splitlines() if line.startswith("== ")]
    assert len(steps) >= len(SUITES)
    for step in steps:
        script = step[1] if step[0] in ("python", "bash") else step[0]
        assert (ROOT / script).is_file(), step


@pytest.mark.slow  # the embedded model decodes a few tokens (matmul_gflops.py)
def test_the_cpu_kernels_suite_runs_at_smoke_sizes():
    out = bench("kernels", "--quick", timeout=300)
    assert out.returncode == 0, out.stderr
    for script in ("matmul_gflops.py", "kivi_cpu.py", "eviction_update.py"):
        assert f"== {script}: " in out.stdout
    # which BLAS the project loaded, not how fast it ran: a speed ratio is timing luck on a busy
    # machine (the ~17x lives in the benchmark's table, not here)
    assert "kvcompress BLAS: " in out.stdout and "libopenblas" in out.stdout, out.stdout
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["256"])
    assert float(row[1]) > 0 and float(row[2]) > 0 and row[-1].endswith("x"), row
    assert "| h2o | 256 | 3 |" in out.stdout and "| streaming | 256 | 3 |" in out.stdout


def test_run_grid_measures_a_speed_grid_without_prefect(tmp_path):
    """benchmarks/run_grid.py runs a speed grid's groups in-process (the lent GPU has no Prefect), into
    the `speed` table, and a rerun skips the finished measurements."""
    grid = tmp_path / "tiny-speed.yaml"
    grid.write_text("kind: speed\nname: tiny-speed\nmodel: {shape: tiny-llama, dtype: float32}\n"
                    "context_tokens: [64]\nbatch: [2]\nsteps: 2\nrounds: 1\nwarmup: 1\n"
                    "methods:\n  - name: full\n  - name: streaming\n    grid: {budget: [0.5]}\n")
    results = tmp_path / "results"
    command = [sys.executable, "benchmarks/run_grid.py", str(grid), "--results", str(results)]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "{'skipped': 0, 'ran': 2, 'failed': 0}" in out.stdout
    files = sorted(p.parent.name for p in (results / "speed" / "sweep_id=tiny-speed").rglob("*.parquet"))
    assert files == ["method=full", "method=streaming"]
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "{'skipped': 2, 'ran': 0, 'failed': 0}" in again.stdout, again.stdout + again.stderr
