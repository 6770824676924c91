"""Shared fixtures: a real redis-server, a real GCS emulator and a real S3-compatible
server on loopback.

Nothing here mocks Redis or storage; the only thing that cannot exist on these
machines is a GPU, and tests that need one carry the ``gpu`` marker.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest
import torch

from nccl_back.dev.gcs import LocalGCS
from nccl_back.dev.s3 import LocalS3
from nccl_back.dev.servers import LocalRedis


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


@pytest.fixture(scope="session")
def s3() -> Iterator[LocalS3]:
    """One real S3-compatible server (moto) for the session; boto3 reaches it through
    the standard AWS_ENDPOINT_URL_S3 and throw-away credentials in the environment."""
    server = LocalS3().start()
    old = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
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
