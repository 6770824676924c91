"""Resharding: a mode of receiving for a sharded library model, from live holders of
any layout (other world sizes, or its own when its flavour has no layer truth).

Entered from ``WeightService._run_phases`` when this rank's skeleton has a
:class:`~nccl_back.model.sharding.Sharding` and some rank found no same-layout holder
it could verify, or the same-layout receive failed some rank (those holders are not
asked again). Each step ends in a consensus round (:mod:`.vote`), so all ranks reshard
or none does; the outcome goes back to the load's one decision, like any receive:

1. *Find* (:func:`find`), within the discovery phase's bound: live holders at any world
   size (a plain holder counts: its layout is every tensor whole), one per holder rank,
   whose layouts cover this rank's pieces (:func:`~nccl_back.model.reshard_plan.plan`)
   and whose truth in checkpoint coordinates agrees and covers what the Verifier must
   check. A world size that fails is skipped with its reason; none left: every rank
   goes on as without resharding.
2. *Receive* (:class:`_Receive`, a kind of the one loop's source): from every holder the plan uses at once, a shared claim
   (:func:`.asking.claimed`), the handshake proving the *plan's* digest (a sender that
   derived another plan refuses before any data moves), this rank's pieces through the
   one transfer path (:func:`.asking.transfer`), in place where a piece is contiguous
   (:class:`~nccl_back.model.reshard_plan.Landing`); then the Verifier's check.
3. *Publish*: as any peer load (:func:`.publish.peer_loaded`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.budget import DISCOVER_SECONDS, Phase
from nccl_back.coord.consensus import Group, gather
from nccl_back.coord.content import PositionTruth
from nccl_back.coord.registry import PeerInfo
from nccl_back.errors import (
    BudgetSpentError,
    NcclBackError,
    NoPeerError,
    PeerError,
    RegistryError,
    UntrustedRecordError,
    WeightVerificationError,
    fallback_reason,
)
from nccl_back.load.asking import Ask, Into, Source, claimed, transfer
from nccl_back.load.attempt import Absence, Attempt, NoHolder, Reason, Worker
from nccl_back.load.discover import usable_peers
from nccl_back.load.fill import NotReceived, Received, Rounds
from nccl_back.load.pulls import Pull
from nccl_back.load.verifier import Basis, PositionCheck, merge_macs
from nccl_back.load.verify import Verified
from nccl_back.model import marginals
from nccl_back.model.layout import Layout
from nccl_back.model.reshard_plan import Landing, Plan, PlanError, plan, zero_padding
from nccl_back.model.sharding import Sharding
from nccl_back.transport import Transport
from nccl_back.transport.broadcast import completes, payload_bytes
from nccl_back.transport.broadcast import plan as broadcast_plan

#: World sizes a reshard plans for (nearest to the receiver's first): each costs a plan.
MAX_WORLDS = 8
#: World sizes whose holders a reshard always looks up, besides its own and those the
#: index keys name: the tensor-parallel sizes of real fleets.
USUAL_WORLDS = (1, 2, 4, 8)


@dataclass(frozen=True)
class ReshardSources:
    """Holders to reshard from (one per holder index of the plan) and their truth."""

    peers: tuple[PeerInfo, ...]
    layouts: tuple[Layout, ...]
    plan: Plan
    group: str
    truths: dict[str, PositionTruth]
    """Each used holder's truth in checkpoint coordinates, by peer id."""
    share: str = ""
    """The receiving group's claim token part (:meth:`~nccl_back.coord.claims.
    ClaimRecords.claim`): its ranks hold a holder's send slot together."""


def run(worker: Worker, a: Attempt, sh: Sharding, found: ReshardSources) -> Received | NotReceived:
    """This rank's pieces from the holders every rank ``found`` (:func:`look`), in one
    round of the one loop (:class:`_Receive`): who served them once they verified, or
    why not (the service records it, then the group votes)."""
    r = _Receive(worker, a, sh, found)
    try:
        ok = r.run()
    except NcclBackError as e:
        r.reason = e
        ok = False
    if not ok:  # this rank's vote: storage (or strict), with the reason
        why = r.reason or NoPeerError("the reshard ended without a reason")
        a.log.warning("reshard_failed", reason=fallback_reason(why), error=str(why))
        return NotReceived(why)
    basis = Basis.NONE if r.checked is None else worker.verifier.basis()
    return Received(",".join(found.peers[k].peer_id for k in found.plan.used),
                    Verified(None, basis), r.checked)


def look(worker: Worker, a: Attempt, sh: Sharding) -> ReshardSources | Reason:
    """This rank's holders to reshard from (:func:`find`), or why it has none (the
    registry's trouble, or a lookup that found no cover): its vote in the group's round."""
    try:
        return find(worker, a, sh)
    except (NoPeerError, RegistryError) as e:
        return e


