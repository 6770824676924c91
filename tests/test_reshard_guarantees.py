"""Resharding under the guarantees every other path has, in one process (a world-1
receiver of fused layers from a plain holder, real Redis, gloo): verified means what it
says, only checked bytes become truth, disagreeing truth skips holders, hostile records
cost bounded work, and an outage at publication costs a heartbeat, not the publication."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import reshard_workers as rw
import torch

import nccl_back
from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.content import PositionTruth
from nccl_back.coord.registry import Registry
from nccl_back.dev.servers import LocalRedis
from nccl_back.load import publish as publish_module
from nccl_back.load.service import WeightService
from nccl_back.model import position_truth
from nccl_back.model.identity import ModelSpec
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import build, manifest, named_tensors
from nccl_back.result import LoadResult

from models import fill_random, write_checkpoint
from workers import settings_for

pytestmark = pytest.mark.timeout(120)
SECRET = "reshard-guarantees-secret-0123456789"


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.detach().contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


class World:
    """One flat checkpoint, a fleet's settings, and its holders and receivers."""

    def __init__(self, ckpt: str, settings: Settings) -> None:
        self.ckpt, self.settings = ckpt, settings
        self.spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
        self.services: list[WeightService] = []

    def service(self, **overrides: Any) -> WeightService:
        svc = WeightService(self.settings.replace(**overrides) if overrides else self.settings)
        self.services.append(svc)
        return svc

    def holder(self, **overrides: Any) -> tuple[WeightService, torch.nn.Module]:
        svc = self.service(**overrides)
        model = build(lambda: rw.Flat(rw.checkpoint_shapes()))
        assert svc.load(model, self.spec).source == "storage"
        return svc, model

    def fused(self) -> torch.nn.Module:
        return build(lambda: rw.Flat(rw.tp_shapes(1, "megatron")))

    def reshard(self, svc: WeightService, model: torch.nn.Module | None = None) -> LoadResult:
        model = model if model is not None else self.fused()
        sh = nccl_back.sharding(model, self.spec, rw.describe(0, 1, "megatron"), svc.settings)
        result = svc.load(model, self.spec, sharding=sh)
        self.last = model
        return result

    def exact(self, model: torch.nn.Module) -> bool:
        return _bytes(named_tensors(model)[0]) == _bytes(rw.expected(self.ckpt, 0, 1, "megatron"))

    def close(self) -> None:
        for svc in self.services:
            svc.close()


@pytest.fixture
def world(tmp_path: Path, redis_url: str, namespace: str, cache_dir: str) -> Iterator[World]:
    model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=11)
    ckpt = str(write_checkpoint(model, tmp_path / "ckpt"))
    w = World(ckpt, settings_for(redis_url, namespace, cache_dir, secret=SECRET, bucket_bytes=4096,
                                 busy_wait=5.0))  # a cap: settings_for's is 10 s
    yield w
    w.close()


def _unsampled(name: str, shape: tuple[int, ...], settings: Settings) -> int:
    """A flat index of checkpoint tensor ``name`` that no sampled check looks at."""
    sampled = set(position_truth.positions(name, shape, settings.key("integrity")).tolist())
    return next(i for i in range(1, 1 << 20) if i not in sampled)


def test_full_reshard_reads_every_byte_and_refuses_one_changed_element(world: World) -> None:
    """verify=full: a holder serving one changed element outside every sampled position
    is caught (storage, the exact bytes); sampled verification would have passed it."""
    holder, model = world.holder(verify="full")
    flat = _unsampled("q", (rw.D, rw.D), world.settings)
    with torch.no_grad():
        model.q.view(-1)[flat] += 1.0  # the bytes it now serves; its truth is storage's
    full = world.service(verify="full")
    result = world.reshard(full)
    assert result.source == "storage" and world.exact(world.last), result
    assert result.fallback_reason.startswith("verification_failed:"), result.fallback_reason
    full.close()  # the changed holder is the only one left
    sampled = world.reshard(world.service(verify="sampled"))
    assert sampled.source == "peer" and not world.exact(world.last)  # what "sampled" means


