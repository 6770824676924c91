"""A clean close drains: the sends in flight finish within a bound, what remains is
aborted with a notice the receiver sees at once, and workers that close right after
their own load still read storage once (real Redis, real gloo, real processes)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import torch
from groups import CTX
from test_service import MODEL, Fleet, ckpt  # noqa: F401 - ckpt: the fixture
from test_transport import model_tensors, skeleton_like

from nccl_back.config import Settings
from nccl_back.coord import records
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.handshake import run_receiver
from nccl_back.coord.registry import Registry
from nccl_back.errors import TransferError
from nccl_back.load.service import WeightService
from nccl_back.log import get_logger
from nccl_back.model.identity import ModelSpec
from nccl_back.result import LoadResult
from nccl_back.transport import (
    open_rendezvous,
    payload_bytes,
    plan,
    receiver_transport,
    recv_tensors,
    run_guarded,
)
from nccl_back.transport.pacing import Pacer
from nccl_back.transport.relay import Member, Progress, RelayServer
from nccl_back.transport.send import (
    DRAIN_ARRIVAL,
    DRAIN_FLOOR_GBPS,
    DRAIN_GRACE,
    DRAIN_MAX,
    Owed,
    drain,
    drain_bound,
)

import workers


def _settings(redis_url: str, namespace: str, cache_dir: str, **kw: Any) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, cache_dir=cache_dir,
                    advertise_host="127.0.0.1", transport="gloo", bucket_bytes=16384, **kw)


def test_the_drain_bound_is_the_bytes_left_at_the_slower_rate_plus_a_grace_capped() -> None:
    """Bytes left at DRAIN_FLOOR_GBPS (or a lower send cap), plus DRAIN_GRACE, at most DRAIN_MAX."""
    s = Settings()
    assert drain_bound(0, s) == DRAIN_GRACE
    assert drain_bound(10**6, s) == pytest.approx(DRAIN_GRACE + 10**6 / (DRAIN_FLOOR_GBPS * 1e9))
    capped = Settings(max_send_gbps=0.001)  # 1 MB/s
    assert drain_bound(10**6, capped) == pytest.approx(DRAIN_GRACE + 1.0)
    assert drain_bound(10**6, Settings(max_send_gbps=100.0)) == drain_bound(10**6, s)
    assert drain_bound(10**12, s) == DRAIN_MAX


def test_an_owed_receiver_is_awaited_until_it_asked_or_while_it_may_ask_again() -> None:
    """Owed.awaited: one that never asked, within DRAIN_ARRIVAL of the drain's start; one
    whose last send failed (it gave the transfer up), within DRAIN_ARRIVAL of that; one
    served, or one that loaded, not at all (which only those still due are asked)."""
    asked: set[str] = set()
    loaded: set[str] = set()
    owed = Owed(frozenset({"f"}), lambda: set(asked), lambda ws: loaded & ws)
    assert owed.awaited(0.0, {}) and not owed.awaited(DRAIN_ARRIVAL, {})
    asked.add("f")
    assert not owed.awaited(0.0, {})  # its send completed
    now = time.monotonic()
    assert owed.awaited(DRAIN_ARRIVAL + 1, {"f": now})
    assert not owed.awaited(DRAIN_ARRIVAL + 1, {"f": now - DRAIN_ARRIVAL - 0.1})
    loaded.add("f")
    assert not owed.awaited(0.0, {"f": now})
    # Redis is read only for receivers still due, never on a look that ends without them.
    looked: list[frozenset[str]] = []
    quiet = Owed(frozenset({"f", "g"}), lambda: {"f", "g"}, lambda ws: looked.append(ws) or set())
    assert not quiet.awaited(0.0, {}) and not looked
    assert quiet.awaited(DRAIN_ARRIVAL + 1, {"g": now}) and looked == [frozenset({"g"})]


def test_a_drain_with_nothing_in_flight_waits_for_an_owed_receiver_yet_to_ask() -> None:
    """With no send in flight, a drain still waits for an owed receiver that has not asked,
    returning once it loaded; one that never asks nor loads is given up at DRAIN_ARRIVAL."""
    began = time.monotonic()
    owed = Owed(frozenset({"f"}), set, lambda ws: set(ws) if time.monotonic() - began > 0.6 else set())
    assert drain([], Settings(), get_logger("test"), owed) == 0
    assert 0.6 <= time.monotonic() - began < 2.0
    began = time.monotonic()
    assert drain([], Settings(), get_logger("test"), Owed(frozenset({"f"}), set, lambda ws: set())) == 0
    assert DRAIN_ARRIVAL <= time.monotonic() - began < DRAIN_ARRIVAL + 1.0


@pytest.mark.timeout(120)
def test_a_receiver_whose_sender_closes_past_its_drain_bound_moves_on_at_once(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str  # noqa: F811
) -> None:
    """A holder closed while its send has more bytes left than its drain bound allows
    waits out the bound (DRAIN_MAX), then aborts the send: close() returns within the
    bound, and the receiver moves on (to storage) within moments, not after its 30 s
    stall bound; with nothing in flight, the receiver's own close waits for nothing."""
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    # 0.1 MB/s: the 0.83 MB model takes ~8 s to send, past DRAIN_MAX.
    holder = WeightService(_settings(redis_url, namespace, cache_dir, max_send_gbps=0.0001),
                           worker_id="holder")
    receiver = WeightService(_settings(redis_url, namespace, cache_dir, stall_timeout=30.0),
                             worker_id="receiver")
    try:
        assert holder.load(workers.make_model(MODEL), spec).source == "storage"
        got: list[LoadResult | BaseException] = []
        ended: list[float] = []
        model = workers.make_model(MODEL)

        def load() -> None:
            try:
                got.append(receiver.load(model, spec))
            except BaseException as e:  # noqa: BLE001 - reported by the assertions below
                got.append(e)
            ended.append(time.monotonic())

        thread = threading.Thread(target=load)
        thread.start()
        deadline = time.monotonic() + 30
        while not holder.active_sends:
            assert time.monotonic() < deadline and thread.is_alive(), got
            time.sleep(0.01)
        time.sleep(0.5)  # a few steps went out; most of the model is still to send
        t0 = time.monotonic()
        holder.close()
        closed = time.monotonic()
        thread.join(40)
        assert len(got) == 1 and isinstance(got[0], LoadResult), got
        result = got[0]
        assert closed - t0 < DRAIN_MAX + 1.5, closed - t0
        assert result.source == "storage", result
        assert (result.fallback_reason or "").startswith("transfer_error"), result.fallback_reason
        assert workers.matches_checkpoint(model, ckpt)
        # Told at once: its load ended within moments of the abort (a notice read within
        # a second, then a storage load of 0.83 MB), far from its 30 s stall bound.
        assert ended[0] - closed < 4.0, ended[0] - closed
        t1 = time.monotonic()
        receiver.close()  # nothing in flight: no wait
        assert time.monotonic() - t1 < 1.0
    finally:
        holder.close()
        receiver.close()


