"""``nccl_back.compile_cache``: a torch.compile user's inductor cache travels between
processes (real Redis, real processes, real inductor compiles on CPU); nothing another
local user planted travels; blocks run at once and every wait has its bound.

The in-process tests point inductor's precompiled-header directory (torch's
``codecache._HEADER_DIR``) at a temporary one, so that fetches install there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_artifacts_transfer import Holders, base_settings

from nccl_back import compile_cache
from nccl_back.caches import artifact_transfer as flow
from nccl_back.caches import compile_cache as cc
from nccl_back.config import Settings
from nccl_back.dev.servers import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "compile_cache_worker.py"

pytestmark = pytest.mark.timeout(300)


def start(settings: dict[str, Any], cache: Path, *, name: str = "f-8x8",
          hold: bool = False, default_dirs: bool = False) -> subprocess.Popen[str]:
    # Its own temporary directory too: inductor's precompiled headers live there (and,
    # with ``default_dirs``, its cache directory: torch's default).
    (cache.parent / f"{cache.name}-tmp").mkdir(parents=True, exist_ok=True)
    # TORCHINDUCTOR_VEC_ISA_OK: inductor trusts the CPU's flags instead of building and
    # loading a probe library per vector ISA (half of a cold compile on a loaded 2-core
    # machine); the FX-graph cache and the precompiled headers, what travels, are as before.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "TMPDIR": str(cache.parent / f"{cache.name}-tmp"), "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    if default_dirs:
        del env["TORCHINDUCTOR_CACHE_DIR"]
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(
        {"settings": settings, "name": name, "hold": hold})], text=True, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def report(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, f"worker exited {p.wait(30)}"
    return dict(json.loads(line))


@pytest.fixture(scope="module")
def publisher(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory,
              ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """The clean engine (torch's default directories, which it created): its cold compile,
    published and held, serves both tests below; one cold compile, not one per test.
    Yields its settings and its report."""
    s = {"redis_url": redis_server.url, "namespace": "t" + uuid.uuid4().hex[:12],
         "advertise_host": "127.0.0.1", "peer_ttl": 5.0, "secret": "compile-cache-secret-0123"}
    clean = start(s, tmp_path_factory.mktemp("publisher") / "clean", hold=True, default_dirs=True)
    try:
        yield s, report(clean)
    finally:
        assert clean.stdin is not None
        clean.stdin.close()
        clean.wait(30)


def test_a_compiled_program_starts_from_a_peers_inductor_cache(
        publisher: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    """The second process fetches the first one's inductor cache (its compile is an FX-graph
    cache hit) and the precompiled headers its C++ kernels were built with (none rebuilt)."""
    s, first = publisher
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


def test_nothing_another_user_planted_travels(
        publisher: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    """An engine whose default cache directories another user created first (0777), with
    a kernel.so dropped in and a replaced .gch: it installs nothing into them and
    publishes nothing from them (both logged); what the fleet serves is the clean
    engine's set only."""
    s, first = publisher
    assert "published" in first["reason"] and first["headers"], first
    planted_tmp = tmp_path / "victim-tmp"
    cache = planted_tmp / Path(first["cache_dir"]).name
    (cache / "precompiled_headers").mkdir(parents=True)
    (cache / "zz").mkdir()
    (cache / "zz" / "kernel.so").write_bytes(b"planted kernel")
    for name in first["headers"]:  # each .gch replaced (gcc ignores an invalid one)
        planted = b"planted header" if name.endswith(".gch") else \
            (Path(first["headers_dir"]) / name).read_bytes()
        (cache / "precompiled_headers" / name).write_bytes(planted)
    for d in (cache, cache / "precompiled_headers", cache / "zz"):
        d.chmod(0o777)
    victim = start(s, tmp_path / "victim", default_dirs=True)
    second = report(victim)
    assert victim.wait(60) == 0
    assert second["cache_dir"] == str(cache), second
    assert not second["ok"] and "not installed" in second["reason"], second
    assert "not published" in second["reason"] and "mode 0777" in second["reason"], second
    # Caches and headers: each refused at install and at publish.
    assert sum("artifact_install_refused" in w for w in second["warnings"]) == 2, second
    assert sum("artifact_set_refused" in w for w in second["warnings"]) == 2, second
    assert (cache / "zz" / "kernel.so").read_bytes() == b"planted kernel"
    # What a third engine receives: the clean engine's files, nothing planted.
    settings = Settings(**s)
    key = cc.inductor_key("f-8x8")
    try:
        for k, where in ((key, tmp_path / "third-cache"), (cc.headers_key(key), tmp_path / "third-h")):
            got = flow.fetch(settings, k, str(where), serve=False)
            assert got.ok, got.reason
            files = {p.relative_to(where).as_posix(): p.read_bytes() for p in where.rglob("*") if p.is_file()}
            assert files and "zz/kernel.so" not in files
            assert not any(b"planted" in b for b in files.values())
            assert not any(b"planted" in p.read_bytes() for p in Path(first["headers_dir"]).rglob("*")
                           if p.is_file())
    finally:
        flow.close_all()


@pytest.fixture
def held() -> Iterator[Holders]:
    """Holder processes, killed at the end (stopped ones too)."""
    h = Holders()
    yield h
    h.kill_all()
    flow.close_all()


