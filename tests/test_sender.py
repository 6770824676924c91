"""The sending side (sender.PeerServer through WeightService), in this process against a
real redis-server and real gloo: withdrawal is final, queued and incompatible requests
are refused visibly, a failing send frees the receiver's slot, the rendezvous store
keeps no per-transfer keys."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from stored import stored_json

from nccl_back.config import Settings
from nccl_back.coord import handshake
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.errors import IncompatiblePeerError
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import build
from nccl_back.transport.sender import worker_of

from models import TinyTransformer, fill_random, write_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return str(write_checkpoint(fill_random(TinyTransformer(), seed=5), tmp_path / "ckpt"))


@pytest.fixture
def settings(redis_url: str, namespace: str, cache_dir: str) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                    cache_dir=cache_dir, peer_ttl=3.0,
                    transfer_timeout=20.0, handshake_timeout=5.0)


@pytest.fixture
def registry(settings: Settings) -> Iterator[Registry]:
    reg = Registry(settings)
    yield reg
    reg.close()


def _request(info: PeerInfo, **extra: Any) -> dict[str, Any]:
    return {"transfer_id": uuid.uuid4().hex, "receiver": "test", "version": info.version,
            "manifest_digest": info.manifest_digest, "transport": info.transport,
            "device": info.device, **extra}


class SlowHeartbeat(Registry):
    """A registry whose heartbeat takes ``delay`` s before it writes (a slow Redis)."""

    def __init__(self, settings: Settings, delay: float) -> None:
        super().__init__(settings)
        self.delay = delay
        self.beating = threading.Event()

    def heartbeat(self, info: PeerInfo, scheme: str, truth: dict[str, str] | None = None) -> None:
        self.beating.set()
        time.sleep(self.delay)
        super().heartbeat(info, scheme, truth)


@pytest.mark.timeout(30)
def test_close_racing_the_heartbeat_leaves_no_entry(settings: Settings, ckpt: str, registry: Registry) -> None:
    """close() while a heartbeat is mid-write: once close() returns, no entry of the worker reappears."""
    fast = settings.replace(peer_ttl=0.6)  # a heartbeat every 0.2 s
    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    slow = SlowHeartbeat(fast, delay=0.5)
    svc = WeightService(fast, registry=slow)
    info = svc.serve(build(TinyTransformer), spec)
    assert slow.beating.wait(5)  # a heartbeat is on its way to Redis now
    svc.close()
    deadline = time.monotonic() + 1.5  # several heartbeat periods
    while time.monotonic() < deadline:
        assert registry.find_peers(info.version, 0, 1) == []
        assert list(registry.scan(f"peer:*:{info.peer_id}")) == []
        time.sleep(0.05)


@pytest.mark.timeout(30)
def test_loaded_names_the_workers_that_publish_what_this_worker_serves(
    settings: Settings, ckpt: str, registry: Registry
) -> None:
    """PeerServer.loaded: of the workers asked about, those with an entry for a version this
    worker serves at its rank (a close stops waiting for them); its own entry names itself."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    with WeightService(settings, worker_id="holder-1") as holder, \
            WeightService(settings, worker_id="follower-r2-x") as follower:
        info = holder.serve(build(TinyTransformer), spec)
        server = holder._server
        assert server.loaded({"follower-r2-x", "late"}) == set()
        follower.serve(build(TinyTransformer), spec)
        assert server.loaded({"follower-r2-x", "late"}) == {"follower-r2-x"}
        assert server.loaded({"holder-1"}) == {"holder-1"}
        assert worker_of(info.peer_id) == "holder-1"


def test_queued_send_after_withdraw_is_refused(settings: Settings, ckpt: str, registry: Registry) -> None:
    """A request queued behind a busy send slot is refused once the worker withdrew, never served."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    with WeightService(settings.replace(handshake_timeout=15.0)) as svc:  # a sender's: 1.5 s
        info = svc.serve(build(TinyTransformer), spec)
        # First request: nobody answers its handshake, so the one send slot is busy ~1.5 s.
        registry.push_request(info.peer_id, _request(info))
        deadline = time.monotonic() + 5
        while svc.active_sends == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        queued = _request(info)
        r_key, _ = handshake.keys(registry, queued["transfer_id"])
        registry.set_json(r_key, {"by": "receiver", "value": 1, "digest": info.manifest_digest}, 30)
        registry.push_request(info.peer_id, queued)
        time.sleep(0.8)  # the serve loop hands it to the (busy) pool
        svc.withdraw()
        deadline = time.monotonic() + 10
        while (stored_json(registry, r_key) or {}).get("by") != "sender":
            assert time.monotonic() < deadline, "the queued request was never answered"
            time.sleep(0.02)
        assert stored_json(registry, r_key)["refused"] == "draining"


@pytest.mark.timeout(30)
def test_sender_refuses_another_transport_at_once(settings: Settings, ckpt: str, registry: Registry) -> None:
    """A request for nccl to a gloo peer is refused before anything is created; the receiver learns in seconds."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    with WeightService(settings) as svc:
        info = svc.serve(build(TinyTransformer), spec)
        request = _request(info, transport="nccl", device="cuda")
        t0 = time.monotonic()
        with pytest.raises(IncompatiblePeerError, match="refused it \\(incompatible\\)"):
            handshake.run_receiver(registry, request["transfer_id"], info.manifest_digest, 5.0,
                                   after_ready=lambda: registry.push_request(info.peer_id, request))
        assert time.monotonic() - t0 < 4


