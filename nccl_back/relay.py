"""Cohorts: receivers that arrive together form one pipelined relay chain.

With whole 2-rank copies, N receivers of one holder need a binomial tree of
⌈log2(N+1)⌉ rounds. Instead, receivers of the same version, rank and manifest that
start within ``cohort_window`` seconds join one *cohort* (at most ``cohort_max_size``
members, then the next one starts), ordered by arrival::

    holder -> m0 -> m1 -> m2 -> ...      (each arrow: one 2-rank link, gloo or NCCL)

Member 0 (the head) receives from a holder as any receiver does. Member p > 0
receives from member p-1, which forwards step k (a bucket, :mod:`.transport.broadcast`)
as soon as step k is in its own tensors, while step k+1 arrives. So the chain takes
about one transfer plus one step per member, whatever its length. A late arrival
joins the tail: its upstream forwards what it already holds at link speed and then
follows. Each link is a separate 2-rank communicator (not one NCCL communicator for
the cohort, whose pipelined broadcast would be faster per byte) because a member
that dies then breaks one link, not the whole cohort, and the same code runs on gloo
and NCCL.

Failure: a member whose upstream link fails (the upstream died: gloo raises in
~0.3 s; or stalled: no step within ``relay_stall_timeout``) re-attaches to the
nearest member further up, then to any holder, resuming at the first step it lacks;
only then does it fall back to storage, with the reason. Its own downstream waits on
its progress meanwhile and never notices. A member that gives up fails its
downstream links at once, so they re-attach too. Every member verifies what it got
against the ground truth, as any receiver does. A member whose verification fails
forwards nothing more (its endpoint refuses every request while it lingers); its
downstream, which may hold some of those bytes, finds them in its own verification,
blames the sources that sent the failing steps (:class:`Held`), discards what they
sent and receives it again from someone else.

Streamed downloads (single flight). The worker elected to download a version
announces a relay endpoint of its own (:func:`stream`) before it reads storage, and
tells it which tensors are in place as the storage loader fills them (each after its
shard's CRC32C passed): step k can be forwarded once every tensor it carries is
(:class:`Fills`; steps follow sorted names, as checkpoints are sharded, so progress is
a prefix). Waiting workers that see the stream record join a cohort as usual and its
head receives from the stream, so the cohort finishes about one bucket per member after
the download does, instead of after the download, the publication and a whole relayed
transfer. The stream's receivers have no ground truth yet: they verify against the
hashes the downloader publishes once its load is complete. If the download fails, its
stream fails and its receivers go back to the election (another worker downloads, or
the first one publishes); a stream-fed link allows ``max(relay_stall_timeout,
download_lease)`` between steps, since its pace is storage's.

Registry (keys built by :class:`~nccl_back.registry.Registry`)::

    ns:cohort:{v}:{r}:{w}:{d}                 hash {n, epoch}; TTL cohort_window
    ns:cohort:{v}:{r}:{w}:{d}:{epoch}:{c}     list of member records, in chain order
    ns:stream:{v}:{r}:{w}:{d}                 the downloader's member record; dropped
                                              when its load ends (TTL as a bound)

A member record (JSON, parsed by :func:`parse_member`) names where to reach the
member's relay endpoint: ``{"member_id", "address", "transport", "device"}``; the
member answers relay requests pushed to ``ns:req:{member_id}`` with the usual
liveness handshake.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import records
from .auth import transfer_scope
from .config import Settings
from .errors import (
    NcclBackError,
    RegistryError,
    TransferError,
    TransferTimeoutError,
    UntrustedRecordError,
    fallback_reason,
)
from .handshake import refuse, run_sender
from .log import get_logger
from .metrics import Metrics
from .registry import Registry
from .transport import Rendezvous, Step, payload_bytes, plan, run_guarded, send_tensors
from .transport.pacing import Pacer

log = get_logger(__name__)

#: Seconds a member's relay endpoint stays up, idle, after its own load ended and the
#: cohort window passed, for a downstream member that is still re-attaching. A late
#: arrival (within the window) may sit behind a member that already finished: the
#: endpoint stays up ``cohort_window`` + this, so it still finds it.
LINGER = 2.0
#: Seconds a member waits in the handshake with a relay upstream: a live one answers
#: within its poll interval, so a dead one costs little.
RELAY_HANDSHAKE = 3.0
#: Relay sends one member runs at once (its successor, plus one re-attaching from
#: further down while the first is still unwinding).
MAX_RELAY_SENDS = 2
#: Relay sends a streamed download serves at once: the heads of the cohorts that formed
#: while it downloads (waiters arriving more than ``cohort_window`` apart), plus
#: re-attaching members. Its worker's ``max_send_gbps`` is shared by all of them.
STREAM_SENDS = 4
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Member:
    """One cohort member's relay endpoint."""

    member_id: str
    address: str
    transport: str
    device: str

    def to_dict(self) -> dict[str, str]:
        return {"member_id": self.member_id, "address": self.address,
                "transport": self.transport, "device": self.device}


