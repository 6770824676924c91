"""The liveness handshake, both halves against a real redis-server."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from stored import stored_json

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord import handshake
from nccl_back.coord.registry import Registry
from nccl_back.dev.servers import LocalRedis
from nccl_back.errors import (
    HandshakeTimeoutError,
    IncompatiblePeerError,
    ManifestMismatchError,
    RegistryError,
)


@pytest.fixture
def registry(redis_url: str, namespace: str) -> Registry:
    return Registry(Settings(redis_url=redis_url, namespace=namespace))


class FakeClock(_clock.Clock):
    """Time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


def in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


@pytest.mark.timeout(30)
def test_both_sides_complete(registry: Registry) -> None:
    """Receiver and sender in two threads both return; each saw its nonce made +1."""
    tid = uuid.uuid4().hex
    thread, errors = in_thread(lambda: handshake.run_sender(registry, tid, "m", 5.0))
    handshake.run_receiver(registry, tid, "m", 5.0)
    thread.join(10)
    assert errors == []
    r_key, s_key = handshake.keys(registry, tid)
    r, s = stored_json(registry, r_key), stored_json(registry, s_key)
    assert r is not None and r["by"] == "sender"
    assert s is not None and s["by"] == "receiver"
    assert 0 < registry.ttl(r_key) <= handshake.HANDSHAKE_KEY_TTL


@pytest.mark.timeout(30)
def test_sender_started_before_receiver_still_completes(registry: Registry) -> None:
    """The sender may poll before X exists; after_ready runs once X is stored."""
    tid = uuid.uuid4().hex
    started = threading.Event()
    thread, errors = in_thread(lambda: handshake.run_sender(registry, tid, "m", 5.0))
    handshake.run_receiver(registry, tid, "m", 5.0, after_ready=started.set)
    thread.join(10)
    assert errors == [] and started.is_set()


def test_receiver_alone_times_out_and_cleans_up(registry: Registry) -> None:
    """No sender: HandshakeTimeoutError at the receiver's timeout, keys removed."""
    clock = FakeClock()
    tid = uuid.uuid4().hex
    with _clock.use(clock), pytest.raises(HandshakeTimeoutError, match="R1 WAIT_ACK"):
        handshake.run_receiver(registry, tid, "m", 10.0)
    assert clock.now == pytest.approx(10.0)
    assert stored_json(registry, handshake.keys(registry, tid)[0]) is None