@pytest.mark.timeout(30)
def test_failed_send_frees_the_receivers_slot(settings: Settings, ckpt: str, registry: Registry) -> None:
    """A receiver that claims a slot and vanishes: the sender frees the slot when its side fails."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    with WeightService(settings) as svc:
        info = svc.serve(build(TinyTransformer), spec)
        token = registry.claim(info.peer_id, "ghost", info.max_sends, ttl=60)
        assert token is not None
        # The request arrives but no handshake follows (the receiver died right after).
        registry.push_request(info.peer_id, _request(info, claim=token))
        deadline = time.monotonic() + 10  # the sender's handshake is 1 s; the claim's TTL 60 s
        while registry.active_claims(info.peer_id):
            assert time.monotonic() < deadline, "the slot stayed claimed"
            time.sleep(0.05)


@pytest.mark.timeout(60)
def test_peer_load_in_process_leaves_no_store_keys(settings: Settings, ckpt: str,
                                                   registry: Registry) -> None:
    """After transfers, no rendezvous key of theirs is left in Redis (each side deletes its own)."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    with WeightService(settings) as seed:
        assert seed.load(build(TinyTransformer), spec).source == "storage"
        (info,) = seed.peers
        for _ in range(2):
            with WeightService(settings) as receiver:
                assert receiver.load(build(TinyTransformer), spec).source == "peer"
        assert info.address == "127.0.0.1:0"  # no rendezvous port to reach
        assert list(registry.scan("rdv:*")) == []


@pytest.mark.timeout(60)
def test_cpu_receiver_skips_a_peer_of_another_transport_before_any_claim(
    settings: Settings, ckpt: str, registry: Registry
) -> None:
    """A peer advertising nccl/cuda is never claimed by a CPU receiver: discovery skips it and says why."""
    from nccl_back.model.skeleton import manifest

    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    model = build(TinyTransformer)
    digest = manifest(model).digest
    gpu_peer = PeerInfo(peer_id="gpu-peer", version=spec.version, rank=0, world_size=1,
                        manifest_digest=digest, transport="nccl", address="10.0.0.9:29500",
                        device="cuda")
    registry.publish_peer(gpu_peer)
    registry.put_ground_truth(spec.version, 0, 1, digest, SCHEME, {"sampled|x": "0"})
    t0 = time.monotonic()
    with WeightService(settings) as svc:
        result = svc.load(model, spec)
    assert result.source == "storage"
    assert result.fallback_reason is not None
    assert result.fallback_reason.startswith("incompatible_peer: 1 peer(s) hold version")
    assert "none speaks gloo on cpu (theirs: nccl on cuda)" in result.fallback_reason
    # No request ever reached the GPU peer, no handshake was started, no timeout waited.
    assert registry.client.llen(registry.keys.key("req", "gpu-peer")) == 0
    assert list(registry.scan("hs:*")) == []
    assert time.monotonic() - t0 < settings.handshake_timeout


@pytest.mark.timeout(60)
def test_another_flavours_ground_truth_does_not_block_ours(
    settings: Settings, ckpt: str, registry: Registry
) -> None:
    """Ground truth stored first by another skeleton flavour (another manifest) leaves ours its own: peers still verify."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
    registry.put_ground_truth(spec.version, 0, 1, "f" * 32, SCHEME, {"sampled|other.layout": "0"})
    with WeightService(settings) as seed:
        assert seed.load(build(TinyTransformer), spec).source == "storage"
        with WeightService(settings) as receiver:
            result = receiver.load(build(TinyTransformer), spec)
    assert (result.source, result.fallback_reason, result.verified) == ("peer", None, True)


@pytest.mark.timeout(60)
def test_connect_phase_has_its_own_short_deadline(settings: Settings, registry: Registry) -> None:
    """A communicator that never forms fails at the connect deadline, not the transfer deadline."""
    import torch

    from nccl_back.errors import TransferTimeoutError
    from nccl_back.transport import open_rendezvous, receiver_transport, run_guarded

    with open_rendezvous(settings, "gloo", device=torch.device("cpu"), registry=registry) as rv:
        # The sender never joins this transfer (it gave up, or died after the handshake).
        transport = receiver_transport(settings, "gloo", rv.address, uuid.uuid4().hex,
                                       device=torch.device("cpu"), registry=registry)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="the communicator did not form by the connect deadline"):
            run_guarded(transport, lambda tr: None, t0 + 60.0, connect_deadline=t0 + 1.0)
        assert time.monotonic() - t0 < 15
