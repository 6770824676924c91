"""Real vLLM engines in separate processes, for the vLLM integration tests."""

from __future__ import annotations

import contextlib
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

import psutil
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENGINE = HERE / "engine.py"

_LOADED = re.compile(
    r"nccl_back: loaded version (?P<version>\w+) from (?P<source>peer|storage)"
    r"(?: (?P<peer>\S+))?:.*?(?:; fallback: (?P<reason>.*)"
    r"|; first engine of this version, it will serve the next ones \((?P<first>.*)\))?$",
    re.M,
)


def _fields(m: re.Match[str]) -> dict[str, str | None]:
    out = m.groupdict()
    if out["first"] is not None:
        out["reason"] = out["first"]
    return out


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
              hold: bool = False, tp: int = 1, compile: bool = False,
              compilation_config: dict[str, Any] | None = None) -> Engine:
        args = [sys.executable, str(ENGINE), "--model", model, "--load-format", load_format,
                "--dtype", dtype, "--out", str(self.out), "--tp", str(tp)]
        if compile:
            args.append("--compile")
        if compilation_config is not None:
            args += ["--compilation-config", json.dumps(compilation_config)]
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
        """SIGKILL the engine and every process under it (vLLM's engine core and worker), as a crash.

        Killing only the front end is not a crash of the worker: vLLM's worker notices
        its parent's death and exits cleanly (leaving the registry).
        """
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            procs = psutil.Process(self.proc.pid).children(recursive=True)
            for p in reversed(procs):  # the worker first: it holds the registry entry
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def loaded_ranks(self) -> list[dict[str, str | None]]:
        """The nccl_back load line of each rank (one per vLLM worker), in log order."""
        return [_fields(m) for m in _LOADED.finditer(self.log())]

    def loaded(self) -> dict[str, str | None]:
        """What the nccl_back loader logged: version, source, peer, the reason it loaded
        from storage (a fallback, or ``first``: the first engine of its version)."""
        m = _LOADED.search(self.log())
        if m is None:
            pytest.fail(f"engine {self.name} logged no nccl_back load line:\n{self.tail()}")
        return _fields(m)