def parse_member(data: dict[str, Any] | str | bytes | None) -> Member:
    """A member record (as verified by the registry, or raw JSON);
    :class:`UntrustedRecordError` if it is not one."""
    what = "cohort member"
    if not isinstance(data, dict):
        data = records.load(data, what)
    return Member(
        member_id=records.ident(data, "member_id", what),
        address=records.address(data, "address", what),
        transport=records.choice(data, "transport", what, records.TRANSPORTS),
        device=records.choice(data, "device", what, DEVICES),
    )


@dataclass(frozen=True)
class Seat:
    """Where a member sits: its cohort's chain key and its position in it."""

    chain: str
    position: int


class Progress:
    """How many leading steps of a member's transfer are in its tensors (thread-safe).

    Its relay sends wait here for the step they forward next; a member that gives up
    fails it, which ends those sends (so their receivers re-attach elsewhere).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._done = 0
        self._failed: str | None = None
        self._clock = clock

    @property
    def done(self) -> int:
        with self._cond:
            return self._done

    def advance(self, step: int) -> None:
        """Step ``step`` is in place (steps arrive in order, a resumed transfer included)."""
        with self._cond:
            self._done = max(self._done, step + 1)
            self._cond.notify_all()

    def complete(self, steps: int) -> None:
        self.advance(steps - 1)

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
        """Return once step ``step`` is in place; raise if the member gave up or by ``deadline``.

        A member that gave up forwards nothing more, not even steps it holds: they may be
        the ones that failed its verification.
        """
        with self._cond:
            while True:
                if self._failed is not None:
                    raise TransferError(f"relay upstream gave up at step {self._done}: {self._failed}")
                if self._done > step:
                    return
                left = deadline - self._clock()
                if left <= 0:
                    raise TransferTimeoutError(f"relay: step {step} not received by the deadline")
                self._cond.wait(min(left, 0.5))


class Held:
    """Which source put each step of this rank's plan into its tensors (thread-safe).

    A receiver may fill its tensors from several sources (a relay upstream that died,
    then another member, then a holder), resuming each time at the first step it
    lacks. When verification fails, the layers that failed name the steps that carry
    them, and those steps name the sources that sent them: only those are blamed, and
    everything they sent is discarded, so the next source sends it again instead of
    the same bad bytes failing once more under another source's name.
    """

    def __init__(self, steps: list[Step]) -> None:
        self._names = [frozenset(slot.name for slot in step.slots) for step in steps]
        self._sources: list[str | None] = [None] * len(steps)
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

    def sources(self) -> set[str]:
        """Every source whose steps are held."""
        with self._lock:
            return {src for src in self._sources if src is not None}

    def blame(self, bad_layers: set[str], layer_of: Callable[[str], str]) -> set[str]:
        """The sources of the held steps that carry a tensor of ``bad_layers``; every
        source held when no step carries one (the failure cannot be placed)."""
        with self._lock:
            blamed = {src for names, src in zip(self._names, self._sources, strict=True)
                      if src is not None and any(layer_of(n) in bad_layers for n in names)}
            return blamed or {src for src in self._sources if src is not None}

    def discard(self, sources: set[str]) -> int:
        """Forget everything from the first step any of ``sources`` sent (a transfer
        resumes as a prefix); returns the steps still held."""
        with self._lock:
            first = next((k for k, src in enumerate(self._sources) if src in sources),
                         len(self._sources))
            for k in range(first, len(self._sources)):
                self._sources[k] = None
        return self.done


class RelayServer:
    """A member's downstream side: answers relay requests while (and shortly after) it
    receives, forwarding each step once :class:`Progress` says it is in place."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        rendezvous: Rendezvous,
        member: Member,
        tensors: dict[str, torch.Tensor],
        manifest_digest: str,
        pacer: Pacer,
        progress: Progress,
        log_: Any,
        *,
        max_sends: int = MAX_RELAY_SENDS,
        send_timeout: float | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.max_sends = max_sends
        self.send_timeout = settings.transfer_timeout if send_timeout is None else send_timeout
        self.registry = registry
        self.rendezvous = rendezvous
        self.member = member
        self.tensors = tensors
        self.digest = manifest_digest
        self.pacer = pacer
        self.progress = progress
        self._log = log_
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._sends: list[threading.Thread] = []
        self._transports: set[Any] = set()
        self.served = 0
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"nccl-back-relay-{member.member_id[-6:]}")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> RelayServer:
        self._thread.start()
        return self

    def end(self, ok: bool, reason: str = "") -> None:
        """The member's own load ended; failed: its downstream links fail at once.

        The endpoint lingers ``cohort_window`` + :data:`LINGER` seconds without
        requests, then stops
        (in the background: the caller does not wait for downstream sends).
        """
        if not ok:
            self.progress.fail(reason or "the member fell back")
        self._ended.set()

    def close(self, timeout: float) -> None:
        """Stop now; abort relay sends still running; wait at most ``timeout`` s."""
        self._stop.set()
        with self._lock:
            transports = list(self._transports)
        for tr in transports:
            with contextlib.suppress(Exception):
                tr.abort()
        self._thread.join(timeout)

    def _loop(self) -> None:
        idle_since: float | None = None
        key = self.member.member_id
        while not self._stop.is_set():
            with self._lock:
                self._sends = [t for t in self._sends if t.is_alive()]
                busy = len(self._sends)
            if self._ended.is_set() and busy == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > LINGER + self.settings.cohort_window:
                    break
            else:
                idle_since = None
            try:
                request = self.registry.pop_request(key, timeout=0.2)
            except RegistryError as e:
                self._log.warning("relay_poll_failed", error=str(e))
                self._stop.wait(0.2)
                continue
            if request is None:
                continue
            gave_up = self.progress.failed
            if gave_up is not None:
                # What this member holds failed (or never completed): serve none of it,
                # and say so at once, so the requester attaches elsewhere now.
                self._log.warning("relay_request_refused", reason="gave_up")
                with contextlib.suppress(RegistryError):
                    refuse(self.registry, str(request.get("transfer_id", ""))[:64], "draining",
                           f"relay endpoint {key} gave up: {gave_up}")
                continue
            if busy >= self.max_sends:
                # Said at once, so the requester tries its next upstream now rather
                # than after its handshake timeout.
                self._log.warning("relay_request_refused", reason="busy")
                with contextlib.suppress(RegistryError):
                    refuse(self.registry, str(request.get("transfer_id", ""))[:64], "busy",
                           f"relay endpoint {key} serves {busy} already")
                continue
            idle_since = None
            t = threading.Thread(target=self._send_one, args=(request,), daemon=True,
                                 name=f"nccl-back-relay-send-{key[-6:]}")
            with self._lock:
                self._sends.append(t)
            t.start()
        with contextlib.suppress(RegistryError):
            self.registry.delete(self.registry.key("req", key))
        for t in list(self._sends):
            t.join(self.settings.transfer_timeout)
        # A stopped endpoint must not keep the model alive: a sidecar whose hand-off
        # re-pointed the model into its arena would otherwise hold it twice.
        self.tensors = {}

    def _send_one(self, request: dict[str, Any]) -> None:
        s = self.settings
        transfer_id = str(request.get("transfer_id", ""))[:64]
        start = request.get("start", 0)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            start = 0
        log_ = self._log.bind(transfer_id=transfer_id, peer=str(request.get("receiver"))[:200])
        transport: Any = None
        try:
            run_sender(self.registry, transfer_id, self.digest, s.sender_handshake_timeout)
            transport = self.rendezvous.sender(transfer_scope(s.key("store"), transfer_id))
            with self._lock:
                self._transports.add(transport)
            now = time.monotonic()
            deadline = now + self.send_timeout
            with self.metrics.sending("relay"):
                stats = run_guarded(
                    transport,
                    lambda tr: send_tensors(
                        tr, self.tensors,
                        s.bucket_for(self.member.transport, payload_bytes(self.tensors)),
                        start=start,
                        ready=lambda k: self.progress.wait_for(k, deadline), pace=self.pacer.take),
                    deadline,
                    connect_deadline=now + s.connect_timeout,
                )
            self.metrics.record_sent("relay", stats.bytes, stats.seconds)
            self.served += 1
            log_.info("relayed", start=start, bytes=stats.bytes, gbps=round(stats.gbps, 3))
        except NcclBackError as e:
            log_.warning("relay_failed", reason=fallback_reason(e), error=str(e))
        except Exception as e:  # a relay thread must never die silently
            log_.error("relay_crashed", error=repr(e))
        finally:
            with self._lock:
                self._transports.discard(transport)


