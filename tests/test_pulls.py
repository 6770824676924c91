"""Pulls into one rank's tensors from several sources (``load/pulls.py``): every pull is
waited for, the first failure is the one named, and only ``abort`` stops the others; a
watched pull's source looked at soon, then ever less often. The one loop of rounds over
them (``load/fill.py`` ``Rounds``): what each outcome of a round's pulls and check costs.

The pulls here are plain functions and the transports stand-ins that record an abort:
what is under test is the coordination, which never touches data.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from nccl_back.errors import (
    NoPeerError,
    PeerError,
    RegistryError,
    TransferError,
    WeightVerificationError,
)
from nccl_back.load.fill import Rounds
from nccl_back.load.pulls import Pull, Pulls, watched
from nccl_back.timing import WATCH_FIRST

WAIT = 10.0


class Recorder:
    """A transport stand-in: records that it was aborted."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()


def test_the_pull_that_failed_first_is_named_though_another_fails_later() -> None:
    """Pull 1 fails at once, pull 0 after it: ``first`` is 1, and both errors come back."""
    failed = threading.Event()

    def late(started: Callable[[Any], None]) -> None:
        assert failed.wait(WAIT)
        raise TransferError("late: the abort's echo")

    def early(started: Callable[[Any], None]) -> None:
        failed.set()
        raise TransferError("early: the cause")

    pulls = Pulls(abort=True)
    errors = pulls.run([late, early], "test-pull")
    assert pulls.first == 1
    assert [str(e) for e in errors] == ["late: the abort's echo", "early: the cause"]


def test_abort_reaches_a_running_pull_and_one_that_starts_after_the_failure() -> None:
    """With ``abort``, the first failure aborts the transport of a pull under way, and a
    pull whose transport starts afterwards is aborted as it starts."""
    running, later = Recorder(), Recorder()
    failed = threading.Event()

    def under_way(started: Callable[[Any], None]) -> None:
        started(running)
        assert running.aborted.wait(WAIT)
        raise TransferError("aborted at its next step")

    def starts_late(started: Callable[[Any], None]) -> None:
        assert failed.wait(WAIT)
        time.sleep(0.05)  # the failure is recorded before this transport starts
        started(later)
        assert later.aborted.is_set()
        raise TransferError("aborted as it started")

    def fails(started: Callable[[Any], None]) -> None:
        time.sleep(0.05)  # the others are under way
        failed.set()
        raise TransferError("the cause")

    pulls = Pulls(abort=True)
    errors = pulls.run([under_way, starts_late, fails], "test-pull")
    assert pulls.first == 2
    assert str(errors[2]) == "the cause"
    assert running.aborted.is_set() and later.aborted.is_set()


def test_without_abort_the_other_pulls_finish_and_are_waited_for() -> None:
    """Without ``abort`` a failure touches no other transport, and :meth:`run` returns
    only once every pull has ended."""
    transport = Recorder()
    finished = threading.Event()

    def slow(started: Callable[[Any], None]) -> None:
        started(transport)
        time.sleep(0.3)
        finished.set()

    def fails(started: Callable[[Any], None]) -> None:
        raise TransferError("the cause")

    pulls = Pulls(abort=False)
    errors = pulls.run([fails, slow], "test-pull")
    assert finished.is_set()
    assert pulls.first == 0 and errors[1] is None
    assert not transport.aborted.is_set()


def test_an_error_that_is_not_a_transfer_error_comes_back_too() -> None:
    """Whatever a pull raises is handed back, not raised on a pool thread and lost."""

    def broken(started: Callable[[Any], None]) -> None:
        raise ValueError("a bug")

    pulls = Pulls(abort=True)
    errors = pulls.run([lambda started: None, broken], "test-pull")
    assert errors[0] is None
    with pytest.raises(ValueError, match="a bug"):
        raise errors[1]  # type: ignore[misc]


def test_a_watch_looks_soon_after_the_pull_starts_then_ever_less_often() -> None:
    """``watched(first=...)`` asks ``lost`` after ``first``, then at twice the wait before
    up to ``poll``: a source lost right away (a forming cohort's leaf parent) is found
    within tens of ms, not after a whole poll; once found, the pull's transport is aborted."""
    looks: list[float] = []
    began = time.monotonic()

    def lost() -> bool:
        looks.append(time.monotonic() - began)
        return len(looks) == 5

    transport = Recorder()
    with watched(lost, 2.0, "test-watch", first=WATCH_FIRST) as (gone, on_start):
        on_start(transport)  # type: ignore[arg-type]
        assert gone.wait(WAIT)
    assert transport.aborted.is_set()
    assert WATCH_FIRST <= looks[0] < 1.0  # the first look, well before one poll
    gaps = [b - a for a, b in zip(looks, looks[1:], strict=False)]
    # 0.04, 0.08, 0.16, 0.32: each gap at least twice the first wait.
    assert all(g >= 2 * WATCH_FIRST for g in gaps) and gaps[-1] >= 8 * WATCH_FIRST


