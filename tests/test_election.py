"""Single-flight election against a real redis-server, time driven by a fake clock.

(The group form, one election per multi-rank worker, is exercised end to end with real
processes in tests/test_multirank.py; the member number's way to every rank here, with
real processes in a gloo group.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from groups import CTX  # forked from a server with torch imported (tests/groups.py)
from hostile import corrupt, corruptions

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.election import DownloadLease, Election, elect
from nccl_back.coord.records import Member
from nccl_back.coord.registry import Registry
from nccl_back.dev.servers import free_port
from nccl_back.transport_kinds import MAX_PARTS


class FakeClock(_clock.Clock):
    """Time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def settings(redis_url: str, namespace: str) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace).capped(  # download_lease 15 s
        single_flight_wait=10.0, single_flight_max_wait=50.0)


@pytest.fixture
def registry(settings: Settings) -> Iterator[Registry]:
    reg = Registry(settings)
    yield reg
    reg.close()


def _lease(registry: Registry, owner: str) -> DownloadLease:
    return DownloadLease(registry, "v1", 2, owner, registry.settings.download_lease)


@pytest.mark.timeout(30)
def test_lease_is_one_per_worker_not_per_rank(registry: Registry) -> None:
    """The lease key names the version and world size only: one worker of that size wins."""
    a, b = _lease(registry, "A"), _lease(registry, "B")
    try:
        assert a.key == registry.keys.of(schema.LEASE, "v1", 2) == f"{{{registry.ns}}}:dl:v1:2"
        assert a.try_acquire() and not b.try_acquire()
        assert b.holder() == "A"
    finally:
        a.release()
        b.release()


@pytest.mark.timeout(30)
def test_waiter_keeps_waiting_while_the_downloader_renews(settings: Settings, registry: Registry) -> None:
    """Past single_flight_wait a live downloader is waited for, up to single_flight_max_wait."""
    holder, waiter = _lease(registry, "A"), _lease(registry, "B")
    clock = FakeClock()
    try:
        assert holder.try_acquire()
        with _clock.use(clock):
            result = elect(waiter, lambda: False, None, 0, settings)
        assert result == Election("timeout", 0)
        assert 50.0 <= clock.now <= 52.0
    finally:
        holder.release()


@pytest.mark.timeout(30)
def test_waiter_takes_over_when_the_lease_is_gone(settings: Settings, registry: Registry) -> None:
    """When the downloader's lease disappears (died, or finished without publishing) a waiter is elected."""
    holder, waiter = _lease(registry, "A"), _lease(registry, "B")
    clock = FakeClock()

    def sees_peer() -> bool:
        if clock.now >= 3.0:
            holder.release()
        return False

    try:
        assert holder.try_acquire()
        with _clock.use(clock):
            result = elect(waiter, sees_peer, None, 0, settings)
        assert result == Election("elected", 0)
        assert waiter.held and waiter.holder() == "B"
    finally:
        waiter.release()
        holder.release()


@pytest.mark.timeout(30)
def test_peer_wins_over_the_lease(settings: Settings, registry: Registry) -> None:
    """A peer seen in the same poll wins: the lease just taken is given back at once."""
    waiter = _lease(registry, "B")
    assert elect(waiter, lambda: True, None, 0, settings) == Election("peer")
    assert not waiter.held and waiter.holder() is None


@pytest.mark.timeout(30)
def test_the_elected_worker_sees_who_waits_with_it(settings: Settings, registry: Registry) -> None:
    """Every cooperating waiter's rank 0 enters the download group as it starts to wait: the
    elected one reads them all, each once, in arrival order."""
    holder, first, second = _lease(registry, "A"), _lease(registry, "B"), _lease(registry, "C")
    clock = FakeClock()
    try:
        assert holder.try_acquire()
        with _clock.use(clock):
            for waiter in (first, second, first):
                assert elect(waiter, lambda: False, None, 0, settings, cooperate=True).outcome == "timeout"
        assert holder.group() == ["B", "C"]
        holder.release()
        assert elect(holder, lambda: False, None, 0, settings, cooperate=True).outcome == "elected"
        assert holder.group() == ["B", "C", "A"]
        assert _lease(registry, "X").group() == ["B", "C", "A"]
    finally:
        holder.release()


@pytest.mark.timeout(30)
def test_a_rank_other_than_0_never_joins_the_download_group(settings: Settings, registry: Registry) -> None:
    """A worker is one member of its download group, whatever its number of ranks."""
    waiter = _lease(registry, "B")
    assert elect(waiter, lambda: True, None, 1, settings, cooperate=True).outcome == "peer"
    assert waiter.group() == []


@pytest.mark.timeout(30)
def test_a_worker_that_cannot_read_a_share_never_joins_the_download_group(
        settings: Settings, registry: Registry) -> None:
    """A waiter that cannot cooperate (several ranks, a sharded or engine skeleton) is
    never named a member: it does not enter the group."""
    holder, waiter = _lease(registry, "A"), _lease(registry, "B")
    try:
        assert holder.try_acquire()
        with _clock.use(FakeClock()):
            assert elect(waiter, lambda: False, None, 0, settings).outcome == "timeout"
        assert holder.group() == []
    finally:
        holder.release()


