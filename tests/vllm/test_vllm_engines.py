"""``--load-format nccl_back`` with real vLLM engines (CPU build), real Redis, separate processes.

Engines start in parallel where the scenario allows (each start is ~40 s of mostly
CPU): the ``fleet`` starts the reference ``auto`` engine, engine A, and the two
misconfigured engines at once. Tests run in file order; the last one kills A.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT, Engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


class Fleet:
    def __init__(self, model: str, env: dict[str, str], workdir: Path) -> None:
        self.model, self.env, self.workdir = model, env, workdir
        self.engines: list[Engine] = []

    def start(self, name: str, *, env: dict[str, str] | None = None, **kw: Any) -> Engine:
        e = Engine(name, self.workdir).start(self.model, env or self.env, **kw)
        self.engines.append(e)
        return e

    def status(self) -> dict[str, Any]:
        """``nccl-back status --json``: what the registry holds."""
        out = subprocess.run(
            [str(Path(sys.executable).parent / "nccl-back"), "status", "--json"], env=self.env,
            cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        return dict(json.loads(out))

    def peers(self) -> list[dict[str, Any]]:
        return [p for v in self.status()["versions"].values() for p in v["peers"]]


@pytest.fixture(scope="module")
def fleet(tiny_model: str, engine_env: dict[str, str], workdir: Path) -> Iterator[Fleet]:
    f = Fleet(tiny_model, engine_env, workdir)
    f.start("auto", load_format="auto")
    f.start("a", hold=True)
    f.start("bad_config", extra={"bogus": 1})
    unreachable = dict(engine_env, NCCL_BACK_REDIS_URL="redis://127.0.0.1:9/0",
                       NCCL_BACK_REDIS_TIMEOUT="0.5")
    f.start("no_redis", env=unreachable)
    yield f
    for e in f.engines:
        e.kill()


def by_name(fleet: Fleet, name: str) -> Engine:
    return next(e for e in fleet.engines if e.name == name)


def test_bad_extra_config_is_one_clear_error(fleet: Fleet) -> None:
    """An unknown model_loader_extra_config key stops the engine with one ConfigError, before any load."""
    bad = by_name(fleet, "bad_config")
    assert bad.wait_exit() != 0
    log = bad.log()
    assert "ConfigError: model_loader_extra_config: unknown key(s) ['bogus'] for load format 'nccl_back'" in log
    assert "Loading weights took" not in log and "nccl_back: loaded" not in log


def test_unreachable_redis_falls_back_to_storage(fleet: Fleet) -> None:
    """With Redis unreachable the engine loads from storage, says why, and generates as `auto` does."""
    engine = by_name(fleet, "no_redis")
    tokens = engine.wait_ready()["tokens"]
    loaded = engine.loaded()
    assert loaded["source"] == "storage"
    assert loaded["reason"] is not None and loaded["reason"].startswith("registry_error:")
    assert tokens == by_name(fleet, "auto").wait_ready()["tokens"]
    log = engine.log()
    # A fallback an operator must see: at WARNING in vLLM's own output, with the
    # library's own event (routed to vLLM's logger) saying why.
    assert re.search(r"WARNING [^\n]*nccl_back: loaded version \w+ from storage", log), log[-3000:]
    assert re.search(r"WARNING [^\n]*fallback_to_storage [^\n]*reason='registry_error'", log)


def test_peer_load_matches_auto(fleet: Fleet) -> None:
    """B, started once A is ready, loads from A (status: source peer); A, B and `auto` generate alike."""
    a = by_name(fleet, "a")
    a_tokens = a.wait_ready()["tokens"]
    assert a.loaded()["source"] == "storage"
    a_log = a.log()
    # The first engine of a version says so, at INFO: nothing went wrong. The library's
    # own warnings (no secret here) reach vLLM's output.
    assert re.search(r"INFO [^\n]*nccl_back: loaded version \w+ from storage[^\n]*; first engine"
                     r" of this version", a_log), a.tail()
    assert "fallback_to_storage" not in a_log and "fallback:" not in a_log
    assert re.search(r"WARNING [^\n]*no_secret ", a_log), a.tail()
    b = fleet.start("b", hold=True)
    b_tokens = b.wait_ready()["tokens"]
    loaded = b.loaded()
    assert loaded["source"] == "peer", b.tail()
    assert loaded["version"] == a.loaded()["version"]
    peers = {p["peer_id"]: p for p in fleet.peers()}
    assert peers[loaded["peer"]]["source"] == "storage"  # A, which B loaded from
    assert sorted(p["source"] for p in peers.values()) == ["peer", "storage"]
    # `status` names what an operator looks for: the model, the engine, host and pid.
    assert {p["model"] for p in peers.values()} == {Path(fleet.model).name}, peers
    assert all(p["engine"].startswith("vllm-") and p["host"] and p["pid"] > 0
               for p in peers.values()), peers
    assert len({p["pid"] for p in peers.values()}) == 2, peers
    assert a_tokens == b_tokens == by_name(fleet, "auto").wait_ready()["tokens"]

    assert b.release() == 0
    # Gone at once (the TTL is 600 s): B withdrew its entry when the engine shut down,
    # first thing (vLLM kills a worker whose teardown outlasts its grace period).
    assert [p["peer_id"] for p in fleet.peers()] == [loaded["peer"]]
    assert "withdrawn from the registry: vLLM is shutting this worker down" in b.log(), b.tail()


def test_other_dtype_never_receives(fleet: Fleet) -> None:
    """A float16 engine never receives A's bfloat16 weights, and generates as `auto` in float16 does."""
    a = by_name(fleet, "a")
    a.wait_ready()
    c = fleet.start("c_fp16", dtype="float16")
    ref = fleet.start("auto_fp16", load_format="auto", dtype="float16")
    tokens = c.wait_ready()["tokens"]
    loaded = c.loaded()
    assert loaded["source"] == "storage"
    assert loaded["version"] != a.loaded()["version"]
    assert "no live peer holds version" in (loaded["reason"] or "")
    assert tokens == ref.wait_ready()["tokens"]
    assert a.proc.poll() is None, a.tail()  # A kept serving all along


