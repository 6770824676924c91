"""A cooperative first download with real processes: workers that start together for a
version nobody holds split its download (each reads its share from storage), the
elected worker gathers the parts, proves every file and streams the whole; every worker
ends with the checkpoint's exact bytes, verified. A member lost costs its part's read,
spread over the others, not the download."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from groups import CTX
from test_service import Fleet, _ok

from models import TinyTransformer, fill_random, write_checkpoint

#: Large enough for several steps per part at the fleet's 16 KiB bucket.
MODEL = {"n_layers": 4, "d": 64}
#: A download group's window of 1 s (a tenth of the cohort's), a sender's handshake of 3 s
#: (a tenth of the receiver's).
# A download group's window is a tenth of cohort_window: 3 s, so three workers released
# together join one roster even when the machine is busy (at 1 s, one beside a CI run and
# two CPU burners missed it, and the test saw a roster of two).
COOPERATIVE = {"cohort_window": 30.0, "peer_ttl": 3.0, "redis_timeout": 3.0,
               "handshake_timeout": 30.0, "single_flight_max_wait": 90.0,  # single_flight_wait 50 s
               "stall_timeout": 5.0}


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return str(write_checkpoint(fill_random(TinyTransformer(**MODEL), seed=7), tmp_path / "ckpt",
                                n_shards=2))


@pytest.fixture
def fleet(ckpt: str, redis_url: str, namespace: str, cache_dir: str) -> Any:
    f = Fleet(ckpt, redis_url, namespace, cache_dir)
    yield f
    f.close()


def _checkpoint_bytes(ckpt: str) -> int:
    return sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))


def _start_together(fleet: Fleet, n: int, **kwargs: Any) -> list[Any]:
    go = CTX.Event()
    procs = [fleet.start(f"w{i}", settings=COOPERATIVE, go=go, serve_for=30, model_kwargs=MODEL, **kwargs)
             for i in range(n)]
    fleet.wait_ready(n)  # every worker built its skeleton and waits for go
    go.set()
    return procs


@pytest.mark.timeout(180)
def test_three_workers_split_the_first_download_and_all_hold_the_verified_checkpoint(
        fleet: Fleet, ckpt: str) -> None:
    """Three workers started together: one elected, two members reading their shares;
    the elected worker read about a third of the checkpoint from storage, every worker
    holds its exact bytes, verified."""
    _start_together(fleet, 3)
    reports = [_ok(fleet.report(120)) for _ in range(3)]
    sources = sorted(r["source"] for r in reports)
    assert sources == ["peer", "peer", "storage"], reports
    elected = next(r for r in reports if r["source"] == "storage")
    members = [r for r in reports if r["source"] == "peer"]
    # Every member read its share (its timings say how long).
    assert all("share" in r["timings"] for r in members), members
    # The elected worker read its own share plus the bytes no tensor holds: not the whole.
    assert elected["bytes"] < 0.6 * _checkpoint_bytes(ckpt), elected
    # Storage read the checkpoint once in all (each member's header read aside), and
    # each worker says what it read and what it received.
    read = sum(r["storage_bytes"] for r in reports)
    assert _checkpoint_bytes(ckpt) <= read < 1.05 * _checkpoint_bytes(ckpt), reports
    assert all(0 < m["storage_bytes"] < 0.5 * _checkpoint_bytes(ckpt) for m in members), members
    assert all(m["peer_bytes"] == m["bytes"] for m in members), members
    assert 0.5 * _checkpoint_bytes(ckpt) < elected["peer_bytes"] < 0.8 * _checkpoint_bytes(ckpt), elected


@pytest.mark.timeout(180)
def test_a_member_killed_before_it_serves_costs_its_share_not_the_download(
        fleet: Fleet, ckpt: str) -> None:
    """One member SIGKILLed as it reads its share: its part is spread over the other
    two (the elected worker and the member left), and both still end verified."""
    procs = _start_together(fleet, 3, fault="kill_member_1_on_share")
    reports = []
    deadline = time.monotonic() + 150
    while len(reports) < 2 and time.monotonic() < deadline:
        r = fleet.report(max(deadline - time.monotonic(), 1))
        reports.append(r)
    assert len(reports) == 2, reports
    for r in reports:
        _ok(r)
    assert sum(1 for p in procs if p.exitcode == -signal.SIGKILL) == 1, [p.exitcode for p in procs]
    assert os.path.exists(ckpt)


@pytest.mark.timeout(180)
def test_a_member_serving_a_wrong_byte_is_blamed_and_its_share_read_again(fleet: Fleet) -> None:
    """Member 1 serves one altered byte of its part: the elected worker's proof fails on
    that file, blames member 1, reads its share of the file again, and every worker
    (member 1 too, from the stream) ends with the checkpoint's exact bytes, verified."""
    _start_together(fleet, 3, fault="corrupt_member_1_share")
    reports = [_ok(fleet.report(120)) for _ in range(3)]
    assert sorted(r["source"] for r in reports) == ["peer", "peer", "storage"], reports


