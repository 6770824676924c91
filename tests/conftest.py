"""Shared fixtures: a real redis-server, a real GCS emulator, a real S3-compatible
server and Azurite (Microsoft's Azure Storage emulator) on loopback.

Nothing here mocks Redis or storage; the only thing that cannot exist on these
machines is a GPU, and tests that need one carry the ``gpu`` marker.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from nccl_back.dev.azurite import AzuriteUnavailable, LocalAzurite, install
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.s3_emulator import LocalS3
from nccl_back.dev.servers import LocalRedis
from nccl_back.errors import NcclBackError

#: Why Azurite could not be installed, if it could not (set once, at collection).
_AZURITE_INSTALL: list[NcclBackError] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # NB_GPU_REHEARSAL=1: run the gpu tests that can on CPU, over gloo (their harness
    # rehearsed before a device run; see tests/test_relay_gpu.py).
    if torch.cuda.is_available() or os.environ.get("NB_GPU_REHEARSAL") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with NCCL (run scripts/gpu_check.sh there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One real redis-server for the session; tests isolate themselves by namespace."""
    server = LocalRedis().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    """A fresh key namespace per test, so tests sharing one Redis never see each other."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def gcs() -> Iterator[LocalGCS]:
    """One real GCS emulator for the session, reached by the real google-cloud-storage client."""
    emulator = LocalGCS().start()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.host
    yield emulator
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old
    emulator.stop()


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process's environment, the old values back after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3() -> Iterator[LocalS3]:
    """One real S3-compatible server (moto) for the session; boto3 reaches it through
    the standard AWS_ENDPOINT_URL_S3 and throw-away credentials in the environment."""
    server = LocalS3().start()
    with _environment(server.env):
        yield server
    server.stop()


def pytest_collection_finish(session: pytest.Session) -> None:
    # One fork server per pytest process, started by the first test that forks: its
    # preload is the union every module's children need, whichever module set one last.
    # Only where a collected module imported tests/groups.py (not in the vLLM suite).
    groups = sys.modules.get("groups")
    if groups is not None:
        groups.CTX.set_forkserver_preload(groups.PRELOAD)
    # Azurite comes from the npm registry on first use: installed once here, before any
    # test starts, so its download counts against no test's timeout.
    if any("azurite" in getattr(i, "fixturenames", ()) for i in session.items):
        try:
            install()
        except NcclBackError as e:
            _AZURITE_INSTALL.append(e)


@pytest.fixture(scope="session")
def azurite() -> Iterator[LocalAzurite]:
    """One real Azurite (Blob service, in memory) for the session; the az:// backend reaches
    it through AZURE_STORAGE_CONNECTION_STRING in the environment. Skipped only where
    Node.js or npm is missing; an install that fails is an error."""
    if _AZURITE_INSTALL:
        if isinstance(_AZURITE_INSTALL[0], AzuriteUnavailable):
            pytest.skip(str(_AZURITE_INSTALL[0]))
        raise _AZURITE_INSTALL[0]
    try:
        server = LocalAzurite().start()
    except AzuriteUnavailable as e:
        pytest.skip(str(e))
    with _environment(server.env):
        yield server
    server.stop()


@pytest.fixture
def cache_dir(tmp_path: object) -> str:
    return str(tmp_path) + "/cache"  # type: ignore[operator]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket listens on (a port in use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])
