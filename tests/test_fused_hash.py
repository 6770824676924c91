"""The fused hash kernels: checked bit for bit against the torch path in Triton's
interpreter (``tests/fused_hash_cases.py``, in a process of its own), and what they
leave to the torch path."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from nccl_back.model import fused_hash

HERE = Path(__file__).resolve().parent


def test_the_kernels_hash_as_the_torch_path_in_tritons_interpreter(tmp_path: Path) -> None:
    """Every case of ``fused_hash_cases.py`` passes in the interpreter, none skipped."""
    pytest.importorskip("triton")
    report = tmp_path / "cases.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "fused_hash_cases.py"), "-q", "-p",
         "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}"],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 14 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts


def test_the_kernels_read_what_they_can_and_leave_the_rest() -> None:
    """Contiguous, word-aligned, word-sized tensors are fused; a transposed view, a
    misaligned view and a byte count that is not whole words go to the torch path."""
    flat = torch.zeros(4096, dtype=torch.uint8)
    tensors = {
        "ok": flat[:64].view(torch.int64), "t": torch.zeros(8, 4, dtype=torch.int64).t(),
        "misaligned": flat[4:68].view(torch.int32), "odd": flat[:12].view(torch.int32),
    }
    assert [n for n in tensors if fused_hash._readable(tensors[n], 8)] == ["ok"]
    assert [n for n in tensors if fused_hash._readable(tensors[n], 4)] == ["ok", "misaligned", "odd"]


def test_cpu_tensors_are_hashed_by_torch_unless_the_interpreter_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ``TRITON_INTERPRET=1`` a CPU model never goes near Triton."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_hash.usable(torch.device("cpu"))
    assert not fused_hash.usable(torch.device("meta"))
