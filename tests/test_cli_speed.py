"""Metadata commands are instant: `--help`, `fingerprint` and `status` never import torch
(`python -X importtime`), and cost a fraction of a bare `import torch`'s CPU."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from nccl_back.dev.servers import LocalRedis

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(600)

EXE = str(Path(sys.executable).parent / "nccl-back")


@pytest.fixture
def commands(tmp_path: Path, cache_dir: str, redis_server: LocalRedis, namespace: str) -> dict[str, list[str]]:
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)
    return {
        "help": ["--help"],
        "fingerprint": ["fingerprint", str(ckpt), "--cache-dir", cache_dir],
        "status": ["status", "--redis-url", redis_server.url, "--namespace", namespace],
    }


def _imported(argv: list[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "nccl_back.cli", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


@pytest.mark.parametrize("name", ["help", "fingerprint", "status"])
def test_metadata_commands_do_not_import_torch(name: str, commands: dict[str, list[str]]) -> None:
    """The command succeeds without importing torch (nor the GCS client for a local path)."""
    modules = _imported(commands[name])
    assert "nccl_back.config" in modules  # the import list is real
    assert "torch" not in modules
    assert "google.cloud.storage" not in modules


def _best(runs: dict[str, list[str]], rounds: int = 3) -> dict[str, float]:
    """Each command's least CPU seconds (user and system, the child's own): what a run
    costs, which a busy machine (the second test process, the vLLM suite, a CPU burner)
    stretches in wall time without bound, not in CPU time."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, argv in runs.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            took = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            best[name] = min(best[name], took)
    return best


def test_metadata_commands_take_a_fraction_of_a_torch_import(commands: dict[str, list[str]]) -> None:
    """Each metadata command's best run costs under half the CPU of a bare `import torch`."""
    best = _best({"import torch": [sys.executable, "-c", "import torch"],
                  **{name: [EXE, *argv] for name, argv in commands.items()}})
    torch_import = best.pop("import torch")
    for name, took in best.items():
        assert took < 0.5 * torch_import, f"{name}: {took:.3f} CPU-s vs import torch {torch_import:.3f} CPU-s"


def test_package_import_is_lazy() -> None:
    """`import nccl_back` and its light names leave torch unimported; WeightService imports it."""
    code = (
        "import sys, nccl_back\n"
        "assert 'torch' not in sys.modules\n"
        "nccl_back.Settings, nccl_back.NcclBackError, nccl_back.ModelSpec\n"
        "assert 'torch' not in sys.modules, 'light names imported torch'\n"
        "from nccl_back import WeightService\n"
        "assert 'torch' in sys.modules and WeightService.__name__ == 'WeightService'\n"
        "assert set(nccl_back.__all__) <= set(dir(nccl_back))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
