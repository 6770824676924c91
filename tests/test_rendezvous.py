"""The transfer rendezvous against strangers: no port, signed bounded keys.

The class of attacks, not one example: a party without the fleet secret may reach
every port of the worker (there is no rendezvous port to reach) and read and write the
shared Redis (it can see the transfer's keys there). Whatever it writes at a transfer's
keys, and whenever, is never accepted; whatever size it writes, a worker reads at most
a bound; and a transfer it floods still completes. Real redis-server, real gloo.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import hmac
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from rendezvous_util import listening_sockets

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.errors import NcclBackError, TransferError, TransferTimeoutError
from nccl_back.transport import (
    open_rendezvous,
    receiver_transport,
    recv_tensors,
    run_guarded,
    send_tensors,
)
from nccl_back.transport.gloo import GlooTransport
from nccl_back.transport.rendezvous_store import _MAX_STORED, MAX_VALUE_BYTES, RedisStore

SECRET = "fleet-secret-" + "r" * 24
CPU = torch.device("cpu")


@pytest.fixture
def fleet(redis_url: str, namespace: str) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                    secret=SECRET)


@pytest.fixture
def registry(fleet: Settings) -> Iterator[Registry]:
    reg = Registry(fleet)
    yield reg
    reg.close()


def store(registry: Registry, settings: Settings, scope: str = "scope", seconds: float = 5.0) -> RedisStore:
    return RedisStore(registry, scope, settings.key("rendezvous"), time.monotonic() + seconds)


def forgeries(fleet: Settings, registry: Registry, genuine_name: str) -> dict[str, str]:
    """Values a stranger can write at a key, one per way of trying (each fails)."""
    sender = store(registry, fleet)
    key = registry.keys.key("rdv", "scope", genuine_name)
    value = b"10.0.0.66:4444"
    wrong = Settings(redis_url=fleet.redis_url, namespace=fleet.namespace,
                     advertise_host="127.0.0.1", secret="another-secret-" + "x" * 20)
    moved_from = registry.keys.key("rdv", "other-transfer", genuine_name)
    return {
        "unsigned": "-:" + base64.b64encode(value).decode(),
        "no separator": base64.b64encode(value).decode(),
        "wrong secret": RedisStore(registry, "scope", wrong.key("rendezvous"), 0).encode(key, value),
        "the signing key, not the rendezvous key": (
            hmac.new(fleet.key("sign") or b"", key.encode() + b"\0" + value, hashlib.sha256).hexdigest()
            + ":" + base64.b64encode(value).decode()),
        "moved from another transfer": sender.encode(moved_from, value),
        "truncated": sender.encode(key, value)[:-4],
        "bad base64": sender.encode(key, value)[:64] + ":!!!!",
        "empty value, wrong mac": "0" * 64 + ":",
        "oversize": sender.encode(key, b"x" * (MAX_VALUE_BYTES + 1)),
    }


def test_every_kind_of_forged_value_is_treated_as_absent(fleet: Settings, registry: Registry) -> None:
    """Unsigned, wrongly keyed, moved, truncated, malformed or oversize values at a
    transfer's key never satisfy a check or a get: each is rejected and counted."""
    reader = store(registry, fleet, seconds=0.3)
    cases = forgeries(fleet, registry, "gloo/0/0")
    for why, stored in cases.items():
        registry.client.set(registry.keys.key("rdv", "scope", "gloo/0/0"), stored)
        assert not reader.check(["gloo/0/0"]), why
        with pytest.raises(TransferTimeoutError, match="deadline passed"):
            reader.deadline = time.monotonic() + 0.2
            reader.get("gloo/0/0")
    assert reader.rejected >= len(cases)


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200), st.integers(min_value=0, max_value=400), st.integers(0, 255))
def test_no_mutation_of_a_genuine_value_is_accepted(fleet: Settings, registry: Registry, value: bytes,
                                                    at: int, flip: int) -> None:
    """Any single-character change to a genuine stored value makes it untrusted."""
    s = store(registry, fleet)
    key = registry.keys.key("rdv", "scope", "k")
    genuine = s.encode(key, value)
    assert s.decode(key, genuine) == value
    i = at % len(genuine)
    mutated = genuine[:i] + chr((ord(genuine[i]) + 1 + flip % 94) % 127 or 1) + genuine[i + 1:]
    if mutated != genuine:
        assert s.decode(key, mutated) is None


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=300))
def test_any_bytes_a_stranger_stores_are_rejected_never_raised(fleet: Settings, registry: Registry,
                                                              raw: bytes) -> None:
    """Arbitrary bytes at a transfer's key (not UTF-8, not ASCII, cut mid-character by the
    bounded read): check() says absent, nothing raises, and the connection stays usable."""
    s = store(registry, fleet)
    registry.client.set(registry.keys.key("rdv", "scope", "k"), raw)
    assert s.check(["k"]) is False
    s.set("ok", b"v")
    assert s.get("ok") == b"v"