@pytest.fixture
def cooperative(redis_url: str, namespace: str) -> Iterator[Registry]:
    reg = Registry(Settings(redis_url=redis_url, namespace=namespace,  # group window 0.2 s
                            secret="election-test-secret-" + "x" * 16).capped(
        single_flight_wait=10.0, single_flight_max_wait=50.0))
    yield reg
    reg.close()


@pytest.mark.timeout(30)
def test_the_elected_worker_names_itself_then_the_waiters_in_arrival_order(cooperative: Registry) -> None:
    """After its window the elected worker names itself member 0 and the waiters 1, 2, ...;
    a waiter that joined after it named them is not named."""
    holder, first, second = _lease(cooperative, "A"), _lease(cooperative, "B"), _lease(cooperative, "C")
    try:
        assert holder.try_acquire()
        with _clock.use(FakeClock()):
            for waiter in (first, second):
                assert elect(waiter, lambda: False, None, 0, cooperative.settings,
                             cooperate=True).outcome == "timeout"
                assert waiter.member is None  # nobody named yet
        assert holder.name_members(cooperative.settings.download_group_window) == ["A", "B", "C"]
        late = _lease(cooperative, "D")
        late.join()
        for waiter, member in ((_lease(cooperative, "B"), (1, 3)), (_lease(cooperative, "C"), (2, 3)),
                               (late, None)):
            waiter.read_roster()
            assert waiter.member == member
    finally:
        holder.release()


@pytest.mark.timeout(30)
def test_a_waiter_learns_its_member_number_at_its_polls(cooperative: Registry) -> None:
    """A waiting worker's rank 0 reads the holder's roster as it polls: the wait ends as
    member 1 of 2 (not waiting out single_flight_wait)."""
    holder, waiter = _lease(cooperative, "A"), _lease(cooperative, "B")
    clock = FakeClock()
    try:
        assert holder.try_acquire()
        waiter.join()
        holder.name_members(0.0)
        with _clock.use(clock):
            got = elect(waiter, lambda: False, None, 0, cooperative.settings, cooperate=True)
        assert got == Election("member", 0, member=(1, 2)) and clock.now < 1.0
        assert waiter.member == (1, 2)
    finally:
        holder.release()


@pytest.mark.timeout(30)
def test_a_roster_whose_owner_does_not_hold_the_lease_names_nobody(cooperative: Registry) -> None:
    """A roster of a former (or forged) owner is not obeyed: the waiter waits for the
    holder's own roster, and one of a released lease names nobody."""
    holder, waiter = _lease(cooperative, "A"), _lease(cooperative, "B")
    try:
        assert holder.try_acquire()
        waiter.join()
        cooperative.name_download_roster("v1", 2, ["X", "Y"])
        waiter.read_roster()
        assert waiter.member is None and waiter.roster() is None
        holder.name_members(0.0)
        waiter.read_roster()
        assert waiter.member == (1, 2)
        holder.release()
        assert _lease(cooperative, "B").roster() is None
    finally:
        holder.release()


@pytest.mark.timeout(30)
def test_a_new_owner_names_none_of_a_former_roster(cooperative: Registry) -> None:
    """The lease taken over from an owner that named A and B: the new owner C names
    neither (A lost the lease, B read its share and waits for a stream), only D, a
    waiter that joined like them."""
    former = _lease(cooperative, "A")
    try:
        for w in ("A", "B", "C", "D"):
            _lease(cooperative, w).join()
        assert former.try_acquire()
        assert former.name_members(0.0) == ["A", "B", "C", "D"]
        former.release()  # as its expiry would
        owner = _lease(cooperative, "C")
        assert owner.try_acquire()
        cooperative.name_download_roster("v1", 2, ["A", "B"])  # the former roster, as C finds it
        assert owner.name_members(0.0) == ["C", "D"]
        owner.release()
    finally:
        former.release()


@pytest.mark.timeout(30)
def test_a_new_owner_takes_over_a_former_split_whose_members_still_serve(cooperative: Registry) -> None:
    """A former owner A named B and C, and B still announces its part: the new owner D,
    no member, takes that split over at once in A's place (D, B, C), writes no roster
    of its own (a waiter reads none and stays a receiver); once no member announces,
    a new owner names afresh."""
    former = _lease(cooperative, "A")
    try:
        for w in ("A", "B", "C"):
            _lease(cooperative, w).join()
        assert former.try_acquire()
        assert former.name_members(0.0) == ["A", "B", "C"]
        _lease(cooperative, "E").join()  # a waiter arriving after the roster
        cooperative.announce_download_member("v1", 0, 2, 1, Member("b-r0-share-1", "127.0.0.1:1", "gloo", "cpu"))
        former.release()  # as its expiry would
        owner = _lease(cooperative, "D")
        assert owner.try_acquire()
        assert owner.name_members(60.0) == ["D", "B", "C"]  # at once: no window waited
        waiter = _lease(cooperative, "E")
        waiter.read_roster()
        assert waiter.member is None and waiter.roster() is None
        owner.release()
        cooperative.delete(cooperative.keys.of(schema.DOWNLOAD_MEMBER, "v1", 0, 2, 1))  # B's lapsed
        again = _lease(cooperative, "F")
        assert again.try_acquire()
        assert again.name_members(0.0) == ["F", "E"]
        again.release()
    finally:
        former.release()


