"""Resharding: a sharded library model loads from live holders of other layouts.

Entered from ``WeightService._load`` at one point: this rank's skeleton has a
:class:`~nccl_back.model.sharding.Sharding` and some rank found no same-layout holder.
Its phases, each closed by a consensus round over the receiver's group (:mod:`.vote`),
so all ranks reshard, or none does:

1. *Find* (:func:`find`): live holders of the version at any world size (a plain
   holder of the whole checkpoint counts: its layout is every tensor whole), one per
   holder rank, whose layouts cover this rank's pieces (:func:`~nccl_back.model.
   reshard_plan.plan`), and their truth in checkpoint coordinates. A world size whose
   holders do not cover us is skipped; none at all: every rank goes on as before (the
   single flight, then storage), with the reason discovery gave.
2. *Receive* (:func:`receive`): from every holder the plan uses at once, a claim, the
   handshake proving the *plan's* digest (a sender that derived another plan refuses
   before any data moves), exactly this rank's pieces, received in place where a piece
   is contiguous in its tensor (:func:`~nccl_back.model.reshard_plan.landing`); then
   every sampled checkpoint position it holds is checked against the holders' truth
   (:mod:`nccl_back.model.position_truth`).
3. *Publish* (:func:`published`): the worker serves its own layout like any holder:
   its layout, the position truth it verified, and layer hashes of its verified bytes as
   its flavour's ground truth (rooted in the position check: see docs/layouts.md).

A failed receive or check on any rank sends every rank to storage with its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import secrets
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nccl_back import _clock
from nccl_back.coord import records
from nccl_back.coord.auth import transfer_scope
from nccl_back.coord.consensus import gather
from nccl_back.coord.handshake import run_receiver
from nccl_back.coord.registry import PeerInfo, encode_truth
from nccl_back.errors import (
    NcclBackError,
    NoPeerError,
    RegistryError,
    UntrustedRecordError,
    fallback_reason,
)
from nccl_back.load.attempt import Attempt, Env, NobodyHolds
from nccl_back.load.discover import usable_peers
from nccl_back.load.receive import kept_claim
from nccl_back.load.storage import fall_back
from nccl_back.load.vote import agree, caught
from nccl_back.model import integrity, position_truth
from nccl_back.model.layout import Layout
from nccl_back.model.loader import StorageLoader
from nccl_back.model.reshard_plan import Landing, Plan, PlanError, plan, zero_padding
from nccl_back.model.sharding import Sharding
from nccl_back.result import LoadResult
from nccl_back.transport import Transport, receiver_transport, recv_tensors, run_guarded
from nccl_back.transport.broadcast import completes, payload_bytes
from nccl_back.transport.broadcast import plan as broadcast_plan

#: Seconds between two claims of a holder whose send slots are all taken.
_BUSY_POLL = 0.05


class NoLayoutCover(NobodyHolds):
    """No live holders of any layout cover this rank's pieces (or they lack truth)."""


@dataclass(frozen=True)
class Found:
    """Holders to reshard from (one per holder index of the plan) and what to verify."""

    peers: tuple[PeerInfo, ...]
    layouts: tuple[Layout, ...]
    plan: Plan
    group: str
    truth: position_truth.Macs
    share: str = ""
    """The receiving group's claim token part (:meth:`~nccl_back.coord.claims.
    ClaimRecords.claim`): its ranks hold a holder's send slot together."""


def attempt(env: Env, a: Attempt, sh: Sharding, loader: StorageLoader) -> LoadResult | None:
    """The whole reshard (every rank, or none): the result, a storage load after a
    failed reshard (with its reason), or None when no holders cover every rank."""
    t = _clock.perf()
    found = run(env, a, sh)
    if found is None:
        return None
    macs: position_truth.Macs | None = None
    with caught(a, "reshard"):
        try:
            macs = receive(env, a, sh, found)
        except NcclBackError as e:  # this rank's vote: go to storage, with the reason
            a.reason = e
            a.log.warning("reshard_failed", reason=fallback_reason(e), error=str(e))
    a.timings["peer"] = _clock.perf() - t
    decision = agree(a, "reshard")
    if decision.ok:
        return published(env, a, sh, found, macs)
    if a.reason is None:
        a.reason = decision.why()
    if env.settings.strict and decision.failed:
        raise decision.strict_error(a)
    return fall_back(env, a, loader)


def run(env: Env, a: Attempt, sh: Sharding) -> Found | None:
    """Find holders on every rank; the :class:`Found` if every rank can reshard, else
    None with this rank's earlier vote restored (the load goes on as without it)."""
    before = a.reason
    found: Found | None = None
    a.reason = None
    began = _clock.perf()
    with caught(a, "reshard_discovery"):
        try:
            found = find(env, a, sh)
        except (NoPeerError, RegistryError) as e:
            a.reason = e
    a.timings["reshard_discovery"] = _clock.perf() - began
    if not agree(a, "reshard discovery").ok:
        a.log.info("reshard_skipped", reason=str(a.reason) if a.reason else "another rank")
        a.reason = before
        return None
    # One value on every rank of the group, new for every load: the ranks' random parts.
    parts = gather(secrets.randbits(62), a.group)
    share = hashlib.sha256(",".join(map(str, parts)).encode()).hexdigest()[:32]
    return None if found is None else dataclasses.replace(found, share=share)


