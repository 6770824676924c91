"""Single-flight election against a real redis-server, time driven by a fake clock.

(The group form, one election per multi-rank worker, is exercised end to end with real
processes in tests/test_multirank.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.election import DownloadLease, elect
from nccl_back.coord.registry import Registry


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
    return Settings(redis_url=redis_url, namespace=namespace, single_flight_wait=10.0,
                    single_flight_max_wait=50.0, download_lease=15.0)


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
        assert a.key == registry.lease_key("v1", 2) == f"{{{registry.ns}}}:dl:v1:2"
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
            outcome, who, error = elect(waiter, lambda: False, None, 0, settings)
        assert (outcome, who, error) == ("timeout", 0, None)
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
            outcome, who, _ = elect(waiter, sees_peer, None, 0, settings)
        assert (outcome, who) == ("elected", 0)
        assert waiter.held and waiter.holder() == "B"
    finally:
        waiter.release()
        holder.release()


@pytest.mark.timeout(30)
def test_peer_wins_over_the_lease(settings: Settings, registry: Registry) -> None:
    """A peer seen in the same poll wins: the lease just taken is given back at once."""
    waiter = _lease(registry, "B")
    outcome, _, _ = elect(waiter, lambda: True, None, 0, settings)
    assert outcome == "peer"
    assert not waiter.held and waiter.holder() is None


@pytest.mark.timeout(30)
def test_the_elected_worker_sees_who_waits_with_it(settings: Settings, registry: Registry) -> None:
    """Every waiter's rank 0 enters the download group as it starts to wait: the elected one
    reads them all, each once, in arrival order."""
    holder, first, second = _lease(registry, "A"), _lease(registry, "B"), _lease(registry, "C")
    clock = FakeClock()
    try:
        assert holder.try_acquire()
        with _clock.use(clock):
            for waiter in (first, second, first):
                assert elect(waiter, lambda: False, None, 0, settings)[0] == "timeout"
        assert holder.group() == ["B", "C"]
        holder.release()
        assert elect(holder, lambda: False, None, 0, settings)[0] == "elected"
        assert holder.group() == ["B", "C", "A"]
        assert _lease(registry, "X").group() == ["B", "C", "A"]
    finally:
        holder.release()


@pytest.mark.timeout(30)
def test_a_rank_other_than_0_never_joins_the_download_group(settings: Settings, registry: Registry) -> None:
    """A worker is one member of its download group, whatever its number of ranks."""
    waiter = _lease(registry, "B")
    assert elect(waiter, lambda: True, None, 1, settings)[0] == "peer"
    assert waiter.group() == []
