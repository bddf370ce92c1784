"""A lease per shard in the results root, so two launches of one sweep never compute a run twice.

    {root}/_leases/sweep_id={sweep}/{shard key}.lease    JSON {"host", "pid", "token", "at"}

A shard's runner takes the lease before it loads anything and gives it back when the shard is done;
a second launch of the same sweep finds it held and leaves the shard to its owner (runs the owner
finishes are then skipped as finished). A lease is stale, and may be taken over, when its owner is
a process of this host that no longer exists, or when its owner has not renewed it (after each run)
for `stale_s` seconds, whatever host it is on: a `kill -9`, a lost machine.

On a file system the lease file is created with O_EXCL, so of two launches exactly one gets it. An
object store has no exclusive create through pyarrow: there the lease is written and read back, and
the owner is whoever's token reads back (two writes in the same instant can both read back their
own: a narrow window, where the local rule has none). Taking over a stale lease is the same
write-and-read-back on either.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from .results import _filesystem, validate_sweep_id

LEASES = "_leases"  # beside _quarantine: outside every table's glob
STALE_S = 3600.0  # an owner renews after each run; a run is bounded by run_timeout_s (default 1800 s)
UNREADABLE_GRACE_S = 60.0  # a lease file without an owner in it this long is a crashed create: stale


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    token: str
    at: float  # when it was taken or last renewed (time.time())

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, renewed {time.time() - self.at:.0f} s ago"


class ShardLease:
    """The lease of one shard of one sweep. `acquire()` -> whether this process holds it now."""

    def __init__(self, root: str, sweep_id: str, key: str, stale_s: float = STALE_S):
        validate_sweep_id(sweep_id)
        validate_sweep_id(key, "shard key")
        self.fs, base = _filesystem(root)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.directory = f"{base}/{LEASES}/sweep_id={sweep_id}"
        self.path = f"{self.directory}/{key}.lease"
        self.stale_s = stale_s
        self.me = Owner(socket.gethostname(), os.getpid(), uuid.uuid4().hex, time.time())
        self.held = False

    def owner(self) -> Owner | None:
        """The lease's owner as written, or None when there is no lease (or an unreadable one)."""
        try:
            with self.fs.open_input_stream(self.path) as stream:
                return Owner(**json.loads(stream.read()))
        except (OSError, pa.ArrowException, ValueError, TypeError):
            return None

    def is_stale(self, owner: Owner) -> bool:
        if owner.host == self.me.host and owner.pid != self.me.pid:
            try:
                os.kill(owner.pid, 0)
            except ProcessLookupError:
                return True  # its process is gone
            except PermissionError:
                pass
        return time.time() - owner.at > self.stale_s

    def acquire(self) -> bool:
        self.fs.create_dir(self.directory, recursive=True)
        if self.local and self._create_exclusive():
            self.held = True
            return True
        owner = self.owner()
        if owner is not None and owner.token == self.me.token:
            self.held = True
            return True
        if owner is not None and not self.is_stale(owner):
            return False
        if owner is None and self._age_s() < UNREADABLE_GRACE_S:
            return False  # being written by its owner this instant (O_EXCL made it, the JSON follows)
        self._write()  # no lease (object store), or a stale one: take it, and keep it if it reads back
        owner = self.owner()
        self.held = owner is not None and owner.token == self.me.token
        return self.held

    def renew(self) -> None:
        """Say this owner is alive (after each run), so the lease never looks stale while it works."""
        if self.held:
            self.me = Owner(self.me.host, self.me.pid, self.me.token, time.time())
            self._write()

    def release(self) -> None:
        if self.held:
            owner = self.owner()
            if owner is not None and owner.token == self.me.token:
                self.fs.delete_file(self.path)
            self.held = False

    def _age_s(self) -> float:
        """Seconds since the lease file was written; infinite when there is none."""
        info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.NotFound or info.mtime is None:
            return float("inf")
        return time.time() - info.mtime.timestamp()

    def _content(self) -> bytes:
        return json.dumps(self.me.__dict__).encode()

    def _create_exclusive(self) -> bool:
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "wb") as out:
            out.write(self._content())
        return True

    def _write(self) -> None:
        """The whole lease at once (a temp file renamed over it here; one PUT on an object store)."""
        if self.local:
            temporary = f"{self.path}.{self.me.token}.tmp"
            with open(temporary, "wb") as out:
                out.write(self._content())
            os.replace(temporary, self.path)
        else:
            with self.fs.open_output_stream(self.path) as out:
                out.write(self._content())

    def __enter__(self) -> "ShardLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
