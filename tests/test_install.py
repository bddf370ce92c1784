"""A non-editable install (`pip install .`) into a fresh venv works from anywhere: the CLI, the
reports (sql/ found as package data of kvcompress_reports), the built-in grids, a sweep; and it
installs no generic top-level package (`import tasks` / `import flows` fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _setuptools_can_build() -> bool:
    """pyproject's license string needs setuptools >= 77; offline, the build uses the one here."""
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding a non-editable install of a copy of the checkout (files git does not ignore); its dependencies
    come from this environment's site-packages (a path in a .pth file: no download, and this
    environment's editable install of the checkout is not seen there)."""
    if not _setuptools_can_build():
        pytest.skip("needs setuptools >= 77 here to build offline (pip install '.[test]')")
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file() and not name.startswith("tests/"):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]  # .pth-added ones too
    (site / "deps.pth").write_text("\n".join(deps) + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-deps", "--no-build-isolation", "--no-index", str(source)], cwd=base,
                           capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (venv / "install.log").write_text(done.stdout + done.stderr)
    return venv


def test_the_build_warns_of_nothing(installed):
    """Issue 50, item 10: setuptools' box "Package would be ignored" (kvcompress.grids, a folder of data
    files missing from `packages`) printed on every set-up."""
    log = (installed / "install.log").read_text()
    assert "****" not in log and "Warning" not in log, log


def test_python_started_beside_the_clone_imports_this_checkout(tmp_path):
    """Issue 50, item 9: in the folder holding the clone (`git clone` names it kvcompress/, here with the
    results/ a demo leaves), Python found that folder as a namespace package `kvcompress` before the
    editable install ("cannot import name 'TABLES' from 'kvcompress.results' (unknown location)");
    scripts/setup.sh puts the editable install's finder first."""
    (tmp_path / "kvcompress" / "results").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", "from kvcompress.results import TABLES; import kvcompress, "
                           "kvcompress_reports; print(kvcompress.__file__)"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "kvcompress" / "__init__.py")


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**env, "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"})


def test_no_generic_top_level_packages(installed, tmp_path):
    python = str(installed / "bin" / "python")
    for name in ("tasks", "flows"):
        done = run(installed, python, "-c", f"import {name}", cwd=tmp_path)
        assert done.returncode != 0 and f"No module named '{name}'" in done.stderr
    done = run(installed, python, "-c", "import kvcompress, kvcompress_reports as r, kvcompress_tasks, kvcompress_flows; "
               "print(kvcompress.__file__); print(r.__file__); print(r.report_names())", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(str(installed) in line for line in lines[:2])  # the installed copy, not the checkout
    assert "summary" in lines[2] and "pareto" in lines[2]


def test_installed_cli_sweeps_and_reports(installed, tmp_path, prefect_server):
    results = tmp_path / "results"
    done = run(installed, "kvcompress", "sweep", "smoke", "--results", str(results), "--sweep-id", "installed",
               cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    done = run(installed, "kvcompress", "report", "--results", str(results), "--report", "pareto", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "streaming budget=0.5" in done.stdout
    done = run(installed, "kvcompress", "report", "--results", str(results), cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("Sweep installed"), done.stderr[-3000:]
    assert (results / "html" / "installed.html").exists()
    done = run(installed, "kvcompress", "report", "--results", str(results), "--all", "--no-html", cwd=tmp_path)
    assert "== summary" in done.stdout and "compare_sweeps" not in done.stdout  # one sweep: nothing to compare
