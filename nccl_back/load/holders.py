"""The receive pass's one loop over holders (:func:`from_holders`): this rank's tensors
are the plan's parts, its sources the holders in discovery's order, each asked through
:func:`~.asking.transfer` under a claimed send slot, the bytes verified once per round,
blame applied once (:class:`~.fill.Fill`).

A round claims up to ``holder_parts`` idle holders and pulls part ``i`` of ``n`` from
the ``i``-th at once (several senders fill one receiver faster than one does); with one
(``n`` = 1) the part is the whole plan. Only the first round is in several parts, and
only when this rank holds no step yet and nobody is seated after it in its cohort
(their trees move at this rank's send cap whatever it receives at, and the holders'
other slots serve other cohorts' roots). Every round resumes at the first step of its
part this rank lacks, so what landed is never sent again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from nccl_back import _clock
from nccl_back.coord.registry import PeerInfo
from nccl_back.errors import (
    HandshakeTimeoutError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    fallback_reason,
)
from nccl_back.load.asking import BUSY_POLL, Ask, Source, claimed, transfer
from nccl_back.load.attempt import PeerBusy
from nccl_back.load.discover import holders
from nccl_back.load.fill import Fill
from nccl_back.timing import MAX_PEER_ATTEMPTS
from nccl_back.transport import Transport, relay
from nccl_back.transport.parts import Part

#: A round's holders: each with the send slot it holds for this rank.
Claimed = list[tuple[PeerInfo, str]]


def from_holders(fill: Fill) -> None:
    """Try holders until a round's bytes verify: sets ``fill.peer_id`` (every holder
    whose part landed, comma-separated) or ``fill.reason``.

    A failed part goes to a holder of the round whose own part landed, from the first
    step of it this rank lacks; with none left, the next round asks the next free
    holder. A holder whose send slots are all claimed is not a failure: the receiver
    waits (re-discovering, so receivers that finished meanwhile become candidates) up
    to ``settings.busy_wait``. Real failures count towards
    :data:`~nccl_back.timing.MAX_PEER_ATTEMPTS`. A failed verification blames only the
    sources that sent failing bytes (:class:`~nccl_back.transport.relay.DamagedBytes`):
    a lone holder not among them is asked again (it then sends what was discarded);
    when a round's failing layer came from several holders and none alone is to blame
    (a layer at a cut), none is, and the next rounds, one holder each, tell them apart.
    """
    _Holders(fill).run()


class _Holders:
    """One pass's loop over holders (see :func:`from_holders`)."""

    def __init__(self, fill: Fill) -> None:
        self.fill, self.a, self.s = fill, fill.a, fill.worker.settings
        rx = self.a.rx
        # What failed already (a relay upstream, a tree's part, a verification) says why
        # when no holder is left to try.
        self.last: NcclBackError = rx.relay_error or NoPeerError(
            "no peer tried" if not rx.failed else f"holders {sorted(rx.failed)} failed")
        self.width = self.s.holder_parts
        if self.width > 1 and (rx.sources.sources() or self._seated_below()):
            self.width = 1

    def run(self) -> None:
        fill, a, s, rx = self.fill, self.a, self.s, self.a.rx
        claim = rx.peer_budget.phase("claim", s.busy_wait)
        candidates = fill.found.candidates
        while True:
            busy = i = 0
            while i < len(candidates):
                with contextlib.ExitStack() as held:
                    picked: Claimed = []
                    while i < len(candidates) and len(picked) < self.width:
                        peer = candidates[i]
                        i += 1
                        if peer.peer_id in rx.failed or peer.peer_id in rx.blamed:
                            continue
                        if fill.budget_spent(self.last):
                            return
                        try:
                            picked.append((peer, held.enter_context(claimed(fill.worker, a, peer))))
                        except PeerBusy:
                            busy += 1
                        except RegistryError as e:
                            if not picked:
                                fill.reason = e
                                return
                            break
                    if not picked:
                        break
                    try:
                        again = self._round(picked)
                    except RegistryError as e:
                        fill.reason = e
                        return
                if fill.peer_id is not None or fill.reason is not None:
                    return
                if len(rx.failed) >= MAX_PEER_ATTEMPTS:
                    fill.reason = self.last
                    return
                self.width = 1
                if len(picked) > 1:
                    busy = i = 0  # one holder at a time from here, from the first
                elif again:
                    i -= 1
            if busy == 0 or claim.spent():
                if busy:
                    self.last = NoPeerError(f"every peer stayed busy for {s.busy_wait:g} s (busy_wait)")
                fill.reason = self.last
                return
            _clock.sleep(BUSY_POLL)
            try:
                candidates = holders(fill.worker, a)
            except RegistryError as e:
                fill.reason = e
                return

    def _round(self, picked: Claimed) -> bool:
        """Part ``i`` of ``n`` from the ``i``-th of ``picked`` (``n`` = 1: the whole plan),
        failed parts from those whose part landed, then one verification. True: the
        lone holder was not blamed, ask it again."""
        fill, a, n = self.fill, self.a, len(picked)
        parts: list[Part | None] = [None] if n == 1 else [(i, n) for i in range(n)]
        if n > 1:
            a.log.info("holder_parts", peers=[p.peer_id for p, _ in picked])
        errors = fill.pull([functools.partial(self._part, peer, token, part)
                            for (peer, token), part in zip(picked, parts, strict=True)], "nccl_back-part")
        done: Claimed = []  # whose part landed (its slot still held)
        lost: list[Part | None] = []
        for (peer, token), part, e in zip(picked, parts, errors, strict=True):
            if e is None:
                done.append((peer, token))
            else:
                self._failed(peer, part, e)
                lost.append(part)
        while lost and done and not fill.budget_spent(self.last):
            try:
                self._part(*done[0], lost[0], lambda _tr: None)
                lost.pop(0)
            except PeerError as e:
                self._failed(done.pop(0)[0], lost[0], e)
        if lost:
            return False
        try:
            bad = fill.verify(a.rx.peer_budget.deadline, (p.peer_id for p, _ in done))
        except PeerError as stream:  # a stream's truth never came: as a failed transfer
            for peer, _ in done:
                self._failed(peer, None, stream)
            return False
        if bad is None:
            return False
        self.last = fill.cause(bad)
        ids = {p.peer_id for p, _ in picked}
        blamed_by = bad.blamed if isinstance(bad, relay.DamagedBytes) else frozenset()
        if n > 1 and not blamed_by:
            # The failing layers' bytes came from several holders and none alone (a
            # layer at a cut): what they sent is gone, and one holder at a time tells
            # them apart.
            fill.worker.metrics.record_verification_failure()
            a.log.warning("holder_parts_unplaced", peers=sorted(ids), error=str(bad))
            return False
        tried = picked[0][0].peer_id if n == 1 else min(blamed_by)
        blamed = fill.blame(bad, tried)
        a.rx.failed |= blamed & ids
        return n == 1 and tried not in blamed

    def _failed(self, peer: PeerInfo, part: Part | None, e: BaseException) -> None:
        """Count and log ``peer``'s failure of ``part``; anything but a peer's failure
        (Redis's ends the pass) is raised."""
        if not isinstance(e, PeerError):
            raise e
        self.last = e
        self.a.rx.failed.add(peer.peer_id)
        if isinstance(e, HandshakeTimeoutError):
            self.fill.worker.metrics.record_handshake_timeout()
        where = {} if part is None else {"part": part[0]}
        self.a.log.warning("peer_attempt_failed", peer=peer.peer_id, **where,
                           reason=fallback_reason(e), error=str(e))

    def _part(self, peer: PeerInfo, claim: str, part: Part | None,
              started: Callable[[Transport], None]) -> None:
        """``part`` of this rank's plan (None: all of it) from holder ``peer`` (its slot
        ``claim`` held), from the first step of it this rank lacks (each candidate speaks
        this rank's transport: discover)."""
        fill = self.fill
        transfer(fill.worker, fill.a, Source.peer(peer),
                 Ask.holder(fill.worker.settings, fill.a.rx.peer_budget, claim, part=part, started=started))

    def _seated_below(self) -> bool:
        """Whether a member is seated after this rank in its cohort (unknown: yes)."""
        seat = self.a.rx.seat
        if seat is None:
            return False
        try:
            return bool(self.fill.worker.registry.chain_members(seat.place.key, seat.position + 1,
                                                                seat.position + 1))
        except RegistryError:
            return True
