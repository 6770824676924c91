"""Blame after a failed verification: only the sources
that sent the failing steps are blamed, what they sent is discarded and sent again by
another, a member whose bytes failed forwards none of them, stopped relay endpoints
release the model, and every peer attempt of a load shares one budget.

The classes, not single examples: every fill history and set of failing layers
(hypothesis) for the bookkeeping; every point of failure for a relay endpoint; a
damaged holder that corrupts its first or its last step, with and without cohorts.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_service import MODEL, Fleet, _ok

from nccl_back.config import Settings
from nccl_back.coord import records, schema
from nccl_back.coord.handshake import run_receiver
from nccl_back.coord.registry import Registry
from nccl_back.errors import NoPeerError, TransferError, TransferTimeoutError
from nccl_back.load.service import WeightService
from nccl_back.log import get_logger
from nccl_back.model import integrity
from nccl_back.model.identity import ModelSpec
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import named_tensors
from nccl_back.transport import open_rendezvous, plan
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.relay import Member, Progress, RelayServer, StepSources

import workers
from models import TinyTransformer, fill_random, write_checkpoint

# -- the bookkeeping, over every history --------------------------------------------------

_LAYERS = [f"blocks.{i}" for i in range(6)] + ["embed", "head"]


@st.composite
def _histories(draw: Any) -> tuple[list[Any], list[str | None], set[str]]:
    """A plan over random tensors, a fill history (each transfer resumes where the
    previous one stopped and reaches some step), and a set of failing layers."""
    n = draw(st.integers(1, 12))
    tensors = {
        f"{draw(st.sampled_from(_LAYERS))}.w{i}": torch.empty(draw(st.integers(0, 300)),
                                                              dtype=torch.uint8)
        for i in range(n)
    }
    steps = plan(tensors, draw(st.sampled_from([16, 64, 256, 1024])))
    owners: list[str | None] = [None] * len(steps)
    done = 0
    for source in draw(st.lists(st.sampled_from("ABCD"), max_size=5)):
        upto = draw(st.integers(done, len(steps)))
        for k in range(draw(st.integers(0, done)), upto):  # a resume may step back
            owners[k] = source
        done = max(done, upto)
    bad = set(draw(st.sets(st.sampled_from(_LAYERS + ["elsewhere"]))))
    return steps, owners, bad


@settings(max_examples=300, deadline=None)
@given(_histories())
def test_blame_names_only_the_senders_of_failing_bytes_and_discards_all_they_sent(
    case: tuple[list[Any], list[str | None], set[str]],
) -> None:
    """For any fill history and failing layers: a source is guilty iff it alone sent the
    held bytes of some failing layer; the senders of a failing layer with no guilty
    sender are suspects, not blamed (all held sources guilty when no step carries a
    failing layer); a check that implicates a suspect again makes it guilty. After
    discard no implicated source's step is held, everything before its first step still
    is, and the resume point is that first step."""
    steps, owners, bad = case
    held = StepSources(steps)
    for k, src in enumerate(owners):
        if src is not None:
            held.record(k, src)
    expect_done = next((k for k, src in enumerate(owners) if src is None), len(owners))
    assert held.done == expect_done
    senders: dict[str, set[str]] = {}
    for step, src in zip(steps, owners, strict=True):
        for slot in step.slots if src is not None else ():
            if integrity.layer_of(slot.name) in bad:
                senders.setdefault(integrity.layer_of(slot.name), set()).add(src)
    everyone = {src for src in owners if src is not None}
    alone = {next(iter(s)) for s in senders.values() if len(s) == 1}
    blame = held.blame(bad, integrity.layer_of)
    assert blame.guilty == (alone if senders else everyone)
    assert blame.suspects == {src for s in senders.values() if not s & alone for src in s}
    again = held.blame(bad, integrity.layer_of)  # the same failure once more
    assert again.guilty == blame.guilty | blame.suspects and not again.suspects
    kept = held.discard(blame.sources)
    first = next((k for k, src in enumerate(owners) if src in blame.sources), len(owners))
    assert kept == held.done == min(first, expect_done)
    assert not held.sources() & blame.sources
    assert held.sources() == {src for src in owners[:first] if src is not None}


def test_a_blamed_member_whose_own_check_failed_is_only_a_suspect(redis_url: str, namespace: str) -> None:
    """A member blamed alone for a failing layer whose signed verdict says its own check
    failed (it forwarded the wrong bytes it was sent) is a suspect, and guilty if
    implicated again; one whose verdict passed, none, a forged one (unsigned, or another
    member's copied to its key) or one over the bound stays guilty."""
    reg = Registry(Settings(redis_url=redis_url, namespace=namespace, secret="s" * 32))
    try:
        reg.put_verdict("forwarder", False, ttl=30)
        reg.put_verdict("garbler", True, ttl=30)
        reg.client.set(reg.keys.of(schema.VERDICT, "unsigned"),
                       json.dumps({"member_id": "unsigned", "ok": False}))
        reg.client.set(reg.keys.of(schema.VERDICT, "copied"),
                       reg.client.get(reg.keys.of(schema.VERDICT, "forwarder")))
        reg.client.set(reg.keys.of(schema.VERDICT, "huge"), b"x" * (64 << 10))
        members = ["forwarder", "garbler", "absent", "unsigned", "copied", "huge"]
        said = reg.verdicts(members)
        assert said == {"forwarder": False, "garbler": True}
        failed = {m for m, ok in said.items() if not ok}
        # One layer per member, all sent by it alone and all failing: each is guilty.
        steps = plan({f"blocks.{i}.w": torch.empty(64, dtype=torch.uint8) for i in range(len(members))}, 64)
        held = StepSources(steps)
        for k, step in enumerate(steps):
            held.record(k, members[int(step.slots[0].name.split(".")[1])])
        bad = {f"blocks.{i}" for i in range(len(members))}
        blame = held.forwarded(held.blame(bad, integrity.layer_of), failed)
        assert blame.guilty == set(members) - {"forwarder"} and blame.suspects == {"forwarder"}
        again = held.forwarded(held.blame(bad, integrity.layer_of), failed)
        assert again.guilty == set(members) and not again.suspects
    finally:
        reg.close()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=10), st.one_of(st.none(), st.integers(0, 10)))
