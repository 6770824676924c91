"""Resharding between vLLM engines of different tensor-parallel sizes: real engines (CPU
build), real Redis, separate processes.

The model has one KV head (replicated at TP=2), a vocabulary of 500 (padded) and tied
embeddings. H1 (TP=1) loads from storage; R2 (TP=2) then reshards from it; with H1 gone,
R1 (TP=1) reshards from R2's two ranks (a resharded engine serving its own layout);
then a slow TP=1 holder is killed while a TP=2 engine reshards from it. Each generates
greedily as ``--load-format auto`` at its TP size does. Tests run in file order.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT, Engine
from test_vllm_layout import make_gqa_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


class Fleet:
    def __init__(self, model: str, env: dict[str, str], workdir: Path) -> None:
        self.model, self.env, self.workdir = model, env, workdir
        self.engines: dict[str, Engine] = {}

    def start(self, name: str, env: dict[str, str] | None = None, **kw: Any) -> Engine:
        e = Engine(name, self.workdir).start(self.model, env or self.env, **kw)
        self.engines[name] = e
        return e

    def versions(self) -> dict[str, dict[str, Any]]:
        """``nccl-back status --json``'s versions (every module's engines share the namespace)."""
        out = subprocess.run(
            [str(Path(sys.executable).parent / "nccl-back"), "status", "--json"], env=self.env,
            cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        return dict(json.loads(out)["versions"])

    def peers(self, version: str = "") -> dict[str, dict[str, Any]]:
        """The live peers of the versions starting with ``version``, by id. Other modules'
        engines share the namespace, and one killed before it withdrew (a rank that
        outlived its executor's shutdown grace) stays listed for the peer TTL."""
        return {p["peer_id"]: p for v, entry in self.versions().items() if v.startswith(version)
                for p in entry["peers"]}


@pytest.fixture(scope="module")
def fleet(engine_env: dict[str, str], workdir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = make_gqa_model(str(tmp_path_factory.mktemp("gqa") / "model"))
    f = Fleet(model, engine_env, workdir)
    f.start("auto1", load_format="auto")
    f.start("h1", hold=True)
    yield f
    for e in f.engines.values():
        e.kill()


def test_tp1_holder_to_tp2_engine(fleet: Fleet) -> None:
    """R2 (TP=2) reshards from H1 (TP=1) on both ranks: source peer, each rank H1's entry, tokens as `auto` at TP=2."""
    h1 = fleet.engines["h1"]
    h1.wait_ready()
    assert h1.loaded()["source"] == "storage", h1.tail()
    r2 = fleet.start("r2", tp=2, hold=True)
    auto2 = fleet.start("auto2", load_format="auto", tp=2)
    r2_tokens = r2.wait_ready()["tokens"]
    ranks = r2.loaded_ranks()
    assert [r["source"] for r in ranks] == ["peer", "peer"], r2.tail()
    # One version for every layout of this content: the TP=1 holder's.
    assert {r["version"] for r in ranks} == {h1.loaded()["version"]}
    peers = fleet.peers(h1.loaded()["version"] or "?")
    assert {(peers[r["peer"] or ""]["world_size"], peers[r["peer"] or ""]["source"])
            for r in ranks} == {(1, "storage")}
    # R2 now serves its own layout, as a peer-loaded holder of both ranks.
    assert sorted((p["rank"], p["world_size"]) for p in peers.values() if p["source"] == "peer") \
        == [(0, 2), (1, 2)]
    assert "layout_mismatch" not in r2.log()
    assert r2_tokens == auto2.wait_ready()["tokens"]


def test_tp2_holders_to_tp1_engine(fleet: Fleet) -> None:
    """With H1 gone, R1 (TP=1) reshards from both ranks of R2 (itself resharded); tokens as `auto` at TP=1."""
    assert fleet.engines["h1"].release() == 0
    r1 = fleet.start("r1")
    tokens = r1.wait_ready()["tokens"]
    loaded = r1.loaded()
    assert loaded["source"] == "peer", r1.tail()
    peers = fleet.peers()
    sources = (loaded["peer"] or "").split(",")
    assert sorted((peers[p]["rank"], peers[p]["world_size"]) for p in sources) == [(0, 2), (1, 2)]
    assert tokens == fleet.engines["auto1"].wait_ready()["tokens"]
    assert fleet.engines["r2"].release() == 0


def test_holder_killed_mid_reshard_sends_every_rank_to_storage(fleet: Fleet) -> None:
    """A TP=1 holder killed while a TP=2 engine reshards from it: both ranks load from storage with the reason; tokens as `auto` at TP=2."""
    from nccl_back.config import Settings
    from nccl_back.coord.registry import Registry

    # 0.25 MB/s: half of this model takes the holder seconds to send, so the kill lands mid-transfer.
    slow = fleet.start("h1b", env=dict(fleet.env, NCCL_BACK_MAX_SEND_GBPS="0.00025"), hold=True)
    slow.wait_ready()
    assert fleet.engines["r1"].release() == 0  # h1b is now the only holder
    version = slow.loaded()["version"] or "?"
    holders = [p["peer_id"] for v, entry in fleet.versions().items() if v.startswith(version)
               for p in entry["peers"] if p["world_size"] == 1]
    assert len(holders) == 1, fleet.versions()
    reg = Registry(Settings.from_env(fleet.env))
    r2b = fleet.start("r2b", tp=2)
    deadline = time.monotonic() + 300
    while reg.active_claims(holders[0]) == 0:
        assert r2b.proc.poll() is None and not r2b.out.exists(), r2b.tail()
        assert time.monotonic() < deadline, r2b.tail()
        time.sleep(0.1)
    time.sleep(1.0)  # into the paced transfer
    slow.kill()
    tokens = r2b.wait_ready()["tokens"]
    ranks = r2b.loaded_ranks()
    assert [r["source"] for r in ranks] == ["storage", "storage"], r2b.tail()
    # The rank whose transfer broke says so; the other was sent along by the group's vote.
    reasons = [(r["reason"] or "").split(":")[0] for r in ranks]
    assert {"transfer_error", "transfer_timeout", "handshake_timeout"} & set(reasons), r2b.tail()
    assert tokens == fleet.engines["auto2"].wait_ready()["tokens"]
