"""A receiver with several idle holders pulls one part of the steps from each at once
(``holder_parts``), verifies once, and a holder that dies mid-part costs its part,
not the load: real holder processes over gloo, the receiver in this process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from test_blame import _blamed, _cohorts_closed, _events, _exact, _failures, _holder, _wait
from test_service import MODEL, Fleet, _ok

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.coord.signed_store import TTL_SLACK
from nccl_back.errors import ConfigError
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec

import workers
from models import TinyTransformer, fill_random, write_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return str(write_checkpoint(fill_random(TinyTransformer(**MODEL), seed=7), tmp_path / "ckpt"))


def _fleet(ckpt: str, redis_url: str, namespace: str, cache_dir: str, **overrides: Any,
           ) -> tuple[Fleet, Settings, Registry, ModelSpec]:
    """A fleet verifying everything (and its settings, registry and spec), without
    cohorts: a lone receiver's load in parts runs (a seat in the trees spreads over
    holders per tree, tested below)."""
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    fleet.settings.update({"verify": "full", "peer_ttl": 30.0, "cohort_max_size": 1, **overrides})
    settings = workers.settings_for(**fleet.settings)
    return fleet, settings, Registry(settings), ModelSpec.from_dir(ckpt, cache_dir=cache_dir)


def _holders(fleet: Fleet, reg: Registry, version: str, faults: dict[str, str | None],
             model_kwargs: dict[str, Any] = MODEL) -> list[str]:
    """One holder per role in ``faults``, started one after another (the first from
    storage, each next one from those before; its fault in its sends), all serving
    with their cohort windows closed: the peer ids, in that order."""
    for role, fault in faults.items():
        fleet.start(role, serve_for=120, fault=fault, model_kwargs=model_kwargs)
        _ok(fleet.report())
    ids = [_wait(f"holder {role}", lambda role=role: _holder(reg, version, role)).peer_id
           for role in faults]
    _cohorts_closed(fleet.settings["redis_url"], fleet.settings["namespace"])
    return ids


def _load(settings: Settings, spec: ModelSpec, ckpt: str, caplog: pytest.LogCaptureFixture,
          model_kwargs: dict[str, Any] = MODEL) -> tuple[Any, list[dict[str, Any]], float, bool]:
    """Load in this process: the result, the events, verification failures, exactness."""
    model = workers.make_model(model_kwargs)
    with _events(caplog) as events, WeightService(settings, worker_id="receiver") as svc:
        result = svc.load(model, spec)
        failures = _failures(svc)
    return result, events, failures, _exact(model, ckpt)


def _close(fleet: Fleet) -> None:
    """Stop the fleet, a SIGSTOPped holder (which never sees the stop event) killed."""
    for p in fleet.procs:
        if p.is_alive() and p.pid is not None:
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    os.kill(p.pid, signal.SIGKILL)
    fleet.close()


def _parts_of(events: list[dict[str, Any]]) -> list[list[str]]:
    return [e["peers"] for e in events if e.get("event") == "holder_parts"]


def _failed(events: list[dict[str, Any]]) -> set[str]:
    return {e["peer"] for e in events if e.get("event") == "peer_attempt_failed"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cohort_max_size", [1, 0], ids=["no_cohort", "trees"])
def test_a_receiver_fills_from_two_idle_holders_one_part_each(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, caplog: pytest.LogCaptureFixture,
    cohort_max_size: int,
) -> None:
    """With two idle holders, the load pulls part 0 from one and part 1 from the other
    at once, each step once, and verifies every byte: both holders named as its peer (a
    receiver without cohorts as a load in parts; a lone seat in the trees, each tree's
    part from its own holder)."""
    fleet, settings, reg, spec = _fleet(ckpt, redis_url, namespace, cache_dir,
                                        cohort_max_size=cohort_max_size)
    try:
        a, b = _holders(fleet, reg, spec.version, {"a": None, "b": None})
        result, events, _, exact = _load(settings, spec, ckpt, caplog)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and exact
        assert set(result.peer_id.split(",")) == {a, b}
        if cohort_max_size == 1:
            assert {"transfer.p0", "transfer.p1"} <= set(result.timings), result.timings
        assert _parts_of(events) == ([result.peer_id.split(",")] if cohort_max_size == 1 else [])
    finally:
        _close(fleet)


@pytest.mark.timeout(180)
def test_three_idle_holders_each_send_one_third(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """holder_parts=3 with three idle holders: three parts at once, verified and
    byte-exact, all three named as the load's peer."""
    fleet, settings, reg, spec = _fleet(ckpt, redis_url, namespace, cache_dir, holder_parts=3)
    try:
        ids = _holders(fleet, reg, spec.version, {"a": None, "b": None, "c": None})
        result, events, _, exact = _load(settings, spec, ckpt, caplog)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and exact
        assert sorted(result.peer_id.split(",")) == sorted(ids)
        assert {"transfer.p0", "transfer.p1", "transfer.p2"} <= set(result.timings), result.timings
        assert len(_parts_of(events)) == 1
    finally:
        _close(fleet)


