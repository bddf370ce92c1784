"""Ctrl-C that always ends a sweep.

Prefect's flow engine catches a KeyboardInterrupt that lands in parts of its own code (seen under
load: a Ctrl-C during the flow run's set-up was swallowed and the sweep ran to its end). So the CLI's
Ctrl-C is also remembered, and the sweep raises it again at its next step (`check()`, called between
datasets and shards) and once more when the flow returns: a sweep never ignores the user's Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_requested = threading.Event()


@contextlib.contextmanager
def remembered():
    """Within: the first Ctrl-C raises KeyboardInterrupt as usual and is remembered until the block ends."""
    _requested.clear()

    def on_sigint(signum, frame):
        _requested.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
        check()  # the flow returned although the user pressed Ctrl-C
    finally:
        signal.signal(signal.SIGINT, previous)
        _requested.clear()


def check() -> None:
    """Raise KeyboardInterrupt if the user pressed Ctrl-C (in a `remembered()` block) and it was swallowed."""
    if _requested.is_set():
        raise KeyboardInterrupt
