"""End an in-process sweep in one line when its Prefect server dies.

A flow run in this process reports every state change to the server; once the server is gone each
report is retried with back-off (PREFECT_CLIENT_MAX_RETRIES, ~1 min a request), so a sweep whose
server died used to take minutes to fail, with a long traceback at the end. Here a thread asks the
server's /health every second; after GRACE_S seconds without any answer it prints one `error:` line
and ends the process. Nothing is lost: every finished run is already in the results (each written
whole), a run cut short is rerun by the next sweep, and its shard's lease is stale once this
process is gone (kvcompress/leases.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import urllib.error
import urllib.request

GRACE_S = 15.0  # a server restarting, or slow on a busy machine, answers within this
POLL_S = 1.0


def answers(api_url: str, timeout_s: float = 5.0) -> bool:
    """Whether anything answers at the server's /health (an HTTP error is an answer: auth, a proxy)."""
    try:
        urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout_s)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


@contextlib.contextmanager
def exit_when_server_dies(api_url: str, grace_s: float = GRACE_S):
    """Within this block, the process ends with exit status 1 and one line once `api_url` has not
    answered for `grace_s` seconds."""
    done = threading.Event()

    def watch() -> None:
        silent_since = None
        while not done.wait(POLL_S):
            if answers(api_url):
                silent_since = None
                continue
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since >= grace_s and not done.is_set():
                print(f"error: the Prefect server at {api_url} stopped answering ({grace_s:.0f} s): the sweep "
                      "stopped; every finished run is kept, rerun to resume", file=sys.stderr, flush=True)
                os._exit(1)  # the flow cannot report, finish or fail without its server

    thread = threading.Thread(target=watch, name="prefect-server-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