# ---------------------------------------------------------------- the loop of rounds


def _ok(started: Callable[[Any], None]) -> None:
    """A pull that lands."""


class Toy(Rounds):
    """A kind of source whose rounds and checks are given: it records what the loop asks of it."""

    def __init__(self, rounds: list[list[Pull]], checks: list[BaseException | None],
                 abort: bool = False) -> None:
        self.rounds, self.checks, self.abort = iter(rounds), iter(checks), abort
        self.calls: list[tuple[Any, ...]] = []

    def round(self, held: Any) -> list[Pull] | None:
        return next(self.rounds, None)

    def landed(self, errors: list[PeerError | RegistryError | None]) -> bool:
        self.calls.append(("landed", [None if e is None else str(e) for e in errors], self.first))
        return all(e is None for e in errors)

    def verify(self) -> WeightVerificationError | None:
        check = next(self.checks)
        if isinstance(check, (PeerError, RegistryError)):
            raise check
        assert check is None or isinstance(check, WeightVerificationError)
        return check

    def untrue(self, e: PeerError) -> None:
        self.calls.append(("untrue", str(e)))

    def blamed(self, bad: WeightVerificationError) -> None:
        self.calls.append(("blamed", str(bad)))

    def lost(self, e: RegistryError) -> None:
        self.calls.append(("lost", str(e)))


def test_a_missing_truth_and_a_failed_check_each_cost_a_round_until_one_verifies() -> None:
    """A truth that never came (a peer's error from the check) goes to ``untrue``, a failed
    check to ``blamed``; each time the next round is asked, and a check that passes ends
    the loop with True."""
    toy = Toy([[_ok], [_ok], [_ok]], [NoPeerError("no truth"), WeightVerificationError("bad layer"), None])
    assert toy.run() is True
    assert toy.calls == [("landed", [None], None), ("untrue", "no truth"),
                         ("landed", [None], None), ("blamed", "bad layer"),
                         ("landed", [None], None)]


def test_redis_trouble_in_the_check_ends_the_rounds() -> None:
    """Redis's trouble during a check goes to ``lost`` and ends the loop with False: the
    next round is never asked."""
    toy = Toy([[_ok], [_ok]], [RegistryError("redis down")])
    assert toy.run() is False
    assert toy.calls == [("landed", [None], None), ("lost", "redis down")]
    assert next(toy.rounds, None) is not None  # the second round was left


def test_a_part_that_failed_skips_the_check_and_no_round_left_ends_the_loop() -> None:
    """A round whose part failed is not checked (``landed`` said so); with no round left
    the loop ends with False."""
    def fails(started: Callable[[Any], None]) -> None:
        raise TransferError("reset")

    toy = Toy([[_ok, fails]], [])
    assert toy.run() is False
    assert toy.calls == [("landed", [None, "reset"], 1)]


def test_an_abort_kind_sees_the_first_failure_and_the_others_aborted() -> None:
    """A kind that aborts (a reshard): the part that failed first is ``first``, and the
    transport of the part under way was aborted."""
    running = Recorder()

    def under_way(started: Callable[[Any], None]) -> None:
        started(running)
        assert running.aborted.wait(WAIT)
        raise TransferError("aborted")

    def fails(started: Callable[[Any], None]) -> None:
        time.sleep(0.05)  # the other is under way
        raise TransferError("the cause")

    toy = Toy([[under_way, fails]], [], abort=True)
    assert toy.run() is False
    assert toy.calls == [("landed", ["aborted", "the cause"], 1)]
    assert running.aborted.is_set()


def test_an_error_that_is_not_a_sources_is_raised_once_every_part_ended() -> None:
    """A part's error that is neither a peer's nor Redis's (a bug, a storage read here) is
    raised, after the other parts of the round ended (they write this rank's tensors)."""
    ended = threading.Event()

    def slow(started: Callable[[Any], None]) -> None:
        time.sleep(0.1)
        ended.set()

    def broken(started: Callable[[Any], None]) -> None:
        raise ValueError("a bug")

    toy = Toy([[slow, broken]], [])
    with pytest.raises(ValueError, match="a bug"):
        toy.run()
    assert ended.is_set() and toy.calls == []
