"""The Redis registry, against a real redis-server."""

from __future__ import annotations

import json
import time

import pytest
import redis

from nccl_back.config import Settings
from nccl_back.coord import records, schema
from nccl_back.coord.records import TransferRequest
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.coord.signed_store import Raw
from nccl_back.dev.servers import LocalRedis, free_port
from nccl_back.errors import ConfigError, RegistryError
from nccl_back.metrics import Metrics


def make_registry(redis_url: str, namespace: str, **overrides: object) -> Registry:
    return Registry(Settings(redis_url=redis_url, namespace=namespace, **overrides))  # type: ignore[arg-type]


def peer(peer_id: str = "p1", version: str = "v1", rank: int = 0, max_sends: int = 1) -> PeerInfo:
    return PeerInfo(
        peer_id=peer_id,
        version=version,
        rank=rank,
        world_size=1,
        manifest_digest="d" * 32,
        transport="gloo",
        address="127.0.0.1:1234",
        started_at=1_700_000_000.0,
        max_sends=max_sends,
    )


def test_every_key_has_a_ttl_and_a_json_value(redis_url: str, namespace: str) -> None:
    """Every key the registry writes expires and holds JSON (lists: JSON items)."""
    reg = make_registry(redis_url, namespace)
    info = peer()
    reg.publish_peer(info)
    reg.heartbeat(info, "s1")
    reg.put_ground_truth("v1", 0, 1, "d" * 32, "s1", {"layer": "abc"})
    reg.claim("p1", "r1", max_sends=1, ttl=5)
    reg.push_request("p1", {"transfer_id": "t1"})
    reg.set_json(reg.keys.key("hs", "t1", "receiver_ready"), {"value": 1}, ttl=5)
    keys = list(reg.client.scan_iter(reg.keys.key("*")))
    assert len(keys) == 6
    for key in keys:
        assert reg.client.pttl(key) > 0, key
        kind = reg.client.type(key)
        if kind == b"string":
            json.loads(reg.client.get(key))
        elif kind == b"list":
            for item in reg.client.lrange(key, 0, -1):
                json.loads(item)
        else:
            assert kind == b"set"


def test_find_peers_returns_published_peers_for_the_version_and_rank(
    redis_url: str, namespace: str
) -> None:
    """Peers are found by exact version and rank; withdrawn ones disappear."""
    reg = make_registry(redis_url, namespace)
    reg.publish_peer(peer("a"))
    reg.publish_peer(peer("b"))
    reg.publish_peer(peer("c", rank=1))
    reg.publish_peer(peer("d", version="v2"))
    assert sorted(p.peer_id for p in reg.find_peers("v1", 0, 1)) == ["a", "b"]
    assert reg.find_peers("v1", 0, 1)[0] in {peer("a"), peer("b")}
    reg.withdraw("a", "v1")
    assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["b"]
    assert reg.find_peers("v3", 0, 1) == []


def test_find_peers_puts_least_claimed_first(redis_url: str, namespace: str) -> None:
    """A peer whose send slot is taken is offered after a free one."""
    reg = make_registry(redis_url, namespace)
    reg.publish_peer(peer("a"))
    reg.publish_peer(peer("b"))
    assert reg.claim("a", "r1", max_sends=1, ttl=5) is not None
    for _ in range(5):
        assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["b", "a"]


@pytest.mark.timeout(20)
def test_dead_peer_vanishes_after_its_ttl(redis_url: str, namespace: str) -> None:
    """Without heartbeats a peer's entry expires; with them it stays."""
    # Heartbeats every 0.1 s against a 1 s TTL: a loaded machine may stall one for 0.9 s.
    reg = make_registry(redis_url, namespace, peer_ttl=1.0)
    reg.publish_peer(peer("dead"))
    reg.publish_peer(peer("alive"))
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        reg.heartbeat(peer("alive"), "s1")
        time.sleep(0.1)
    assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["alive"]
    assert reg.client.smembers(reg.keys.key("peers", "v1", 0, 1)) == {b"alive"}


