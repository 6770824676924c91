"""A cohort seated in the fan-out's two trees: real worker
processes behind one capped holder, each member receiving half the model from each of
two upstreams, and a member SIGKILLed mid-transfer."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import structlog
from groups import CTX
from hostile import corrupt, corruptions
from test_service import MODEL, Fleet, _ok

from nccl_back.budget import Budget
from nccl_back.config import Settings
from nccl_back.coord import records, schema
from nccl_back.coord.registry import Registry
from nccl_back.errors import HandshakeTimeoutError, TransferStalledError
from nccl_back.load import rounds
from nccl_back.load.asking import Source
from nccl_back.load.attempt import Receiving
from nccl_back.metrics import Metrics
from nccl_back.transport.relay import RELAY_HANDSHAKE, Member, Place, Progress, Seat, topology
from nccl_back.transport.relay.state import STALLED_HANDSHAKE, StepSources

from models import TinyTransformer, fill_random, write_checkpoint

TREES = {"cohort_window": 10.0, "stall_timeout": 3.0,
         "transfer_timeout": 20.0, "cohort_max_size": 64}


@pytest.fixture
def slow_ckpt(tmp_path: Path) -> str:
    return str(write_checkpoint(fill_random(TinyTransformer(**MODEL), seed=13), tmp_path / "ckpt"))


def _cohort(reg: Registry, n: int, position: int) -> tuple[list[str], Seat]:
    """``n`` members joined to one cohort, and the seat at ``position`` (no endpoint: only
    its upstreams are read)."""
    ids = [f"w{i}-r0-relay-{i}" for i in range(n)]
    key = ""
    for i in ids:
        key, _ = reg.join_cohort("v1", 0, 1, "ab" * 16, Member(i, "127.0.0.1:5000", "gloo", "cpu").to_dict(),
                                 window=30, max_size=64, ttl=30)
    return ids, Seat(Place(key, position), Member(ids[position], "127.0.0.1:5000", "gloo", "cpu"),
                    Progress(), None, reg)  # type: ignore[arg-type]


def test_a_seat_falls_back_to_earlier_seats_interior_in_the_tree_before_the_source(
    redis_url: str, namespace: str
) -> None:
    """A seat's upstreams for one tree are its ancestors in the cohort as it now stands,
    then every earlier seat interior in that tree, nearest first, never a leaf of it (one
    whose part may come from this seat); those that failed it are skipped; once none is
    left the cohort's source is the caller's (no member listed)."""
    reg = Registry(Settings(redis_url=redis_url, namespace=namespace))
    ids, seat = _cohort(reg, 12, 9)
    for tree in range(topology.TREES):
        ancestors = [p for p in topology.seat_upstreams(9, 12, tree) if p != topology.SOURCE]
        path = seat.tree_path(tree, 64)
        assert path == topology.seat_upstreams(9, 12, tree)
        got = [p for p, _ in seat.tree_upstreams(tree, path)]
        assert got[:len(ancestors)] == ancestors
        rest = got[len(ancestors):]
        assert rest == [q for q in range(8, -1, -1) if q % topology.TREES == tree and q not in ancestors]
    seat.failed.update(ids[q] for q in range(9))
    interior, leaf_tree = 9 % topology.TREES, 1 - 9 % topology.TREES
    assert seat.tree_upstreams(interior, seat.tree_path(interior, 64)) == []  # the source next
    leaf = [p for p, _ in seat.tree_upstreams(leaf_tree, seat.tree_path(leaf_tree, 64))]
    assert leaf == [p for p in topology.seat_upstreams(9, 12, 0) if p > 9]  # a later parent only


def test_a_member_that_stalled_is_asked_once_more_with_a_short_handshake(
    redis_url: str, namespace: str
) -> None:
    """A first stall of a member whose liveness mark lives does not count it failed: it
    is asked once more with a handshake bound of STALLED_HANDSHAKE and a stall bound
    longer by RELAY_HANDSHAKE (time for its own re-attach); a second stall, or any other
    failure, counts."""
    reg = Registry(Settings(redis_url=redis_url, namespace=namespace))
    reg.mark_alive("up", 30)
    seat = Seat(Place("c", 3), Member("me", "127.0.0.1:5000", "gloo", "cpu"), Progress(),
                 None, reg)  # type: ignore[arg-type]  # no endpoint: only liveness is read
    stalled = TransferStalledError("copy stalled (no progress for 3 s)")
    assert seat.handshake_bound("up", 3.0) == 3.0 and seat.stall_bound("up", 3.0) == 3.0
    assert not seat.counts_failed("up", stalled)
    assert seat.failed == set()
    assert seat.handshake_bound("up", 3.0) == STALLED_HANDSHAKE
    assert seat.stall_bound("up", 3.0) == 3.0 + RELAY_HANDSHAKE
    assert seat.counts_failed("up", stalled) and seat.failed == {"up"}
    assert seat.counts_failed("other", HandshakeTimeoutError("no answer")) and "other" in seat.failed


def test_a_stalled_member_whose_liveness_mark_lapsed_counts_failed_at_once(
    redis_url: str, namespace: str
) -> None:
    """A member that stalled a seat and whose liveness mark lapsed (it stopped itself, not
    behind a stopped one) is not asked once more; a mark that does not verify (every
    value and Redis type the hostile suite writes), or Redis unreachable, proves nothing:
    it is asked once more, as before marks."""
    s = Settings(redis_url=redis_url, namespace=namespace)
    reg = Registry(s)
    stalled = TransferStalledError("copy stalled (no progress for 3 s)")

    def seat(registry: Registry) -> Seat:
        return Seat(Place("c", 3), Member("me", "127.0.0.1:5000", "gloo", "cpu"), Progress(),
                     None, registry)  # type: ignore[arg-type]  # no endpoint: only liveness is read

    reg.mark_alive("stopped", 0.2)
    time.sleep(0.4)
    lapsed = seat(reg)
    assert lapsed.counts_failed("stopped", stalled) and lapsed.failed == {"stopped"}
    reg.mark_alive("forged", 30)
    key = reg.keys.of(schema.ALIVE, "forged")
    genuine = ("string", reg.client.get(key))
    for how in corruptions(schema.ALIVE):  # every value and Redis type the hostile suite writes
        corrupt(reg.client, key, schema.ALIVE, how, genuine)
        assert not seat(reg).counts_failed("forged", stalled), how
    down = Registry(s.replace(redis_url="redis://127.0.0.1:1/0", redis_timeout=0.5))
    assert not seat(down).counts_failed("stopped", stalled)
    reg.close()
    down.close()


def test_a_parent_whose_handshake_timed_out_once_is_asked_again_not_its_parent(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seat's parent that times out once in the handshake (a fleet released together
    on busy CPUs) is asked again before any seat further up, and counts failed only at
    its second timeout: a grandparent asked instead sends to three children, over its
    one model's worth. The seat's load state is a stand-in (no transfer runs)."""
    reg = Registry(Settings(redis_url=redis_url, namespace=namespace))
    ids, seat = _cohort(reg, 8, 7)
    rx = Receiving(step_sources=StepSources([]))
    a = SimpleNamespace(rx=rx, log=structlog.get_logger(), found=SimpleNamespace(candidates=[]),
                        replica=lambda: SimpleNamespace(speaks=lambda m: True))
    fill = SimpleNamespace(a=a, worker=SimpleNamespace(settings=reg.settings, metrics=Metrics()))
    trees = rounds._Trees.__new__(rounds._Trees)
    trees.fill, trees.seat, trees.fed_by, trees.timeouts, trees.stalled = fill, seat, None, {}, set()
    trees.bound, trees.stall = Budget.of(30).phase("relay"), 3.0
    asked: list[str] = []

    def pull(tree: int, source: Source, *rest: Any) -> None:
        asked.append(source.id)
        raise HandshakeTimeoutError(f"handshake with {source.id} timed out in state R1 WAIT_ACK")

    monkeypatch.setattr(trees, "_pull", pull)
    tree = 7 % topology.TREES  # interior there: its parent never moves
    assert seat.tree_path(tree, 64)[1] != topology.SOURCE  # a grandparent seat to go to
    for _ in range(rounds.HANDSHAKE_TRIES):
        path = seat.tree_path(tree, 64)
        parent = seat.tree_upstreams(tree, path)[0]
        trees._from_member(tree, parent[1], lambda t: None, threading.Event())
    assert asked == [ids[path[0]]] * rounds.HANDSHAKE_TRIES, asked
    assert seat.failed == {ids[path[0]]} and isinstance(rx.relay_error, HandshakeTimeoutError)
    assert seat.tree_upstreams(tree, seat.tree_path(tree, 64))[0][0] == path[1]  # now further up
    reg.close()