@pytest.mark.timeout(30)
def test_a_members_announcement_lapses_only_when_gone_or_moved_never_by_a_forgery(
    cooperative: Registry
) -> None:
    """The elected worker's watch of a member: its announcement lapsed once deleted or
    naming another endpoint, never while a forged value of any form the hostile suite
    writes sits there (the member's renewal overwrites it; its part stays a peer's)."""
    reg, ep = cooperative, "b-r0-share-1"
    reg.announce_download_member("v1", 0, 2, 1, Member(ep, "127.0.0.1:1", "gloo", "cpu"))
    assert not reg.download_member_lapsed("v1", 0, 2, 1, ep)
    assert reg.download_member_lapsed("v1", 0, 2, 1, "b-r0-share-2")
    key = reg.keys.of(schema.DOWNLOAD_MEMBER, "v1", 0, 2, 1)
    genuine = ("string", reg.client.get(key))
    for how in corruptions(schema.DOWNLOAD_MEMBER):
        corrupt(reg.client, key, schema.DOWNLOAD_MEMBER, how, genuine)
        if reg.download_member("v1", 0, 2, 1) is None:  # untrusted (a stale genuine copy is not)
            assert not reg.download_member_lapsed("v1", 0, 2, 1, ep), how
    reg.delete(key)
    assert reg.download_member_lapsed("v1", 0, 2, 1, ep)


@pytest.mark.timeout(30)
def test_a_roster_names_at_most_max_parts_members(cooperative: Registry) -> None:
    """Past MAX_PARTS the waiters are not named (they stay receivers of the fan-out)."""
    holder = _lease(cooperative, "A")
    try:
        assert holder.try_acquire()
        waiters = [f"w{i:03d}" for i in range(MAX_PARTS + 5)]
        for w in waiters:
            _lease(cooperative, w).join()
        assert holder.name_members(0.0) == ["A", *waiters[:MAX_PARTS - 1]]
        last = _lease(cooperative, waiters[MAX_PARTS - 1])
        last.read_roster()
        assert last.member is None
    finally:
        holder.release()


@pytest.mark.timeout(30)
def test_a_roster_that_does_not_verify_is_skipped_and_counted(cooperative: Registry) -> None:
    """Garbage, a forged signature or another Redis type at the roster names nobody; each
    is counted as a rejection, and the holder's next roster replaces it."""
    holder, waiter = _lease(cooperative, "A"), _lease(cooperative, "B")
    key = cooperative.keys.of(schema.DOWNLOAD_ROSTER, "v1", 2)
    try:
        assert holder.try_acquire()
        waiter.join()
        for garbage in (lambda: cooperative.client.set(key, b"\xff{not json", px=5000),
                        lambda: cooperative.client.set(key, b'{"members":["A","B"]}', px=5000),
                        lambda: cooperative.client.rpush(key, b"x")):
            cooperative.client.delete(key)
            garbage()
            before = cooperative.rejected
            waiter.read_roster()
            assert waiter.member is None and cooperative.rejected == before + 1
        cooperative.client.delete(key)
        holder.name_members(0.0)
        waiter.read_roster()
        assert waiter.member == (1, 2)
    finally:
        holder.release()


def _waiting_rank(rank: int, port: int, settings: Settings, out: Any) -> None:
    """Spawned: one rank of worker "B" (2 ranks, its own gloo group) waiting for a peer
    (none comes); puts its Election."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    registry = Registry(settings)
    try:
        lease = _lease(registry, "B") if rank == 0 else None
        out.put((rank, elect(lease, lambda: False, dist.group.WORLD, rank, settings, cooperate=True)))
    finally:
        registry.close()
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_every_rank_of_a_waiting_worker_learns_its_member_number(cooperative: Registry) -> None:
    """A 2-rank worker (separate processes, real gloo) named member 1 of 2: rank 0 read the
    roster, and both ranks leave the wait together as member (1, 2)."""
    holder = _lease(cooperative, "A")
    out = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=_waiting_rank, args=(r, port, cooperative.settings, out), daemon=True)
             for r in range(2)]
    try:
        assert holder.try_acquire()
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60
        while "B" not in holder.group():  # rank 0 joins as it starts to wait
            assert time.monotonic() < deadline, "worker B never joined the download group"
            time.sleep(0.05)
        assert holder.name_members(0.0) == ["A", "B"]
        results = dict(out.get(timeout=60) for _ in procs)
        assert results == {0: Election("member", 0, member=(1, 2)), 1: Election("member", 0, member=(1, 2))}
    finally:
        holder.release()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
