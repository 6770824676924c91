"""A receive pass's rounds, in :class:`~.receive.Receive`'s order: a cohort seat's two
parts from its upstreams in the two trees (:func:`from_trees`), then holders
(:func:`from_holders`): the two kinds of source of the one loop
(:class:`~.fill.Rounds`), which differ in each part's sources and in what a source's
failure costs.

The trees: part ``t`` of the plan from this seat's upstreams in tree ``t`` (its
ancestors, nearest first, ending at the cohort's head, then the stream that feeds the
cohort, else a holder). A failed upstream is never asked again, and the next one resumes
at the part's first step this rank lacks; a member that stalled is asked once more first,
unless its liveness mark lapsed (:meth:`~nccl_back.transport.relay.Seat.counts_failed`).
A seat is a leaf in one tree, and a leaf's parent changes as the cohort grows
(:func:`~nccl_back.transport.relay.topology.seat_upstreams`): while a leaf's part moves,
the cohort's size is looked at soon, then up to every :data:`WATCH_POLL` seconds
(:func:`~.pulls.watched`: a fleet released together moves its leaves at once), and once
the parent moved the transfer is aborted and resumes from the new one (not a failure). A handshake
that times out is tried once more before its upstream counts as failed: under load (a
fleet released together) a live endpoint may be slow to answer, and every seat that
gave up on its parent would load the ones further up. Not once the part stalled: a
member upstream stopped (or partitioned), the upstreams tried next are its suspects,
and each retry would cost a stopped one another handshake bound. A member a failed
check only suspects (a failing layer whose bytes both parts carried, and no source to
blame for another: :class:`~nccl_back.transport.relay.Blame`) is not asked again by
this seat.

The holders: a round claims up to ``holder_parts`` idle holders and pulls part ``i`` of
``n`` from the ``i``-th (several senders fill one receiver faster than one does); with
one (``n`` = 1) the part is the whole plan. Only the first round is in several parts,
and only when this rank holds no step yet and nobody is seated after it in its cohort
(their trees move at this rank's send cap whatever it receives at, and the holders'
other slots serve other cohorts' roots). Every round resumes at the first step of its
part this rank lacks, so what landed is never sent again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from collections.abc import Callable

from nccl_back import _clock
from nccl_back.budget import Phase
from nccl_back.coord.records import Member
from nccl_back.coord.registry import PeerInfo
from nccl_back.errors import (
    HandshakeTimeoutError,
    IncompatiblePeerError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    TransferStalledError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.load.asking import BUSY_POLL, Ask, Source, claimed, transfer
from nccl_back.load.attempt import PeerBusy
from nccl_back.load.discover import holders
from nccl_back.load.fill import Fill, Rounds
from nccl_back.load.pulls import Pull, watched
from nccl_back.timing import MAX_PEER_ATTEMPTS, WATCH_FIRST
from nccl_back.timing import TREE_WATCH_POLL as WATCH_POLL
from nccl_back.transport import Transport, plan, relay
from nccl_back.transport.parts import Part
from nccl_back.transport.parts import parts as split
from nccl_back.transport.relay.topology import TREES
from nccl_back.transport.rendezvous_store import unreachable_reason

#: Handshake timeouts an upstream may cost one seat before it counts as failed.
HANDSHAKE_TRIES = 2


def from_trees(fill: Fill, seat: relay.Seat, fed_by: Member | None) -> bool:
    """Both parts from this seat's upstreams in the two trees (then the stream
    ``fed_by``, or the cohort's holders), then one verification; True once it passed
    (``fill.peer_id`` names every source). False: a part ran out of upstreams, the
    stream's truth never came or Redis failed (``rx.relay_error`` says why; holders go
    on from the first step this rank lacks) or the relay phase is spent."""
    s = fill.worker.settings
    bound = s.transfer_timeout + s.handshake_timeout
    if fed_by is not None:  # we may wait for the whole download, as in the election
        bound += s.single_flight_max_wait
    # A cohort fed by a download moves at storage's pace: a step may take a shard's
    # download; a downloader that stops renewing its lease is given up on as long.
    stall = max(s.stall_timeout, s.download_lease) if fed_by is not None else s.stall_timeout
    return _Trees(fill, seat, fed_by, fill.a.rx.peer_budget.phase("relay", bound), stall).run()


class _Trees(Rounds):
    """One seat's receive in the two trees (see the module docstring)."""

    name = "nccl_back-tree"

    def __init__(self, fill: Fill, seat: relay.Seat, fed_by: Member | None, bound: Phase,
                 stall: float) -> None:
        self.fill, self.seat, self.fed_by, self.bound, self.stall = fill, seat, fed_by, bound, stall
        t, s = fill.a.target, fill.worker.settings
        self.cut = split(plan(t.tensors, t.bucket(s, t.kind)), TREES)
        self.timeouts: dict[str, int] = {}
        """Handshake timeouts per upstream (both parts' loops share it)."""
        self.stalled: set[int] = set()
        """Trees whose part stalled: no handshake retried there (see the module docstring)."""
        self.out = False
        """A part ran out of sources: no round more."""

    def round(self, held: contextlib.ExitStack) -> list[Pull] | None:
        if self.out or self.bound.spent():
            return None
        return [functools.partial(self._part, self.cut[tree], tree) for tree in range(TREES)]

    def landed(self, errors: list[PeerError | RegistryError | None]) -> bool:
        failed = [e for e in errors if e is not None]
        if not failed:
            return True
        # Out of upstreams: the last upstream's failure (kept by _failed) says why.
        rx = self.fill.a.rx
        if not (isinstance(failed[0], NoPeerError) and rx.relay_error is not None):
            rx.relay_error = failed[0]
        self.out = True
        return False

    def verify(self) -> WeightVerificationError | None:
        return self.fill.verify(self.bound.deadline, sorted(self.fill.a.rx.sources.sources()))

    def untrue(self, e: PeerError) -> None:
        if self.fed_by is not None:
            self._failed(self.fed_by.member_id, None, e)
        self.fill.a.rx.relay_error = e
        self.out = True

    def blamed(self, bad: WeightVerificationError) -> None:
        # Whoever sent failing bytes is never asked again and what it sent is gone:
        # both parts resume at what they now lack.
        rx = self.fill.a.rx
        self.seat.failed.update(self.fill.blame(bad, min(rx.sources.sources(), default="")))
        self.seat.failed.update(self._suspects(bad))
        rx.relay_error = self.fill.cause(bad)

    def lost(self, e: RegistryError) -> None:
        self.fill.a.rx.relay_error = e

    def _suspects(self, e: WeightVerificationError) -> set[str]:
        """The members among a failed check's suspects (:class:`~nccl_back.transport.relay.Blame`):
        this seat asks them no more, unblamed, so the retry pairs the other suspects
        with new sources, which tells them apart. A member forwards bytes before it has
        checked them; a holder serves only checked ones and is asked again (so is the
        stream: a cohort's one source)."""
        if not isinstance(e, relay.DamagedBytes):
            return set()
        a = self.fill.a
        sources = {p.peer_id for p in a.found.candidates}
        if self.fed_by is not None:
            sources.add(self.fed_by.member_id)
        return set(e.suspects - sources)

    def _part(self, mine: list[int], tree: int, _started: object) -> None:
        """Tree ``tree``'s part (the step indices ``mine``) from this seat's upstreams in
        that tree, nearest first, then the cohort's source; raises :class:`PeerError`
        once none is left, and then this seat forwards nothing more: the seat below it
        in the other tree, which this seat may itself wait on there (both roots' source
        failed: a stream refused), moves on at once, not after its stall bound."""
        try:
            self._walk(mine, tree)
        except (PeerError, RegistryError) as e:
            self.seat.progress.fail(f"tree {tree}: {e}"[:300])
            raise

    def _walk(self, mine: list[int], tree: int) -> None:
        seat, s, rx = self.seat, self.fill.worker.settings, self.fill.a.rx
        leaf = seat.position % TREES != tree  # grown(): seat p is interior in tree p % 2
        while rx.sources.lacking(mine) is not None:
            self.bound.check(f"tree {tree}")
            path = seat.tree_path(tree, s.cohort_limit)

            def moved(parent: int = path[0]) -> bool:
                try:
                    return seat.tree_path(tree, s.cohort_limit)[0] != parent
                except RegistryError:
                    return False  # Redis trouble says nothing of the tree

            ups = seat.tree_upstreams(tree, path)
            with watched(moved if leaf else (lambda: False), WATCH_POLL,
                         f"nccl-back-tree-{tree}", first=WATCH_FIRST) as (gone, on_start):
                if ups:
                    self._from_member(tree, ups[0][1], on_start, gone)
                else:
                    self._from_source(tree, on_start, gone)
            if gone.is_set():
                self.fill.a.log.info("tree_parent_moved", tree=tree, seat=seat.position, was=path[0],
                                     held_steps=rx.sources.done)

    def _from_member(self, tree: int, member: Member,
                     on_start: Callable[[Transport], None], gone: threading.Event) -> None:
        """One try of the part from ``member`` (a seat's endpoint, or the cohort's stream)."""
        a, s = self.fill.a, self.fill.worker.settings
        why = (f"speaks {member.transport} on {member.device}" if not a.replica().speaks(member)
               else unreachable_reason(s, member.address))
        if why is not None:  # not worth a handshake: the next one now
            self._failed(member.member_id, tree,
                         IncompatiblePeerError(f"cohort member {member.member_id}: {why}"))
            return
        stream = self.fed_by is not None and member.member_id == self.fed_by.member_id
        try:
            self._pull(tree, Source.member(member), None,
                       self.seat.stall_bound(member.member_id, self.stall), on_start, gone)
        except PeerError as e:
            # The retry first: counts_failed marks a handshake timeout failed for good,
            # and the part would then go to a grandparent already sending to two.
            if gone.is_set() or self._retried(member.member_id, tree, e):
                return
            if not stream and not self.seat.counts_failed(member.member_id, e):
                self.fill.a.log.info("relay_upstream_stalled", peer=member.member_id, part=tree,
                                     held_steps=self.fill.a.rx.sources.done, error=str(e))
                return
            self._failed(member.member_id, tree, e)

    def _from_source(self, tree: int, on_start: Callable[[Transport], None],
                     gone: threading.Event) -> None:
        """The part from the cohort's source: the stream that feeds it, else a holder,
        whose one send slot the tree roots hold together (a share drawn from the cohort's
        key: the source sends one model's worth, a part to each root). With several
        holders (up to ``holder_parts``), tree ``t`` first asks the ``t``-th if it has a
        slot free now: the two roots, or a lone seat taking both parts, then fill from
        two holders at once, each sending half."""
        worker, a, s, seat = self.fill.worker, self.fill.a, self.fill.worker.settings, self.seat
        if self.fed_by is not None and self.fed_by.member_id not in seat.failed:
            self._from_member(tree, self.fed_by, on_start, gone)
            return
        share = hashlib.md5(seat.place.key.encode(), usedforsecurity=False).hexdigest()
        out = seat.failed | a.rx.blamed
        usable = [p for p in a.found.candidates if p.peer_id not in out]
        if not usable:
            raise NoPeerError(f"tree {tree}: no upstream left (every member and holder failed this seat)")
        own = usable[tree % min(len(usable), s.holder_parts)]
        tries = [(own, None)] if own is not usable[0] else []  # one try: busy, the shared one
        for peer, until in [*tries, (usable[0], self.bound.phase("claim", s.busy_wait))]:
            try:
                with claimed(worker, a, peer, share=share, until=until) as token:
                    self._pull(tree, Source.peer(peer), token, s.stall_timeout, on_start, gone)
            except PeerBusy:
                continue
            except PeerError as e:
                if not gone.is_set() and not self._retried(peer.peer_id, tree, e):
                    self._failed(peer.peer_id, tree, e)
            return

    def _pull(self, tree: int, source: Source, claim: str | None, stall: float,
              on_start: Callable[[Transport], None], gone: threading.Event) -> None:
        """Tree ``tree``'s part from ``source``, from the first step of it this rank lacks."""
        fill = self.fill
        transfer(fill.worker, fill.a, source, Ask.upstream(
            fill.worker.settings, self.seat, source.id, self.bound, stall, (tree, TREES), claim,
            on_start, gone))

    def _retried(self, source: str, tree: int, e: PeerError) -> bool:
        """Whether ``source`` is asked again after ``e``: it timed out in the handshake
        fewer than :data:`HANDSHAKE_TRIES` times while part ``tree`` never stalled. Every
        failure of a part passes here first, so a stall of it is recorded here."""
        if isinstance(e, TransferStalledError):
            self.stalled.add(tree)
        if not isinstance(e, HandshakeTimeoutError):
            return False
        self.fill.worker.metrics.record_handshake_timeout()
        self.timeouts[source] = self.timeouts.get(source, 0) + 1
        if self.timeouts[source] >= HANDSHAKE_TRIES or tree in self.stalled:
            return False
        self.fill.a.log.info("relay_handshake_retried", peer=source, part=tree, error=str(e))
        return True

    def _failed(self, source: str, tree: int | None, e: PeerError) -> None:
        """``source`` failed this seat's part ``tree`` (None: both, its truth never came):
        never asked again (a stream that failed is the load's to go back to the election
        for)."""
        a = self.fill.a
        self.seat.failed.add(source)
        if any(p.peer_id == source for p in a.found.candidates):
            a.rx.failed.add(source)  # a holder: the holders' loop does not ask it again
        a.rx.relay_error = e
        if self.fed_by is not None and source == self.fed_by.member_id:
            a.rx.failed_streams.add(self.fed_by.member_id)
        a.log.warning("relay_upstream_failed", peer=source, **({} if tree is None else {"part": tree}),
                      held_steps=a.rx.sources.done, reason=fallback_reason(e), error=str(e))


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


