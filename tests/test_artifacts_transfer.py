"""Artifact sets between processes: real Redis, a real holder process, real gloo.

A receiver installs what a holder published, byte for byte; a miss says why (another
compile factor, no live holder); a holder under another secret, or serving bytes that
differ by one, is refused with nothing written; a holder killed mid-transfer leaves no
partial cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_artifacts import files_under, make_cache

from nccl_back.caches import artifact_transfer as flow
from nccl_back.config import Settings

ROOT = Path(__file__).resolve().parents[1]
HOLDER = Path(__file__).resolve().parent / "artifact_holder.py"
SECRET = "s3cret-of-the-fleet-0123"
SCOPE = "ab" * 16
FACTORS = {"vllm": "0.32.0", "config_hash": "c0ffee", "compiler_hash": "beef"}


def base_settings(redis_url: str, namespace: str, **kw: Any) -> dict[str, Any]:
    return {"redis_url": redis_url, "namespace": namespace, "advertise_host": "127.0.0.1",
            "peer_ttl": 5.0, "secret": SECRET,
            "handshake_timeout": 5.0, "transfer_timeout": 30.0, **kw}


class Holders:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, settings: dict[str, Any], root: Path, units: list[str], *,
              factors: dict[str, str] = FACTORS, tamper: bool = False) -> subprocess.Popen[str]:
        cfg = {"settings": settings, "root": str(root), "units": units, "factors": factors,
               "scope": SCOPE, "tamper": tamper}
        p = subprocess.Popen([sys.executable, str(HOLDER), json.dumps(cfg)], text=True,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("READY"), line
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(30)


@pytest.fixture
def holders() -> Iterator[Holders]:
    h = Holders()
    yield h
    h.kill_all()
    flow.close_all()


def test_a_set_travels_from_a_holder_process(redis_url: str, namespace: str, tmp_path: Path,
                                             holders: Holders) -> None:
    """A receiver gets the holder's set and installs it byte for byte, then serves it on."""
    src, dst = tmp_path / "a", tmp_path / "b"
    units = make_cache(src)
    s = base_settings(redis_url, namespace)
    holders.start(s, src, units)
    got = flow.fetch(Settings(**s), flow.CacheKey(FACTORS, SCOPE), str(dst))
    assert got.ok, got.reason
    assert got.installed == units and got.peer
    assert files_under(dst) == files_under(src)
    assert flow._SERVING and flow._SERVING[-1].peers  # fan-out: the receiver holds it too


def test_a_miss_says_which_factor_differs(redis_url: str, namespace: str, tmp_path: Path,
                                          holders: Holders) -> None:
    """Another compile setting is a miss naming the factor; a dead holder's set is a miss too."""
    src, dst = tmp_path / "a", tmp_path / "b"
    s = base_settings(redis_url, namespace)
    holder = holders.start(s, src, make_cache(src))
    other = flow.CacheKey({**FACTORS, "config_hash": "decaf"}, SCOPE)
    got = flow.fetch(Settings(**s), other, str(dst))
    assert not got.ok
    assert "other compile factors: config_hash (theirs c0ffee, ours decaf)" in got.reason
    holder.kill()
    holder.wait(30)
    deadline = time.monotonic() + 30
    while True:  # its entry expires with peer_ttl
        got = flow.fetch(Settings(**s), flow.CacheKey(FACTORS, SCOPE), str(dst))
        if "no live peer" in got.reason or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not got.ok and "no live peer holds the set" in got.reason
    assert not dst.exists()


def test_a_holder_without_the_fleet_secret_is_refused(redis_url: str, namespace: str,
                                                      tmp_path: Path, holders: Holders) -> None:
    """A set published under another secret is not trusted: a miss, nothing written."""
    src, dst = tmp_path / "a", tmp_path / "b"
    holders.start(base_settings(redis_url, namespace, secret="another-fleet-secret-99"),
                  src, make_cache(src))
    got = flow.fetch(Settings(**base_settings(redis_url, namespace)),
                     flow.CacheKey(FACTORS, SCOPE), str(dst))
    assert not got.ok and "no set for key" in got.reason
    assert not dst.exists()


def test_a_holder_serving_one_changed_byte_is_refused(redis_url: str, namespace: str,
                                                      tmp_path: Path, holders: Holders) -> None:
    """Bytes that differ from the signed digest by one byte are refused before any write."""
    src, dst = tmp_path / "a", tmp_path / "b"
    s = base_settings(redis_url, namespace)
    holders.start(s, src, make_cache(src), tamper=True)
    got = flow.fetch(Settings(**s), flow.CacheKey(FACTORS, SCOPE), str(dst))
    assert not got.ok and "keyed digest" in got.reason
    assert not dst.exists()
    assert not flow._SERVING  # the receiver does not serve what it refused


def test_a_holder_killed_mid_transfer_leaves_no_partial_cache(
        redis_url: str, namespace: str, tmp_path: Path, holders: Holders) -> None:
    """Killing the holder while the set is on the wire is a miss; no file, no temporary directory."""
    src, dst = tmp_path / "a", tmp_path / "b"
    units = make_cache(src)
    (src / "torch_compile_cache" / "abc123" / "big.bin").write_bytes(os.urandom(48 << 20))
    s = base_settings(redis_url, namespace)
    holder = holders.start({**s, "max_send_gbps": 0.016, "bucket_bytes": 1 << 20}, src, units)
    out: list[flow.FetchResult] = []
    t = threading.Thread(target=lambda: out.append(flow.fetch(
        Settings(**s, stall_timeout=3.0), flow.CacheKey(FACTORS, SCOPE), str(dst))))
    t.start()
    time.sleep(1.5)  # the 48 MB take ~3 s at this pace
    holder.kill()
    t.join(60)
    assert out and not out[0].ok and "Transfer" in out[0].reason, out
    assert not dst.exists() or files_under(dst) == {}
    assert not dst.exists() or not any(p.name.startswith(".nccl_back") for p in dst.rglob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_planted_kernel_never_reaches_another_process(redis_url: str, namespace: str,
                                                        tmp_path: Path, holders: Holders) -> None:
    """A holder whose cache has a kernel another user owns publishes that unit not at all;
    a receiving process installs the other units, and nothing of the planted one."""
    src, dst = tmp_path / "a", tmp_path / "b"
    units = make_cache(src)
    kernel = src / "torch_compile_cache" / "abc123" / "rank_0_0" / "inductor_cache" / "eb" / "kernel.so"
    kernel.write_bytes(b"planted")
    os.chown(kernel, 65534, 65534)
    s = base_settings(redis_url, namespace)
    holders.start(s, src, units)
    got = flow.fetch(Settings(**s), flow.CacheKey(FACTORS, SCOPE), str(dst))
    assert got.ok, got.reason
    assert got.installed == ["modelinfos/llama.json"]
    assert files_under(dst) == {"modelinfos/llama.json": b"{}"}
