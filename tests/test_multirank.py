"""Multi-rank workers: every rank takes the same path, nobody stalls.

Each worker is two separate processes in their own gloo group, started as ``torchrun``
would (tests/groups.py); real Redis, real gloo, nothing patched in the protocol. Rank 0
holds a transformer, rank 1 a VAE (a 2-stage pipeline), so each rank receives its own
sub-module from the matching rank of a peer worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from groups import Groups

import workers
from models import TinyTransformer, fill_random, write_checkpoint


@pytest.fixture
def groups(tmp_path: Path, redis_url: str, namespace: str, cache_dir: str) -> Iterator[Groups]:
    parts = {name: fill_random(TinyTransformer(**kw), seed=i)
             for i, (name, kw) in enumerate(workers.PIPELINE.items())}
    ckpt = str(write_checkpoint(parts, tmp_path / "pipe", n_shards=2))
    g = Groups(ckpt, {"redis_url": redis_url, "namespace": namespace, "cache_dir": cache_dir,
                      "bucket_bytes": 16384})
    yield g
    g.close()


def _ok(r: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in r, (r.get("error"), r.get("traceback"))
    assert r["identical"] and r["verified"], r
    return r


# Which ranks reach load() late (seconds), per worker: together, and the crossed orders
# in which a per-rank election would give worker A rank 0 and worker B rank 1.
ORDERS = [({}, {}), ({1: 0.5}, {0: 0.5}), ({0: 0.5}, {1: 0.5})]


@pytest.mark.timeout(100)
@pytest.mark.parametrize("trial", range(6))
def test_two_workers_starting_together_one_downloads_one_receives(groups: Groups, trial: int) -> None:
    """Two 2-rank workers started together: one downloads, the other receives from it, no stall."""
    late_a, late_b = ORDERS[trial % len(ORDERS)]
    a, b = groups.start(delays=late_a), groups.start(delays=late_b)
    reports = [_ok(r) for r in groups.reports(4, timeout=80)]
    by = groups.by_group(reports)
    sources = {g: [r["source"] for r in rs] for g, rs in by.items()}
    # One source per worker, never split across its ranks; one worker each way.
    assert sorted(sources.values()) == [["peer", "peer"], ["storage", "storage"]], sources
    downloader = next(g for g, s in sources.items() if s[0] == "storage")
    receiver = b if downloader == a else a
    # Each rank of the receiver got its stage from the same rank of the downloader.
    for r in by[receiver]:
        assert r["peer_id"].startswith(f"g{downloader}-{r['rank']}-r{r['rank']}-"), r
    for r in by[downloader]:
        reason = r["fallback_reason"]
        assert "elected to download it" in reason or reason.startswith("consensus: rank"), r
    # Nobody waited out single_flight_wait (300 s) or a gloo timeout: the reports came in
    # within the test's own bound above.


@pytest.mark.timeout(100)
def test_one_rank_raising_mid_protocol_stops_every_rank(groups: Groups) -> None:
    """A non-library error on rank 1 during the peer load: rank 1 raises it, rank 0 a ConsensusError naming rank 1."""
    groups.start()
    seeds = [_ok(r) for r in groups.reports(2)]
    assert [r["source"] for r in seeds] == ["storage", "storage"]
    groups.start(faults={1: "raise_in_verify"})
    r0, r1 = groups.reports(2, timeout=60)
    assert r1["error"] == "RuntimeError: simulated CUDA error while hashing", r1
    assert r0["error"].startswith("ConsensusError: rank 1 of this worker raised an error during peer load"), r0
    assert r0["failed_rank"] == 1
    # Well inside the group's own 60 s collective timeout: nobody waited for a lost rank.
    assert r0["seconds"] < 40, r0


@pytest.mark.timeout(100)
def test_strict_with_a_split_vote_all_ranks_load_from_storage(groups: Groups) -> None:
    """strict=True, rank 0 finds a peer and rank 1 none: the group decides, and all ranks load."""
    groups.start(withdraw=(1,))
    assert all(_ok(r)["source"] == "storage" for r in groups.reports(2))
    groups.start(settings={"strict": True})
    r0, r1 = (_ok(r) for r in groups.reports(2))
    assert (r0["source"], r1["source"]) == ("storage", "storage")
    assert r0["fallback_reason"].startswith("consensus: rank 1 of this worker found no peer"), r0
    assert "elected to download it (single flight)" in r1["fallback_reason"], r1


@pytest.mark.timeout(100)
def test_strict_with_one_rank_failing_every_rank_raises(groups: Groups) -> None:
    """strict=True and rank 1's transfer fails verification: rank 1 raises it, rank 0 raises naming rank 1."""
    groups.settings["verify"] = "full"
    groups.start(faults={1: "corrupt_send"})
    assert all(_ok(r)["source"] == "storage" for r in groups.reports(2))
    groups.start(settings={"strict": True})
    r0, r1 = groups.reports(2)
    assert r1["error"].startswith("WeightVerificationError:"), r1
    assert r0["error"].startswith("ConsensusError: strict: rank 1 of this worker"), r0
    assert r0["failed_rank"] == 1