class _Holders(Rounds):
    """One pass's rounds over holders (see :func:`from_holders`)."""

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
        self.claim = rx.peer_budget.phase("claim", self.s.busy_wait)
        self.candidates = fill.found.candidates
        self.i = self.busy = 0
        """The next candidate to claim; how many were busy since the first."""
        self.picked: Claimed = []
        """The round's holders, part ``i`` of ``n`` from the ``i``-th (``n`` = 1: the whole plan)."""
        self.done: Claimed = []
        """Those of the round whose part landed (their slots still held)."""
        self.again = False
        """The lone holder of the last round was not blamed: ask it again."""

    def round(self, held: contextlib.ExitStack) -> list[Pull] | None:
        fill, rx = self.fill, self.a.rx
        if fill.reason is not None:
            return None
        if self.picked:  # after a round: one holder at a time from here
            if len(rx.failed) >= MAX_PEER_ATTEMPTS:
                fill.reason = self.last
                return None
            if len(self.picked) > 1:
                self.busy = self.i = 0  # from the first
            elif self.again:
                self.i -= 1
            self.width, self.again = 1, False
        while True:
            picked = self._pick(held)
            if picked is None:
                return None
            if picked:
                break
            if self.busy == 0 or self.claim.spent():
                if self.busy:
                    self.last = NoPeerError(f"every peer stayed busy for {self.s.busy_wait:g} s (busy_wait)")
                fill.reason = self.last
                return None
            _clock.sleep(BUSY_POLL)
            self.candidates = holders(fill.worker, self.a)  # RegistryError: the rounds end
            self.busy = self.i = 0
        n = len(picked)
        if n > 1:
            self.a.log.info("holder_parts", peers=[p.peer_id for p, _ in picked])
        self.picked = picked
        return [functools.partial(self._part, peer, token, part)
                for (peer, token), part in zip(picked, self._parts(), strict=True)]

    def _pick(self, held: contextlib.ExitStack) -> Claimed | None:
        """Up to ``width`` free holders from the ``i``-th, each slot claimed into ``held``
        (none: every one left was busy or out); None: the rounds end (``fill.reason``)."""
        fill, rx = self.fill, self.a.rx
        picked: Claimed = []
        while self.i < len(self.candidates) and len(picked) < self.width:
            peer = self.candidates[self.i]
            self.i += 1
            if peer.peer_id in rx.failed or peer.peer_id in rx.blamed:
                continue
            if fill.budget_spent(self.last):
                return None
            try:
                picked.append((peer, held.enter_context(claimed(fill.worker, self.a, peer))))
            except PeerBusy:
                self.busy += 1
            except RegistryError as e:
                if not picked:
                    fill.reason = e
                    return None
                break
        return picked

    def _parts(self) -> list[Part | None]:
        n = len(self.picked)
        return [None] if n == 1 else [(i, n) for i in range(n)]

    def landed(self, errors: list[PeerError | RegistryError | None]) -> bool:
        """Failed parts from the holders whose part landed, one at a time."""
        done: Claimed = []
        lost: list[Part | None] = []
        for (peer, token), part, e in zip(self.picked, self._parts(), errors, strict=True):
            if e is None:
                done.append((peer, token))
            else:
                self._failed(peer, part, e)
                lost.append(part)
        while lost and done and not self.fill.budget_spent(self.last):
            try:
                self._part(*done[0], lost[0], lambda _tr: None)
                lost.pop(0)
            except PeerError as e:
                self._failed(done.pop(0)[0], lost[0], e)
        self.done = done
        return not lost

    def verify(self) -> WeightVerificationError | None:
        return self.fill.verify(self.a.rx.peer_budget.deadline, [p.peer_id for p, _ in self.done])

    def untrue(self, e: PeerError) -> None:
        for peer, _ in self.done:
            self._failed(peer, None, e)

    def blamed(self, bad: WeightVerificationError) -> None:
        fill, a, n = self.fill, self.a, len(self.picked)
        self.last = fill.cause(bad)
        ids = {p.peer_id for p, _ in self.picked}
        blamed_by = bad.blamed if isinstance(bad, relay.DamagedBytes) else frozenset()
        if n > 1 and not blamed_by:
            # The failing layers' bytes came from several holders and none alone (a
            # layer at a cut): what they sent is gone, and one holder at a time tells
            # them apart.
            fill.worker.metrics.record_verification_failure()
            a.log.warning("holder_parts_unplaced", peers=sorted(ids), error=str(bad))
            return
        tried = self.picked[0][0].peer_id if n == 1 else min(blamed_by)
        blamed = fill.blame(bad, tried)
        a.rx.failed |= blamed & ids
        self.again = n == 1 and tried not in blamed

    def lost(self, e: RegistryError) -> None:
        self.fill.reason = e

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
