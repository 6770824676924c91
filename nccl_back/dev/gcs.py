"""A real GCS emulator on loopback, reached through the real ``google-cloud-storage`` client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nccl_back.dev.servers import _wait_port, free_port


@dataclass
class LocalGCS:
    """A real GCS emulator (``gcp-storage-emulator``, in memory) on loopback.

    The real ``google-cloud-storage`` client reaches it through ``STORAGE_EMULATOR_HOST``
    (see :attr:`host`; pass ``env=`` to child processes or set it yourself).
    """

    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> LocalGCS:
        if not self.port:
            self.port = free_port()
        exe = Path(sys.executable).parent / "gcp-storage-emulator"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gcp_storage_emulator"]
        self.proc = subprocess.Popen(
            [*cmd, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory", "-q"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port("127.0.0.1", self.port, self.proc, time.monotonic() + timeout, "gcp-storage-emulator")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def client(self) -> Any:
        """A real ``google.cloud.storage.Client`` pointed at this emulator."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        os.environ["STORAGE_EMULATOR_HOST"] = self.host
        return storage.Client(project="test", credentials=AnonymousCredentials())

    def __enter__(self) -> LocalGCS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