def test_a_forged_index_of_dead_ids_is_seen_by_every_reader_not_only_the_first(
        redis_url: str, namespace: str) -> None:
    """An index naming only dead ids over a live holder's overwritten entry: every
    reader rejects it (a first reader's pruning would leave the next one an empty index,
    and nobody to wait for: it would download at once)."""
    first, second = make_registry(redis_url, namespace), make_registry(redis_url, namespace)
    first.publish_peer(peer("p1"))
    index = first.keys.of(schema.INDEX, "v1", 0, 1)
    first.client.delete(index)
    first.client.sadd(index, "ghost")
    first.client.set(first.keys.of(schema.PEER, "v1", 0, 1, "p1"), b"{")
    for reg in (first, second):
        before = reg.rejected
        assert reg.find_peers("v1", 0, 1) == []
        assert reg.rejected > before, "the forgery went unseen"
    assert first.client.smembers(index) == {b"ghost"}


def test_ground_truth_is_never_overwritten(redis_url: str, namespace: str) -> None:
    """The first storage load's hashes for a manifest stay; a later put for it is refused."""
    reg = make_registry(redis_url, namespace)
    assert reg.get_ground_truth("v1", 0, 1, "m1", "s1") is None
    assert reg.put_ground_truth("v1", 0, 1, "m1", "s1", {"a": "1"}) is True
    assert reg.put_ground_truth("v1", 0, 1, "m1", "s1", {"a": "2"}) is False
    assert reg.get_ground_truth("v1", 0, 1, "m1", "s1") == {"a": "1"}
    assert reg.has_ground_truth("v1", 0, 1, "s1")
    assert not reg.has_ground_truth("v1", 1, 1, "s1")


def test_ground_truth_is_kept_per_manifest_flavour(redis_url: str, namespace: str) -> None:
    """Two skeleton flavours of one version each get their own ground truth; neither wins."""
    reg = make_registry(redis_url, namespace)
    assert reg.put_ground_truth("v1", 0, 1, "flat", "s1", {"sampled|a": "1"}) is True
    assert reg.put_ground_truth("v1", 0, 1, "module", "s1", {"sampled|b": "2"}) is True
    assert reg.get_ground_truth("v1", 0, 1, "flat", "s1") == {"sampled|a": "1"}
    assert reg.get_ground_truth("v1", 0, 1, "module", "s1") == {"sampled|b": "2"}
    assert reg.get_ground_truth("v1", 0, 1, "other", "s1") is None


def test_two_schemes_keep_two_truths(redis_url: str, namespace: str) -> None:
    """Truth of another verification scheme (a rolling upgrade) neither replaces ours
    nor is read as ours."""
    reg = make_registry(redis_url, namespace)
    assert reg.put_ground_truth("v1", 0, 1, "m1", "old", {"sampled|a": "1"}) is True
    assert reg.get_ground_truth("v1", 0, 1, "m1", "new") is None
    assert reg.put_ground_truth("v1", 0, 1, "m1", "new", {"sampled|a": "2"}) is True
    assert reg.get_ground_truth("v1", 0, 1, "m1", "old") == {"sampled|a": "1"}
    old = reg.client.get(reg.keys.of(schema.GROUND_TRUTH, "v1", 0, 1, "m1", "old"))
    reg.client.set(reg.keys.of(schema.GROUND_TRUTH, "v1", 0, 1, "m1", "new"), old, px=5000)
    with pytest.raises(RegistryError, match="scheme 'old' under another key"):
        reg.get_ground_truth("v1", 0, 1, "m1", "new")


def test_ground_truth_under_another_digest_is_refused(redis_url: str, namespace: str) -> None:
    """A record whose digest differs from its key's is malformed (RegistryError), never used."""
    reg = make_registry(redis_url, namespace)
    reg.set_json(reg.keys.of(schema.GROUND_TRUTH, "v1", 0, 1, "m1", "s1"),
                 {"manifest_digest": "m2", "scheme": "s1", "hashes": {}}, ttl=5)
    with pytest.raises(RegistryError, match="digest .m2. under another key"):
        reg.get_ground_truth("v1", 0, 1, "m1", "s1")


