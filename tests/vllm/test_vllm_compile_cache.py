"""Compile caches travel with the weights: real vLLM engines that compile (no
``enforce_eager``), each with a fresh ``VLLM_CACHE_ROOT``, real Redis, separate processes.

Two rounds of two engines started together (~1 min each on a quiet machine): A (the
first of its key: compiles, publishes) beside a reference ``auto`` engine that also
compiles; then B (fresh cache root: starts warm from A) beside C (another
``compilation_config``: a miss that says why; it compiles and publishes its own set).
Without a secret caches are skipped, said once (test_vllm_engines.py's engines run
without one).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SECRET = "compile-cache-fleet-secret-0123"
_FROM_PEER = re.compile(r"nccl_back: compile caches from peer (\S+): .*installed \[(.*?)\]")
_PUBLISHED = re.compile(r"nccl_back: compile caches published (\d+) files, .* under key (\w+)")


class Caches:
    def __init__(self, model: str, env: dict[str, str], workdir: Path) -> None:
        self.model, self.env, self.workdir = model, env, workdir
        self.engines: dict[str, Engine] = {}

    def root(self, name: str) -> Path:
        return self.workdir / f"cache-root-{name}"

    def start(self, name: str, **kw: Any) -> Engine:
        env = dict(self.env, VLLM_CACHE_ROOT=str(self.root(name)), NCCL_BACK_SECRET=SECRET)
        e = Engine(name, self.workdir).start(self.model, env, compile=True, **kw)
        self.engines[name] = e
        return e


@pytest.fixture(scope="module")
def caches(tiny_model: str, engine_env: dict[str, str], workdir: Path) -> Iterator[Caches]:
    c = Caches(tiny_model, dict(engine_env, NCCL_BACK_NAMESPACE=engine_env["NCCL_BACK_NAMESPACE"]
                                + "cc"), workdir)
    c.start("ref", load_format="auto")
    c.start("a", hold=True)
    c.engines["a"].wait_ready()
    c.engines["ref"].wait_ready()
    wait_published(c.engines["a"])
    c.start("b")
    c.start("c", hold=True, compilation_config={"mode": 2})
    yield c
    for e in c.engines.values():
        e.kill()


def wait_published(e: Engine, timeout: float = 120.0) -> re.Match[str]:
    """The engine's "published" line (written by a thread after its warm-up)."""
    import time

    deadline = time.monotonic() + timeout
    while (m := _PUBLISHED.search(e.log())) is None or "nccl_back: model infos published" \
            not in e.log():
        if time.monotonic() > deadline:
            pytest.fail(f"engine {e.name} published no compile caches:\n{e.tail()}")
        time.sleep(0.5)
    return m


def test_first_engine_compiles_and_publishes(caches: Caches) -> None:
    """The first engine of its key misses (nobody published yet), compiles, and publishes its sets."""
    log = caches.engines["a"].log()
    assert "no compile caches from peers (no set for key" in log
    assert "no peer has published compile caches for this model" in log
    assert int(wait_published(caches.engines["a"]).group(1)) > 0
    assert any(p.suffix == ".so" for p in caches.root("a").rglob("*"))


def test_second_engine_starts_warm_from_the_first(caches: Caches) -> None:
    """A fresh engine receives A's caches before its warm-up; vLLM's compile reads them, tokens as `auto`."""
    b = caches.engines["b"]
    result = b.wait_ready()
    tokens = result["tokens"]
    assert tokens == caches.engines["ref"].wait_ready()["tokens"]
    assert tokens == caches.engines["a"].wait_ready()["tokens"]
    log = b.log()
    m = _FROM_PEER.search(log)
    assert m is not None, b.tail()
    installed = [u.strip(" '") for u in m.group(2).split(",")]
    hashdir = next(u for u in installed if u.startswith("torch_compile_cache/"))
    # vLLM's own key chose the installed directory: it loads its AOT artifact from there
    # ("Directly load AOT compilation from path ..."; this CPU build's loader then fails
    # with 'finalize_loading', on a warm restart too, and traces again) ...
    assert re.search(r"(Directly load AOT compilation from path|load failure from) "
                     + re.escape(str(caches.root("b") / hashdir)), log), b.tail()
    # ... and inductor found every compiled kernel in it: no shared library was rebuilt
    # (they were all written by the install, within a moment, before the warm-up).
    mine = sorted(p.name for p in (caches.root("b") / hashdir).rglob("*.so"))
    theirs = sorted(p.name for p in (caches.root("a") / hashdir).rglob("*.so"))
    assert mine and mine == theirs
    times = [p.stat().st_mtime for p in (caches.root("b") / hashdir).rglob("*.so")]
    assert max(times) - min(times) < 1.0
    # Model infos came when the plugin loaded, before vLLM's configuration needed them
    # (the front end's log is not configured yet then: the engine reports it).
    assert (result["early_modelinfos"] or "").startswith("from peer "), result
    # B used the received set (and serves it on): it publishes none of its own.
    assert _PUBLISHED.search(log) is None


def test_another_compile_setting_is_a_miss_that_says_why(caches: Caches) -> None:
    """Another compilation mode is a miss naming the differing factor; that engine compiles and publishes."""
    c = caches.engines["c"]
    c.wait_ready()
    log = c.log()
    assert "no compile caches from peers (no set for key" in log
    assert "other compile factors: config_hash" in log
    assert "nccl_back: compile caches from peer" not in log
    key_c = wait_published(c).group(2)
    assert key_c != wait_published(caches.engines["a"]).group(2)


@pytest.fixture(scope="module")
def inductor_caches(tiny_model: str, engine_env: dict[str, str], workdir: Path) -> Iterator[Caches]:
    """Two engines without vLLM's AOT compile, each with its own inductor cache directory."""
    c = Caches(tiny_model, dict(engine_env, VLLM_USE_AOT_COMPILE="0",
                                NCCL_BACK_NAMESPACE=engine_env["NCCL_BACK_NAMESPACE"] + "ind"), workdir)
    c.env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor-ia")
    c.start("ia", hold=True)
    c.engines["ia"].wait_ready()
    wait_published(c.engines["ia"])
    c.env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor-ib")
    c.start("ib")
    yield c
    for e in c.engines.values():
        e.kill()


def test_without_aot_compile_inductors_cache_travels(inductor_caches: Caches, workdir: Path) -> None:
    """Without vLLM's AOT compile the compile lives in inductor's cache directory: a fresh
    engine receives it before its warm-up and rebuilds no kernel; tokens as the first's."""
    a, b = inductor_caches.engines["ia"], inductor_caches.engines["ib"]
    assert not any(inductor_caches.root("ia").rglob("torch_compile_cache/*"))  # nothing of vLLM's own
    tokens = b.wait_ready()["tokens"]
    assert tokens == a.wait_ready()["tokens"]
    m = _FROM_PEER.search(b.log())
    assert m is not None, b.tail()
    mine = sorted(p.name for p in (workdir / "inductor-ib").rglob("*.so"))
    theirs = sorted(p.name for p in (workdir / "inductor-ia").rglob("*.so"))
    assert mine and mine == theirs
    times = [p.stat().st_mtime for p in (workdir / "inductor-ib").rglob("*.so")]
    assert max(times) - min(times) < 1.0  # all written by the install: none compiled after
    assert _PUBLISHED.search(b.log()) is None  # it serves what it received
