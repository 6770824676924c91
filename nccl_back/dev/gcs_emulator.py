"""A real GCS emulator on loopback, reached through the real ``google-cloud-storage`` client."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Any

from nccl_back.dev.servers import LocalProcess, free_port, python_server


@dataclass
class LocalGCS(LocalProcess):
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
        self._spawn([*python_server("gcp-storage-emulator", "gcp_storage_emulator"), "start",
                     "--host", "127.0.0.1", "--port", str(self.port), "--in-memory", "-q"],
                    "gcp-storage-emulator", timeout)
        return self

    def client(self) -> Any:
        """A real ``google.cloud.storage.Client`` pointed at this emulator."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        os.environ["STORAGE_EMULATOR_HOST"] = self.host
        return storage.Client(project="test", credentials=AnonymousCredentials())
