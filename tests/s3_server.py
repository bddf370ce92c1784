"""A real S3 API server for the tests: moto's standalone server (PyPI `moto[server]`), a separate
process speaking S3 over HTTP on 127.0.0.1, one per session. Each test gets its own prefix of one
versioned bucket (versions keep every object ever written, so a test can see a temporary object
that was renamed away). Credentials and region come from the usual AWS environment variables, as a
user's would; the endpoint from the URL options `endpoint_override` and `scheme`.

    def test_x(s3_results):        # "s3://kvcompress/<test>-<hex>?endpoint_override=127.0.0.1:PORT&scheme=http"
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

BUCKET = "kvcompress"
# Distinctive values, so a test can grep outputs for them (moto accepts any credentials).
AWS_ENV = {"AWS_ACCESS_KEY_ID": f"KVTESTACCESS{secrets.token_hex(6).upper()}",
           "AWS_SECRET_ACCESS_KEY": f"kvtest-secret-{secrets.token_hex(12)}",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # host:port

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}?endpoint_override={self.endpoint}&scheme=http"

    def client(self):
        """boto3 (installed with moto) for what pyarrow cannot do: bucket versioning, object versions."""
        import boto3

        return boto3.client("s3", endpoint_url=f"http://{self.endpoint}", region_name=AWS_ENV["AWS_DEFAULT_REGION"],
                            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"])

    def keys(self, prefix: str, versions: bool = False) -> list[str]:
        """Every key under `prefix` (with `versions`: every key ever written there, deleted ones too)."""
        client = self.client()
        if versions:
            listing = client.list_object_versions(Bucket=BUCKET, Prefix=prefix)
            return sorted({v["Key"] for v in listing.get("Versions", []) + listing.get("DeleteMarkers", [])})
        return sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))

    def upload(self, local_root: Path, prefix: str) -> str:
        """Copy a local results tree under `prefix`; returns its URL."""
        client = self.client()
        for path in sorted(local_root.rglob("*")):
            if path.is_file():
                client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(local_root).as_posix()}",
                                  Body=path.read_bytes())
        return self.url(prefix)


def _die_with_parent() -> None:
    """In the server's child process, before exec: on Linux, SIGTERM when the test process dies, so a
    killed test session leaves no S3 server behind (the fixture's teardown covers every other end)."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def moto_server(log: Path, env: dict | None = None):
    """A moto server on a free local port, up and answering: yields "127.0.0.1:PORT"; stopped on exit
    (and on Linux when this process dies)."""
    from kvcompress_flows.local_server import free_port, stop_process_group

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=_die_with_parent, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process_group(server, grace_s=5)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    saved = {name: os.environ.get(name) for name in AWS_ENV}
    os.environ.update(AWS_ENV)  # the usual variables: this process and every subprocess read them
    try:
        with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint:
            s3 = S3Server(endpoint)
            s3.client().create_bucket(Bucket=BUCKET)
            s3.client().put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
            yield s3
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def s3_results(s3_server, request):
    """A fresh results root on the S3 server: (server, prefix, URL)."""
    prefix = f"{request.node.name[:40]}-{secrets.token_hex(4)}".replace("[", "-").replace("]", "")
    return s3_server, prefix, s3_server.url(prefix)
