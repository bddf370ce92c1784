"""A sweep's shards on a Dask cluster (`prefect-dask`'s DaskTaskRunner): the engine for where Prefect
workers are not wanted, e.g. a Dask cluster that already exists.

`dask` names the cluster: `local:N` starts a LocalCluster of N worker processes on this machine for
the sweep's duration; `tcp://HOST:PORT` (or `tls://...`) joins a running scheduler whose workers run
on any machine that reaches the Prefect API and the results store. Every Dask worker must run one
thread (`dask worker ADDRESS --nthreads 1`; checked before any shard is submitted): one shard at a
time per process, so one MLX (one model, one Metal/CUDA stream) per process: two shards in one
process would share both, and MLX does not promise that concurrent threads are safe.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Callable

from kvcompress.errors import ConfigError
from kvcompress.sweep import Shard

LOCAL = re.compile(r"local:([1-9][0-9]*)")
SCHEDULER = re.compile(r"(tcp|tls)://[^\s/]+:[0-9]+")


def validate_dask(value: str | None, field: str = "dask") -> str | None:
    """None, `local:N` (N >= 1) or a scheduler address `tcp://HOST:PORT` / `tls://HOST:PORT`."""
    if value is None or (isinstance(value, str) and (LOCAL.fullmatch(value) or SCHEDULER.fullmatch(value))):
        return value
    raise ConfigError(f"{field}: expected local:N (N >= 1 worker processes on this machine) or a Dask scheduler "
                      f"address tcp://HOST:PORT or tls://HOST:PORT, got {value!r}")


def task_runner(dask: str):
    """The DaskTaskRunner for `dask` (validated): a LocalCluster of one-thread processes, or a scheduler."""
    from prefect_dask import DaskTaskRunner  # imported here: inline and Prefect-worker sweeps do not need Dask

    local = LOCAL.fullmatch(dask)
    if local is None:
        return DaskTaskRunner(address=dask)
    # processes, not threads (one MLX each); no dashboard: it would claim a port nobody asked for
    return DaskTaskRunner(cluster_class="distributed.LocalCluster",
                          cluster_kwargs={"n_workers": int(local.group(1)), "threads_per_worker": 1, "processes": True,
                                          "dashboard_address": None})


@contextlib.contextmanager
def errors_only(prefix: str = "distributed"):
    """Only errors from the cluster's loggers in this process: its INFO lines and its warnings at close
    ("killing" workers that take over 4 s to exit, as on a busy machine) are not the sweep's story
    (38 lines for a two-worker sweep). distributed gives its loggers their own levels: each one is set."""
    import distributed  # noqa: F401  (creates its loggers)

    names = [prefix, *(n for n in list(logging.root.manager.loggerDict) if n.startswith(prefix + "."))]
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def run_on_dask(dask: str, shards: tuple[Shard, ...], shard_args: dict, advance: Callable[[str], None],
                timeout_s: float) -> None:
    """Submit every shard's `run-shard` task to the cluster, then wait for all of them (at most `timeout_s`).

    A failed shard (its task retries first, as inline) or one past the timeout leaves its runs unfinished
    for the next rerun, as on Prefect workers (a shard whose worker process died is Dask's to reschedule)."""
    from prefect.futures import as_completed

    from kvcompress_tasks.sweep import run_shard  # imports Prefect: not at the top, which the CLI imports

    with errors_only(), task_runner(dask) as runner:
        threaded = {address: w["nthreads"] for address, w in runner.client.scheduler_info()["workers"].items()
                    if w["nthreads"] != 1}
        if threaded:
            raise ConfigError(f"dask: every worker must run one thread (dask worker {dask} --nthreads 1: one MLX per "
                              f"process), got threads per worker {threaded}")
        futures = {runner.submit(run_shard, parameters={"shard": shard, **shard_args}): shard for shard in shards}
        try:
            for future in as_completed(list(futures), timeout=timeout_s):
                shard = futures[future]
                future.wait()  # done: this fetches the task's final state from its Dask future
                advance(f"{shard.dataset} #{shard.sample_index}: {future.state.name}")
        except TimeoutError:
            pass  # the sweep counts finished runs and asks for a rerun
