"""A load in parts (``holder_parts``): part ``i`` of ``n`` from each of ``n`` idle
holders at once, then one verification, since several senders fill one receiver faster
than one does.

A step of the receive loop (:class:`~.receive.Receive`), kept apart so that loop stays
one page: it asks each holder as every path does (:mod:`.asking`) and shares the loop's
blame and the load's one budget (:class:`~.fill.Fill`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from nccl_back.coord.registry import PeerInfo
from nccl_back.errors import (
    PeerError,
    RegistryError,
    WeightVerificationError,
)
from nccl_back.load import verify
from nccl_back.load.asking import Ask, Source, claimed, transfer
from nccl_back.load.attempt import PeerBusy
from nccl_back.load.fill import Fill
from nccl_back.load.pulls import Pulls
from nccl_back.transport import Transport, relay
from nccl_back.transport.parts import Part


def from_holders_in_parts(fill: Fill) -> set[str]:
    """Part ``i`` of ``n`` from each of ``n`` idle holders at once (``holder_parts``),
    into this rank's tensors, then one verification: ``fill.peer_id`` names those whose
    parts landed.

    Not tried when fewer than two holders have a free send slot now, when this rank
    holds steps already, or when members are seated after it (their trees move at
    this rank's send cap whatever it receives at, and the holders' other slots serve
    other cohorts' roots). A failed part leaves what landed, and its remainder comes
    from a holder whose part landed; with none left, the one-holder loop resumes at
    the first step this rank lacks, without the holders returned (those that failed).
    Failed verification blames the holders that sent failing bytes (a layer whose
    bytes all came from one); when a failing layer's bytes came from several and
    none is to blame for another layer (a layer at a cut), none.
    """
    worker, a, s, rx = fill.worker, fill.a, fill.worker.settings, fill.a.rx
    if s.holder_parts < 2 or rx.sources.sources() or _seated_below(fill):
        return set()
    with contextlib.ExitStack() as held:
        picked: list[tuple[PeerInfo, str]] = []
        for peer in a.found.candidates:
            if len(picked) == s.holder_parts or fill.budget_spent(None):
                break
            if peer.peer_id in rx.blamed or peer.peer_id in rx.failed:
                continue
            try:
                picked.append((peer, held.enter_context(claimed(worker, a, peer))))
            except PeerBusy:
                continue
            except RegistryError:
                break
        if len(picked) < 2:
            return set()  # the claims taken go back as the block ends
        n = len(picked)
        a.log.info("holder_parts", peers=[p.peer_id for p, _ in picked])
        # Not aborted on a failure: what the other parts land stays (see Pulls).
        errors = Pulls(abort=False).run(
            [functools.partial(_part, fill, peer, token, (i, n))
             for i, (peer, token) in enumerate(picked)], "nccl_back-part")
        failed: set[str] = set()
        done: list[tuple[PeerInfo, str]] = []  # whose part landed (its slot still held)
        lost: list[int] = []  # the parts that failed
        for i, ((peer, token), e) in enumerate(zip(picked, errors, strict=True)):
            if e is None:
                done.append((peer, token))
            else:
                _part_failed(fill, peer, i, e)
                failed.add(peer.peer_id)
                lost.append(i)
        # A failed part's remainder comes from a holder whose own part landed, from the
        # first step of it this rank lacks: the parts that landed are not sent again.
        while lost and done and not fill.budget_spent(None):
            try:
                _part(fill, *done[0], (lost[0], n), lambda _tr: None)
                lost.pop(0)
            except (PeerError, RegistryError) as e:
                _part_failed(fill, done[0][0], lost[0], e)
                failed.add(done.pop(0)[0].peer_id)
    if lost:
        return failed
    try:
        verify.check(worker, a, rx.peer_budget.deadline)
    except WeightVerificationError as e:
        blamed, suspects = ((e.blamed, e.suspects) if isinstance(e, relay.DamagedBytes)
                            else (frozenset(), frozenset()))
        if blamed:
            fill.blame(e, min(blamed))
            return failed
        # The failing layers' bytes came from several holders and none alone (a layer
        # at a cut): none is blamed, what they sent is gone, and the one-holder loop
        # tells them apart.
        worker.metrics.record_verification_failure()
        a.log.warning("holder_parts_unplaced", peers=sorted(suspects), error=str(e))
        return failed
    fill.peer_id = ",".join(p.peer_id for p, _ in done)
    return set()


def _part_failed(fill: Fill, peer: PeerInfo, i: int, e: BaseException) -> None:
    """Log part ``i``'s failure at holder ``peer``; anything but a peer's or Redis's
    failure is a bug, raised."""
    if not isinstance(e, (PeerError, RegistryError)):
        raise e
    fill.failed(peer.peer_id, e, part=i)


def _part(fill: Fill, peer: PeerInfo, claim: str, part: Part,
          started: Callable[[Transport], None]) -> None:
    """Part ``part`` of this rank's plan from holder ``peer`` (its slot ``claim`` held),
    from the first step of it this rank lacks (each candidate speaks this rank's
    transport: discover)."""
    transfer(fill.worker, fill.a, Source.peer(peer),
             Ask.holder(fill.worker.settings, fill.a.rx.peer_budget, claim, part=part, started=started))


def _seated_below(fill: Fill) -> bool:
    """Whether a member is seated after this rank in its cohort (unknown: yes)."""
    seat = fill.a.rx.seat
    if seat is None:
        return False
    try:
        return bool(fill.worker.registry.chain_members(seat.place.key, seat.position + 1,
                                                       seat.position + 1))
    except RegistryError:
        return True
