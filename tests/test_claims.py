"""Send slots under attack and under load, against a real redis-server: a replayed
genuine claim expires with its signature, the ranks of one group take one slot however
they race, and a holder queues every rank's request of a group behind one slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.registry import Registry
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.layout import trivial_layout
from nccl_back.model.skeleton import build, manifest
from nccl_back.transport.sender import SHARED_SENDS

from models import TinyTransformer, fill_random, write_checkpoint
from workers import settings_for

pytestmark = pytest.mark.timeout(120)
SECRET = "claims-test-secret-0123456789abcdef"


@pytest.fixture
def fleet(tmp_path: Path, redis_url: str, namespace: str, cache_dir: str) -> Iterator[tuple[Settings, ModelSpec]]:
    ckpt = write_checkpoint(fill_random(TinyTransformer(), seed=21), tmp_path / "ckpt")
    # settings_for's peer_ttl 3 s and transfer_timeout 20 s: claim_ttl 1.8 s, busy_wait 10 s.
    s = settings_for(redis_url, namespace, cache_dir, secret=SECRET, max_concurrent_sends=1)
    yield s, ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)


def test_a_replayed_claim_expires_with_its_signature(fleet: tuple[Settings, ModelSpec]) -> None:
    """A genuine claim copied out of Redis and written back every second (no secret
    needed) holds a one-slot holder's slot only until the expiry signed into it: a
    receiver then loads from the holder, not from storage."""
    s, spec = fleet
    client = redis.Redis.from_url(s.redis_url)
    with WeightService(s) as holder:
        assert holder.load(build(TinyTransformer), spec).source == "storage"
        peer = holder.peers[0]
        reg = Registry(s)
        token = reg.claim(peer.peer_id, "genuine", 1, s.claim_ttl)
        assert token is not None
        key = reg.keys.of(schema.CLAIM, peer.peer_id, 0)
        copy = client.get(key)
        reg.release(peer.peer_id, token)
        stop = threading.Event()

        def replay() -> None:
            while not stop.is_set():
                client.set(key, copy, px=int(s.claim_ttl * 1000))
                stop.wait(1.0)

        attacker = threading.Thread(target=replay, daemon=True)
        attacker.start()
        try:
            start = time.monotonic()
            with WeightService(s) as receiver:
                result = receiver.load(build(TinyTransformer), spec)
            took = time.monotonic() - start
        finally:
            stop.set()
            attacker.join(5)
        assert result.source == "peer", result.fallback_reason
        assert took < s.claim_ttl + 5.0 + 4.0  # the replay's expiry, the clock skew, the load


def test_a_claim_is_signed_with_its_expiry_and_renewed_by_resigning(
        fleet: tuple[Settings, ModelSpec]) -> None:
    """The claim's signature carries an expiry; renewal moves it (a re-signed value)."""
    s, _ = fleet
    reg = Registry(s)
    token = reg.claim("p", "r", 1, s.claim_ttl)
    assert token is not None
    key = reg.keys.of(schema.CLAIM, "p", 0)
    before = reg.client.get(key)
    assert b'"exp"' in before
    time.sleep(0.05)
    assert reg.renew_claim("p", token, s.claim_ttl)
    assert reg.client.get(key) != before
    assert reg.get_signed(key, schema.CLAIM) is not None


def _race(reg: Registry, barrier: threading.Barrier, tokens: list[str | None], peer: str, i: int,
          slots: int, share: str) -> None:
    barrier.wait()
    tokens.append(reg.claim(peer, f"g-{i}", slots, 5.0, share=share))


@pytest.mark.parametrize("slots", [2, 3, 8])
def test_the_ranks_of_a_group_racing_for_slots_take_one(redis_url: str, namespace: str,
                                                        slots: int) -> None:
    """Ranks of one group claiming a many-slot holder at the same moment (40 races) hold
    one slot together every time, leaving the others to other receivers."""
    reg = Registry(Settings(redis_url=redis_url, namespace=namespace, secret=SECRET))
    for trial in range(40):
        share = f"{trial:032x}"
        tokens: list[str | None] = []
        barrier = threading.Barrier(4)
        threads = [threading.Thread(target=_race, args=(reg, barrier, tokens, f"p{trial}", i, slots, share))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(set(tokens)) == 1 and tokens[0] is not None, tokens
        assert reg.active_claims(f"p{trial}") == 1


def test_every_rank_of_a_large_group_is_queued_behind_one_slot(
        fleet: tuple[Settings, ModelSpec]) -> None:
    """A one-slot holder queues the reshard requests of every rank sharing one claim
    token (up to SHARED_SENDS): none is dropped as a flood, so a TP=8 group is served."""
    s, spec = fleet
    with WeightService(s) as holder:
        assert holder.load(build(TinyTransformer), spec).source == "storage"
        peer = holder.peers[0]
        reg = Registry(s)
        token = reg.claim(peer.peer_id, "group", 1, 30.0, share="c" * 32)
        assert token is not None
        # Real layouts, so each request is planned and its send waits in the handshake
        # (its receivers never answer): all of them are queued at once.
        lay = trivial_layout(manifest(build(TinyTransformer)))
        reg.put_layout(lay)
        group = reg.put_group([lay.digest])
        for i in range(SHARED_SENDS):
            reg.push_request(peer.peer_id, {
                "transfer_id": f"t{i}" + "0" * 30, "receiver": f"g-{i}", "version": spec.version,
                "manifest_digest": lay.digest, "transport": "gloo", "device": "cpu",
                "claim": token, "layout": lay.digest, "group": group, "holder": 0})
        deadline = time.monotonic() + 10
        queue = reg.keys.of(schema.REQUEST, peer.peer_id)
        while reg.client.llen(queue) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert holder.metrics.requests_dropped._value.get() == 0