def test_full_reshard_of_good_bytes_is_verified_and_publishes_full_truth(world: World) -> None:
    """verify=full from a good holder: a peer load, verified, every byte checked; the
    worker then publishes full truth (its bytes are storage's), so a later full
    receiver of its layout can check every byte against it."""
    world.holder(verify="full")
    first = world.service(verify="full")
    result = world.reshard(first)
    assert result.source == "peer" and result.verified and world.exact(world.last)
    lay = nccl_back.sharding(world.fused(), world.spec, rw.describe(0, 1, "megatron"), world.settings).layout
    truth = Registry(world.settings).get_position_truth(world.spec.version, 0, 1, lay.digest, SCHEME)
    assert truth is not None and truth.marginals


def test_an_unverified_reshard_publishes_no_truth(world: World) -> None:
    """verify=none: the worker serves its bytes but publishes no truth of any kind (none
    was checked), so no later receiver can be verified against bytes nobody checked."""
    world.holder()
    svc = world.service(verify="none")
    result = world.reshard(svc)
    assert result.source == "peer" and not result.verified
    reg = Registry(world.settings)
    lay = nccl_back.sharding(world.fused(), world.spec, rw.describe(0, 1, "megatron"), world.settings).layout
    digest = manifest(world.last).digest
    time.sleep(world.settings.heartbeat_interval * 2)  # what the heartbeat keeps, too
    assert reg.get_position_truth(world.spec.version, 0, 1, lay.digest, SCHEME) is None
    assert reg.get_ground_truth(world.spec.version, 0, 1, digest, SCHEME) is None
    assert svc.peers  # it still serves


def test_a_sampled_reshard_publishes_only_the_macs_it_checked(world: World) -> None:
    """verify=sampled: the worker re-publishes exactly the position MACs it checked, and
    no layer hashes or full sums (which its check never covered)."""
    world.holder(verify="full")
    result = world.reshard(world.service(verify="sampled"))
    assert result.source == "peer" and result.verified
    reg = Registry(world.settings)
    lay = nccl_back.sharding(world.fused(), world.spec, rw.describe(0, 1, "megatron"), world.settings).layout
    truth = reg.get_position_truth(world.spec.version, 0, 1, lay.digest, SCHEME)
    assert truth is not None and not truth.marginals
    assert truth.macs == position_truth.held_macs(lay, named_tensors(world.last)[0],
                                                  world.settings.key("integrity"))
    assert reg.get_ground_truth(world.spec.version, 0, 1, manifest(world.last).digest, SCHEME) is None


def test_truth_that_does_not_cover_every_byte_is_not_used_for_full(world: World) -> None:
    """A holder whose truth has no full sums (published under verify=sampled) cannot
    serve a verify=full reshard: the load goes to storage saying why, never reports
    verified bytes it did not check."""
    world.holder(verify="sampled")
    result = world.reshard(world.service(verify="full"))
    assert result.source == "storage" and world.exact(world.last)
    assert "no truth for every byte" in (result.fallback_reason or ""), result.fallback_reason


def test_a_truth_record_forged_with_the_fleet_key_costs_a_storage_read_never_a_raise(
        world: World) -> None:
    """A holder's truth in checkpoint coordinates replaced by one signed with the fleet's
    own key (a compromised worker) but saying other MACs: the load neither raises nor
    keeps the bytes it cannot verify; it loads the exact bytes from storage."""
    holder, _ = world.holder()
    reg = Registry(world.settings)
    info = holder.peers[0]
    key = reg.keys.of(schema.POSITION_TRUTH, info.version, 0, 1, next(iter(
        k.rsplit(":", 2)[-2] for k in reg.scan(f"ct:{info.version}:0:1:*"))), SCHEME)
    got = reg.read(key, schema.POSITION_TRUTH)
    assert got is not None
    truth: PositionTruth = got[0]
    name = sorted(truth.macs)[0]
    forged = [("0" * 8 if m is not None and j == 0 else m) for j, m in enumerate(truth.macs[name])]
    reg.delete(key)
    reg.put_position_truth(info.version, 0, 1, PositionTruth(truth.layout, SCHEME,
                                                             {**truth.macs, name: forged}))
    result = world.reshard(world.service())  # any exception fails the test
    assert world.exact(world.last), result
    assert result.source == "storage", result