def find(env: Env, a: Attempt, sh: Sharding) -> Found:
    """The first world size (nearest to ours) whose live holders cover this rank."""
    reg, version, mine = env.registry, a.spec.version, sh.layout
    by_world: dict[int, list[PeerInfo]] = {}
    for r, w in reg.worlds(version):
        for p in usable_peers(env, a, reg.find_peers(version, r, w)):
            if (p.rank, p.world_size, p.layout) != (a.rank, a.world, mine.digest):
                by_world.setdefault(w, []).append(p)
                break
    why = f"no live holders of version {version[:12]} in any layout"
    for w in sorted(by_world, key=lambda w: (abs(w - a.world), w)):
        peers, layouts = [], []
        for p in sorted(by_world[w], key=lambda p: p.rank):
            lay = _layout_of(env, sh, p)
            if lay is not None:
                peers.append(p)
                layouts.append(lay)
        try:
            p_ = plan(mine, layouts)
        except PlanError as e:
            why = f"holders at world size {w} do not cover this rank: {e}"
            continue
        try:
            truth = position_truth.merge([_truth(env, a, peers[k], layouts[k]) for k in p_.used])
        except (NoPeerError, UntrustedRecordError) as e:
            why = str(e)
            continue
        group = reg.put_group([lay.digest for lay in layouts])
        reg.put_layout(mine)
        a.log.info("reshard_planned", world=w, holders=len(p_.used), bytes=p_.nbytes(),
                   plan=p_.digest[:12])
        return Found(tuple(peers), tuple(layouts), p_, group, truth)
    raise NoLayoutCover(why)


def _layout_of(env: Env, sh: Sharding, p: PeerInfo) -> Layout | None:
    """A holder's layout: a plain one holds the whole checkpoint (its manifest says so)."""
    if not p.layout:
        return sh.whole if p.manifest_digest == sh.checkpoint.digest else None
    return env.registry.get_layout(p.layout)


def _truth(env: Env, a: Attempt, p: PeerInfo, lay: Layout) -> position_truth.Macs:
    got = env.registry.get_position_truth(a.spec.version, p.rank, p.world_size, lay.digest)
    if got is None and env.settings.verify != "none":
        raise NoPeerError(f"holder {p.peer_id} has no truth in checkpoint coordinates")
    return got or {}


def receive(env: Env, a: Attempt, sh: Sharding, f: Found) -> position_truth.Macs | None:
    """Every piece from its holder, all holders at once, then the check; raises with the
    reason if not (the first holder's that failed, once every pull has ended). Returns
    the MACs of the positions it checked (None with ``verify`` off): what it publishes."""
    s, t = env.settings, a.target
    budget = _clock.monotonic() + s.peer_budget_seconds
    pulls = _Pulls()
    if len(f.plan.used) == 1:
        _from_holder(env, a, f, f.plan.used[0], budget, pulls)
    else:
        # One thread per holder: a receiver's link is faster than one sender's path (a TP=1
        # rank behind TP=2 holders). Every pull is waited for, even after one failed: each
        # writes into this rank's tensors (the first failure aborts the others).
        with ThreadPoolExecutor(len(f.plan.used), thread_name_prefix="nccl_back-reshard") as pool:
            futures = [pool.submit(_from_holder, env, a, f, k, budget, pulls) for k in f.plan.used]
            errors = [fut.exception() for fut in futures]
        for e in errors:
            if e is not None:
                raise e
    zero_padding(sh.layout, t.tensors)
    if s.verify == "none":
        return None
    began = _clock.perf()
    mine = position_truth.held_macs(sh.layout, t.tensors, s.key("integrity"))
    checked = position_truth.compare(mine, f.truth)
    a.timings["verify"] = _clock.perf() - began
    a.log.info("reshard_verified", positions=checked)
    return mine