def test_a_long_wait_reads_redis_at_most_every_poll_max(registry: Registry,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait backs off to one read per POLL_MAX: a fleet's waiting handshakes cost the
    one Redis little (10 s at 5 ms a read would be 2,000 reads)."""
    reads = 0
    get_signed = registry.get_signed

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal reads
        reads += 1
        return get_signed(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(registry, "get_signed", counted)
    with _clock.use(FakeClock()), pytest.raises(HandshakeTimeoutError, match="R1 WAIT_ACK"):
        handshake.run_receiver(registry, uuid.uuid4().hex, "m", 10.0)
    assert 10.0 / handshake.POLL_MAX <= reads <= 10.0 / handshake.POLL_MAX + 10


def test_sender_alone_times_out(registry: Registry) -> None:
    """No receiver: the sender gives up at its own (short) timeout."""
    clock = FakeClock()
    with _clock.use(clock), pytest.raises(HandshakeTimeoutError, match="S0 WAIT_X"):
        handshake.run_sender(registry, uuid.uuid4().hex, "m", 1.0)
    assert clock.now == pytest.approx(1.0)


def test_receiver_that_vanishes_after_x_times_the_sender_out(registry: Registry) -> None:
    """X is there but nobody acknowledges Y: the sender times out waiting in S3."""
    tid = uuid.uuid4().hex
    r_key, _ = handshake.keys(registry, tid)
    registry.set_json(r_key, {"by": "receiver", "value": 41, "digest": "m"}, 5)
    clock = FakeClock()
    with _clock.use(clock), pytest.raises(HandshakeTimeoutError, match="S3 WAIT_ACK"):
        handshake.run_sender(registry, tid, "m", 1.0)


def test_stale_keys_of_another_transfer_do_not_satisfy(registry: Registry) -> None:
    """A completed handshake under one transfer_id does not answer a new one."""
    old = uuid.uuid4().hex
    thread, errors = in_thread(lambda: handshake.run_sender(registry, old, "m", 5.0))
    handshake.run_receiver(registry, old, "m", 5.0)
    thread.join(10)
    assert errors == []
    clock = FakeClock()
    with _clock.use(clock), pytest.raises(HandshakeTimeoutError):
        handshake.run_receiver(registry, uuid.uuid4().hex, "m", 2.0)


def test_stale_ack_under_the_same_id_does_not_satisfy(registry: Registry) -> None:
    """An old +1 left under the key is not our X+1: the receiver still waits."""
    tid = uuid.uuid4().hex
    r_key, _ = handshake.keys(registry, tid)

    class Leftovers(FakeClock):
        def sleep(self, seconds: float) -> None:
            # A leftover acknowledgement of some other nonce appears while we wait.
            registry.set_json(r_key, {"by": "sender", "value": 7, "digest": "m"}, 5)
            super().sleep(seconds)

    with _clock.use(Leftovers()), pytest.raises(HandshakeTimeoutError, match="R1 WAIT_ACK"):
        handshake.run_receiver(registry, tid, "m", 1.0)


@pytest.mark.timeout(30)
def test_a_sender_gives_a_transfer_up_with_a_notice_only_it_can_leave(
    redis_url: str, namespace: str
) -> None:
    """abandon() leaves the notice abandoned() reads, over a completed handshake's keys;
    no key, the completed handshake's own values, or (with a secret) a marker nobody
    signed are no notice."""
    registry = Registry(Settings(redis_url=redis_url, namespace=namespace, secret="s" * 32))
    tid = uuid.uuid4().hex
    assert not handshake.abandoned(registry, tid)
    thread, errors = in_thread(lambda: handshake.run_sender(registry, tid, "m", 5.0))
    handshake.run_receiver(registry, tid, "m", 5.0)
    thread.join(10)
    assert errors == [] and not handshake.abandoned(registry, tid)
    forged = uuid.uuid4().hex
    _, s_key = handshake.keys(registry, forged)
    registry.client.set(s_key, '{"by": "sender", "abandoned": true}', ex=5)
    assert not handshake.abandoned(registry, forged)
    handshake.abandon(registry, tid)
    assert handshake.abandoned(registry, tid)


@pytest.mark.timeout(30)
def test_digest_mismatch_fails_both_sides(registry: Registry) -> None:
    """Different manifests: ManifestMismatchError on both sides, before any communicator."""
    tid = uuid.uuid4().hex
    thread, errors = in_thread(lambda: handshake.run_sender(registry, tid, "sender-digest", 5.0))
    with pytest.raises(ManifestMismatchError, match="sender's manifest digest sender-digest"):
        handshake.run_receiver(registry, tid, "receiver-digest", 5.0)
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ManifestMismatchError)
    assert "receiver's manifest digest receiver-digest" in str(errors[0])


@pytest.mark.timeout(30)
def test_redis_down_raises_registry_error(namespace: str) -> None:
    """Redis gone mid-way: RegistryError (the caller falls back), not a timeout or a hang."""
    server = LocalRedis().start()
    registry = Registry(Settings(redis_url=server.url, namespace=namespace, redis_timeout=0.5))
    server.kill()
    with pytest.raises(RegistryError, match="redis SET failed"):
        handshake.run_receiver(registry, uuid.uuid4().hex, "m", 1.0)
    server.stop()


class SlowCas(Registry):
    """A registry whose compare-and-set lands ``delay`` s late (a slow Redis round trip)."""

    def __init__(self, settings: Settings, *, delay: float) -> None:
        super().__init__(settings)
        self._delay = delay

    def compare_and_set(self, *a: object, **k: object) -> bool:
        time.sleep(self._delay)
        return super().compare_and_set(*a, **k)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_late_ack_after_the_sender_gave_up_is_refused(registry: Registry) -> None:
    """The receiver's last reply lands after the sender abandoned: the receiver raises at once."""
    tid = uuid.uuid4().hex
    late = SlowCas(registry.settings, delay=1.0)
    thread, errors = in_thread(lambda: handshake.run_sender(registry, tid, "m", 0.3))
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeoutError, match="the sender gave up"):
        handshake.run_receiver(late, tid, "m", 10.0)
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], HandshakeTimeoutError), errors
    # Seconds, not the receiver's 10 s timeout (nor a transfer timeout after it).
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_ack_landing_as_the_sender_gives_up_is_honoured(registry: Registry) -> None:
    """An ack that lands between the sender's deadline and its abandonment wins: both sides go on."""
    tid = uuid.uuid4().hex
    # The sender's abandonment is slow, so the receiver's ack (after 0.5 s) gets there first.
    hesitant = SlowCas(registry.settings, delay=1.0)
    slow_receiver = SlowCas(registry.settings, delay=0.5)
    thread, errors = in_thread(lambda: handshake.run_sender(hesitant, tid, "m", 0.3))
    handshake.run_receiver(slow_receiver, tid, "m", 10.0)
    thread.join(10)
    assert errors == []


@pytest.mark.timeout(30)
def test_abandonment_is_read_by_a_receiver_still_waiting_for_the_nonce(registry: Registry) -> None:
    """A receiver that reaches R2 after the sender abandoned reads the marker and raises at once."""
    tid = uuid.uuid4().hex
    thread, errors = in_thread(lambda: handshake.run_sender(registry, tid, "m", 0.3))
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeoutError, match="before we read its nonce"):
        handshake.run_receiver(registry, tid, "m", 10.0, after_ready=lambda: time.sleep(1.0))
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], HandshakeTimeoutError), errors
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_refusal_reaches_the_receiver_at_once(registry: Registry) -> None:
    """A sender's refusal (another transport) raises IncompatiblePeerError without waiting out the timeout."""
    tid = uuid.uuid4().hex
    t0 = time.monotonic()
    with pytest.raises(IncompatiblePeerError, match="refused it \\(incompatible\\): nccl only"):
        handshake.run_receiver(
            registry, tid, "m", 10.0,
            after_ready=lambda: handshake.refuse(registry, tid, "incompatible", "nccl only"),
        )
    assert time.monotonic() - t0 < 5