def test_thousands_of_fake_index_keys_cost_bounded_discovery(world: World) -> None:
    """8,000 fake peer-index keys (key names need no secret) leave a resharding load
    bounded (discovery reads a bounded number of them, within its phase's bound) and
    served by the genuine holder they would hide."""
    world.holder()
    client = redis.Redis.from_url(world.settings.redis_url)
    keys = Registry(world.settings).keys
    pipe = client.pipeline(transaction=False)
    for i in range(8000):
        w = 2 + i % 4000
        pipe.sadd(keys.of(schema.INDEX, world.spec.version, i % w, w), "ghost")
        pipe.expire(keys.of(schema.INDEX, world.spec.version, i % w, w), 60)
    pipe.execute()
    start = time.monotonic()
    result = world.reshard(world.service())
    took = time.monotonic() - start
    assert world.exact(world.last) and result.source == "peer", result.fallback_reason
    assert took < 15, f"{took:.1f} s ({result.fallback_reason})"


def test_an_outage_at_publication_costs_a_heartbeat_not_the_publication(
        tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis goes away as a resharded worker publishes (and as a storage loader publishes
    its truth) and comes back empty: within a few heartbeats both are findable with their
    truth in checkpoint coordinates, and a new receiver reshards from the first."""
    model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=12)
    ckpt = str(write_checkpoint(model, tmp_path / "ckpt"))
    server = LocalRedis().start()
    real = publish_module.publish
    outage = {"on": True}

    def publish_in_outage(*args: Any, **kwargs: Any) -> None:
        if outage["on"]:
            server.kill()
        try:
            real(*args, **kwargs)
        finally:
            if outage["on"]:
                server.restart()

    monkeypatch.setattr(publish_module, "publish", publish_in_outage)
    world = World(ckpt, settings_for(server.url, "outage", cache_dir, secret=SECRET,
                                     bucket_bytes=4096, redis_timeout=0.5, peer_ttl=3.0))
    try:
        holder, _ = world.holder()  # its truth could not be stored either
        outage["on"] = False
        reg = Registry(world.settings)
        plain = holder.peers[0]
        deadline = time.monotonic() + 20
        while not (reg.find_peers(plain.version, 0, 1) and any(reg.scan(f"ct:{plain.version}:0:1:*"))):
            assert time.monotonic() < deadline, "the storage loader never came back to Redis"
            time.sleep(0.1)
        first = world.service()
        result = world.reshard(first)
        assert result.source == "peer" and world.exact(world.last)
        outage["on"] = True
        second = world.service()
        assert world.reshard(second).source == "peer"  # published into the outage
        outage["on"] = False
        lay = nccl_back.sharding(world.fused(), world.spec, rw.describe(0, 1, "megatron"),
                                 world.settings).layout
        deadline = time.monotonic() + 20
        # The worker that published into the outage itself, not just any two entries
        # (the others' may be found first; closing them at once leaves none to reshard from).
        mine = second.peers[0].peer_id
        while not (reg.get_position_truth(world.spec.version, 0, 1, lay.digest, SCHEME)
                   and any(p.peer_id == mine for p in reg.find_peers(world.spec.version, 0, 1))):
            assert time.monotonic() < deadline, "the workers never came back to Redis"
            time.sleep(0.1)
        for svc in world.services[:2]:
            svc.close()  # only the worker published into the outage is left
        third = world.reshard(world.service())
        assert third.source == "peer" and world.exact(world.last), third.fallback_reason
        assert third.peer_id == second.peers[0].peer_id
    finally:
        world.close()
        server.stop()


def test_a_plain_worker_reshards_from_holders_of_another_layout(world: World) -> None:
    """A plain skeleton (no sharding given) whose version only fused-layout workers hold
    receives its tensors from them (resharded, verified in checkpoint coordinates)
    instead of reading storage."""
    holder, _ = world.holder()
    fused = world.service()
    assert world.reshard(fused).source == "peer"
    holder.close()  # only the fused worker holds the version now
    plain = build(lambda: rw.Flat(rw.checkpoint_shapes()))
    result = world.service().load(plain, world.spec)
    assert result.source == "peer" and result.verified, result.fallback_reason
    assert result.peer_id == fused.peers[0].peer_id
    assert _bytes(named_tensors(plain)[0]) == _bytes(rw.expected(world.ckpt, 0, 1, "plain"))