class Chain:
    """This receiver's place in a cohort, its progress and its relay endpoint."""

    def __init__(self, seat: Seat, member: Member, progress: Progress, server: RelayServer,
                 registry: Registry) -> None:
        self.seat = seat
        self.member = member
        self.progress = progress
        self.server = server
        self._registry = registry
        self.failed: set[str] = set()
        """Member ids that failed this receiver as upstreams (never tried again)."""

    @property
    def position(self) -> int:
        return self.seat.position

    def upstreams(self) -> list[Member]:
        """Members before this one, nearest first, without those that failed us.

        A malformed record is skipped with a reason: the member behind it is then
        served by one further up (or by a holder).
        """
        if self.position == 0:
            return []
        raws = self._registry.chain_members(self.seat.chain, 0, self.position - 1)
        out: list[Member] = []
        for raw in reversed(raws):
            if raw is None:  # untrusted: the registry said why
                continue
            try:
                m = parse_member(raw)
            except UntrustedRecordError as e:
                log.warning("cohort_member_skipped", chain=self.seat.chain, reason=str(e))
                continue
            if m.member_id not in self.failed and m.member_id != self.member.member_id:
                out.append(m)
        return out

    def end(self, ok: bool, reason: str = "") -> None:
        self.server.end(ok, reason)


