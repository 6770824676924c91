"""Relay state: member records, a member's progress, which source sent each step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.errors import (
    TransferError,
    TransferTimeoutError,
)
from nccl_back.log import get_logger
from nccl_back.timing import LINGER as LINGER  # the relay's modules import these from here
from nccl_back.timing import RELAY_HANDSHAKE as RELAY_HANDSHAKE
from nccl_back.timing import STALLED_HANDSHAKE as STALLED_HANDSHAKE
from nccl_back.transport import Step

log = get_logger(__name__)

#: Relay sends one endpoint runs at once unless it says otherwise (one receiver, plus
#: one re-attaching while the first is still unwinding).
MAX_RELAY_SENDS = 2
#: Relay sends a seated member runs at once: its two children where it is interior, a
#: leaf not yet moved out when a new child moved in, and one re-attaching.
TREE_SENDS = 4
#: Relay sends a streamed download serves at once: the heads of the cohorts that formed
#: while it downloads, plus re-attaching members.
STREAM_SENDS = 4
#: Sends a cooperative download member's endpoint runs at once: its own part, and the
#: sub-parts of failed members' parts spread to it.
SHARE_SENDS = 4


@dataclass(frozen=True)
class Place:
    """Where a member sits: its cohort's seat list key and its position (arrival order)."""

    key: str
    position: int


class Progress:
    """Which steps of a member's transfer are in its tensors (thread-safe), in any order
    (two sources fill parts at once); :attr:`done` is the leading run. Relay sends wait
    here for their next step; a member that gives up fails it, ending those sends."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done = 0
        self._ahead: set[int] = set()  # held steps past the leading run (bounded by the plan)
        self._failed: str | None = None

    @property
    def done(self) -> int:
        """Leading steps in place."""
        with self._cond:
            return self._done

    def advance(self, step: int) -> None:
        """Step ``step`` is in place."""
        with self._cond:
            if step >= self._done:
                self._ahead.add(step)
                self._settle()

    def complete(self, steps: int) -> None:
        """Steps ``[0, steps)`` are in place (a whole load, or what an earlier pass left)."""
        with self._cond:
            self._done = max(self._done, steps)
            self._ahead = {k for k in self._ahead if k >= self._done}
            self._settle()

    def _settle(self) -> None:
        """Extend the leading run over held steps and wake the waiters (lock held)."""
        while self._done in self._ahead:
            self._ahead.discard(self._done)
            self._done += 1
        self._cond.notify_all()

    def fail(self, reason: str) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = reason
            self._cond.notify_all()

    @property
    def failed(self) -> str | None:
        """Why the member gave up (its forwarding is over for good), or None."""
        with self._cond:
            return self._failed

    def wait_for(self, step: int, deadline: float) -> None:
        """Return once step ``step`` is in place; raise if the member gave up (not even held
        steps go out: they may be what failed its check) or by ``deadline``."""
        with self._cond:
            while True:
                if self._failed is not None:
                    raise TransferError(f"relay upstream gave up at step {self._done}: {self._failed}")
                if step < self._done or step in self._ahead:
                    return
                left = deadline - _clock.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"relay: step {step} not received by the deadline")
                self._cond.wait(min(left, 0.5))


@dataclass(frozen=True)
class Blame:
    """Whom a failed check implicates (:meth:`StepSources.blame`)."""

    guilty: frozenset[str]
    """Sources that alone sent some failing layer (or were suspected before and are again)."""
    suspects: frozenset[str] = frozenset()
    """Sources of failing layers sent by several, none guilty (the truth is per layer, so
    the check cannot say which): not blamed, but what they sent is discarded, and a
    second implication makes one guilty."""

    @property
    def sources(self) -> frozenset[str]:
        """Every source whose bytes the check implicates (what is discarded)."""
        return self.guilty | self.suspects


class StepSources:
    """Which source put each step of this rank's plan into its tensors (thread-safe).

    When verification fails, the failing layers name their steps and those the sources
    (:meth:`blame`): a layer from one source alone convicts it; one from several is
    explained by a convicted one among them, so an honest source sharing a layer with a
    corrupting one is not blamed. What the implicated sent is discarded and sent again.
    """

    def __init__(self, steps: list[Step]) -> None:
        self._names = [frozenset(slot.name for slot in step.slots) for step in steps]
        self._sources: list[str | None] = [None] * len(steps)
        self._suspected: set[str] = set()
        self._lock = threading.Lock()

    @property
    def done(self) -> int:
        """Leading steps in place (where a transfer resumes)."""
        with self._lock:
            return next((k for k, src in enumerate(self._sources) if src is None),
                        len(self._sources))

    def record(self, step: int, source: str) -> None:
        """``source`` put step ``step`` in place."""
        with self._lock:
            if 0 <= step < len(self._sources):
                self._sources[step] = source

    def lacking(self, steps: list[int]) -> int | None:
        """The first of ``steps`` not held (None: all are)."""
        with self._lock:
            return next((k for k in steps if self._sources[k] is None), None)

    def sources(self) -> set[str]:
        """Every source whose steps are held."""
        with self._lock:
            return {src for src in self._sources if src is not None}

    def blame(self, bad_layers: set[str], layer_of: Callable[[str], str]) -> Blame:
        """Whom the failure of ``bad_layers`` implicates (every held source when no step
        carries one)."""
        with self._lock:
            senders: dict[str, set[str]] = {}
            for names, src in zip(self._names, self._sources, strict=True):
                if src is not None:
                    for layer in {layer_of(n) for n in names} & bad_layers:
                        senders.setdefault(layer, set()).add(src)
            if not senders:
                return Blame(frozenset(src for src in self._sources if src is not None))
            guilty = {next(iter(s)) for s in senders.values() if len(s) == 1}
            unexplained = [s for s in senders.values() if not s & guilty]
            # Implicated once more (paired with another source, or with the same one
            # again): a retry would tell no more, so it counts.
            guilty |= set[str]().union(*unexplained) & self._suspected
            suspects = set[str]().union(*(s for s in unexplained if not s & guilty))
            self._suspected |= suspects
            return Blame(frozenset(guilty), frozenset(suspects))

    def forwarded(self, blame: Blame, forwarders: Collection[str]) -> Blame:
        """``blame`` with its guilty ``forwarders`` (members whose own check failed: they
        forward before checking) made suspects; one suspected before stays guilty, so a
        forged verdict shields a corrupting member for one retry at most."""
        with self._lock:
            moved = (blame.guilty & set(forwarders)) - self._suspected
            self._suspected |= moved
            return Blame(blame.guilty - moved, blame.suspects | moved)

    def discard(self, sources: Collection[str]) -> int:
        """Forget all from the first step any of ``sources`` sent; the steps still held."""
        with self._lock:
            first = next((k for k, src in enumerate(self._sources) if src in sources),
                         len(self._sources))
            for k in range(first, len(self._sources)):
                self._sources[k] = None
        return self.done


class Fills:
    """A storage load's per-tensor fills as relay progress: step k is in place once every
    tensor it carries is (thread-safe; the loader's copy threads call :meth:`filled`)."""

    def __init__(self, steps: list[Step], progress: Progress) -> None:
        self._need = [frozenset(slot.name for slot in step.slots) for step in steps]
        self._filled: set[str] = set()
        self._next = 0
        self._progress = progress
        self._lock = threading.Lock()

    def filled(self, name: str) -> None:
        with self._lock:
            self._filled.add(name)
            while self._next < len(self._need) and self._need[self._next] <= self._filled:
                self._progress.advance(self._next)
                self._next += 1