class _Pulls:
    """One receive's transfers in flight: the first failure aborts the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[Transport] = set()
        self._failed = False

    def start(self, transport: Transport) -> None:
        with self._lock:
            self._live.add(transport)
            if self._failed:
                transport.abort()

    def end(self, transport: Transport) -> None:
        with self._lock:
            self._live.discard(transport)

    def fail(self) -> None:
        with self._lock:
            self._failed = True
            for tr in self._live:
                with contextlib.suppress(Exception):  # already torn down
                    tr.abort()


def _from_holder(env: Env, a: Attempt, f: Found, k: int, budget: float, pulls: _Pulls) -> None:
    """Holder ``k``'s moves: a send slot, the transfer into place, the staged copies."""
    s, reg, t, peer = env.settings, env.registry, a.target, f.peers[k]
    land = Landing(f.plan.for_holder(k), t.tensors, t.device)
    began = _clock.perf()
    try:
        token = _claim(env, peer, min(budget, _clock.monotonic() + s.busy_wait), f.share)
    except BaseException:
        pulls.fail()
        raise
    a.timings[f"claim.{k}"] = _clock.perf() - began
    try:
        with kept_claim(reg, peer.peer_id, token, s.claim_ttl, a.log):
            _pull(env, a, f, k, token, land, budget, pulls)
    except BaseException:
        pulls.fail()
        raise
    finally:
        with contextlib.suppress(RegistryError):
            reg.release(peer.peer_id, token)
    began = _clock.perf()
    land.finish()
    a.timings[f"unpack.{k}"] = _clock.perf() - began


def _claim(env: Env, peer: PeerInfo, until: float, share: str) -> str:
    """A send slot of ``peer`` (one this group's other ranks hold counts: ``share``),
    waiting while all are claimed by other receivers until ``until``."""
    s = env.settings
    while True:
        token = env.registry.claim(peer.peer_id, env.worker_id, peer.max_sends, s.claim_ttl,
                                   share=share)
        if token is not None:
            return token
        if _clock.monotonic() >= until:
            raise NoPeerError(f"holder {peer.peer_id}: every send slot stayed claimed")
        _clock.sleep(_BUSY_POLL)


def _pull(env: Env, a: Attempt, f: Found, k: int, token: str,
          land: Landing, budget: float, pulls: _Pulls) -> None:
    s, t, peer = env.settings, a.target, f.peers[k]
    transfer_id = uuid.uuid4().hex
    request = records.TransferRequest(
        transfer_id=transfer_id, receiver=env.worker_id, version=a.spec.version,
        manifest_digest=t.manifest.digest, transport=t.kind, device=t.device.type, claim=token,
        layout=f.plan.receiver, group=f.group, holder=k,
    ).to_dict()
    began = _clock.perf()
    run_receiver(env.registry, transfer_id, f.plan.digest,
                 max(min(s.receiver_handshake_timeout, budget - _clock.monotonic()), 0.001),
                 after_ready=lambda: env.registry.push_request(peer.peer_id, request))
    a.timings[f"handshake.{k}"] = _clock.perf() - began
    deadline = min(_clock.monotonic() + s.transfer_timeout, budget)
    transport = receiver_transport(s, peer.transport, peer.address,
                                   transfer_scope(s.key("store"), transfer_id),
                                   device=t.device, registry=env.registry)
    bucket = s.bucket_for(peer.transport, payload_bytes(land.payload))
    # Staged boxes are copied into place as their step arrives, while the next ones do.
    done = {k: [n for n in names if n in land.staged]
            for k, names in completes(broadcast_plan(land.payload, bucket)).items()}

    def placed(step: int) -> None:
        for name in done.get(step, ()):
            land.place(name)

    began = _clock.perf()
    pulls.start(transport)
    try:
        run_guarded(transport, lambda tr: recv_tensors(tr, land.payload, bucket, on_step=placed),
                    deadline,
                    connect_deadline=min(_clock.monotonic() + s.connect_timeout, deadline),
                    stall=s.stall_timeout)
    finally:
        pulls.end(transport)
    a.timings[f"transfer.{k}"] = _clock.perf() - began


def published(env: Env, a: Attempt, sh: Sharding, f: Found,
              macs: position_truth.Macs | None) -> LoadResult:
    """The resharded load's result; this worker then serves its own layout (with the
    position MACs it checked, or computes them where verification was off)."""
    s, reg, man = env.settings, env.registry, a.target.manifest
    seconds = _clock.perf() - a.start
    sources = ",".join(f.peers[k].peer_id for k in f.plan.used)
    result = LoadResult(source="peer", version=a.spec.version, bytes=f.plan.nbytes(),
                        seconds=seconds, peer_id=sources, verified=s.verify != "none",
                        timings=a.timings)
    env.metrics.record_load("peer", f.plan.nbytes(), seconds)
    a.log.info("loaded", source="peer", resharded=True, peers=sources, seconds=round(seconds, 3),
               gbps=round(result.gbps, 3))
    hashes = encode_truth({"sampled": integrity.layer_hashes(a.model, key=s.key("integrity"))})
    try:
        if macs is None:
            macs = position_truth.held_macs(sh.layout, a.target.tensors, s.key("integrity"))
        reg.put_position_truth(a.spec.version, a.rank, a.world, sh.layout.digest, macs)
        reg.put_ground_truth(a.spec.version, a.rank, a.world, man.digest, hashes)
        env.server.publish(a.model, man, a.spec.version, a.rank, a.world, source="peer", log=a.log,
                           truth=hashes, model_name=a.spec.name, layout=sh.layout, positions=macs)
    except Exception as e:  # loaded and verified; only serving others is lost
        a.log.warning("publish_failed", error=str(e))
    return result