def test_key_schema_lives_in_the_registry(redis_url: str, namespace: str) -> None:
    """Lease, handshake and ground-truth keys all come from one module, under one hash tag."""
    reg = make_registry(redis_url, namespace)
    ns = f"{{{namespace}}}"
    assert reg.keys.of(schema.LEASE, "v1", 2) == f"{ns}:dl:v1:2"
    assert reg.keys.of(schema.HANDSHAKE, "t1", "receiver_ready") == f"{ns}:hs:t1:receiver_ready"
    assert reg.keys.of(schema.GROUND_TRUTH, "v1", 0, 2, "d", "s1") == f"{ns}:gt:v1:0:2:d:s1"
    with pytest.raises(ValueError, match="a dl key has the parts"):
        reg.keys.of(schema.LEASE, "v1")  # a part short: never a key of another kind


def test_truth_encoding_round_trips() -> None:
    """``{mode: {layer: hash}}`` flattens to "mode|layer" keys and back, one mode at a time."""
    from nccl_back.coord.registry import encode_truth, truth_for_mode

    flat = encode_truth({"sampled": {"a": "1"}, "full": {"a": "2"}})
    assert flat == {"sampled|a": "1", "full|a": "2"}
    assert truth_for_mode(flat, "full") == {"a": "2"}


@pytest.mark.timeout(20)
def test_claim_renewal_keeps_only_our_own_claim(redis_url: str, namespace: str) -> None:
    """A renewed claim outlives its TTL; one that expired and was retaken is not renewed."""
    reg = make_registry(redis_url, namespace)
    # Renewed every 0.3 s for 1.5 s against a 1.2 s TTL: past one TTL, with 0.9 s of
    # slack per renewal for a loaded machine (0.2 s against 0.4 s failed under mypy).
    token = reg.claim("p", "r", max_sends=1, ttl=1.2)
    assert token is not None
    for _ in range(5):
        time.sleep(0.3)
        assert reg.renew_claim("p", token, 1.2)
    assert reg.active_claims("p") == 1
    time.sleep(1.5)
    assert reg.active_claims("p") == 0
    other = reg.claim("p", "next", max_sends=1, ttl=5)
    assert other is not None
    assert not reg.renew_claim("p", token, 5)


def test_compare_and_set(redis_url: str, namespace: str) -> None:
    """Compare-and-set acts only on the exact expected JSON value."""
    reg = make_registry(redis_url, namespace)
    key = reg.keys.key("x")
    reg.set_json(key, {"v": 1}, 5)
    assert not reg.compare_and_set(key, {"v": 2}, {"v": 3}, 5)
    assert reg.compare_and_set(key, {"v": 1}, {"v": 3}, 5)
    assert json.loads(reg.client.get(key)) == {"v": 3}
    reg.delete(key)
    assert not reg.compare_and_set(key, {"v": 3}, {"v": 4}, 5)
    assert reg.client.get(key) is None


def test_malformed_peer_entry_is_skipped(redis_url: str, namespace: str) -> None:
    """A bad entry in the index is skipped with a reason; the good peers are still found."""
    reg = make_registry(redis_url, namespace)
    reg.publish_peer(peer("good"))
    reg.client.set(reg.keys.key("peer", "v1", 0, 1, "bad"), '{"peer_id": "bad"}', px=5000)
    reg.client.sadd(reg.keys.key("peers", "v1", 0, 1), "bad")
    assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["good"]


def test_claims_are_exclusive_up_to_max_sends(redis_url: str, namespace: str) -> None:
    """max_sends receivers get a slot, the next gets None until one is released."""
    reg = make_registry(redis_url, namespace)
    tokens = [reg.claim("p", f"r{i}", max_sends=2, ttl=5) for i in range(2)]
    assert all(tokens) and tokens[0] != tokens[1]
    assert reg.claim("p", "r3", max_sends=2, ttl=5) is None
    assert reg.active_claims("p") == 2
    assert tokens[0] is not None
    reg.release("p", tokens[0])
    assert reg.active_claims("p") == 1
    assert reg.claim("p", "r3", max_sends=2, ttl=5) is not None


