"""A real S3-compatible server on loopback (moto's server mode), reached through boto3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nccl_back.dev.servers import LocalProcess, python_server


@dataclass
class LocalS3(LocalProcess):
    """A real S3-compatible HTTP server (``moto_server``, in memory) in its own process;
    :attr:`env` points boto3 at it with throw-away credentials."""

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
        self._spawn([*python_server("moto_server", "moto.server"), "-H", "127.0.0.1",
                     "-p", self._port()], "moto_server", timeout)
        return self

    def client(self, endpoint: str | None = None) -> Any:
        """A real boto3 S3 client on this server (or on ``endpoint``, a proxy in front of it)."""
        import boto3

        env = self.env
        return boto3.session.Session(
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        ).client("s3", endpoint_url=endpoint or self.endpoint)
