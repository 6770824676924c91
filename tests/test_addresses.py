"""The address a worker advertises, and the peers a receiver will not try.

Where the host name resolves to 127.0.0.1 (a common ``/etc/hosts``, this machine's
among them), resolving it would give every worker a loopback address no other host
reaches. The default is the address of the interface that reaches Redis; advertising
loopback to a Redis on another host is warned about; and receivers skip peers that
advertise loopback while their Redis is elsewhere, before any claim or handshake.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nccl_back.config import Settings
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.dev.servers import LocalRedis
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import build, manifest
from nccl_back.transport import open_rendezvous
from nccl_back.transport.rendezvous_store import is_loopback, redis_is_local, unreachable_reason

from models import TinyTransformer, fill_random, write_checkpoint

#: An address only documentation uses (TEST-NET-1): never a real Redis, but routing to
#: it shows which interface faces the network.
ELSEWHERE = "192.0.2.1"


def route_source(host: str) -> str | None:
    """This machine's address on the route to ``host`` (None: no route at all)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


@pytest.fixture
def outward() -> str:
    """This machine's non-loopback address (skips where there is none)."""
    ip = route_source(ELSEWHERE)
    if ip is None or is_loopback(ip):
        pytest.skip("this machine has no route off loopback")
    return ip


def test_default_advertise_host_is_the_interface_that_reaches_redis(outward: str) -> None:
    """With Redis on another host, the default is this machine's address towards it,
    never loopback, whatever the host name resolves to."""
    s = Settings(redis_url=f"redis://{ELSEWHERE}:6379/0")
    assert s.advertise_host == outward
    assert not is_loopback(s.advertise_host)
    for url in (f"redis+sentinel://{ELSEWHERE}:26379,{ELSEWHERE}:26380/mymaster/0",
                f"redis+cluster://{ELSEWHERE}:7000", f"rediss://:pw@{ELSEWHERE}:6380/1"):
        assert Settings(redis_url=url).advertise_host == outward, url


def test_default_advertise_host_for_a_local_redis_and_unusable_hosts() -> None:
    """A loopback Redis gives loopback (a one-host fleet); an unresolvable or socket
    Redis falls back to the host name's address; nothing raises."""
    assert Settings(redis_url="redis://127.0.0.1:6379/0").advertise_host == "127.0.0.1"
    assert Settings(redis_url="redis://localhost:6379/0").advertise_host in ("127.0.0.1", "::1")
    for url in ("redis://no-such-host.invalid:6379/0", "unix:///tmp/none.sock"):
        assert Settings(redis_url=url).advertise_host  # some address, chosen without error


def test_explicit_advertise_host_wins_and_replace_rechooses_the_automatic_one(outward: str) -> None:
    """An explicit address is kept everywhere; an automatic one follows a replaced redis_url."""
    local = Settings(redis_url="redis://127.0.0.1:6379/0")
    assert local.replace(redis_url=f"redis://{ELSEWHERE}:6379/0").advertise_host == outward
    pinned = Settings(redis_url="redis://127.0.0.1:6379/0", advertise_host="10.9.8.7")
    assert pinned.replace(redis_url=f"redis://{ELSEWHERE}:6379/0").advertise_host == "10.9.8.7"
    assert Settings(redis_url=f"redis://{ELSEWHERE}:6379/0",
                    advertise_host="10.9.8.7").advertise_host == "10.9.8.7"


LOOPBACKS = ["127.0.0.1:0", "127.9.9.9:29500", "[::1]:0", "localhost:0", "LOCALHOST:1",
             "worker.localhost:0"]
REACHABLE = ["10.0.0.5:0", "[fe80::1]:0", "192.0.2.7:29500"]


