"""A receiver with several idle holders pulls one part of the steps from each at once
(``holder_parts``), verifies once, and a holder that dies mid-part costs its part,
not the load: real holder processes over gloo, the receiver in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_blame import _blamed, _cohorts_closed, _events, _exact, _holder, _wait
from test_service import MODEL, Fleet, _ok

from nccl_back.config import Settings
from nccl_back.coord.registry import Registry
from nccl_back.coord.store import TTL_SLACK
from nccl_back.errors import ConfigError
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec

import workers
from models import TinyTransformer, fill_random, write_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return str(write_checkpoint(fill_random(TinyTransformer(**MODEL), seed=7), tmp_path / "ckpt"))


def _two_holders(fleet: Fleet, reg: Registry, version: str, fault: str | None = None) -> tuple[str, str]:
    """Holder ``a`` (from storage), then ``b`` (from ``a``; ``fault`` in its sends), both
    serving with their cohort windows closed: the peer ids."""
    fleet.start("a", serve_for=120)
    _ok(fleet.report())
    fleet.start("b", serve_for=120, fault=fault)
    _ok(fleet.report())
    a = _wait("holder a", lambda: _holder(reg, version, "a"))
    b = _wait("holder b", lambda: _holder(reg, version, "b"))
    _cohorts_closed(fleet.settings["redis_url"], fleet.settings["namespace"])
    return a.peer_id, b.peer_id


@pytest.mark.timeout(180)
def test_a_receiver_fills_from_two_idle_holders_one_part_each(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """With two idle holders, the load pulls part 0 from one and part 1 from the other
    at once, each step once, and verifies every byte: both holders named as its peer."""
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    fleet.settings.update(verify="full", peer_ttl=30.0)
    settings = workers.settings_for(**fleet.settings)
    reg = Registry(settings)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    try:
        a, b = _two_holders(fleet, reg, spec.version)
        model = workers.make_model(MODEL)
        with _events(caplog) as events, WeightService(settings, worker_id="receiver") as svc:
            result = svc.load(model, spec)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and _exact(model, ckpt)
        assert set(result.peer_id.split(",")) == {a, b}
        assert {"transfer.p0", "transfer.p1"} <= set(result.timings), result.timings
        assert [e["peers"] for e in events if e.get("event") == "holder_parts"] == [
            result.peer_id.split(",")]
    finally:
        fleet.close()


@pytest.mark.timeout(180)
def test_a_holder_killed_mid_part_costs_its_part_and_the_other_holder_finishes(
    ckpt: str, redis_url: str, namespace: str, cache_dir: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A holder SIGKILLed a few steps into its part fails only that part: the load goes
    on from the surviving holder at the first step it lacks, verified, byte-exact, no
    storage read, the dead holder logged as failed."""
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    fleet.settings.update(verify="full", peer_ttl=30.0)
    settings = workers.settings_for(**fleet.settings)
    reg = Registry(settings)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    try:
        a, b = _two_holders(fleet, reg, spec.version, fault="kill_mid_send")
        model = workers.make_model(MODEL)
        with _events(caplog) as events, WeightService(settings, worker_id="receiver") as svc:
            result = svc.load(model, spec)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and _exact(model, ckpt)
        assert result.peer_id == a
        assert [e["peers"] for e in events if e.get("event") == "holder_parts"] != []
        assert {e["peer"] for e in events if e.get("event") == "peer_attempt_failed"} == {b}
    finally:
        fleet.close()


#: Three layers: the cut between two parts falls inside layer 1 (with the fleet's bucket).
CUT_MODEL = {"n_layers": 3, "d": 64}


def _good_and_damaged(tmp_path: Path, redis_url: str, namespace: str, cache_dir: str,
                      first: str) -> tuple[Fleet, Settings, ModelSpec, str, str, str]:
    """Holder ``a`` (good) and ``b`` (corrupts the first step of every send), two send
    slots each, one of the other's taken so that ``first`` is asked first (least
    claimed first) and sends part 0."""
    ckpt = str(write_checkpoint(fill_random(TinyTransformer(**CUT_MODEL), seed=7), tmp_path / "ckpt"))
    fleet = Fleet(ckpt, redis_url, namespace, cache_dir)
    fleet.settings.update(verify="full", peer_ttl=30.0, max_concurrent_sends=2)
    settings = workers.settings_for(**fleet.settings)
    reg = Registry(settings)
    spec = ModelSpec.from_dir(ckpt, cache_dir=cache_dir)
    fleet.start("a", serve_for=120, model_kwargs=CUT_MODEL)
    _ok(fleet.report())
    fleet.start("b", serve_for=120, fault="corrupt_send", model_kwargs=CUT_MODEL)
    _ok(fleet.report())
    a = _wait("holder a", lambda: _holder(reg, spec.version, "a"))
    b = _wait("holder b", lambda: _holder(reg, spec.version, "b"))
    later = b if first == "a" else a
    # As long as a claim may be kept without being taken over: the load is well inside it.
    ttl = settings.claim_ttl * TTL_SLACK
    assert reg.claim(later.peer_id, "test-holdout", later.max_sends, ttl) is not None
    _cohorts_closed(redis_url, namespace)
    return fleet, settings, spec, ckpt, a.peer_id, b.peer_id


def _load(settings: Settings, spec: ModelSpec, ckpt: str, caplog: pytest.LogCaptureFixture,
          ) -> tuple[Any, list[dict[str, Any]], float, bool]:
    """Load in this process: the result, the events, verification failures, exactness."""
    model = workers.make_model(CUT_MODEL)
    with _events(caplog) as events, WeightService(settings, worker_id="receiver") as svc:
        result = svc.load(model, spec)
        failures = float(svc.metrics.verification_failures._value.get())
    return result, events, failures, _exact(model, ckpt)


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
        result, events, failures, exact = _load(settings, spec, ckpt, caplog)
        assert result.source == "peer", result.fallback_reason
        assert result.verified and exact
        assert result.peer_id == a
        assert [e["peers"] for e in events if e.get("event") == "holder_parts"] == [[b, a]]
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
        result, events, failures, exact = _load(settings, spec, ckpt, caplog)
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