def test_ranks_of_one_receiving_group_share_a_slot_and_no_one_else_does(
        redis_url: str, namespace: str) -> None:
    """Claims with one group's share hold one slot together; another share or a plain
    receiver gets None while it is held, and a released slot is free for anyone."""
    reg = make_registry(redis_url, namespace, secret="s" * 32)
    share, other = "a" * 32, "b" * 32
    first = reg.claim("p", "g-0", max_sends=1, ttl=5, share=share)
    assert first == f"0:{share}"
    assert reg.claim("p", "g-1", max_sends=1, ttl=5, share=share) == first
    assert reg.claim("p", "h-0", max_sends=1, ttl=5, share=other) is None
    assert reg.claim("p", "plain", max_sends=1, ttl=5) is None
    assert reg.active_claims("p") == 1
    reg.release("p", first)
    assert reg.claim("p", "h-0", max_sends=1, ttl=5, share=other) == f"0:{other}"
    # A forged record carrying our share (not signed with the fleet secret) is taken over, not joined.
    reg.release("p", f"0:{other}")
    reg.client.set(reg.keys.of(schema.CLAIM, "p", 0),
                   json.dumps({"token": f"0:{share}", "receiver": "x"}), px=5000)
    assert reg.claim("p", "g-1", max_sends=1, ttl=5, share=share) == f"0:{share}"
    got = reg.get_signed(reg.keys.of(schema.CLAIM, "p", 0), schema.CLAIM)
    assert got is not None and got[0].receiver == "g-1"


@pytest.mark.timeout(20)
def test_release_deletes_only_our_own_claim(redis_url: str, namespace: str) -> None:
    """A late release after our claim expired and was retaken leaves the new claim alone."""
    reg = make_registry(redis_url, namespace)
    old = reg.claim("p", "slow", max_sends=1, ttl=0.2)
    assert old is not None
    time.sleep(0.4)
    new = reg.claim("p", "next", max_sends=1, ttl=5)
    assert new is not None
    reg.release("p", old)
    assert reg.active_claims("p") == 1
    reg.release("p", new)
    assert reg.active_claims("p") == 0
    with pytest.raises(RegistryError, match="malformed claim token"):
        reg.release("p", "nonsense")


@pytest.mark.timeout(20)
def test_requests_are_queued_and_popped_with_a_bounded_wait(redis_url: str, namespace: str) -> None:
    """Requests come out newest first (a flood pushed earlier cannot delay a live
    receiver's); an empty queue returns None after the timeout; the queue is bounded."""
    reg = make_registry(redis_url, namespace, redis_timeout=0.4)
    req = {"receiver": "w", "version": "v1", "manifest_digest": "d" * 32, "transport": "gloo"}
    reg.push_request("p", {"transfer_id": "t1", **req})
    reg.push_request("p", {"transfer_id": "t2", **req})
    assert reg.pop_request("p", timeout=1) == TransferRequest(transfer_id="t2", **req)
    assert reg.pop_request("p", timeout=0) == TransferRequest(transfer_id="t1", **req)
    # Longer than the socket timeout: the wait is split so it is not taken for a dead link.
    assert reg.pop_request("p", timeout=0.9) is None
    for i in range(300):
        reg.push_request("p", {"transfer_id": f"f{i}", **req})
    assert reg.client.llen(reg.keys.key("req", "p")) == 256


def test_a_wake_up_ends_the_wait_on_a_queue_at_once_and_is_no_request(
        redis_url: str, namespace: str) -> None:
    """A closing endpoint's wake-up ends its own 30-second wait on the queue at once;
    it is not a request, not a rejected record, and lives a second at most."""
    import threading

    metrics = Metrics()
    reg = make_registry(redis_url, namespace)
    reg.on_untrusted = metrics.record_untrusted  # the real callback, as the service wires it
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(reg.pop_request("p", timeout=30)))
    start = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    reg.wake_requests("p")
    waiter.join(10)
    assert got == [None] and time.monotonic() - start < 10
    reg.wake_requests("p")  # nobody waits: it expires
    assert 0 < reg.client.pttl(reg.keys.key("req", "p")) <= 1000
    assert metrics.records_rejected.labels(kind="request")._value.get() == 0


def test_list_all_groups_peers_by_version(redis_url: str, namespace: str) -> None:
    """Status lists every live peer with its claims and whether it is busy."""
    reg = make_registry(redis_url, namespace)
    reg.publish_peer(peer("a"))
    reg.publish_peer(peer("b", version="v2", max_sends=2))
    reg.claim("a", "r", max_sends=1, ttl=5)
    listing = reg.list_all()
    assert sorted(listing) == ["v1", "v2"]
    (a,) = listing["v1"]
    assert a.info == peer("a") and a.active_claims == 1 and a.busy and 0 < a.ttl <= 10
    (b,) = listing["v2"]
    assert b.active_claims == 0 and not b.busy