def shared(found: ReshardSources | None, group: Group) -> ReshardSources | None:
    """``found`` with the group's claim share: one value on every rank of ``group``, new
    for every load (the ranks' random parts). A collective: every rank calls it."""
    parts = gather(secrets.randbits(62), group)
    share = hashlib.sha256(",".join(map(str, parts)).encode()).hexdigest()[:32]
    return None if found is None else dataclasses.replace(found, share=share)


def also(reason: Reason | None, more: str) -> Reason | None:
    """``reason`` (its class: its fallback code) saying ``more`` as well."""
    if reason is None:
        return None
    if isinstance(reason, NoHolder):
        return reason.also(more)
    try:
        return type(reason)(f"{reason}; {more}")
    except TypeError:  # a class whose constructor takes more
        return reason


def find(worker: Worker, a: Attempt, sh: Sharding) -> ReshardSources | NoHolder:
    """The first world size (nearest to ours) whose live holders cover this rank, with
    truth the Verifier can check every held position (or byte) against; else why none
    does (:attr:`Absence.NO_LAYOUT_COVER`)."""
    phase = a.rx.start_budget(worker.settings).phase("reshard discovery", DISCOVER_SECONDS)
    reg, version = worker.registry, a.spec.version
    by_world: dict[int, list[PeerInfo]] = {}
    # The usual world sizes are looked up whatever index keys exist: key names need no
    # secret, so a flood of fake ones must not hide a genuine holder (the scanned ones,
    # a bounded number, add other sizes).
    usual = [(r, w) for w in sorted({a.world, *USUAL_WORLDS}) for r in range(w)]
    for r, w in dict.fromkeys([*usual, *reg.worlds(version)]):
        phase.check(f"{len(by_world)} world sizes read")
        for p in usable_peers(worker, a, reg.find_peers(version, r, w)):
            if p.peer_id in a.rx.failed or p.peer_id in a.rx.blamed:
                continue  # it failed this load's receive already
            by_world.setdefault(w, []).append(p)
            break
    why = f"no live holders of version {version[:12]} in any layout"
    for w in sorted(by_world, key=lambda w: (abs(w - a.world), w))[:MAX_WORLDS]:
        phase.check(f"planning for world size {w}")
        try:
            return _at_world(worker, a, sh, by_world[w], phase)
        except (PlanError, NoPeerError, UntrustedRecordError, WeightVerificationError) as e:
            if isinstance(e, BudgetSpentError):
                raise
            why = f"holders at world size {w}: {e}"
    return NoHolder(Absence.NO_LAYOUT_COVER, why)


def _at_world(worker: Worker, a: Attempt, sh: Sharding, holders: list[PeerInfo], phase: Phase) -> ReshardSources:
    reg, mine = worker.registry, sh.layout
    peers: list[PeerInfo] = []
    layouts: list[Layout] = []
    for p in sorted(holders, key=lambda p: p.rank):
        lay = _layout_of(worker, sh, p)
        if lay is not None:
            peers.append(p)
            layouts.append(lay)
    same = [k for k, lay in enumerate(layouts) if lay.digest == mine.digest]
    if same:  # a holder of exactly this layout: one source, as a same-layout receive
        peers, layouts = [peers[same[0]]], [layouts[same[0]]]
    p_ = plan(mine, layouts)  # PlanError: they do not cover us (or it would cost too much)
    phase.check("the plan")
    truths = {peers[k].peer_id: _truth(worker, a, peers[k], layouts[k]) for k in p_.used}
    _check_truth(worker, sh, truths)
    group = reg.put_group([lay.digest for lay in layouts])
    reg.put_layout(mine)
    a.log.info("reshard_planned", world=holders[0].world_size, holders=len(p_.used),
               bytes=p_.nbytes(), plan=p_.digest[:12])
    return ReshardSources(tuple(peers), tuple(layouts), p_, group, truths)


def _layout_of(worker: Worker, sh: Sharding, p: PeerInfo) -> Layout | None:
    """A holder's layout: a plain one holds the whole checkpoint (its manifest says so)."""
    if not p.layout:
        return sh.whole if p.manifest_digest == sh.checkpoint.digest else None
    return worker.registry.get_layout(p.layout)


def _truth(worker: Worker, a: Attempt, p: PeerInfo, lay: Layout) -> PositionTruth:
    v = worker.verifier
    got = worker.registry.get_position_truth(a.spec.version, p.rank, p.world_size, lay.digest, v.scheme)
    if got is None and v.mode != "none":
        raise NoPeerError(f"holder {p.peer_id} has no truth in checkpoint coordinates")
    return got or PositionTruth(lay.digest, v.scheme, {})


