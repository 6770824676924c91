"""A real Azure Blob Storage emulator on loopback: Microsoft's Azurite, reached through
the real ``azure-storage-blob`` client. Installed from npm on first use into
:func:`azurite_dir`, under a file lock (parallel tests install it once) and a deadline;
without ``node`` and ``npm`` :class:`AzuriteUnavailable` is the one reason tests skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from nccl_back.dev.servers import LocalProcess
from nccl_back.errors import NcclBackError

#: The Azurite release the tests run against (pinned: a fresh machine gets this one).
AZURITE_VERSION = "3.37.0"
#: Azurite's one account and its well-known key (Microsoft's, published for the emulator).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Seconds an install may take (downloads ~450 packages; ~20 s on a good link).
INSTALL_TIMEOUT = 600.0


class AzuriteUnavailable(NcclBackError):
    """Azurite cannot run here: no ``node`` or ``npm`` on ``PATH`` (the message says which)."""


def azurite_dir() -> Path:
    """Where Azurite is (to be) installed."""
    given = os.environ.get("NCCL_BACK_AZURITE_DIR")
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nccl-back" / f"azurite-{AZURITE_VERSION}"


def _binary(root: Path) -> Path:
    return root / "node_modules" / ".bin" / "azurite-blob"


@contextlib.contextmanager
def _locked(path: Path, deadline: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, waited for until ``deadline`` (monotonic)."""
    with open(path, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise NcclBackError(f"another process held {path} for the whole install"
                                        " deadline; remove it if no install is running") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def install(timeout: float = INSTALL_TIMEOUT) -> Path:
    """The ``azurite-blob`` executable, installed from the npm registry on first use."""
    root = azurite_dir()
    if _binary(root).exists():
        return _binary(root)
    missing = [t for t in ("node", "npm") if shutil.which(t) is None]
    if missing:
        raise AzuriteUnavailable(f"Azurite needs Node.js and npm; {' and '.join(missing)} not on"
                                 " PATH (install Node.js 18 or newer with npm)")
    root.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with _locked(root.parent / f".{root.name}.lock", deadline):
        if _binary(root).exists():  # another process installed it while we waited
            return _binary(root)
        # Into a fresh directory renamed into place: a killed install leaves no half tree.
        work = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
        try:
            argv = ["npm", "install", "--prefix", str(work), f"azurite@{AZURITE_VERSION}",
                    "--no-audit", "--no-fund", "--no-save", "--omit=dev", "--ignore-scripts",
                    "--loglevel=error"]
            try:
                proc = subprocess.run(argv, capture_output=True, text=True,
                                      timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                raise NcclBackError(f"`{' '.join(argv[:2])} azurite@{AZURITE_VERSION}` took over"
                                    f" {timeout:.0f} s; check the npm registry is reachable") from e
            if proc.returncode != 0 or not _binary(work).exists():
                tail = " ".join((proc.stderr or proc.stdout).split())[-500:]
                raise NcclBackError(f"installing Azurite {AZURITE_VERSION} with npm failed"
                                    f" (exit {proc.returncode}): {tail}")
            if root.exists():  # a tree without its executable: damaged, replaced whole
                shutil.rmtree(root)
            os.rename(work, root)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _binary(root)


@dataclass
class LocalAzurite(LocalProcess):
    """Azurite's Blob service (in memory) on a loopback port, with its one account;
    :attr:`env` points the ``az://`` backend at it."""

    @property
    def endpoint(self) -> str:
        """The account's blob endpoint (path-style, as Azurite serves it)."""
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def connection_string(self, endpoint: str | None = None) -> str:
        """A connection string with the account key, to this server or to ``endpoint``
        (a proxy in front of it: the account's path included)."""
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint={endpoint or self.endpoint};")

    @property
    def env(self) -> dict[str, str]:
        """The environment that points ``az://`` reads at this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def start(self, timeout: float = 60.0) -> LocalAzurite:
        binary = install()
        # In memory, no telemetry (nothing leaves the machine), and any API version: the
        # Python client may be newer than the emulator.
        self._spawn([str(binary), "--blobHost", "127.0.0.1", "--blobPort", self._port(),
                     "--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck",
                     "--silent"], "azurite-blob", timeout)
        return self

    def client(self, endpoint: str | None = None) -> Any:
        """A real ``BlobServiceClient`` on this server (or on ``endpoint``)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string(endpoint))

    def sas(self, container: str, *, expires_in: float = 3600.0) -> str:
        """A read-and-list SAS token for ``container`` (negative: already expired)."""
        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        now = datetime.now(timezone.utc)
        return generate_container_sas(
            ACCOUNT, container, account_key=KEY,
            permission=ContainerSasPermissions(read=True, list=True),
            start=now - timedelta(hours=2), expiry=now + timedelta(seconds=expires_in))
