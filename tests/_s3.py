"""A real S3-compatible server for the tests: moto's server mode (``moto[server]``), one per test
session and xdist worker, on 127.0.0.1 and a free port.

Tests talk to it the way users talk to S3: through the standard AWS environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), which pyarrow's ``S3FileSystem`` and boto3 read.
:class:`S3Server` can be stopped and started again on the same port (the server stopped mid-write);
its buckets live in the server process and are gone after a stop.

moto 5.2.5 or later: with 5.2.1, pyarrow's multipart upload fails in ``CompleteMultipartUpload``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ACCESS_KEY = "hetflow-test-key"
SECRET_KEY = "hetflow-test-secret"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """A moto server process on ``127.0.0.1:port``; ``env`` is what a client needs to reach it."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"moto-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The AWS environment that points a client (pyarrow, boto3, a ``hetflow run``) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",   # no 1-s probes of an instance metadata service
        }

    def start(self) -> None:
        """Start the server and wait until it answers (at most 30 s)."""
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.process.returncode}; "
                                   f"see {self.log_path}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.endpoint} in 30 s; see {self.log_path}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset endpoint)."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def client(self):  # type: ignore[no-untyped-def]
        """A boto3 client on this server, for tests that look at or damage objects directly."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or f"hf-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server for the session (per xdist worker)."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The session's server, with its AWS environment set in this process (and so in the processes
    a test starts without an ``env=`` of its own)."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    yield s3_server


@pytest.fixture
def s3_bucket(s3_env: S3Server) -> str:
    """A fresh empty bucket on the session's server (its AWS environment set)."""
    return s3_env.make_bucket()


def s3_environ(server: S3Server) -> dict[str, str]:
    """``os.environ`` with ``server``'s AWS variables, for a subprocess's ``env=``."""
    env = dict(os.environ)
    env.update(server.env)
    return env