@pytest.mark.timeout(60)
def test_a_receiver_of_a_relay_endpoint_closed_mid_forward_sees_it_at_once(
    redis_url: str, namespace: str
) -> None:
    """A relay endpoint closed while it forwards steps it does not all hold yet (its own
    upstream is slow) ends that send at once: the receiver's transfer fails within moments,
    not after its 30 s stall bound."""
    settings = Settings(redis_url=redis_url, namespace=namespace, transport="gloo",
                        advertise_host="127.0.0.1")
    reg = Registry(settings)
    want = model_tensors()
    bucket = settings.bucket_for("gloo", payload_bytes(want))
    steps = plan(want, bucket)
    rdv = open_rendezvous(settings, "gloo", device=torch.device("cpu"), registry=reg)
    progress = Progress()
    progress.complete(len(steps) // 2)  # the member holds half: the send waits for the rest
    server = RelayServer(settings, reg, rdv, Member("closing-r0-relay-1", rdv.address, "gloo", "cpu"),
                         want, "ab" * 16, Pacer(0.0), progress, get_logger("test")).start()
    tid = f"t-close-{uuid.uuid4().hex[:8]}"
    request = records.TransferRequest(tid, "r", "v1", "ab" * 16, "gloo", "cpu", start=0)
    seen: list[int] = []
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            run_receiver(reg, tid, "ab" * 16, 5.0,
                         after_ready=lambda: reg.push_request(server.member.member_id, request.to_dict()))
            tr = receiver_transport(settings, "gloo", rdv.address, transfer_scope(settings.key("store"), tid),
                                    device=torch.device("cpu"), registry=reg)
            run_guarded(tr, lambda t: recv_tensors(t, skeleton_like(want), bucket, on_step=seen.append),
                        time.monotonic() + 50, stall=30.0)
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            errors.append(e)
        ended.append(time.monotonic())

    ended: list[float] = []
    receiving = threading.Thread(target=pull)
    try:
        receiving.start()
        deadline = time.monotonic() + 20
        while len(seen) < len(steps) // 2:  # every step the member holds went out
            assert time.monotonic() < deadline and receiving.is_alive(), errors
            time.sleep(0.01)
        time.sleep(0.3)  # the send now waits for a step the member does not hold
        t0 = time.monotonic()
        server.close(2.0)
        receiving.join(40)
        assert len(errors) == 1 and isinstance(errors[0], TransferError), errors
        assert ended[0] - t0 < 3.0, (ended[0] - t0, errors)
    finally:
        server.close(2.0)
        rdv.close()


def _round(ckpt: str, redis_url: str, namespace: str, cache_dir: str) -> list[dict[str, Any]]:  # noqa: F811
    """Three workers with no holder, released together, each closing its service right
    after its own load; their reports."""
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    # 0.4 MB/s links: the 0.83 MB model's stream takes ~2 s, so the elected worker
    # closes with its followers' stream in flight.
    fleet.settings["max_send_gbps"] = 0.0004
    # The sender's side of a handshake is a tenth of this (3 s): a heavily loaded machine
    # stretched the 1 s a 5 s bound gives it past a follower's wait (each then read
    # storage on its own). What is checked is the drain, not the handshake's speed.
    fleet.settings["handshake_timeout"] = 30.0
    try:
        go = CTX.Event()
        for i in range(3):
            fleet.start(f"w{i}", go=go, serve_for=0)
        fleet.wait_ready(3)  # every worker built its skeleton and waits for go
        go.set()
        return [fleet.report(timeout=60) for _ in range(3)]
    finally:
        fleet.close()


@pytest.mark.timeout(240)
def test_workers_closing_right_after_their_own_load_read_storage_once(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str  # noqa: F811
) -> None:
    """Three workers, no holder, each closing its service right after its own load: the
    elected worker drains its followers' stream, so each round reads the checkpoint from
    storage once (a cooperative download's shares add up to one, with their headers) and
    nobody waits out a stall bound (slowest <= 8 s). Two rounds, each a fresh version's
    fleet (benchmarks/close_drain.py runs 12 and more)."""
    size = sum(s.size for s in ModelSpec.from_dir(ckpt, cache_dir=cache_dir).shards)
    for r in range(2):
        reports = _round(ckpt, redis_url, f"{namespace}-{r}", cache_dir)
        for report in reports:
            assert "error" not in report, report.get("traceback")
            assert report["identical"] and report["verified"], report
        reads = sum(report["storage_bytes"] for report in reports) / size
        # Strings, not tuples: pytest cuts a long repr, and the reasons are the evidence.
        why = "\n".join(f'{x["source"]} {x["load_seconds"]:.2f} s: {x["fallback_reason"]}'
                        for x in reports)
        assert reads < 1.05, f"round {r}: storage read {reads:.2f} times\n{why}"
        slowest = max(report["load_seconds"] for report in reports)
        assert slowest <= 8.0, f"round {r}: slowest load {slowest:.2f} s\n{why}"