@pytest.mark.timeout(180)
def test_a_share_slower_to_read_than_the_stall_bound_still_serves_its_part(
        fleet: Fleet, ckpt: str) -> None:
    """Member 1 reads its share at 1 s a step, longer in all than the elected
    worker's stall bound (3 s) and its announcement's TTL (``claim_ttl`` 1.8 s, renewed
    while it serves): each step goes out as it lands, so the pull keeps moving, nobody
    reads member 1's share again, and all three end verified."""
    go = CTX.Event()
    slow = {**COOPERATIVE, "stall_timeout": 2.0, "download_lease": 3.0}
    for i in range(3):
        fleet.start(f"w{i}", settings=slow,
                    go=go, serve_for=30, model_kwargs=MODEL, fault="slow_member_1_share")
    fleet.wait_ready(3)
    go.set()
    reports = [_ok(fleet.report(150)) for _ in range(3)]
    assert sorted(r["source"] for r in reports) == ["peer", "peer", "storage"], reports
    member_1 = next(r for r in reports if r["source"] == "peer" and r["timings"]["share"] > 3.0)
    elected = next(r for r in reports if r["source"] == "storage")
    assert elected["bytes"] < 0.6 * _checkpoint_bytes(ckpt), (elected, member_1)


@pytest.mark.timeout(180)
def test_a_late_arrival_is_no_member_and_receives_the_whole(fleet: Fleet, ckpt: str) -> None:
    """A worker arriving after the roster was named is not a member (it reads nothing
    from storage) and receives the whole from the fan-out, verified like the others."""
    _start_together(fleet, 2)
    client = redis.Redis.from_url(fleet.settings["redis_url"])
    deadline = time.monotonic() + 30
    while not any(client.scan_iter(f"{{{fleet.settings['namespace']}}}:dlr:*")):  # the roster is named
        assert time.monotonic() < deadline, "no roster named in 30 s"
        time.sleep(0.05)
    fleet.start("late", settings=COOPERATIVE, serve_for=30, model_kwargs=MODEL)
    reports = [_ok(fleet.report(120)) for _ in range(3)]
    late = next(r for r in reports if r["role"] == "late")
    assert late["source"] == "peer" and "share" not in late["timings"], late
    assert sorted(r["source"] for r in reports) == ["peer", "peer", "storage"], reports


@pytest.mark.timeout(180)
def test_members_with_different_send_caps_all_end_verified(fleet: Fleet) -> None:
    """One member's link capped at 1 MB/s, the others' not: the elected worker waits for
    the slow part (it makes progress, so no stall bound fires) and nobody falls back."""
    go = CTX.Event()
    for i, cap in enumerate((0.0, 0.001, 0.0)):
        fleet.start(f"w{i}", settings={**COOPERATIVE, "max_send_gbps": cap}, go=go, serve_for=30,
                    model_kwargs=MODEL)
    fleet.wait_ready(3)
    go.set()
    reports = [_ok(fleet.report(120)) for _ in range(3)]
    assert sorted(r["source"] for r in reports) == ["peer", "peer", "storage"], reports


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["kill_member_1_mid_share", "stop_member_1_mid_share",
                                   "kill_member_1_before_announce", "stop_member_1_before_announce"])