def _seats(redis_url: str, namespace: str, n: int, t0: float) -> list[str]:
    """The worker ids in the cohort's seat order, once ``n`` are seated."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    members: list[str] = []
    while len(members) < n and time.monotonic() - t0 < 30:
        chains = [k for k in client.scan_iter(f"{{{namespace}}}:cohort:*") if client.type(k) == "list"]
        # The longest: a holder that loaded from another may have seated a cohort too.
        members = max((client.lrange(k, 0, -1) for k in chains), key=len, default=[])
        time.sleep(0.05)
    assert len(members) == n, members
    return [records.member(json.loads(m)).member_id for m in members]


def _release(fleet: Fleet, n: int, settings: dict[str, Any],
             fault: str | None = None) -> tuple[dict[str, Any], Any]:
    go = CTX.Event()
    procs = {f"m{i}": fleet.start(f"m{i}", settings=settings, go=go, serve_for=30, fault=fault)
             for i in range(n)}
    fleet.wait_ready(n)  # every member built its skeleton and waits for go
    go.set()
    return procs, time.monotonic()


@pytest.mark.timeout(150)
def test_a_cohort_in_trees_receives_its_halves_from_two_upstreams(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str
) -> None:
    """Five members released together behind one capped holder: every one verified and
    bit-identical from peers, none reads storage, and each takes its two parts from at
    least two sources, one its parent in the tree where it is interior (the holder for
    the first seat)."""
    fleet = Fleet(slow_ckpt, redis_url, namespace, cache_dir)
    try:
        fleet.start("holder", settings={"max_send_gbps": 0.0004})
        _ok(fleet.report())
        _, t0 = _release(fleet, 5, TREES | {"max_send_gbps": 0.0008})
        order = _seats(redis_url, namespace, 5, t0)
        reports = {r["role"]: r for r in (fleet.report(timeout=60) for _ in range(5))}
        for r in reports.values():
            _ok(r)
            assert r["source"] == "peer" and r["storage_bytes"] == 0, r
        for p in range(5):
            got = set(reports[_role(order[p])]["peer_id"].split(","))
            # Its parent in the tree where it is interior never changes (the holder for
            # seat 0); in the other (a leaf) it may have moved while the cohort grew.
            parent = topology.seat_upstreams(p, 5, p % topology.TREES)[0]
            assert (order[parent] in got if parent >= 0
                    else any(g.startswith("holder-") for g in got)), (p, got)
            assert len(got) >= 2 and order[p] not in got, (p, got)
    finally:
        fleet.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("how", "extra", "resume"), [
    (signal.SIGKILL, {}, False), (signal.SIGSTOP, {}, False),
    (signal.SIGSTOP, {"claim_ttl": 1.5}, False), (signal.SIGSTOP, {}, True),
], ids=["killed", "stalled", "stalled_mark_lapsed", "stalled_then_resumed"])
def test_a_member_killed_mid_transfer_its_children_reattach_and_verify(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str, how: signal.Signals,
    extra: dict[str, Any], resume: bool,
) -> None:
    """Six members in trees; SIGKILL (or SIGSTOP: silent, as a partition looks) seat 1,
    the second tree's root, once data moves: every other member ends verified and
    bit-identical from peers, none reads storage, each within its deadline. Its liveness
    mark lapsed before the stall bound, or it resumed (SIGCONT) while the seats below
    ask it once more: the same, and a resumed one ends verified too (from any source: it
    was stopped past the stall bound, which bounds its own upstream link as well)."""
    fleet = Fleet(slow_ckpt, redis_url, namespace, cache_dir)
    victim: Any = None
    try:
        fleet.start("holder", settings={"max_send_gbps": 0.0004})
        _ok(fleet.report())
        procs, t0 = _release(fleet, 6, TREES | {"max_send_gbps": 0.0008} | extra)
        order = _seats(redis_url, namespace, 6, t0)
        role = _role(order[1])
        victim = procs[role]
        time.sleep(0.8)  # the trees are flowing
        os.kill(victim.pid, how)
        if resume:
            time.sleep(TREES["stall_timeout"] + 0.3)  # its children stalled and ask again
            os.kill(victim.pid, signal.SIGCONT)
        reports = {r["role"]: r for r in (fleet.report(timeout=60) for _ in range(6 if resume else 5))}
        assert (role in reports) is resume
        for r in reports.values():
            _ok(r)
            if r["role"] != role:  # said in full (a busy run saw m5 read storage, reason cut)
                assert r["source"] == "peer" and r["storage_bytes"] == 0, json.dumps(r, default=str)
            assert r["load_seconds"] < 2 * TREES["transfer_timeout"], json.dumps(r, default=str)
        assert time.monotonic() - t0 < 60
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)
        fleet.close()


@pytest.mark.timeout(150)
def test_a_late_arrival_joins_the_trees_in_flight(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str
) -> None:
    """Four members released together, a fifth released once they are a third of the way
    through (within the cohort window): it takes the next seat, under members still
    receiving, and every one ends verified and bit-identical from peers, none reading
    storage; the late one takes both halves from members, not the holder."""
    fleet = Fleet(slow_ckpt, redis_url, namespace, cache_dir)
    try:
        fleet.start("holder", settings={"max_send_gbps": 0.0004})
        _ok(fleet.report())
        late_go = CTX.Event()
        fleet.start("late", settings=TREES | {"max_send_gbps": 0.0008}, go=late_go, serve_for=30)
        fleet.wait_ready(1)  # its ready signal is not one of the four _release waits for
        _, t0 = _release(fleet, 4, TREES | {"max_send_gbps": 0.0008})
        _seats(redis_url, namespace, 4, t0)
        time.sleep(0.7)  # about a third of the model has moved
        late_go.set()
        order = _seats(redis_url, namespace, 5, t0)
        assert _role(order[4]) == "late"
        reports = {r["role"]: r for r in (fleet.report(timeout=60) for _ in range(5))}
        for r in reports.values():
            _ok(r)
            assert r["source"] == "peer" and r["storage_bytes"] == 0, r
        got = reports["late"]["peer_id"].split(",")
        assert not any(g.startswith("holder-") for g in got) and len(got) >= 2, got
    finally:
        fleet.close()


def _role(member_id: str) -> str:
    """The role of the worker whose relay endpoint ``member_id`` is (member ids start
    with the worker id, the fleet's role)."""
    return member_id.split("-", 1)[0]


@pytest.mark.timeout(150)
def test_junk_pushed_onto_a_cohort_in_trees_is_built_over_and_skipped(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str
) -> None:
    """An outsider pushes 60 junk records onto the cohort's seat list while five members
    receive in the trees (its size, and so the trees, grow under them; leaves move to
    junk seats): junk is never asked, and every member ends verified and bit-identical
    from peers without reading storage."""
    fleet = Fleet(slow_ckpt, redis_url, namespace, cache_dir)
    try:
        fleet.start("holder", settings={"max_send_gbps": 0.0004})
        _ok(fleet.report())
        _, t0 = _release(fleet, 5, TREES | {"max_send_gbps": 0.0008})
        _seats(redis_url, namespace, 5, t0)
        client = redis.Redis.from_url(redis_url)
        chain = next(k for k in client.scan_iter(f"{{{namespace}}}:cohort:*") if client.type(k) == b"list")
        client.rpush(chain, *([b"\xff junk", b'{"member_id": 5}', b"[]"] * 20))
        for r in (fleet.report(timeout=60) for _ in range(5)):
            _ok(r)
            assert r["source"] == "peer" and r["storage_bytes"] == 0, r
    finally:
        fleet.close()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("seat", "verify", "holders"), [
    (1, "sampled", 1), (1, "full", 2), (2, "full", 1), (2, "sampled", 2),
], ids=["root-sampled-1holder", "root-full-2holders", "other-tree-full-1holder",
        "other-tree-sampled-2holders"])
