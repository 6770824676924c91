"""Smoke tests of ``python -m nccl_back.dev.demo``: the README's first command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = [sys.executable, "-m", "nccl_back.dev.demo"]
ROOT = str(Path(__file__).resolve().parents[1])


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([*DEMO, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _sources(stdout: str) -> list[str]:
    """The ``source`` column of the demo's table (the first table: ``--phases`` follows it)."""
    table = stdout.split("seconds per phase:")[0]
    return [line.split()[1] for line in table.splitlines() if line.startswith("worker-")]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_demo_first_worker_loads_from_storage_the_others_from_peers() -> None:
    """With a small model and 2 workers, one row says storage and both others say peer;
    storage is the GCS emulator behind links that keep a fleet's ratio (said, with why),
    and the fleet's cost from storage alone follows."""
    proc = _run("--model-mb", "4", "--workers", "2", "--timeout", "60", "--phases",
                timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _sources(proc.stdout) == ["storage", "peer", "peer"], proc.stdout
    assert "3/3 workers ready and verified, 2 from peers" in proc.stdout
    assert "storage: the GCS emulator through google-cloud-storage, 0.02 Gbit/s per worker" in proc.stdout
    assert ("why 0.02 Gbit/s: in a fleet a worker's link to its bucket (about 2 Gbit/s) is some"
            " 50x slower than its links to peers (100 Gbit/s; 20-200x across fleets)") in proc.stdout
    assert "the demo keeps a fleet's ratio, not its speeds" in proc.stdout
    assert "with peers:    1 download(s) from storage" in proc.stdout, proc.stdout
    assert "storage alone: 3 downloads" in proc.stdout, proc.stdout
    phases = proc.stdout.split("seconds per phase:")[1].splitlines()
    assert phases[1].split()[:6] == ["worker", "skeleton", "discovery", "handshake", "transfer",
                                     "verify"], proc.stdout
    assert [line.split()[0] for line in phases[2:5]] == ["worker-0", "worker-1", "worker-2"]
    # The brand-new version's round: three fresh workers split its download; each row
    # says what that worker read from storage (on its own link) and got from peers.
    new = proc.stdout.split("nobody holds it")[1]
    rows = [line.split() for line in new.splitlines() if line.startswith("new-")][:3]
    assert sorted(r[1] for r in rows) == ["peer", "peer", "storage"], proc.stdout
    assert all(r[6] == "yes" and float(r[3]) > 0 and int(r[4]) > 0 and float(r[5]) > 0
               for r in rows), proc.stdout
    assert "split download: storage served" in new, proc.stdout


@pytest.mark.timeout(60)
def test_demo_bad_storage_rate_is_one_line_error() -> None:
    """A --storage-gbit that is not a positive number exits 2 naming the flag."""
    proc = _run("--storage-gbit", "0", timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--storage-gbit" in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_demo_ratio_and_storage_rate_are_one_or_the_other() -> None:
    """--ratio and --storage-gbit both set the bucket link: giving both exits 2, one line."""
    proc = _run("--ratio", "20", "--storage-gbit", "1", timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not allowed with argument" in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_demo_bad_flag_is_one_line_error() -> None:
    """A bad --workers value exits 2 with one line naming the flag, no traceback."""
    proc = _run("--workers", "0", timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--workers" in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_demo_missing_model_is_one_line_error(tmp_path: object) -> None:
    """A --model directory that does not exist exits 1 with one error line, no traceback."""
    missing = os.path.join(str(tmp_path), "nope")
    proc = _run("--model", missing, timeout=50)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "not found" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
