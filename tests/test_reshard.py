"""Resharding a library model: real processes, real Redis, gloo.

A plain transformer-shaped checkpoint; a TP=1 holder serves TP=2 receivers of the
"megatron" scheme (fused qkv / gate_up column-parallel, row-parallel o / down, the
vocabulary split by rows), which then serve a TP=1 receiver of the whole model and a
TP=2 receiver of their own layout; a TP=2 "cols" scheme receives from TP=2 megatron
holders. Every receiver's bytes are compared with the checkpoint's, cut by hand.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import reshard_workers as rw
import torch
from gpu_pair import nccl_env

from nccl_back.coord import schema
from nccl_back.coord.keys import Keys
from nccl_back.dev.servers import free_port
from nccl_back.model.skeleton import build

from models import fill_random, write_checkpoint

CTX = mp.get_context("forkserver")
#: Every byte checked: one changed element escapes sampled verification by design.
FULL = {"verify": "full"}
CTX.set_forkserver_preload(["torch", "torch.distributed", "nccl_back.load.service", "reshard_workers"])


class Fleet:
    def __init__(self, ckpt: str, settings: dict[str, Any]) -> None:
        self.ckpt, self.settings = ckpt, settings
        self.stops: list[Any] = []
        self.procs: list[Any] = []
        self.readers: list[Any] = []

    def start(self, world: int, scheme: str, fault: str | None = None,
              settings: dict[str, Any] | None = None, spec: Any = None, device: str = "cpu") -> Any:
        port, stops = str(free_port()), []
        for rank in range(world):
            # One event per process: a process killed inside ``wait`` may leave its
            # event's lock held, and set() would then block forever.
            stop = CTX.Event()
            stops.append(stop)
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port}
            if device == "cuda":  # processes sharing the one GPU: an NCCL host id each
                env.update(nccl_env(len(self.procs)))
            reader, writer = CTX.Pipe(duplex=False)
            self.readers.append(reader)
            p = CTX.Process(target=rw.rank_main, daemon=True,
                            args=(env, self.ckpt, {**self.settings, **(settings or {})}, scheme,
                                  writer, stop),
                            kwargs={"fault": fault, "spec": spec, "device": device})
            p.start()
            self.procs.append(p)
            self.stops.append(stop)
        return stops

    def reports(self, n: int, timeout: float = 90, *, errors: bool = False) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(got)} of {n} reports: {got}")
            for conn in mp.connection.wait(self.readers, timeout=left):
                try:
                    got.append(conn.recv())  # type: ignore[union-attr]
                except EOFError:
                    self.readers.remove(conn)
        for r in got:
            assert errors or "error" not in r, (r.get("error"), r.get("traceback"))
        return sorted(got, key=lambda r: (r["group"], r["rank"]))

    def wait_for_data(self, timeout: float = 60) -> None:
        """Return once some transfer's process group is being built (its rendezvous key
        exists): a receiver is past discovery, claim and handshake."""
        client = redis.Redis.from_url(self.settings["redis_url"])
        pattern = Keys(self.settings["namespace"]).of(schema.RENDEZVOUS, "*", "*")
        deadline = time.monotonic() + timeout
        while not client.keys(pattern):
            if time.monotonic() > deadline:
                raise TimeoutError("no transfer started")
            time.sleep(0.05)

    def wait_gone(self, i: int, world: int, timeout: float = 30) -> None:
        """Return once process ``i`` has exited and no entry of a ``world``-rank group is
        listed (a stopped holder's close drains, then withdraws; else its entry expires
        in peer_ttl): waited for, not slept on, since a loaded machine stretches both."""
        self.procs[i].join(timeout)
        client = redis.Redis.from_url(self.settings["redis_url"])
        pattern = Keys(self.settings["namespace"]).of(schema.PEER, "*", "*", world, "*")
        deadline = time.monotonic() + timeout
        while client.keys(pattern):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a {world}-rank holder's entry outlived its process")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """SIGKILL process ``i`` (its stop event is never touched again)."""
        self.procs[i].kill()
        self.stops[i] = None

    def close(self) -> None:
        for s in self.stops:
            if s is not None:
                s.set()
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture
def fleet(tmp_path: Path, redis_url: str, namespace: str, cache_dir: str) -> Iterator[Fleet]:
    model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=3)
    ckpt = str(write_checkpoint(model, tmp_path / "ckpt", n_shards=2))
    f = Fleet(ckpt, {"redis_url": redis_url, "namespace": namespace, "cache_dir": cache_dir,
                     "advertise_host": "127.0.0.1", "peer_ttl": 3.0,
                     "transfer_timeout": 20.0,
                     # Waits a 2-core machine running CI's two suites can meet: at the
                     # defaults a GET timed out there and the receiver rightly went to storage
                     # (a sender's handshake is a tenth of the receiver's: 3 s).
                     "redis_timeout": 3.0, "handshake_timeout": 30.0,
                     "secret": "s" * 32, "bucket_bytes": 4096})
    yield f
    f.close()


@pytest.mark.timeout(240)
def test_tp1_to_tp2_and_back_bit_exact_and_resharded_workers_serve(fleet: Fleet) -> None:
    (holder_stop,) = fleet.start(1, "plain")
    (h,) = fleet.reports(1)
    assert h["source"] == "storage" and h["identical"], h

    # TP=1 holder -> TP=2 megatron group: each rank receives exactly its own shards.
    fleet.start(2, "megatron")
    tp2 = fleet.reports(2)
    for r in tp2:
        assert r["source"] == "peer" and r["identical"], [x["fallback_reason"] for x in tp2]
        assert r["bytes"] == r["own_bytes"], r
        assert r["peer_id"].startswith(f"g{h['group']}-0"), r

    # A TP=2 receiver of the same layout: a same-layout peer load from the resharded group.
    fleet.start(2, "megatron")
    same = fleet.reports(2)
    for r in same:
        assert r["source"] == "peer" and r["identical"], [x["fallback_reason"] for x in same]
        assert r["peer_id"].startswith(f"g{tp2[r['rank']]['group']}-{r['rank']}"), r

    # With the TP=1 holder gone, a TP=2 "cols" group and a TP=1 (whole) receiver reshard
    # from TP=2 megatron holders: the TP=1 one needs both of their ranks.
    holder_stop.set()
    fleet.wait_gone(0, world=1)
    fleet.start(2, "cols")
    cols = fleet.reports(2)
    for r in cols:
        assert r["source"] == "peer" and r["identical"], [x["fallback_reason"] for x in cols]
        assert r["bytes"] == r["own_bytes"], r


@pytest.mark.timeout(180)
def test_a_groups_ranks_receive_from_a_one_slot_holder_side_by_side(fleet: Fleet) -> None:
    """A TP=2 group behind a TP=1 holder with one send slot (paced: seconds per shard):
    its ranks hold the slot together and receive at once, not one after the other."""
    fleet.start(1, "plain", settings={"max_send_gbps": 0.00001})
    fleet.reports(1)
    fleet.start(2, "megatron")
    tp2 = fleet.reports(2, timeout=120)
    assert all(r["source"] == "peer" and r["identical"] for r in tp2), [r["fallback_reason"] for r in tp2]
    # Neither rank waited for the other's transfer to end before it could claim.
    for r, other in zip(tp2, reversed(tp2), strict=True):
        assert r["timings"]["claim.0"] < other["timings"]["transfer.0"] / 2, [x["timings"] for x in tp2]


@pytest.mark.timeout(180)
def test_tp2_holders_to_tp1_receiver(fleet: Fleet) -> None:
    fleet.start(2, "megatron")
    seeds = fleet.reports(2)
    assert [r["source"] for r in seeds] == ["storage", "storage"] and all(r["identical"] for r in seeds)
    fleet.start(1, "whole")
    (r,) = fleet.reports(1)
    assert r["source"] == "peer" and r["identical"], r
    assert r["bytes"] == r["own_bytes"] and "," in r["peer_id"], r  # both holder ranks


@pytest.mark.timeout(240)
def test_a_dead_holder_still_listed_costs_a_handshake_then_other_layouts_serve(fleet: Fleet) -> None:
    """A TP=1 holder SIGKILLed while its entry lives on: a TP=1 receiver's handshake with
    it times out, then it reshards from TP=2 holders instead of reading storage."""
    fleet.start(1, "whole", settings={"peer_ttl": 120.0})  # listed long after its death
    (h,) = fleet.reports(1)
    fleet.start(2, "megatron")
    tp2 = fleet.reports(2)
    assert all(r["source"] == "peer" for r in tp2), [r["fallback_reason"] for r in tp2]
    fleet.kill(0)
    fleet.start(1, "whole")
    (r,) = fleet.reports(1, timeout=120)
    assert r["source"] == "peer" and r["identical"], r
    sources = r["peer_id"].split(",")
    assert len(sources) == 2 and not any(p.startswith(f"g{h['group']}-") for p in sources), r


@pytest.mark.timeout(240)
def test_a_same_layout_holder_failing_verification_is_passed_over_for_other_layouts(
        fleet: Fleet) -> None:
    """A TP=1 holder that serves one changed byte: the TP=1 receiver's full verification
    catches it, and it reshards from TP=2 holders instead of reading storage, bit-exact."""
    fleet.start(2, "megatron", settings=FULL)
    tp2 = fleet.reports(2)
    assert [r["source"] for r in tp2] == ["storage", "storage"], tp2
    fleet.start(1, "whole", fault="corrupt_send", settings=FULL)
    (bad,) = fleet.reports(1)
    assert bad["source"] == "peer" and bad["identical"], bad
    fleet.start(1, "whole", settings=FULL)
    (r,) = fleet.reports(1, timeout=120)
    assert r["source"] == "peer" and r["identical"], r
    sources = r["peer_id"].split(",")
    assert len(sources) == 2 and not any(p.startswith(f"g{bad['group']}-") for p in sources), r


@pytest.mark.timeout(240)
def test_one_rank_failing_its_same_layout_receive_sends_the_whole_group_to_reshard(
        fleet: Fleet) -> None:
    """strict TP=2 receiver whose rank 1 gets a changed byte from its same-layout holder:
    both ranks reshard (a group loads one way), rank 1 never from the holder that failed
    it, bit-exact, no error."""
    fleet.start(1, "whole", settings=FULL)
    (h,) = fleet.reports(1)
    fleet.start(2, "megatron", fault="corrupt_send_rank1", settings=FULL)
    bad = fleet.reports(2)
    assert all(r["source"] == "peer" and r["identical"] for r in bad), bad
    fleet.start(2, "megatron", settings={**FULL, "strict": True})
    tp2 = fleet.reports(2, timeout=120)
    for r in tp2:
        assert r["source"] == "peer" and r["identical"], [x["fallback_reason"] for x in tp2]
        assert "reshard_discovery" in r["timings"], r  # the reshard ran on both ranks
    # Rank 1's reshard skips the holder it blamed: the TP=1 holder serves it. Rank 0's
    # may use the failed group's rank 0, which served it verified bytes.
    assert tp2[1]["peer_id"].startswith(f"g{h['group']}-0"), tp2[1]
    assert tp2[0]["peer_id"].startswith((f"g{h['group']}-0", f"g{bad[0]['group']}-0")), tp2[0]


@pytest.mark.timeout(180)
def test_holder_killed_mid_reshard_falls_back_with_its_reason(fleet: Fleet) -> None:
    """TP=2 holders sending slowly (max_send_gbps); one is killed while the TP=1 receiver
    reshards from both: the receiver loads from storage, saying why, bit-exact."""
    fleet.start(2, "megatron", settings={"max_send_gbps": 0.000005})
    fleet.reports(2)
    fleet.start(1, "whole", settings={"stall_timeout": 2.0})
    time.sleep(3.0)  # the receiver is inside its first (paced: ~36 s) transfer
    fleet.kill(0)
    (r,) = fleet.reports(1, timeout=120)
    assert r["source"] == "storage" and r["identical"], r
    assert r["fallback_reason"].split(":")[0] in ("transfer_error", "transfer_timeout"), r


@pytest.mark.timeout(240)
def test_strict_reshard_failure_raises_on_every_rank(fleet: Fleet) -> None:
    """strict: a TP=2 group resharding from a TP=1 holder that is killed mid-transfer
    raises on every rank (no storage load), each naming why."""
    fleet.start(1, "whole", settings={"max_send_gbps": 0.000005})
    fleet.reports(1)
    fleet.start(2, "megatron", settings={"strict": True, "stall_timeout": 2.0})
    fleet.wait_for_data()
    time.sleep(0.5)
    fleet.kill(0)
    reports = fleet.reports(2, timeout=120, errors=True)
    assert all("source" not in r for r in reports), reports  # nobody fell back to storage
    errors = [r["error"] for r in reports]
    assert all(e.startswith(("Transfer", "ConsensusError", "Handshake")) for e in errors), errors
    assert any(e.startswith("Transfer") for e in errors), errors  # the failing rank's own reason


def test_plan_mismatch_is_refused_before_data_moves(tmp_path: Path, redis_url: str, namespace: str,
                                                    cache_dir: str, monkeypatch: Any) -> None:
    """A receiver that derived another plan than its holder: the handshake refuses it
    (the plan digests differ) before any communicator exists; it falls back, bytes exact."""
    import nccl_back
    from nccl_back.config import Settings
    from nccl_back.load import reshard
    from nccl_back.load.service import WeightService
    from nccl_back.model import reshard_plan
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.skeleton import named_tensors

    model = fill_random(build(lambda: rw.Flat(rw.checkpoint_shapes())), seed=3)
    ckpt = str(write_checkpoint(model, tmp_path / "ckpt", n_shards=2))
    s = Settings(redis_url=redis_url, namespace=namespace, cache_dir=cache_dir, secret="s" * 32,
                 advertise_host="127.0.0.1", handshake_timeout=5.0)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)

    def skewed(receiver: Any, holders: Any) -> reshard_plan.Plan:
        p = reshard_plan.plan(receiver, holders)
        return reshard_plan.Plan(p.moves[:-1], p.receiver, p.holders)  # one move short

    monkeypatch.setattr(reshard, "plan", skewed)
    with WeightService(s, worker_id="holder") as holder, WeightService(s, worker_id="recv") as recv:
        assert holder.load(build(lambda: rw.Flat(rw.checkpoint_shapes())), spec).source == "storage"
        skel = build(lambda: rw.Flat(rw.tp_shapes(1, "megatron")))
        sh = nccl_back.sharding(skel, spec, rw.describe(0, 1, "megatron"), s)
        result = recv.load(skel, spec, sharding=sh)
        assert result.source == "storage", result
        assert result.fallback_reason.startswith("manifest_mismatch"), result.fallback_reason
        assert "transfer.0" not in result.timings, result.timings  # no data moved
        want = rw.expected(ckpt, 0, 1, "megatron")
        got = named_tensors(skel)[0]
        assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.timeout(240)
def test_disagreeing_position_truth_skips_those_holders(fleet: Fleet) -> None:
    """Two TP=2 holders' truth records disagree on a replicated tensor (one rewritten
    with the fleet key): a TP=1 receiver that would use both neither raises nor trusts
    either; it loads the exact bytes from storage, saying why."""
    from nccl_back.config import Settings
    from nccl_back.coord.content import PositionTruth
    from nccl_back.coord.registry import Registry

    (holder_stop,) = fleet.start(1, "plain")
    (h,) = fleet.reports(1)
    fleet.start(2, "megatron")
    tp2 = fleet.reports(2)
    assert all(r["source"] == "peer" for r in tp2), tp2
    holder_stop.set()
    s = fleet.settings
    reg = Registry(Settings(redis_url=s["redis_url"], namespace=s["namespace"], secret=s["secret"]))
    fleet.wait_gone(0, world=1)
    (key,) = [k for k in reg.scan("ct:*") if k.split(":")[4] == "2" and k.split(":")[3] == "1"]
    got = reg.read(key, schema.POSITION_TRUTH)
    assert got is not None
    truth: PositionTruth = got[0]
    j = next(i for i, m in enumerate(truth.macs["norm"]) if m is not None)
    macs = dict(truth.macs)
    macs["norm"] = [("0" * 8 if i == j else m) for i, m in enumerate(macs["norm"])]
    reg.delete(key)
    reg.put_position_truth(key.split(":")[2], 1, 2, PositionTruth(truth.layout, truth.scheme, macs))
    fleet.start(1, "whole")
    (r,) = fleet.reports(1)  # an exception in any worker fails here
    assert r["source"] == "storage" and r["identical"], r
    assert "disagree" in (r["fallback_reason"] or ""), r["fallback_reason"]