def test_a_huge_value_at_a_transfer_key_is_never_held(fleet: Settings, registry: Registry) -> None:
    """A stranger's 64 MiB value at the key a worker waits on: the worker reads a bounded
    prefix only (its Python heap grows by far less than the value) and rejects it."""
    name = "gloo/0/1"
    registry.client.set(registry.keys.key("rdv", "scope", name), "a" * (64 << 20))
    reader = store(registry, fleet, seconds=1.0)
    tracemalloc.start()
    try:
        with pytest.raises(TransferTimeoutError):
            reader.get(name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * _MAX_STORED + (1 << 20), peak
    assert reader.rejected >= 1


def test_a_process_group_cannot_make_this_side_write_unbounded_values(fleet: Settings,
                                                                      registry: Registry) -> None:
    """Writes are bounded too, and nothing can count or list a transfer's keys."""
    s = store(registry, fleet)
    with pytest.raises(TransferError, match="over"):
        s.set("k", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(TransferError, match="over"):
        s.set("n" * 300, b"x")
    with pytest.raises(TransferError, match="cannot count"):
        s.num_keys()
    with pytest.raises(TransferError, match="does not support add"):
        s.add("k", 1)


def _in_a_native_thread(name: bytes, call: Callable[[], object]) -> None:
    """Run ``call`` in a thread made by ``pthread_create``, as NCCL's watchdog and
    heartbeat monitor are (Python sees it as a dummy thread), named ``name``."""
    libc = ctypes.CDLL(None)
    errors: list[BaseException] = []

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    def body(_: object) -> None:
        libc.prctl(15, name)  # PR_SET_NAME: the name NCCL gives its threads
        try:
            call()
        except BaseException as e:
            errors.append(e)

    tid = ctypes.c_ulong()
    assert libc.pthread_create(ctypes.byref(tid), None, body, None) == 0
    assert libc.pthread_join(tid, None) == 0
    if errors:
        raise errors[0]


def test_calls_from_threads_python_did_not_start_are_recorded_by_name(
    fleet: Settings, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    """A store call from a native thread (NCCL's heartbeat monitor, say) is recorded by
    method and OS thread name, and a refused one says which thread asked; calls from
    Python's own threads are not recorded."""
    s = store(registry, fleet)
    s.set("k", b"v")
    threading.Thread(target=s.check, args=(["k"],), name="a-python-thread").start()
    _in_a_native_thread(b"pt_nccl_heartbt", lambda: s.check(["k"]))
    _in_a_native_thread(b"pt_nccl_heartbt", lambda: s.check(["k"]))
    with pytest.raises(TransferError, match="does not support add"):
        _in_a_native_thread(b"pt_nccl_watchdg", lambda: s.add("k", 1))
    assert dict(s.foreign_calls) == {("check", "pt_nccl_heartbt"): 2, ("add", "pt_nccl_watchdg"): 1}
    refused = [r for r in caplog.records if "rendezvous_call_refused" in r.getMessage()]
    assert refused and "pt_nccl_watchdg" in refused[0].getMessage()


def test_keys_live_no_longer_than_the_connect_phase(fleet: Settings, registry: Registry) -> None:
    """A bootstrap key expires a few seconds past the store's deadline and close() deletes it."""
    s = store(registry, fleet, seconds=2.0)
    s.set("k", b"v")
    key = registry.keys.key("rdv", "scope", "k")
    assert 0 < registry.client.pttl(key) <= 7_000
    assert s.get("k") == b"v"
    s.close()
    assert registry.client.exists(key) == 0


def pair(fleet: Settings, registry: Registry, tid: str, want: dict[str, torch.Tensor],
         got: dict[str, torch.Tensor], connect_s: float,
         during: Callable[[], None] | None = None, stall: float | None = None) -> list[BaseException]:
    """A sender and a receiver (two threads) transfer ``want`` into ``got`` through a
    rendezvous; ``during`` runs beside them; ``stall``: each side's stall bound, as a
    load passes one. Returns what each side raised."""
    errors: list[BaseException] = []
    before = listening_sockets()
    with open_rendezvous(fleet, "gloo", device=CPU, registry=registry) as rdv:
        assert listening_sockets() == before  # no rendezvous port, ever
        now = time.monotonic()

        def side(tr: object, fn: object) -> None:
            try:
                run_guarded(tr, fn, now + 60, connect_deadline=now + connect_s,  # type: ignore[arg-type]
                            stall=stall)
            except NcclBackError as e:
                errors.append(e)

        threads = [
            threading.Thread(target=side, args=(rdv.sender(tid), lambda t: send_tensors(t, want, 4096))),
            threading.Thread(target=side, args=(
                receiver_transport(fleet, "gloo", rdv.address, tid, device=CPU, registry=registry),
                lambda t: recv_tensors(t, got, 4096))),
        ]
        for t in threads:
            t.start()
        if during is not None:
            during()
        for t in threads:
            t.join(80)
    return errors


WANT = {"w": torch.arange(50_000, dtype=torch.float32), "b": torch.arange(7, dtype=torch.int64)}


@pytest.mark.timeout(90)
def test_forgeries_planted_in_advance_do_not_stop_a_transfer(fleet: Settings, registry: Registry) -> None:
    """A stranger who writes every kind of forgery, in turn, at the keys a transfer will
    use before it starts: the genuine writes replace them and the transfer is bit-identical."""
    tid = uuid.uuid4().hex
    got = {n: torch.zeros_like(t) for n, t in WANT.items()}
    for stored in forgeries(fleet, registry, "x").values():
        for rank in (0, 1):
            key = registry.keys.key("rdv", f"gloo/{tid}", f"gloo/0/{rank}")
            registry.client.set(key, stored, px=30_000)
    assert pair(fleet, registry, tid, WANT, got, connect_s=30) == []
    for n in WANT:
        assert got[n].numpy().tobytes() == WANT[n].numpy().tobytes(), n


@pytest.mark.timeout(90)
def test_a_stranger_overwriting_the_bootstrap_fails_it_cleanly_never_feeds_it(
    fleet: Settings, registry: Registry
) -> None:
    """A stranger overwriting every rendezvous key it sees with forgeries, as fast as it
    can: at worst the transfer fails by its connect deadline (the receiver falls back);
    no forged address is ever used and the receiver's tensors are untouched."""
    tid = uuid.uuid4().hex
    got = {n: torch.full_like(t, 3) for n, t in WANT.items()}
    attacker = Registry(fleet.replace(secret=None))
    junk = list(forgeries(fleet, registry, "x").values())
    stop = time.monotonic() + 6

    def flood() -> None:
        while time.monotonic() < stop:
            for key in list(attacker.client.scan_iter(attacker.keys.key("rdv", "*"))):
                for stored in junk:
                    attacker.client.set(key, stored, px=2000)

    # A side that formed its half of the communicator before the flood won waits for the
    # other at the stall bound, as in a load (without one it would wait out the deadline).
    errors = pair(fleet, registry, tid, WANT, got, connect_s=4, during=flood, stall=5)
    if errors:  # the flood won the race: a clean, typed failure of both sides
        assert all(isinstance(e, TransferError) for e in errors), errors
        for n in WANT:
            assert got[n].numpy().tobytes() == torch.full_like(WANT[n], 3).numpy().tobytes(), n
    else:  # the genuine values were read before the flood reached them
        for n in WANT:
            assert got[n].numpy().tobytes() == WANT[n].numpy().tobytes(), n


def test_a_non_canonical_spelling_of_a_genuine_value_is_rejected(fleet: Settings,
                                                                  registry: Registry) -> None:
    """The same bytes in another base64 spelling (padding bits set) are not what a worker
    wrote: rejected (found by the mutation property above)."""
    s = store(registry, fleet)
    key = registry.keys.key("rdv", "scope", "k")
    genuine = s.encode(key, b"\x00")
    assert genuine.endswith(":AA==")
    assert s.decode(key, genuine[:-3] + "B==") is None


def test_an_aborted_transport_stops_forming_its_communicator_at_once(fleet: Settings,
                                                                     registry: Registry) -> None:
    """A receiver whose sender never comes, aborted 0.3 s into its connect, raises at
    its store's next poll, not at its 30 s connect deadline."""
    tr = GlooTransport.receiver(fleet, registry, "127.0.0.1:1", uuid.uuid4().hex,
                                device=torch.device("cpu"))
    threading.Timer(0.3, tr.abort).start()
    began = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=r"rendezvous wait .*: aborted"):
        tr.connect(time.monotonic() + 30)
    assert time.monotonic() - began < 5
    tr.close()
