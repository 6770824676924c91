"""Bad input to ``nccl-back serve`` and ``status``: one line on stderr naming the bad
value, a non-zero exit, never a traceback. Every case runs in a real subprocess: the bad
serve values one after another in one interpreter (the CLI's ``main``, each case's
file descriptors 1 and 2 its own: one torch import, not one per case), the rest as
``python -m nccl_back.cli``."""

from __future__ import annotations

import json
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


def run_cli(*args: str, extra_env: dict[str, str] | None = None,
            python: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m nccl_back.cli ARGS`` (with ``python``: ``python ARGS``), without the
    caller's NCCL_BACK_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}
    env.update(extra_env or {})
    # Nothing listens here: a command that got as far as Redis would fail differently.
    env["NCCL_BACK_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    return subprocess.run(
        [sys.executable, *([] if python else ["-m", "nccl_back.cli"]), *args],
        env=env, capture_output=True, text=True, timeout=50,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], names: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert names in lines[0]


#: Runs ``nccl_back.cli.main`` once per argv of ``sys.argv[1]`` (JSON), as
#: ``sys.exit(main())`` would, each case's stdout and stderr (the file descriptors, so a
#: handler or C code writing to them is caught too) in a file of its own; prints the
#: exit statuses. An exception escaping ``main`` is written as Python would, a traceback.
BATCH = """
import json, os, sys, tempfile, traceback
from nccl_back import cli
statuses = []
for i, argv in enumerate(json.loads(sys.argv[1])):
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(sys.argv[2], f"{i}.{name}"), os.O_WRONLY | os.O_CREAT)
        os.dup2(f, fd); os.close(f)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc(); code = 1
    sys.stdout.flush(); sys.stderr.flush()
    for fd, old in zip((1, 2), saved):
        os.dup2(old, fd); os.close(old)
    statuses.append(code)
print(json.dumps(statuses))
"""

#: Bad serve input (after ``serve --model CKPT --health-port 0``) and what its line names.
SERVE_CASES = [
    (["--bogus-flag"], "--bogus-flag"),
    (["--redis-url", "http://x"], "http://x"),
    (["--factory", "nocolon"], "nocolon"),
    (["--factory", "no_such_module:f"], "no_such_module"),
    (["--factory", "json:no_such_attr"], "no_such_attr"),
    (["--factory", "json:__doc__"], "json:__doc__"),
    (["--transfer-timeout", "-1"], "transfer_timeout=-1"),
    (["--drain-timeout", "0"], "--drain-timeout"),
]


@pytest.fixture(scope="module")
def serve_batch(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each bad serve input's outcome, keyed by the case's argv (one subprocess for all),
    with a missing --model directory and --device cuda:0 as ``missing`` and ``cuda``."""
    out = tmp_path_factory.mktemp("batch")
    cases = {" ".join(extra): ["serve", "--model", str(ckpt), "--health-port", "0", *extra]
             for extra, _ in SERVE_CASES}
    cases["missing"] = ["serve", "--model", str(out / "no-such-ckpt"), "--health-port", "0"]
    cases["cuda"] = ["serve", "--model", str(ckpt), "--health-port", "0", "--device", "cuda:0"]
    proc = run_cli("-c", BATCH, json.dumps(list(cases.values())), str(out), python=True)
    assert proc.returncode == 0, proc.stderr
    statuses = json.loads(proc.stdout)
    return {key: subprocess.CompletedProcess(argv, statuses[i], (out / f"{i}.out").read_text(),
                                             (out / f"{i}.err").read_text())
            for i, (key, argv) in enumerate(cases.items())}


@pytest.mark.parametrize(("extra", "names"), SERVE_CASES)
def test_serve_bad_flag_values(serve_batch: dict[str, subprocess.CompletedProcess[str]],
                               extra: list[str], names: str) -> None:
    """Each bad serve flag is one stderr line naming it, before any load starts."""
    assert_one_line_error(serve_batch[" ".join(extra)], names)


def test_serve_bad_flag_value_through_the_real_cli(ckpt: Path) -> None:
    """The same through the console script's module (its exit status and stderr)."""
    proc = run_cli("serve", "--model", str(ckpt), "--health-port", "0", "--transfer-timeout", "-1")
    assert_one_line_error(proc, "transfer_timeout=-1")


def test_serve_missing_model_path(serve_batch: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """A nonexistent --model directory is named in one line."""
    missing = serve_batch["missing"].args[2]
    assert_one_line_error(serve_batch["missing"], missing)


def test_serve_health_port_in_use(ckpt: Path, busy_port: int) -> None:
    """A health port already in use is named in one line."""
    proc = run_cli("serve", "--model", str(ckpt), "--health-port", str(busy_port))
    assert_one_line_error(proc, f"health port {busy_port}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_serve_cuda_without_cuda(serve_batch: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """--device cuda:0 on a machine without CUDA is named in one line."""
    assert_one_line_error(serve_batch["cuda"], "cuda:0")


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