def test_a_member_garbling_what_it_forwards_is_the_only_one_blamed(
    slow_ckpt: str, redis_url: str, namespace: str, cache_dir: str, seat: int, verify: str,
    holders: int,
) -> None:
    """Six members in trees behind honest holders, secret set; the member at ``seat``
    (1: the second tree's root; 2: interior in the first tree) flips every byte it
    forwards while its own copy stays exact. Every member ends verified and
    bit-identical from peers, none reads storage, and no receiver blames a holder or an
    honest member: only the garbling one. Not a member that forwarded its bytes before
    its own check caught them either: that check's verdict says it failed (the
    garbler's own passes). A failing layer whose bytes both parts carried is put on the
    part that alone sent another."""
    fleet = Fleet(slow_ckpt, redis_url, namespace, cache_dir)
    fleet.settings.update(verify=verify, secret="a-fleet-secret-for-the-trees-0123")
    try:
        for h in range(holders):
            fleet.start(f"holder{h}", settings={"max_send_gbps": 0.0004})
            _ok(fleet.report())
        _, t0 = _release(fleet, 6, TREES | {"max_send_gbps": 0.0008},
                         fault=f"corrupt_relay_seat={seat}")
        order = _seats(redis_url, namespace, 6, t0)
        reports = {r["role"]: r for r in (fleet.report(timeout=90) for _ in range(6))}
        garbler = order[seat]
        summary = {_role(m): (reports[_role(m)].get("source"), reports[_role(m)].get("blamed"))
                   for m in order}
        for r in reports.values():
            _ok(r)
            assert r["source"] == "peer" and r["storage_bytes"] == 0, (garbler, summary)
            assert set(r["blamed"]) <= {garbler}, (garbler, summary)
        assert any(garbler in r["blamed"] for r in reports.values()), summary  # it was caught
    finally:
        fleet.close()