def test_malformed_peer_entry_raises_registry_error(redis_url: str, namespace: str) -> None:
    """A value that is not a PeerInfo is reported, not half-parsed; discovery skips it
    and counts it."""
    reg = make_registry(redis_url, namespace)
    metrics = Metrics()
    reg.on_untrusted = metrics.record_untrusted  # the real callback, as the service wires it
    reg.publish_peer(peer("a"))
    reg.client.set(reg.keys.key("peer", "v1", 0, 1, "a"), json.dumps({"peer_id": "a"}), ex=5)
    with pytest.raises(RegistryError, match="peer entry: world_size must be an integer"):
        records.peer(records.load(json.dumps({"peer_id": "a"}), "peer entry"))
    assert reg.find_peers("v1", 0, 1) == []
    assert metrics.records_rejected.labels(kind="peer")._value.get() == 1


@pytest.mark.timeout(30)
def test_password_url_is_used_and_redacted_in_errors(namespace: str) -> None:
    """A password in the URL authenticates; a wrong one fails without leaking it."""
    with LocalRedis(password="s3cret") as server:
        reg = make_registry(server.url, namespace)
        reg.ping()
        reg.publish_peer(peer())
        assert len(reg.find_peers("v1", 0, 1)) == 1
        bad = make_registry(f"redis://:wrong@127.0.0.1:{server.port}/0", namespace)
        with pytest.raises(RegistryError, match=r"redis PING failed \(redis://:\*\*\*@") as info:
            bad.ping()
        assert "wrong" not in str(info.value)
        assert isinstance(info.value.__cause__, redis.AuthenticationError)


def test_unsafe_ids_and_clients_are_refused(redis_url: str, namespace: str) -> None:
    """A peer id that would break key parsing, or a client decoding replies, is a ConfigError."""
    reg = make_registry(redis_url, namespace)
    with pytest.raises(ConfigError, match="peer_id='a:b'"):
        reg.publish_peer(peer("a:b"))
    with pytest.raises(ConfigError, match="decode_responses=False"):
        Registry(Settings(redis_url=redis_url, namespace=namespace),
                 redis.Redis.from_url(redis_url, decode_responses=True))


def test_rediss_url_selects_tls(namespace: str) -> None:
    """rediss:// makes a TLS connection pool with the URL's host, port, password and db."""
    reg = make_registry("rediss://:pw@cache.example:6380/2", namespace)
    kwargs = reg.client.connection_pool.connection_kwargs
    assert reg.client.connection_pool.connection_class is redis.SSLConnection
    assert (kwargs["host"], kwargs["port"], kwargs["password"], kwargs["db"]) == (
        "cache.example", 6380, "pw", 2
    )
    assert kwargs["socket_timeout"] == Settings().redis_timeout