@dataclass(frozen=True)
class Place:
    """Where one rank's relay endpoints live and what they serve: the same for a chain
    member (:func:`join`) and a streamed download (:func:`stream`)."""

    settings: Settings
    registry: Registry
    rendezvous: Rendezvous
    worker_id: str
    version: str
    rank: int
    world: int
    manifest_digest: str
    kind: str
    device: torch.device
    tensors: dict[str, torch.Tensor]
    pacer: Pacer
    log: Any
    metrics: Metrics | None = None
    """Where relay sends are counted (the service's); None: counted nowhere visible."""

    @property
    def key(self) -> tuple[str, int, int, str]:
        """``(version, rank, world, manifest digest)``: what the registry keys it by."""
        return (self.version, self.rank, self.world, self.manifest_digest)

    def server(self, role: str, **options: Any) -> RelayServer:
        """A relay endpoint (not started) of a fresh member ``{worker}-r{rank}-{role}-…``."""
        member = Member(f"{self.worker_id}-r{self.rank}-{role}-{uuid.uuid4().hex[:6]}"[-200:],
                        self.rendezvous.address, self.kind, self.device.type)
        return RelayServer(self.settings, self.registry, self.rendezvous, member, self.tensors,
                           self.manifest_digest, self.pacer, Progress(),
                           self.log.bind(member=member.member_id), metrics=self.metrics,
                           **options)


def join(p: Place) -> Chain:
    """Take a seat in the current cohort and start this member's relay endpoint.

    Raises :class:`RegistryError` (the caller then receives on its own, as without
    cohorts).
    """
    s = p.settings
    server = p.server("relay").start()  # listening before anyone can read our record
    member = server.member
    try:
        chain_key, position = p.registry.join_cohort(
            *p.key, member.to_dict(), window=s.cohort_window, max_size=s.cohort_max_size,
            ttl=s.transfer_timeout + s.busy_wait,
        )
    except RegistryError:
        server.end(False, "could not join a cohort")
        raise
    seat = Seat(chain_key, position)
    p.log.info("cohort_joined", chain=chain_key.rsplit(":", 2)[-2:], position=position,
               member=member.member_id)
    return Chain(seat, member, server.progress, server, p.registry)


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


class Stream:
    """The elected downloader's relay endpoint for one rank (see the module docstring)."""

    def __init__(self, registry: Registry, server: RelayServer, steps: list[Step],
                 key: tuple[str, int, int, str]) -> None:
        self.server = server
        self.fills = Fills(steps, server.progress)
        self._steps = len(steps)
        self._registry = registry
        self._key = key

    @property
    def member(self) -> Member:
        return self.server.member

    def filled(self, name: str) -> None:
        self.fills.filled(name)

    def loaded(self) -> None:
        """Every tensor is in place (also what a loader without per-tensor fills says)."""
        if self._steps:
            self.server.progress.complete(self._steps)

    def end(self, ok: bool, reason: str = "") -> None:
        """The download ended (``ok``: loaded and published): no new receiver finds the
        stream; a failed one fails its receivers' links at once."""
        self.server.end(ok, reason)
        with contextlib.suppress(RegistryError):
            self._registry.drop_stream(*self._key, self.member.member_id)


def stream(p: Place) -> Stream:
    """Start the relay endpoint a download is streamed from and announce it.

    Raises :class:`RegistryError` (the worker then downloads without streaming).
    """
    # A receiver of the stream may wait for the whole download, as it would have in the
    # election: the same bound.
    wait = p.settings.transfer_timeout + p.settings.single_flight_max_wait
    server = p.server("stream", max_sends=STREAM_SENDS, send_timeout=wait).start()
    try:
        p.registry.put_stream(*p.key, server.member.to_dict(), ttl=wait)
    except RegistryError:
        server.end(False, "could not announce the stream")
        raise
    steps = plan(p.tensors, p.settings.bucket_for(p.kind, payload_bytes(p.tensors)))
    p.log.info("download_streamed", member=server.member.member_id, steps=len(steps))
    return Stream(p.registry, server, steps, p.key)