def _check_truth(worker: Worker, sh: Sharding, truths: dict[str, PositionTruth]) -> None:
    """Before any byte moves: the holders' truth agrees, and covers what the Verifier
    must check (every byte this rank holds, under ``full``)."""
    v = worker.verifier
    if v.mode == "none":
        return
    merge_macs(truths)  # TruthConflict: these holders are not used
    if v.mode == "full":
        truth = marginals.Truth()
        for publisher, record in sorted(truths.items()):
            truth.add(record.marginals, publisher)
        missing = marginals.uncovered(sh.layout, truth)
        if missing is not None:
            raise marginals.NotCheckable(missing)


class _Receive(Rounds):
    """A reshard's one round: every piece from its holder, all holders at once (a
    receiver's link is faster than one sender's path: a TP=1 rank behind TP=2 holders),
    the first failure aborting the others (the load starts over without the pieces;
    ``reason`` is that holder's), then the Verifier's check in checkpoint coordinates
    (``checked``: what it covered; None under ``verify`` "none"). A failed check blames
    the holders that sent the failing tensors' pieces (:func:`_blame`) and ends the
    reshard: it is the load's last peer pass."""

    name = "nccl_back-reshard"
    abort = True

    def __init__(self, worker: Worker, a: Attempt, sh: Sharding, f: ReshardSources) -> None:
        self.worker, self.a, self.sh, self.f = worker, a, sh, f
        self.reason: NcclBackError | None = None
        self.checked: PositionCheck | None = None
        self.asked = False

    def round(self, held: contextlib.ExitStack) -> list[Pull] | None:
        if self.asked or self.reason is not None:
            return None
        self.asked = True
        self.a.rx.start_budget(self.worker.settings)  # the holders are asked within it (Ask.holder)
        return [functools.partial(_from_holder, self.worker, self.a, self.f, k) for k in self.f.plan.used]

    def landed(self, errors: list[PeerError | RegistryError | None]) -> bool:
        if self.first is None:
            return True
        self.reason = errors[self.first]
        return False

    def verify(self) -> WeightVerificationError | None:
        zero_padding(self.sh.layout, self.a.target.tensors)
        v = self.worker.verifier
        if v.mode == "none":
            return None
        began = _clock.perf()
        try:
            self.checked = v.check_positions(self.sh.layout, self.a.target.tensors, self.f.truths)
        except WeightVerificationError as e:
            return e
        self.a.timings["verify"] = _clock.perf() - began
        self.a.log.info("reshard_verified", positions=self.checked.positions, elements=self.checked.elements)
        return None

    def blamed(self, bad: WeightVerificationError) -> None:
        blamed = _blame(self.worker, self.sh, self.f, set(bad.bad))
        self.a.log.warning("reshard_verification_failed", blamed=sorted(blamed), error=str(bad))
        self.reason = bad

    def untrue(self, e: PeerError) -> None:
        self.reason = e

    def lost(self, e: RegistryError) -> None:
        self.reason = e


def _blame(worker: Worker, sh: Sharding, f: ReshardSources, bad: set[str]) -> set[str]:
    """The holders that sent any piece of the checkpoint tensors in ``bad`` (logged, not
    kept: a reshard is the load's last peer pass, nobody is asked after it)."""
    holds = {name: {p.source for p in t.parts if hasattr(p, "source")}
             for name, _, _, t in sh.layout.tensors}
    blamed = {f.peers[m.holder].peer_id for m in f.plan.moves if holds.get(m.dst, set()) & bad}
    worker.metrics.record_verification_failure()
    return blamed


def _from_holder(worker: Worker, a: Attempt, f: ReshardSources, k: int,
                 started: Callable[[Transport], None]) -> None:
    """Holder ``k``'s moves: a send slot, the transfer into place, the staged copies."""
    s, t, peer = worker.settings, a.target, f.peers[k]
    land = Landing(f.plan.for_holder(k), t.tensors, t.device)
    began = _clock.perf()
    budget = a.rx.peer_budget
    with claimed(worker, a, peer, share=f.share, until=budget.phase("claim", s.busy_wait)) as token:
        a.timings[f"claim.{k}"] = _clock.perf() - began
        bucket = s.bucket_for(peer.transport, payload_bytes(land.payload))
        # Staged boxes are copied into place as their step arrives, while the next ones do.
        done = {j: [n for n in names if n in land.staged]
                for j, names in completes(broadcast_plan(land.payload, bucket)).items()}

        def placed(step: int) -> None:
            for name in done.get(step, ()):
                land.place(name)

        into = Into(f.plan.digest, land.payload, bucket, placed, f.plan.receiver, f.group, k)
        transfer(worker, a, Source.peer(peer), Ask.holder(s, budget, token, into=into, started=started))
    began = _clock.perf()
    land.finish()
    a.timings[f"unpack.{k}"] = _clock.perf() - began
