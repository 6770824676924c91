"""Bad input to ``nccl-back serve`` and ``status``: one line on stderr naming the bad
value, a non-zero exit, never a traceback. Every case is a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nccl_back.dev.servers import free_port

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 1), tmp_path_factory.mktemp("c") / "ckpt")




def run_cli(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}
    env.update(extra_env or {})
    # Nothing listens here: a command that got as far as Redis would fail differently.
    env["NCCL_BACK_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    return subprocess.run(
        [sys.executable, "-m", "nccl_back.cli", *args],
        env=env, capture_output=True, text=True, timeout=50,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], names: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert names in lines[0]


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["--bogus-flag"], "--bogus-flag"),
        (["--redis-url", "http://x"], "http://x"),
        (["--factory", "nocolon"], "nocolon"),
        (["--factory", "no_such_module:f"], "no_such_module"),
        (["--factory", "json:no_such_attr"], "no_such_attr"),
        (["--factory", "json:__doc__"], "json:__doc__"),
        (["--transfer-timeout", "-1"], "transfer_timeout=-1"),
        (["--drain-timeout", "0"], "--drain-timeout"),
    ],
)
def test_serve_bad_flag_values(ckpt: Path, extra: list[str], names: str) -> None:
    """Each bad serve flag is one stderr line naming it, before any load starts."""
    proc = run_cli("serve", "--model", str(ckpt), "--health-port", "0", *extra)
    assert_one_line_error(proc, names)


def test_serve_missing_model_path(tmp_path: Path) -> None:
    """A nonexistent --model directory is named in one line."""
    missing = str(tmp_path / "no-such-ckpt")
    assert_one_line_error(run_cli("serve", "--model", missing, "--health-port", "0"), missing)


def test_serve_health_port_in_use(ckpt: Path, busy_port: int) -> None:
    """A health port already in use is named in one line."""
    proc = run_cli("serve", "--model", str(ckpt), "--health-port", str(busy_port))
    assert_one_line_error(proc, f"health port {busy_port}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_serve_cuda_without_cuda(ckpt: Path) -> None:
    """--device cuda:0 on a machine without CUDA is named in one line."""
    proc = run_cli("serve", "--model", str(ckpt), "--health-port", "0", "--device", "cuda:0")
    assert_one_line_error(proc, "cuda:0")


def test_serve_hf_without_transformers(ckpt: Path, tmp_path: Path) -> None:
    """--hf without the optional extra says how to install it."""
    # Shadow the installed package with one that fails to import, as if absent.
    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    proc = run_cli("serve", "--model", str(ckpt), "--health-port", "0", "--hf",
                   extra_env={"PYTHONPATH": str(tmp_path / "shadow")})
    assert_one_line_error(proc, "pip install 'nccl-back[hf]'")


def test_status_redis_unreachable() -> None:
    """status with nothing listening at the Redis URL: one line, exit 1."""
    port = free_port()
    proc = run_cli("status", "--redis-url", f"redis://127.0.0.1:{port}/0")
    assert proc.returncode == 1
    assert_one_line_error(proc, f"127.0.0.1:{port}")
