"""A real GCS emulator on loopback, reached through the real ``google-cloud-storage`` client."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nccl_back.dev.servers import LocalProcess, python_server


@dataclass
class LocalGCS(LocalProcess):
    """A real GCS emulator (``gcp-storage-emulator``, in memory) on loopback, reached
    through ``STORAGE_EMULATOR_HOST`` = :attr:`host`."""

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> LocalGCS:
        self._spawn([*python_server("gcp-storage-emulator", "gcp_storage_emulator"), "start",
                     "--host", "127.0.0.1", "--port", self._port(), "--in-memory", "-q"],
                    "gcp-storage-emulator", timeout)
        return self

    def client(self) -> Any:
        """A real ``google.cloud.storage.Client`` pointed at this emulator."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        os.environ["STORAGE_EMULATOR_HOST"] = self.host
        return storage.Client(project="test", credentials=AnonymousCredentials())
