"""A local Prefect server whose life is tied to the process that started it.

Prefect's own ephemeral mode (no `PREFECT_API_URL`) starts a temporary API server that outlives
a `kill -9` of its parent (PLATFORM.md: uvicorn with PPID 1, still listening). Here the server runs
under a small watchdog (`python -m kvcompress_flows.local_server`) whose stdin is a pipe from the
parent: when the parent exits, however it exits, the pipe closes and the watchdog stops the server's whole
process group (SIGTERM, then SIGKILL after a grace period). Used by `kvcompress sweep` when no
server is configured, and by the tests; `scripts/prefect_local.sh` runs long-lived servers.

    with LocalServer() as api:      # api == "http://127.0.0.1:PORT/api", healthy
        ...

Processes started elsewhere (workers in tests) are stopped with `stop_process_group`. A server
bound beyond loopback needs Prefect's basic auth (`PREFECT_SERVER_API_AUTH_STRING`; clients send
`PREFECT_API_AUTH_STRING`): `require_auth` refuses to start one without it.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

STOP_GRACE_S = 20.0


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address (a name is resolved: a string
    that starts with "127." may be a name, "127.0.0.1.example.com", of any address)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False  # unresolvable here: not provably this machine
    return bool(addresses) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)


def require_auth(host: str, environ=os.environ) -> None:
    """Refuse to serve the API beyond this machine without an auth string: Prefect's API has no other
    access control, so anyone who reaches the port could run flows (code) on the workers."""
    if environ.get("PREFECT_SERVER_API_AUTH_STRING") or is_loopback(host):
        return
    from kvcompress.errors import ConfigError

    raise ConfigError(f"PREFECT_SERVER_HOST={host} serves the API beyond this machine: set an auth string first, "
                      "e.g. export PREFECT_SERVER_API_AUTH_STRING=\"kvcompress:$(python3 -c 'import secrets; "
                      "print(secrets.token_hex(16))')\", and on every client and worker machine "
                      "PREFECT_API_AUTH_STRING with the same value (docs/many-machines.md)")


def auth_headers(environ=os.environ) -> dict[str, str]:
    """The Authorization header Prefect's clients send for PREFECT_API_AUTH_STRING (none when unset)."""
    auth = environ.get("PREFECT_API_AUTH_STRING")
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback_url(api_url: str) -> bool:
    """Whether `api_url` names a server on this machine's loopback interface."""
    return is_loopback(urllib.parse.urlparse(api_url).hostname or "")


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout)
        return True
    except OSError:
        return False


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL it after `grace_s`; never raises.

    Prefect workers on a busy 2-core machine can take over 30 s to exit after SIGTERM (they relay
    it as SIGINT and wait for their flow runs), so waiting alone is not a way to stop them."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; anything left in its group goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return


def drain_prefect_clients(timeout_s: float = 10.0) -> None:
    """Send what this process's Prefect clients still hold (the API log handler's queue, the events
    queue) while the server still answers. Left queued, they are sent at interpreter exit to a server
    that is gone: Prefect retries for over a minute, then prints `--- Error logging to API ---`."""
    if "prefect" not in sys.modules:  # nothing of Prefect's ran in this process: nothing queued
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):  # logs first: sending them may emit events
        service.drain_all(timeout=timeout_s)


class LocalServer:
    """`prefect server start` on 127.0.0.1 (or `host`) under a parent-death watchdog."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, log: Path | None = None,
                 ui: bool = False, start_timeout_s: float = 300.0):
        self.host, self.port = host, port or free_port(host)
        self.api_url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}/api"
        self.log, self.ui, self.start_timeout_s = log, ui, start_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        require_auth(self.host)
        out = open(self.log, "w") if self.log else subprocess.DEVNULL
        command = [sys.executable, "-m", "kvcompress_flows.local_server", self.host, str(self.port), "ui" if self.ui else "no-ui"]
        # the dashboard's JavaScript calls the API at PREFECT_UI_API_URL (default: port 4200)
        env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": self.api_url}
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout_s
        while not healthy(self.api_url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                detail = self.log.read_text()[-3000:] if self.log else ""
                raise RuntimeError(f"Prefect server at {self.api_url} did not become healthy\n{detail}")
            time.sleep(0.5)
        return self.api_url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            drain_prefect_clients()
            self.proc.stdin.close()  # the watchdog stops the server and exits
            try:
                self.proc.wait(timeout=STOP_GRACE_S + 15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _watchdog(host: str, port: str, ui: str) -> int:
    """Run the server in its own process group; stop the group when stdin closes (parent gone)."""
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", port]
    if ui != "ui":
        command.append("--no-ui")
    server = subprocess.Popen(command, start_new_session=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop_process_group(server) or sys.exit(0))
    try:
        sys.stdin.buffer.read()  # blocks until the parent closes the pipe or dies
    finally:
        stop_process_group(server)
    return 0


def _check_bind(host: str) -> int:
    """`python -m kvcompress_flows.local_server check-bind HOST`: require_auth for scripts/prefect_local.sh."""
    from kvcompress.errors import ConfigError

    try:
        require_auth(host)
    except ConfigError as exc:  # one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_home(api_url: str, home: str) -> int:
    """`python -m kvcompress_flows.local_server check-home URL PREFECT_HOME`: for scripts/prefect_local.sh, refuse
    (exit 2, one line) a server answering at URL that keeps its state under another PREFECT_HOME: another
    checkout's, into which `make demo` would deploy this one's flows (their code would run from that checkout)."""
    import json

    request = urllib.request.Request(api_url.rstrip("/") + "/admin/settings", headers=auth_headers())
    try:
        theirs = json.load(urllib.request.urlopen(request, timeout=30)).get("home")
    except (OSError, ValueError):
        return 0  # not readable: Prefect's own errors follow
    if theirs and Path(theirs).resolve() != Path(home).resolve():
        print(f"error: the Prefect server at {api_url} is not this checkout's: its PREFECT_HOME is {theirs}, this "
              f"checkout's {home}; stop it (`make stop` in its checkout) or use another port, e.g. "
              f"PREFECT_API_URL=http://127.0.0.1:{free_port()}/api make demo", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    commands = {"check-bind": lambda: _check_bind(sys.argv[2]), "check-home": lambda: _check_home(*sys.argv[2:4])}
    sys.exit(commands[sys.argv[1]]() if sys.argv[1] in commands else _watchdog(*sys.argv[1:4]))
