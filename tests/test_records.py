"""Typed, bounded parsing of Redis values: each hostile value is one UntrustedRecordError."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nccl_back.coord import content, records
from nccl_back.errors import UntrustedRecordError

pytestmark = pytest.mark.timeout(10)

PEER = {
    "peer_id": "host-1-abc-r0-1f2e", "version": "0123456789abcdef0123456789abcdef", "rank": 1,
    "world_size": 2, "manifest_digest": "d" * 32, "transport": "nccl",
    "address": "10.1.2.3:29500", "started_at": 1.7e9, "source": "storage", "max_sends": 2,
}


def test_a_genuine_peer_entry_parses() -> None:
    """Real values, IPv6 and hostname addresses included, parse into a PeerInfo."""
    fields = records.peer(records.load(json.dumps(PEER), "p"))
    assert fields.max_sends == 2 and fields.transport == "nccl" and fields.rank == 1
    for addr in ("[fe80::1]:1", "worker-0.svc.cluster.local:29500", "localhost:65535"):
        assert records.peer({**PEER, "address": addr}).address == addr


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (json.dumps({**PEER, "max_sends": -1}), r"max_sends must be an integer in \[1, 64\], got -1"),
        (json.dumps(PEER).replace('"max_sends": 2', '"max_sends": 1e400'), r"max_sends .* got inf"),
        (json.dumps({**PEER, "max_sends": 10**6}), r"max_sends .* got 1000000"),
        (json.dumps({**PEER, "max_sends": True}), r"max_sends .* got True"),
        (json.dumps({**PEER, "max_sends": 2.0}), r"max_sends .* got 2\.0"),
        (json.dumps({**PEER, "rank": 2}), r"rank must be an integer in \[0, 1\]"),
        (json.dumps({**PEER, "world_size": 0}), r"world_size"),
        (json.dumps({**PEER, "transport": "mpi"}), r"transport must be one of gloo, nccl"),
        (json.dumps({**PEER, "address": "10.1.2.3"}), r"address must be host:port"),
        (json.dumps({**PEER, "address": "10.1.2.3:-1"}), r"address must be host:port"),
        (json.dumps({**PEER, "address": "10.1.2.3:99999"}), r"address must be host:port"),
        (json.dumps({**PEER, "address": "evil host:1"}), r"address must be host:port"),
        (json.dumps({**PEER, "address": "[::1:1"}), r"address must be host:port"),
        (json.dumps({**PEER, "peer_id": "a:b"}), r"peer_id must be a name"),
        (json.dumps({**PEER, "peer_id": "x" * 500}), r"peer_id must be a name"),
        (json.dumps({**PEER, "started_at": "soon"}), r"started_at must be a finite number"),
        (json.dumps({**PEER, "manifest_digest": "a b"}), r"manifest_digest must be a digest"),
        (json.dumps({**PEER, "source": "magic"}), r"source must be one of"),
        ("{\"a\": " + "[" * 5000 + "]" * 5000 + "}", r"nested 5001 deep"),
        ("[" + "1," * 20_000 + "1]", r"over the limit of 16384"),
        ("not json", r"Expecting value"),
        ("[1, 2]", r"not a JSON object"),
        ('{"a": NaN}', r"NaN is not JSON"),
    ],
)
def test_hostile_peer_entries_are_refused_with_the_reason(raw: str, message: str) -> None:
    """Every malformed value in the review's table is one UntrustedRecordError naming it."""
    with pytest.raises(UntrustedRecordError, match=message):
        records.peer(records.load(raw, "peer entry"))


def test_wrong_redis_types_are_refused() -> None:
    """A list or set where a string belongs (redis-py returns it as such) is refused."""
    for value in (["a"], {"a"}, 3):
        with pytest.raises(UntrustedRecordError, match="wrong Redis type"):
            records.load(value, "x")  # type: ignore[arg-type]
    with pytest.raises(UntrustedRecordError, match="absent"):
        records.load(None, "x")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"manifest_digest": "d" * 32, "hashes": []}, "hashes must be an object"),
        ({"manifest_digest": "d" * 32, "hashes": {"sampled|a": 5}}, "map layer names to digests"),
        ({"manifest_digest": "d" * 32, "hashes": {"x" * 2000: "ab" * 16}}, "map layer names to digests"),
        ({"hashes": {}}, "manifest_digest"),
    ],
)
def test_hostile_ground_truth_is_refused(value: dict[str, Any], message: str) -> None:
    """Ground truth must map layer names to hex digests under a hex manifest digest."""
    with pytest.raises(UntrustedRecordError, match=message):
        content.ground_truth({"scheme": "nb1", **value}, {})
    good = {"manifest_digest": "d" * 32, "scheme": "nb1", "hashes": {"sampled|layers.0": "ab" * 16}}
    assert content.ground_truth(good, {"manifest": "d" * 32, "scheme": "nb1"}) == \
        content.GroundTruth("d" * 32, "nb1", {"sampled|layers.0": "ab" * 16})


def test_requests_and_handshake_values_are_bounded() -> None:
    """Requests need known transports and names; nonces are bounded integers."""
    req = {"transfer_id": "a" * 32, "receiver": "w1", "version": "v1",
           "manifest_digest": "d" * 32, "transport": "gloo"}
    assert records.request(req).transfer_id == "a" * 32
    with pytest.raises(UntrustedRecordError, match="transport"):
        records.request({**req, "transport": "tcp"})
    with pytest.raises(UntrustedRecordError, match="receiver"):
        records.request({**req, "receiver": {"deep": 1}})
    assert records.handshake({"by": "sender", "value": 5, "digest": "m"}).value == 5
    for bad in (-1, 2**60, 1.5, "5", None):
        with pytest.raises(UntrustedRecordError, match="value must be an integer"):
            records.handshake({"by": "sender", "value": bad, "digest": "m"})
    with pytest.raises(UntrustedRecordError, match="by must be one of receiver, sender"):
        records.handshake({"by": "attacker", "value": 5, "digest": "m"})