def test_peer_killed_while_starting_falls_back(fleet: Fleet) -> None:
    """A killed while B starts: B finds A's stale entry, falls back to storage with the reason, serves correctly."""
    a = by_name(fleet, "a")
    a.wait_ready()
    assert a.proc.poll() is None, a.tail()
    b = fleet.start("b_after_kill")
    a.kill()
    tokens = b.wait_ready()["tokens"]
    loaded = b.loaded()
    assert loaded["source"] == "storage"
    assert (loaded["reason"] or "").startswith(("handshake_timeout:", "transfer_error:")), b.tail()
    assert tokens == by_name(fleet, "auto").wait_ready()["tokens"]
    assert os.path.exists(b.out)


def test_tensor_parallel_engines_prefer_their_layout(fleet: Fleet) -> None:
    """TP=2 engines: B2 loads from A2 on both ranks, rank for rank (same layout first).

    TP=1 <-> TP=2 resharding is test_vllm_reshard's."""
    # Only TP=2 engines serve from here on (A's entry, if A was killed, is stale).
    by_name(fleet, "a").kill()
    a2 = fleet.start("a2_tp2", hold=True, tp=2)
    a2_tokens = a2.wait_ready()["tokens"]
    a2_ranks = a2.loaded_ranks()
    # Both ranks from storage, as one engine: no TP=2 engine was serving (a reshard from
    # A's stale entry, if tried, timed out).
    assert [r["source"] for r in a2_ranks] == ["storage", "storage"], a2.tail()
    a2_versions = {r["version"] for r in a2_ranks}
    # Described layouts share the content's version across ranks and TP sizes.
    assert a2_versions == {a2_ranks[0]["version"]}

    b2 = fleet.start("b2_tp2", tp=2, hold=True)
    b2_tokens = b2.wait_ready()["tokens"]
    b2_ranks = b2.loaded_ranks()
    assert [r["source"] for r in b2_ranks] == ["peer", "peer"], b2.tail()
    assert {r["version"] for r in b2_ranks} == a2_versions
    peers = {p["peer_id"]: p for p in fleet.peers()}
    # Each rank loaded from A2's rank of the same index, and now serves as a peer-loaded copy.
    assert sorted((peers[r["peer"] or ""]["rank"], peers[r["peer"] or ""]["source"])
                  for r in b2_ranks) == [(0, "storage"), (1, "storage")]
    assert sorted((p["rank"], p["source"]) for p in peers.values() if p["source"] == "peer") == [
        (0, "peer"), (1, "peer")]
    assert b2_tokens == a2_tokens
    assert b2.release() == 0 and a2.release() == 0