def test_a_member_lost_costs_its_share_not_the_download(fleet: Fleet, ckpt: str, fault: str) -> None:
    """Member 1 SIGKILLed, or SIGSTOPped (silent, as a partition looks), at the third
    step of its part's send or as it is named (before it announces where it serves):
    the elected worker's pull fails (reset) or its announcement lapses, and its part is
    spread over the two left: each reads half of it (member 2 after its own share) and
    both end verified; the survivors read the checkpoint once in all."""
    procs = _start_together(fleet, 3, fault=fault)
    reports = [_ok(fleet.report(150)) for _ in range(2)]
    assert sorted(r["source"] for r in reports) == ["peer", "storage"], reports
    elected, member = (next(r for r in reports if r["source"] == s) for s in ("storage", "peer"))
    # Each its own third and half of member 1's (the elected worker also the bytes
    # between tensors), not the elected worker the whole of member 1's.
    whole = _checkpoint_bytes(ckpt)
    assert 0.4 * whole < elected["bytes"] < 0.62 * whole, elected
    assert 0.4 * whole < member["storage_bytes"] < 0.62 * whole, member
    assert whole <= elected["bytes"] + member["storage_bytes"] < 1.1 * whole, reports
    lost = [p for p in procs if p.pid not in {r["pid"] for r in reports}]
    assert len(lost) == 1, [p.exitcode for p in procs]
    if fault.startswith("kill"):
        lost[0].join(5)
        assert lost[0].exitcode == -signal.SIGKILL
    else:  # stopped, not merely slower to report
        assert Path(f"/proc/{lost[0].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["kill_member_1_on_request", "stop_member_1_on_request"])
def test_a_member_lost_before_it_answers_is_given_up_on_within_its_announcements_ttl(
        fleet: Fleet, ckpt: str, fault: str) -> None:
    """Member 1 SIGKILLed or SIGSTOPped as the elected worker's request for its part
    arrives (the handshake never answered): its announcement lapses, so its part is
    spread over the other two after ``claim_ttl`` (3 s), not after the elected worker's
    handshake timeout (40 s here), and both end verified."""
    fleet.settings.update(peer_ttl=5.0, handshake_timeout=40.0)  # claim_ttl 3 s
    procs = _start_together(fleet, 3, fault=fault)
    reports = [_ok(fleet.report(150)) for _ in range(2)]
    assert sorted(r["source"] for r in reports) == ["peer", "storage"], reports
    elected = next(r for r in reports if r["source"] == "storage")
    # Said in full when it fails (a run beside the soak once saw the elected worker read
    # only its own third, in 1.4 s: not yet explained).
    seen = [{k: r.get(k) for k in ("role", "source", "bytes", "load_seconds", "peer_id", "timings")}
            for r in reports] + [p.exitcode for p in procs]
    assert 0.4 * _checkpoint_bytes(ckpt) < elected["bytes"] < 0.62 * _checkpoint_bytes(ckpt), seen
    assert all(r["load_seconds"] < 25 for r in reports), seen
    assert len([p for p in procs if p.pid not in {r["pid"] for r in reports}]) == 1, seen


@pytest.mark.timeout(240)
def test_the_elected_worker_killed_during_the_gather_a_member_takes_over(
        fleet: Fleet, ckpt: str, tmp_path: Path) -> None:
    """The elected worker SIGKILLed as it starts to gather: once its lease expires a
    member takes it over with the same split (its own part held, the dead worker's share
    read, the other member's part pulled from its endpoint), so storage reads the
    checkpoint about once in all, not twice, and both survivors end with the
    checkpoint's exact bytes, verified."""
    fleet.settings["download_lease"] = 1.5
    procs = _start_together(fleet, 3, fault=f"kill_first_elected_in_gather={tmp_path / 'killed'}")
    reports = [_ok(fleet.report(150)) for _ in range(2)]
    assert sorted(r["source"] for r in reports) == ["peer", "storage"], reports
    lost = [p for p in procs if p.pid not in {r["pid"] for r in reports}]
    assert len(lost) == 1, [p.exitcode for p in procs]
    lost[0].join(5)
    assert lost[0].exitcode == -signal.SIGKILL
    # Taken over within the lease and the window, not after a dead member's stall bound.
    assert all(r["load_seconds"] < COOPERATIVE["stall_timeout"] + 8 for r in reports), reports
    # Each survivor's share, plus the dead worker's share read by the new owner.
    assert sum(r["storage_bytes"] for r in reports) < 1.1 * _checkpoint_bytes(ckpt), reports
    owner = next(r for r in reports if r["source"] == "storage")
    assert 0.2 * _checkpoint_bytes(ckpt) < owner["peer_bytes"] < 0.5 * _checkpoint_bytes(ckpt), owner
