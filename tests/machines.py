"""Directories standing for machines, for tests of many-machine set-ups on one host: each has its own
working directory, home, caches and Prefect home, and processes started on it get an environment built
from nothing but the install (PATH, PYTHONPATH), the Prefect API and the store's AWS variables, as a
worker machine set up from docs/many-machines.md would have."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from kvcompress_flows.local_server import stop_process_group
from s3_server import AWS_ENV


class Machine:
    def __init__(self, base: Path, name: str, api_url: str):
        self.name, self.dir = name, base / name
        self.env = {
            "PATH": os.environ["PATH"], "HOME": str(self.dir / "home"), "PREFECT_HOME": str(self.dir / "prefect"),
            "XDG_CACHE_HOME": str(self.dir / "cache"), "KVCOMPRESS_CACHE": str(self.dir / "cache" / "kvcompress"),
            "HF_HOME": str(self.dir / "cache" / "huggingface"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PREFECT_API_URL": api_url, "PREFECT_WORKER_QUERY_SECONDS": "1", **AWS_ENV,
        }
        if "PYTHONPATH" in os.environ:  # the install under test, when it is not the venv's own
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        for sub in ("work", "home", "prefect", "cache"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def start(self, command: list[str], until, timeout_s: float = 300) -> None:
        """Run `command` in the machine's working directory, in its own session, until `until()` holds."""
        log = self.dir / f"{self.name}.log"
        self.proc = subprocess.Popen(command, cwd=self.dir / "work", env=self.env, stdout=log.open("a"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not until():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def flow_runs(self) -> list[str]:
        """Ids of the flow runs executing under this machine's process (their PREFECT__FLOW_RUN_ID)."""
        ids = []
        for child in self.descendants():
            try:
                ids.append(child.environ()["PREFECT__FLOW_RUN_ID"])
            except (psutil.Error, KeyError):
                continue
        return ids

    def die(self) -> None:
        """SIGKILL the process and every process under it, as a machine that loses power."""
        for process in [*self.descendants(), psutil.Process(self.proc.pid)]:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for child in self.descendants():  # a flow run in its own session is not in the process group
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            stop_process_group(self.proc)
