"""A real S3-compatible server on loopback (moto's server mode), reached through boto3."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nccl_back.dev.servers import _wait_port, free_port


@dataclass
class LocalS3:
    """A real S3-compatible HTTP server (``moto_server``, in memory) in its own process.

    boto3 reaches it through the standard ``AWS_ENDPOINT_URL_S3`` with throw-away
    credentials: :attr:`env` holds them (pass it to child processes, or set it).
    """

    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment that points boto3 (and so ``s3://`` reads) at this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # Never wait on an instance-metadata endpoint that is not there.
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self, timeout: float = 60.0) -> LocalS3:
        if not self.port:
            self.port = free_port()
        exe = Path(sys.executable).parent / "moto_server"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        self.proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port("127.0.0.1", self.port, self.proc, time.monotonic() + timeout, "moto_server")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def client(self, endpoint: str | None = None) -> Any:
        """A real boto3 S3 client on this server (or on ``endpoint``, a proxy in front of it)."""
        import boto3

        env = self.env
        return boto3.session.Session(
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        ).client("s3", endpoint_url=endpoint or self.endpoint)

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