def test_progress_forwards_nothing_once_failed(advances: list[int], fail_at: int | None) -> None:
    """wait_for(k) returns iff the member has not given up and holds step k (steps land in
    any order; done is their leading run); once it gave up, every step raises, those it
    holds included (they may be what failed)."""
    progress = Progress()  # deadline 0.0 below is long past on the monotonic clock
    for i, k in enumerate(advances):
        if fail_at == i:
            progress.fail("verification failed")
        progress.advance(k)
    failed = fail_at is not None and fail_at < len(advances)
    if fail_at is not None and not failed:
        progress.fail("verification failed")
        failed = True
    held = set(advances)
    done = next(k for k in range(len(held) + 1) if k not in held)
    assert progress.done == done
    for k in range(max(advances, default=0) + 2):
        if failed:
            with pytest.raises(TransferError, match="gave up.*verification failed"):
                progress.wait_for(k, 0.0)
        elif k in held:
            progress.wait_for(k, 0.0)
        else:
            with pytest.raises(TransferTimeoutError, match=f"step {k} not received"):
                progress.wait_for(k, 0.0)


# -- a relay endpoint whose member gave up ---------------------------------------------------


def _relay_settings(redis_url: str, namespace: str, **kw: Any) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, transport="gloo",
                    advertise_host="127.0.0.1", **kw)