@pytest.mark.timeout(180)
def test_a_holder_killed_mid_part_costs_its_part_and_the_other_holder_finishes(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A holder SIGKILLed a few steps into its part fails only that part: the load goes
    on from the surviving holder at the first step it lacks, verified, byte-exact, no
    storage read, the dead holder logged as failed."""
    fleet, settings, reg, spec = _fleet(ckpt, redis_url, namespace, cache_dir)
    try:
        a, b = _holders(fleet, reg, spec.version, {"a": None, "b": "kill_mid_send"})
        result, events, _, exact = _load(settings, spec, ckpt, caplog)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and exact
        assert result.peer_id == a
        assert _parts_of(events) != []
        assert _failed(events) == {b}
    finally:
        _close(fleet)


#: The stall bound of the stopped-holder test, and what the load must stay under.
STALL = 3.0
WELL_BEFORE = 25.0


@pytest.mark.timeout(180)
def test_a_holder_stopped_mid_part_costs_the_stall_bound_and_the_other_holder_finishes(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A holder SIGSTOPped a few steps into its part (no reset: a dead node or a
    partition) fails that part at the stall bound, not the transfer deadline: the
    other holder sends that part's remainder (not its own part again), verified and
    byte-exact, the stopped one logged as stalled."""
    fleet, settings, reg, spec = _fleet(ckpt, redis_url, namespace, cache_dir,
                                        stall_timeout=STALL, transfer_timeout=100.0)
    try:
        a, b = _holders(fleet, reg, spec.version, {"a": None, "b": "stop_mid_send"})
        t0 = time.monotonic()
        result, events, _, exact = _load(settings, spec, ckpt, caplog)
        took = time.monotonic() - t0
        assert result.source == "peer", result.fallback_reason
        assert result.verified and exact
        assert result.peer_id == a
        assert _parts_of(events) != []
        # Both parts' transfers, and no whole-model pull from the first step lacking.
        assert {k for k in result.timings if k.startswith("transfer")} == {"transfer.p0", "transfer.p1"}
        stalled = [e for e in events if e.get("event") == "peer_attempt_failed"]
        assert [e["peer"] for e in stalled] == [b]
        assert "stalled" in stalled[0]["error"], stalled[0]
        assert STALL <= took < WELL_BEFORE, took
    finally:
        _close(fleet)


#: Three layers: the cut between two parts falls inside layer 1 (with the fleet's bucket).
CUT_MODEL = {"n_layers": 3, "d": 64}


def _good_and_damaged(tmp_path: Path, redis_url: str, namespace: str, cache_dir: str,
                      first: str) -> tuple[Fleet, Settings, ModelSpec, str, str, str]:
    """Holder ``a`` (good) and ``b`` (corrupts the first step of every send), two send
    slots each, one of the other's taken so that ``first`` is asked first (least
    claimed first) and sends part 0."""
    ckpt = str(write_checkpoint(fill_random(TinyTransformer(**CUT_MODEL), seed=7), tmp_path / "ckpt"))
    fleet, settings, reg, spec = _fleet(ckpt, redis_url, namespace, cache_dir, max_concurrent_sends=2)
    a, b = _holders(fleet, reg, spec.version, {"a": None, "b": "corrupt_send"}, CUT_MODEL)
    # As long as a claim may be kept without being taken over: the load is well inside it.
    ttl = settings.claim_ttl * TTL_SLACK
    assert reg.claim(b if first == "a" else a, "test-holdout", 2, ttl) is not None
    return fleet, settings, spec, ckpt, a, b


@pytest.mark.timeout(180)
def test_a_holder_whose_part_fails_verification_is_blamed_alone(
    tmp_path: Path, redis_url: str, namespace: str, cache_dir: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The damaged holder sends part 0, whose first step is a layer no other step
    carries: it alone is blamed (one verification failure), everything it sent is
    discarded, and the good holder sends the rest: verified, byte-exact."""
    fleet, settings, spec, ckpt, a, b = _good_and_damaged(tmp_path, redis_url, namespace, cache_dir, "b")
    try:
        result, events, failures, exact = _load(settings, spec, ckpt, caplog, CUT_MODEL)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and exact
        assert result.peer_id == a
        assert _parts_of(events) == [[b, a]]
        assert _blamed(events) == {b}
        assert failures == 1
    finally:
        fleet.close()


@pytest.mark.timeout(180)
def test_a_damaged_layer_at_the_cut_blames_neither_holder_and_one_holder_then_serves(
    tmp_path: Path, redis_url: str, namespace: str, cache_dir: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The damaged holder sends part 1, whose first step is inside the layer the cut
    splits between the two holders: the failure cannot be placed, so neither is
    blamed; the load starts over from one holder and ends verified and byte-exact."""
    fleet, settings, spec, ckpt, a, b = _good_and_damaged(tmp_path, redis_url, namespace, cache_dir, "a")
    try:
        result, events, failures, exact = _load(settings, spec, ckpt, caplog, CUT_MODEL)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and exact
        assert result.peer_id == a
        unplaced = [e for e in events if e.get("event") == "holder_parts_unplaced"]
        assert [e["peers"] for e in unplaced] == [sorted([a, b])]
        assert _blamed(events) == set()
        assert failures == 1
    finally:
        fleet.close()


@pytest.mark.parametrize("value", [0, 5, True, 2.0])
def test_holder_parts_outside_one_to_four_is_refused(value: object) -> None:
    """holder_parts takes an integer from 1 to 4; anything else names the value and the range."""
    with pytest.raises(ConfigError, match=rf"holder_parts={value!r}: must be an integer from 1"):
        Settings(holder_parts=value)  # type: ignore[arg-type]
