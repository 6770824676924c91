"""``nccl_back.compile_cache``: a torch.compile user's inductor cache travels between
processes (real Redis, real processes, real inductor compiles on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "compile_cache_worker.py"

pytestmark = pytest.mark.timeout(300)


def start(settings: dict[str, Any], cache: Path, *, name: str = "f-8x8",
          hold: bool = False) -> subprocess.Popen[str]:
    # Its own temporary directory too: inductor's precompiled headers live there.
    (cache.parent / f"{cache.name}-tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "TMPDIR": str(cache.parent / f"{cache.name}-tmp")}
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(
        {"settings": settings, "name": name, "hold": hold})], text=True, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def report(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, f"worker exited {p.wait(30)}"
    return dict(json.loads(line))


def test_a_compiled_program_starts_from_a_peers_inductor_cache(
        redis_url: str, namespace: str, tmp_path: Path) -> None:
    """The second process fetches the first one's inductor cache (its compile is an FX-graph
    cache hit) and the precompiled headers its C++ kernels were built with (none rebuilt)."""
    s = {"redis_url": redis_url, "namespace": namespace, "advertise_host": "127.0.0.1",
         "bind_host": "127.0.0.1", "peer_ttl": 5.0, "secret": "compile-cache-secret-0123"}
    a = start(s, tmp_path / "a", hold=True)
    try:
        first = report(a)
        assert not first["ok"] and "no peer has published" in first["reason"]
        assert "published" in first["reason"] and first["misses"] >= 1
        b = start(s, tmp_path / "b")
        second = report(b)
        assert b.wait(60) == 0
        assert second["ok"], second["reason"]
        assert second["hits"] >= 1 and second["misses"] == 0
        assert second["sum"] == first["sum"]
        # gcc built the first one's headers (0644); the second's came from it (0600).
        assert first["headers"] and set(first["headers"].values()) == {"0o644"}, first
        assert second["headers"] == {u: "0o600" for u in first["headers"]}, second
    finally:
        assert a.stdin is not None
        a.stdin.close()
        a.wait(30)