def _tensors() -> dict[str, torch.Tensor]:
    return dict(named_tensors(fill_random(TinyTransformer(**MODEL), seed=3))[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("held", ["none", "first", "half", "all"])
def test_endpoint_of_a_member_that_gave_up_refuses_every_request(
    redis_url: str, namespace: str, held: str
) -> None:
    """Whatever the member holds (no step, the first, half, all of them), once its
    progress failed (its verification failed) its lingering endpoint refuses each request
    at once, naming why, instead of forwarding what it holds."""
    settings = _relay_settings(redis_url, namespace)
    reg = Registry(settings)
    rdv = open_rendezvous(settings, "gloo", registry=reg, device=torch.device("cpu"))
    tensors = _tensors()
    steps = len(plan(tensors, settings.bucket_for("gloo", sum(t.nbytes for t in tensors.values()))))
    progress = Progress()
    upto = {"none": 0, "first": 1, "half": steps // 2, "all": steps}[held]
    if upto:
        progress.advance(upto - 1)
    member = Member(f"gaveup-r0-relay-{held}", rdv.address, "gloo", "cpu")
    server = RelayServer(settings, reg, rdv, member, tensors, "ab" * 16, Pacer(0.0), progress,
                         get_logger("test")).start()
    server.end(False, "verification failed: 1 mismatching [blocks.0]")
    try:
        for i in range(2):  # a first requester, then a re-attaching one
            tid = f"t-{held}-{i}"
            request = {"transfer_id": tid, "receiver": "r", "version": "v1",
                       "manifest_digest": "ab" * 16, "transport": "gloo", "device": "cpu",
                       "start": 0}
            with pytest.raises(NoPeerError, match="gave up: verification failed"):
                run_receiver(reg, tid, "ab" * 16, 20.0,
                             after_ready=lambda r=request: reg.push_request(member.member_id, r))
        assert server.served == 0
    finally:
        server.close(5.0)
        rdv.close()


def _storages(tensors: dict[str, torch.Tensor]) -> list[weakref.ref[Any]]:
    return [weakref.ref(t.untyped_storage()) for t in tensors.values()]


def _wait_freed(refs: list[weakref.ref[Any]], seconds: float) -> int:
    """Collect until every storage in ``refs`` is freed or ``seconds`` pass; how many live."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        alive = sum(r() is not None for r in refs)
        if alive == 0 or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["lingered", "closed"])
def test_stopped_relay_endpoint_releases_the_tensors_it_served(
    redis_url: str, namespace: str, how: str
) -> None:
    """A relay endpoint that stopped (its linger ran out, or it was closed) holds no
    reference to the tensors it served: once the caller drops them they are freed."""
    settings = _relay_settings(redis_url, namespace, cohort_window=0.2)
    reg = Registry(settings)
    rdv = open_rendezvous(settings, "gloo", registry=reg, device=torch.device("cpu"))
    tensors = _tensors()
    refs = _storages(tensors)
    progress = Progress()
    member = Member(f"done-r0-relay-{how}", rdv.address, "gloo", "cpu")
    server = RelayServer(settings, reg, rdv, member, tensors, "ab" * 16, Pacer(0.0), progress,
                         get_logger("test")).start()
    del tensors
    try:
        server.end(True)
        if how == "closed":
            server.close(10.0)
        deadline = time.monotonic() + 30
        while server.alive:
            assert time.monotonic() < deadline, "the endpoint never stopped"
            time.sleep(0.05)
        assert _wait_freed(refs, 10.0) == 0
    finally:
        server.close(5.0)
        rdv.close()


# -- real processes: a damaged holder and a good one ------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return str(write_checkpoint(fill_random(TinyTransformer(**MODEL), seed=7), tmp_path / "ckpt"))


def _exact(model: Any, ckpt: str) -> bool:
    """Every tensor byte-identical to the checkpoint's."""
    expected: dict[str, torch.Tensor] = {}
    for f in sorted(p for p in os.listdir(ckpt) if p.endswith(".safetensors")):
        expected.update(load_file(os.path.join(ckpt, f)))
    tensors, _ = named_tensors(model)
    return set(tensors) == set(expected) and all(
        t.contiguous().view(torch.uint8).numpy().tobytes()
        == expected[n].contiguous().view(torch.uint8).numpy().tobytes()
        for n, t in tensors.items())


def _wait(what: str, cond: Callable[[], Any], seconds: float = 60) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _cohorts_closed(redis_url: str, namespace: str) -> None:
    """Wait until no cohort window is open (the holders' own cohorts), so the next
    receiver starts a cohort of its own instead of sitting behind a holder's endpoint."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    _wait("the cohort windows to close", lambda: not [
        k for k in client.scan_iter(f"{{{namespace}}}:cohort:*") if client.type(k) == "hash"])


def _holder(reg: Registry, version: str, role: str) -> Any:
    peers = reg.find_peers(version, 0, 1)
    return next((p for p in peers if p.peer_id.startswith(role + "-")), None)


@contextlib.contextmanager
def _events(caplog: pytest.LogCaptureFixture) -> Iterator[list[dict[str, Any]]]:
    """The service's structured events while the block runs."""
    out: list[dict[str, Any]] = []
    with caplog.at_level(logging.INFO, logger="nccl_back"):
        yield out
    out.extend(r.nccl_back for r in caplog.records if hasattr(r, "nccl_back"))


def _blamed(events: list[dict[str, Any]]) -> set[str]:
    return {e["peer"] for e in events
            if e.get("event") in ("peer_attempt_failed", "relay_upstream_failed")
            and e.get("reason") == "verification_failed"}


def _failures(svc: WeightService) -> float:
    return float(svc.metrics.verification_failures._value.get())


def _damaged_and_good(fleet: Fleet, fault: str, reg: Registry, version: str) -> tuple[Any, Any]:
    """A good holder (from storage), then a damaged one (its sends corrupt ``fault``'s
    step); one send slot of the good one is taken, so every receiver asks the damaged
    one first (least claimed first)."""
    fleet.start("good", serve_for=120)
    _ok(fleet.report())
    fleet.start("bad", fault=fault, serve_for=120)
    _ok(fleet.report())
    good = _wait("the good holder", lambda: _holder(reg, version, "good"))
    bad = _wait("the damaged holder", lambda: _holder(reg, version, "bad"))
    assert reg.claim(good.peer_id, "test-holdout", good.max_sends, 120.0) is not None
    _cohorts_closed(fleet.settings["redis_url"], fleet.settings["namespace"])
    return good, bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cohort", [16, 1], ids=["cohorts", "no-cohorts"])
@pytest.mark.parametrize("fault", ["corrupt_send", "corrupt_send_last"], ids=["first-step", "last-step"])
def test_damaged_holder_is_blamed_and_the_good_one_serves(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, fault: str, cohort: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A holder that corrupts its first (or last) step is tried first and fails
    verification; the receiver discards its bytes, then loads every step again from
    the good holder: verified, byte-exact, only the damaged holder blamed (log and one
    verification failure counted), the good one never."""
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    # Nobody dies here: a peer_ttl that a starved heartbeat cannot outlive, so the
    # damaged holder is still listed when the receiver looks (at 3 s it lapsed once
    # under load and the receiver went straight to the good one, blaming nobody).
    fleet.settings.update(verify="full", max_concurrent_sends=2, peer_ttl=30.0)
    # One holder at a time (parts from several: tests/test_holder_parts.py).
    settings = workers.settings_for(**fleet.settings, cohort_max_size=cohort, holder_parts=1)
    reg = Registry(settings)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    try:
        good, bad = _damaged_and_good(fleet, fault, reg, spec.version)
        model = workers.make_model(MODEL)
        with _events(caplog) as events, WeightService(settings, worker_id="receiver") as svc:
            result = svc.load(model, spec)
            failures = _failures(svc)
        assert result.source == "peer", result.fallback_reason
        assert result.peer_id == good.peer_id
        assert result.verified and _exact(model, ckpt)
        assert _blamed(events) == {bad.peer_id}, events
        assert failures == 1
    finally:
        fleet.close()


@pytest.mark.timeout(240)
def test_member_whose_bytes_failed_forwards_none_of_them(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Cohort head m0 receives from the damaged holder while m1 sits behind it: m0's
    verification fails, it forwards nothing more (its endpoint refuses), and both end
    verified and byte-exact from the good holder; the good holder is never blamed and
    m1 never ends with m0's bytes."""
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    # The damaged holder sends slowly (~2 s for the model): m1 joins while m0 receives.
    fleet.settings.update(verify="full", max_concurrent_sends=2, cohort_window=30.0)
    settings = workers.settings_for(**fleet.settings)
    reg = Registry(settings)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    # The holders keep the default 2 s window: a 30 s one held the good holder's download
    # 3 s (its group window) and kept both holders' arrival counters, which
    # _cohorts_closed waits out, for 30 s. Only m0 and m1 need the long window.
    holders = {"cohort_window": 2.0}
    try:
        fleet.start("good", serve_for=120, settings=holders)
        _ok(fleet.report())
        fleet.start("bad", fault="corrupt_send", serve_for=120,
                    settings={**holders, "max_send_gbps": 0.0004})
        _ok(fleet.report())
        good = _wait("the good holder", lambda: _holder(reg, spec.version, "good"))
        bad = _wait("the damaged holder", lambda: _holder(reg, spec.version, "bad"))
        assert reg.claim(good.peer_id, "test-holdout", good.max_sends, 120.0) is not None
        _cohorts_closed(redis_url, namespace)
        fleet.start("m0", serve_for=60)

        def seat() -> str | None:
            for k in client.scan_iter(f"{{{namespace}}}:cohort:*"):
                if client.type(k) == "list":
                    first = records.member(json.loads(client.lindex(k, 0))).member_id
                    if first.startswith("m0-"):
                        return first
            return None

        m0 = _wait("m0's seat", seat)
        model = workers.make_model(MODEL)
        with _events(caplog) as events, WeightService(settings, worker_id="m1") as svc:
            result = svc.load(model, spec)
        r0 = _ok(fleet.report())
        assert r0["source"] == "peer" and r0["peer_id"] == good.peer_id, r0
        assert result.source == "peer", result.fallback_reason
        assert result.verified and _exact(model, ckpt)
        assert result.peer_id not in (m0, bad.peer_id)
        assert good.peer_id not in _blamed(events), events
        assert _blamed(events) <= {m0, bad.peer_id}, events
    finally:
        fleet.close()


# -- the model is held once after a load --------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("endpoint", ["relay", "stream"])
def test_service_endpoints_release_the_model_once_they_stop(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, endpoint: str,
) -> None:
    """After a load through a relay endpoint (a peer load in a cohort) or a stream
    endpoint (an elected download), re-pointing the model's tensors elsewhere (as a
    hand-off into its arena does) frees the old ones once the endpoints stopped, while
    the service stays open and serves: one copy, not two."""
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    settings = workers.settings_for(**fleet.settings, cohort_window=0.3)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    try:
        if endpoint == "relay":
            fleet.start("holder", serve_for=120)
            _ok(fleet.report())
        model = workers.make_model(MODEL)
        with WeightService(settings, worker_id="sidecar") as svc:
            result = svc.load(model, spec)
            assert result.source == ("peer" if endpoint == "relay" else "storage")
            refs = _storages(named_tensors(model)[0])
            with torch.no_grad():
                for p in [*model.parameters(), *model.buffers()]:
                    p.data = p.data.clone()  # the "arena": the model now lives here
            assert _wait_freed(refs, 30.0) == 0
            assert svc.peers  # still serving, from the new tensors
    finally:
        fleet.close()


# -- one budget for every peer attempt of a load -------------------------------------------------


@pytest.mark.timeout(120)
def test_relay_upstreams_and_holders_share_one_peer_budget(
    redis_url: str, namespace: str, cache_dir: str, tmp_path: Path,
) -> None:
    """Three fake cohort members ahead of the receiver and three fake holders, all of
    which answer the handshake and then stall: the relay attempts and the holder
    attempts together cost at most peer_budget (plus one attempt's unwinding), not a
    deadline each."""
    import threading

    from test_attacks import Tarpit, _fake_peer, _spec_and_model

    from nccl_back.coord import handshake
    from nccl_back.model.skeleton import manifest

    ckpt = str(write_checkpoint(fill_random(TinyTransformer(), seed=11), tmp_path / "ckpt"))
    settings = Settings(redis_url=redis_url, namespace=namespace, advertise_host="127.0.0.1",
                        cache_dir=cache_dir, peer_ttl=3.0, transfer_timeout=60.0,
                        handshake_timeout=3.0, cohort_window=30.0).capped(
        single_flight_wait=20.0, busy_wait=5.0, peer_budget=3.0)
    spec, model = _spec_and_model(ckpt, settings)
    digest = manifest(model).digest
    attacker, tarpit, stop = Registry(settings), Tarpit(), threading.Event()
    ids = [_fake_peer(attacker, spec, model, f"stall-{i}", tarpit.address).peer_id for i in range(3)]
    attacker.put_ground_truth(spec.version, 0, 1, digest, SCHEME, {"sampled|x": "0" * 32})
    for i in range(3):
        member = Member(f"fake-r0-relay-{i}", tarpit.address, "gloo", "cpu")
        attacker.join_cohort(spec.version, 0, 1, digest, member.to_dict(), window=30.0,
                             max_size=16, ttl=60.0)
        ids.append(member.member_id)

    def answer(peer_id: str) -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                request = attacker.pop_request(peer_id, timeout=0.2)
                if request is not None:
                    handshake.run_sender(attacker, request["transfer_id"], digest, 2.0)

    threads = [threading.Thread(target=answer, args=(i,), daemon=True) for i in ids]
    for t in threads:
        t.start()
    try:
        with WeightService(settings, worker_id="receiver") as svc:
            start = time.monotonic()
            result = svc.load(model, spec)
            peer_phase = result.timings.get("peer", time.monotonic() - start)
        assert result.source == "storage"
        assert result.fallback_reason is not None
        assert "peer_budget" in result.fallback_reason, result.fallback_reason
        grace = 5.0  # Transport.join_grace of gloo: one aborted attempt unwinding
        assert peer_phase < 3.0 + grace + 1.5, result.timings
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        tarpit.close()