@pytest.mark.parametrize("address", LOOPBACKS)
def test_a_loopback_peer_is_unreachable_from_a_fleet_that_spans_hosts(address: str) -> None:
    """Every spelling of loopback is refused when Redis is elsewhere, accepted when local."""
    far = Settings(redis_url=f"redis://{ELSEWHERE}:6379/0", advertise_host="10.0.0.1")
    near = Settings(redis_url="redis://127.0.0.1:6379/0")
    reason = unreachable_reason(far, address)
    assert reason is not None and "loopback" in reason and "advertise_host" in reason
    assert unreachable_reason(near, address) is None


@pytest.mark.parametrize("address", REACHABLE)
def test_other_peers_are_tried(address: str) -> None:
    """Non-loopback peers are never skipped for their address."""
    far = Settings(redis_url=f"redis://{ELSEWHERE}:6379/0", advertise_host="10.0.0.1")
    assert unreachable_reason(far, address) is None


def test_redis_locality_covers_every_host_of_the_url() -> None:
    """Redis is local only when every host is (a sentinel list with one remote is not)."""
    assert redis_is_local(Settings(redis_url="unix:///tmp/r.sock"))
    assert redis_is_local(Settings(redis_url="redis+sentinel://127.0.0.1:1,localhost:2/m/0"))
    assert not redis_is_local(Settings(redis_url=f"redis+sentinel://127.0.0.1:1,{ELSEWHERE}:2/m/0"))


def test_advertising_loopback_to_a_remote_redis_is_warned_about(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Opening a rendezvous that advertises loopback while Redis is on another host logs
    a warning naming the fix; a one-host fleet (local Redis) gets none."""
    reg = Registry(Settings(redis_url=redis_url, namespace=namespace))
    wrong = Settings(redis_url=f"redis://{ELSEWHERE}:6379/0", advertise_host="127.0.0.1")
    with caplog.at_level(logging.WARNING, logger="nccl_back"):
        open_rendezvous(wrong, "gloo", device=torch.device("cpu"), registry=reg).close()
    (rec,) = [r for r in caplog.records if r.getMessage().startswith("advertising_loopback")]
    assert "NCCL_BACK_ADVERTISE_HOST" in rec.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nccl_back"):
        open_rendezvous(Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1"),
                        "gloo", device=torch.device("cpu"), registry=reg).close()
    assert not [r for r in caplog.records if r.getMessage().startswith("advertising_loopback")]


@pytest.fixture
def outward_redis(outward: str) -> Iterator[str]:
    """A real redis-server reached at this machine's non-loopback address."""
    server = LocalRedis(extra=["--bind", "127.0.0.1", outward]).start()
    yield f"redis://{outward}:{server.port}/0"
    server.stop()


@pytest.mark.timeout(60)
def test_receiver_skips_a_loopback_peer_before_any_claim(
    outward_redis: str, namespace: str, cache_dir: str, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With Redis on a non-loopback address, a peer advertising 127.0.0.1 is never claimed
    nor handshaken (that cost the connect deadline): skipped with the reason, storage next."""
    ckpt = str(write_checkpoint(fill_random(TinyTransformer(), seed=3), tmp_path / "ckpt"))
    settings = Settings(redis_url=outward_redis, namespace=namespace, cache_dir=cache_dir,
                        handshake_timeout=5.0)
    assert not is_loopback(settings.advertise_host)
    registry = Registry(settings)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    model = build(TinyTransformer)
    digest = manifest(model).digest
    registry.publish_peer(PeerInfo(peer_id="loop-peer", version=spec.version, rank=0, world_size=1,
                                   manifest_digest=digest, transport="gloo", address="127.0.0.1:0",
                                   device="cpu"))
    registry.put_ground_truth(spec.version, 0, 1, digest, SCHEME, {"sampled|x": "0"})
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="nccl_back"), WeightService(settings) as svc:
        result = svc.load(model, spec)
    assert result.source == "storage"
    assert registry.client.llen(registry.keys.key("req", "loop-peer")) == 0
    assert list(registry.scan("hs:*")) == []
    assert time.monotonic() - t0 < settings.handshake_timeout
    assert any(r.getMessage().startswith("peer_unreachable") and "loopback" in r.getMessage()
               for r in caplog.records)