@pytest.fixture
def header_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Inductor's precompiled-header directory, pointed at a temporary one."""
    from torch._inductor import codecache

    path = tmp_path / "precompiled_headers"
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(path))
    yield path
    flow.close_all()


def _headers_holder(held: Holders, s: dict[str, Any], tmp_path: Path, name: str,
                    nbytes: int, **kw: Any) -> subprocess.Popen[str]:
    """A holder process serving ``nbytes`` of precompiled headers for ``name``'s key."""
    src = tmp_path / f"held-{name}"
    src.mkdir()
    (src / f"{name}.h").write_bytes(b"#include <x>\n")
    (src / f"{name}.h.gch").write_bytes(os.urandom(nbytes))
    key = cc.headers_key(cc.inductor_key(name))
    return held.start({**s, **kw}, src, [f"{name}.h", f"{name}.h.gch"], factors=dict(key.factors))


def test_two_compile_cache_blocks_at_once_both_complete(
        redis_url: str, namespace: str, tmp_path: Path, held: Holders, header_dir: Path) -> None:
    """Two blocks at once in one process (two threads), the second entered while the
    first one's headers fetch runs and ending before its own: each gets its own result,
    with no exception, and each set of headers arrives."""
    s = base_settings(redis_url, namespace, bucket_bytes=1 << 20)  # both ends plan alike
    pace = {"max_send_gbps": 0.016}  # 16 MB/s
    _headers_holder(held, s, tmp_path, "quick", 24 << 20, **pace)  # ~1.5 s
    _headers_holder(held, s, tmp_path, "slow", 96 << 20, **pace)  # ~6 s
    results: dict[str, Any] = {}
    entered = threading.Event()

    def block(name: str) -> None:
        try:
            with compile_cache(name, Settings(**s), cache_dir=str(tmp_path / f"cache-{name}")) as got:
                if name == "quick":
                    entered.set()
            results[name] = got
        except BaseException as e:
            results[name] = e

    threads = [threading.Thread(target=block, args=("quick",))]
    threads[0].start()
    assert entered.wait(30)
    time.sleep(0.3)  # the quick one's headers are on the wire now
    threads.append(threading.Thread(target=block, args=("slow",)))
    threads[1].start()
    for t in threads:
        t.join(120)
    assert set(results) == {"quick", "slow"}
    for name, got in results.items():
        assert isinstance(got, flow.FetchResult), (name, got)
    assert sorted(p.name for p in header_dir.iterdir()) == [
        "quick.h", "quick.h.gch", "slow.h", "slow.h.gch"]


def test_a_stalled_headers_fetch_is_waited_for_within_its_bound(
        redis_url: str, namespace: str, tmp_path: Path, held: Holders, header_dir: Path) -> None:
    """A holder stopped (SIGSTOP) mid-transfer: inductor's wait for the headers and the
    block's end each return within artifact_wait of the fetch's start, with the reason
    ("timed out after 3 s"), long before the stall bound would end the transfer; the
    fetch itself gives up (its peer budget) and leaves no partial header."""
    s = base_settings(redis_url, namespace, stall_timeout=30.0, transfer_timeout=60.0,
                      bucket_bytes=1 << 20)
    waiter = Settings(**s).capped(artifact_wait=3.0)
    holder = _headers_holder(held, s, tmp_path, "stalled", 96 << 20,  # ~6 s at 16 MB/s
                             max_send_gbps=0.016)
    began = time.monotonic()
    with compile_cache("stalled", waiter, cache_dir=str(tmp_path / "cache")) as got:
        time.sleep(1.0)
        os.kill(holder.pid, signal.SIGSTOP)
        cc.wait_for_headers()  # what inductor's _precompile_header does first
        waited = time.monotonic() - began
        assert 2.5 < waited < 4.5, waited
        # Asking again joins the fetch in flight (one per set) and gets its outcome.
        job = cc.fetch_headers(waiter, cc.inductor_key("stalled"))
        assert len(cc._IN_FLIGHT) == 1
        outcome = job.result()
    ended = time.monotonic() - began
    assert ended < 5.0, ended
    assert isinstance(got, flow.FetchResult)
    assert not outcome.ok and outcome.reason == \
        "precompiled headers: timed out after 3 s (artifact_wait)", outcome
    deadline = time.monotonic() + 30
    while cc._IN_FLIGHT and time.monotonic() < deadline:  # the fetch ends on its budget
        time.sleep(0.1)
    assert not cc._IN_FLIGHT and time.monotonic() - began < 15
    assert not header_dir.exists() or list(header_dir.iterdir()) == []


def test_a_bad_setting_is_a_miss_not_an_exception(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """A setting from the environment that does not parse: the block still runs, and
    its result is a miss naming the error (a compile never fails for its cache)."""
    monkeypatch.setenv("NCCL_BACK_NAMESPACE", "no spaces allowed")
    ran = []
    with compile_cache("f", cache_dir=str(tmp_path / "cache")) as got:
        ran.append(True)
    assert ran and not got.ok
    assert got.reason.startswith("compile caches skipped: ConfigError: namespace="), got.reason


def test_an_exception_of_the_block_itself_passes(tmp_path: Path) -> None:
    """The block's own exception reaches the caller unchanged (nothing is published)."""
    s = Settings(redis_url="redis://127.0.0.1:9/0", secret=None)
    with pytest.raises(ZeroDivisionError), compile_cache("f", s, cache_dir=str(tmp_path / "c")):
        _ = 1 / 0
