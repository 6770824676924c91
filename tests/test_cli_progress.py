"""`nccl-back load` progress: tqdm bars for download and load on a terminal, nothing when
stderr is piped or with --quiet. The terminal is a real pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from nccl_back.dev.gcs_emulator import LocalGCS

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(90)

EXE = str(Path(sys.executable).parent / "nccl-back")


def _on_tty(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal: (exit status, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    # A fresh pty is 0x0; a real terminal has a size (tqdm sizes the bar to it).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([EXE, *argv], stdout=subprocess.PIPE, stderr=slave,
                            env={**os.environ, **(env or {})})
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 80
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.stdout.read().decode() if proc.stdout else ""
    return proc.wait(10), out, b"".join(chunks).decode(errors="replace")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)


def test_load_draws_a_bar_on_a_terminal(ckpt: Path, cache_dir: str) -> None:
    """On a terminal, load shows a tqdm bar reaching 100% with sizes and a rate."""
    code, out, tty = _on_tty(["load", str(ckpt), "--cache-dir", cache_dir])
    assert code == 0, tty
    assert out.startswith("version ")
    assert "load: 100%" in tty and "B/s" in tty and "|" in tty


def test_quiet_and_piped_draw_nothing(ckpt: Path, cache_dir: str) -> None:
    """--quiet on a terminal, and any piped stderr, get no bar at all."""
    code, _, tty = _on_tty(["load", str(ckpt), "--cache-dir", cache_dir, "--quiet"])
    assert code == 0 and tty == ""
    proc = subprocess.run([EXE, "load", str(ckpt), "--cache-dir", cache_dir],
                          capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0 and proc.stderr == ""


def test_gs_load_draws_download_and_load_bars(gcs: LocalGCS, ckpt: Path, cache_dir: str) -> None:
    """A gs:// load shows a download bar (bytes as chunks arrive) and a load bar."""
    client = gcs.client()
    bucket = client.create_bucket(f"progress-{os.getpid()}-{time.monotonic_ns()}")
    for f in sorted(os.listdir(ckpt)):
        bucket.blob(f"m/{f}").upload_from_filename(str(ckpt / f))
    code, _, tty = _on_tty(["load", f"gs://{bucket.name}/m", "--cache-dir", cache_dir],
                           env={"STORAGE_EMULATOR_HOST": gcs.host})
    assert code == 0, tty
    assert "download: 100%" in tty and "load: 100%" in tty