@pytest.mark.timeout(20)
def test_unreachable_redis_raises_registry_error_quickly(namespace: str) -> None:
    """Nothing listening: RegistryError within about the socket timeout, not a hang."""
    reg = make_registry(f"redis://127.0.0.1:{free_port()}/0", namespace, redis_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(RegistryError, match="redis PING failed"):
        reg.ping()
    with pytest.raises(RegistryError, match="redis publish failed"):
        reg.publish_peer(peer())
    assert time.monotonic() - start < 5


def test_an_oversized_record_is_refused_and_replaced_without_its_bytes_leaving_the_server(
    redis_url: str, namespace: str
) -> None:
    """A value over its kind's bound (64 MiB + 1 of ground truth, a lease) is rejected by a
    reader, repaired by its holder and taken over by an acquirer while the server sends
    under 1 MiB in all: its bytes never cross the wire."""
    from nccl_back.errors import UntrustedRecordError

    reg = make_registry(redis_url, namespace, secret="s" * 32)
    info = peer()
    key = reg.keys.of(schema.GROUND_TRUTH, "v1", 0, 1, info.manifest_digest, "s1")
    lease = reg.keys.of(schema.LEASE, "v1", 1)
    for k, kind in ((key, schema.GROUND_TRUTH), (lease, schema.LEASE)):
        reg.client.set(k, b"x" * (kind.max_bytes + 1), ex=3600)
    sent = int(reg.client.info("stats")["total_net_output_bytes"])
    with pytest.raises(UntrustedRecordError, match="not a bounded string value"):
        reg.get_ground_truth("v1", 0, 1, info.manifest_digest, "s1")
    reg.keep_ground_truth(info, "s1", {"layer": "abc"})
    assert reg.get_ground_truth("v1", 0, 1, info.manifest_digest, "s1") == {"layer": "abc"}
    assert reg.acquire(lease, {"owner": "w1"}, schema.LEASE, 5.0) is not None
    assert reg.client.strlen(lease) < 1024
    assert int(reg.client.info("stats")["total_net_output_bytes"]) - sent < 1 << 20


def test_oversized_peer_entries_cost_a_reader_their_bound_not_their_size(
    redis_url: str, namespace: str
) -> None:
    """Peer entries read in a batch (discovery, ``status``) send at most their kind's
    bound + 1 bytes each: a 16 MiB value at a genuine holder's key is skipped with a
    reason while the holder is still found."""
    reg = make_registry(redis_url, namespace, secret="s" * 32)
    good, bad = peer("good"), peer("bad")
    reg.publish_peer(good)
    reg.publish_peer(bad)
    reg.client.set(reg.keys.of(schema.PEER, "v1", 0, 1, "bad"), b"{" + b" " * (16 << 20), ex=3600)
    sent = int(reg.client.info("stats")["total_net_output_bytes"])
    rejected = reg.rejected
    assert [p.peer_id for p in reg.find_peers("v1", 0, 1)] == ["good"]
    assert [s.info.peer_id for s in reg.list_all()["v1"]] == ["good"]
    assert reg.rejected - rejected == 2
    assert int(reg.client.info("stats")["total_net_output_bytes"]) - sent < 1 << 20


def test_a_started_server_used_as_a_context_stops_when_the_block_ends() -> None:
    """``with LocalRedis().start() as r:`` (the README's form) leaves no server behind."""
    import socket

    with LocalRedis().start() as r:
        port = r.port
        redis.Redis.from_url(r.url).ping()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 1):
        pass


@pytest.mark.parametrize("other", ["list", "set", "hash", "zset"])
def test_writes_that_only_tidy_never_raise_on_another_redis_type(
        redis_url: str, namespace: str, other: str) -> None:
    """Releasing a claim, dropping a lease and pruning a withdrawn peer from its index
    raise nothing whatever type an attacker left there: the failures are counted
    (tidy_failed), and the withdrawal still removes the entry."""
    reg = make_registry(redis_url, namespace)
    reg.publish_peer(peer())
    write = {"list": reg.client.rpush, "set": reg.client.sadd,
             "hash": lambda k, v: reg.client.hset(k, "f", v), "zset": lambda k, v: reg.client.zadd(k, {v: 1})}
    index = reg.keys.of(schema.INDEX, "v1", 0, 1)
    for key in (reg.keys.of(schema.CLAIM, "p1", 0), reg.keys.of(schema.LEASE, "v1", 1), index):
        reg.client.delete(key)
        write[other](key, "x")
    reg.release("p1", "0:token")
    assert reg.drop_lease("v1", 1, Raw("held")) is False
    reg.withdraw("p1", "v1")
    assert reg.client.exists(reg.keys.of(schema.PEER, "v1", 0, 1, "p1")) == 0
    assert reg.tidy_failed == (3 if other != "set" else 2)  # a set index is pruned


def test_writes_that_only_tidy_never_raise_in_an_outage(namespace: str) -> None:
    """With Redis unreachable, a tidy-up write (delete, expiry refresh, claim release,
    queue repair) is counted, not raised; a write a load needs still raises."""
    reg = make_registry(f"redis://127.0.0.1:{free_port()}/0", namespace, redis_timeout=0.5)
    reg.delete(reg.keys.key("k"))
    reg.extend(reg.keys.key("k"), 5)
    reg.release("p1", "0:token")
    reg._repair(reg.keys.of(schema.REQUEST, "p1"), "list", 5)
    assert reg.tidy_failed == 4
    with pytest.raises(RegistryError, match="redis publish failed"):
        reg.publish_peer(peer())
