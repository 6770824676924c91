"""Typed, bounded records for every value read from Redis.

Anyone who can write to Redis can put anything there (``1e400``, JSON nested a million
deep, a list where an object belongs). Each parser turns one raw value into a typed
record or raises :class:`~nccl_back.errors.UntrustedRecordError`, so the caller skips
that value and goes on; nothing else escapes. Bounds are generous for real fleets and
tight for hostile input.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from typing import Any

from nccl_back import _clock, bounded_json
from nccl_back.errors import UntrustedRecordError
from nccl_back.transport_kinds import MAX_PARTS, TRANSPORT_KINDS

#: Bytes of one peer entry, request or handshake value (real ones are < 1 KiB).
MAX_RECORD_BYTES = 16 << 10
#: Nesting of any coordination record (ground truth is the deepest: 2).
MAX_DEPTH = 4
#: Send slots a peer may advertise: each is a Redis key a receiver may probe.
MAX_SENDS = 64
#: World size of one worker (tensor x pipeline parallel ranks).
MAX_WORLD = 1 << 16
#: Steps of one transfer (a resumed transfer's ``start``): far beyond any real model.
MAX_START = 1 << 31
PEER_SOURCES = ("storage", "peer", "adopted")
DEVICES = ("cpu", "cuda")
HANDSHAKE_SIDES = ("receiver", "sender")
#: Linux's largest pid_max.
MAX_PID = 1 << 22
#: Nonces stay below 2**52 (exact in any JSON implementation), their +1 too.
MAX_NONCE = 1 << 53

IDENT = re.compile(r"[A-Za-z0-9._-]{1,200}")
_CLAIM = re.compile(r"[0-9]{1,3}:[0-9a-f]{32}")
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def load(raw: str | bytes | None, what: str, max_bytes: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """A JSON object within bounds, or :class:`UntrustedRecordError` naming ``what``."""
    if raw is None:
        raise UntrustedRecordError(f"{what}: absent")
    if not isinstance(raw, (str, bytes)):
        raise UntrustedRecordError(f"{what}: not a string value (wrong Redis type?)")
    try:
        value = bounded_json.loads(raw, max_bytes=max_bytes, max_depth=MAX_DEPTH)
    except ValueError as e:
        raise UntrustedRecordError(f"{what}: {e}") from e
    if not isinstance(value, dict):
        raise UntrustedRecordError(f"{what}: not a JSON object")
    return value


def ident(data: dict[str, Any], name: str, what: str,
          kind: str = "a name of [A-Za-z0-9._-]") -> str:
    """A name safe in key names and logs: letters, digits, ``._-``, 1 to 200 of them."""
    value = data.get(name)
    if not isinstance(value, str) or not IDENT.fullmatch(value):
        raise UntrustedRecordError(f"{what}: {name} must be {kind}, got {_show(value)}")
    return value


def hexdigest(data: dict[str, Any], name: str, what: str) -> str:
    """A digest: a token as :func:`ident` takes (hex in practice)."""
    return ident(data, name, what, "a digest")


def integer(data: dict[str, Any], name: str, what: str, lo: int, hi: int, default: int | None = None) -> int:
    """An integer (not a bool, not a float) in ``[lo, hi]``."""
    value = data.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise UntrustedRecordError(f"{what}: {name} must be an integer in [{lo}, {hi}], got {_show(value)}")
    return value


def number(data: dict[str, Any], name: str, what: str, default: float = 0.0) -> float:
    """A finite number (``1e400`` parses as infinity: refused)."""
    value = data.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise UntrustedRecordError(f"{what}: {name} must be a finite number, got {_show(value)}")
    return float(value)


def choice(data: dict[str, Any], name: str, what: str, allowed: tuple[str, ...], default: str | None = None) -> str:
    value = data.get(name, default)
    if value not in allowed:
        raise UntrustedRecordError(f"{what}: {name} must be one of {', '.join(allowed)}, got {_show(value)}")
    return str(value)


def address(data: dict[str, Any], name: str, what: str) -> str:
    """``host:port`` with a hostname or an IP (IPv6 in brackets) and a port 0-65535
    (0: no port to reach, the transport bootstraps through Redis)."""
    value = data.get(name)
    if not isinstance(value, str) or len(value) > 300:
        raise UntrustedRecordError(f"{what}: {name} must be host:port, got {_show(value)}")
    host, sep, port = value.rpartition(":")
    ok = bool(sep) and port.isascii() and port.isdigit() and 0 <= int(port) <= 65535
    if ok and host.startswith("[") and host.endswith("]"):
        ok = _is_ip(host[1:-1], version=6)
    elif ok:
        ok = _is_ip(host, version=4) or bool(_HOSTNAME.fullmatch(host))
    if not ok:
        raise UntrustedRecordError(f"{what}: {name} must be host:port, got {_show(value)}")
    return value


@dataclass(frozen=True)
class PeerInfo:
    """A worker rank that holds ``version`` and can send it to a receiver."""

    peer_id: str
    version: str
    rank: int
    world_size: int
    manifest_digest: str
    transport: str
    """``gloo`` or ``nccl``: what the receiver must speak."""
    address: str
    """``host:0``: the host the sender's transports bind on."""
    started_at: float = field(default_factory=_clock.wall)
    """Wall-clock time the peer finished loading (for ``status``)."""
    source: str = "storage"
    """Where this peer got its weights: ``storage`` or ``peer``."""
    max_sends: int = 1
    """How many receivers this peer serves at once (number of claim slots)."""
    device: str = "cpu"
    """Device kind its weights live on (``cpu``/``cuda``): a receiver needs the same."""
    host: str = ""
    """The worker's host name, for an operator (``status``); never used to connect."""
    pid: int = 0
    """The worker's process id on ``host`` (0: not said)."""
    model: str = ""
    """The model's folder name (its last path component), for an operator."""
    engine: str = ""
    """What runs the worker: ``library``, ``sidecar``, ``vllm-<version>`` ..."""
    layout: str = ""
    """The digest of its layout; empty: every tensor whole."""


def peer(data: dict[str, Any], what: str = "peer entry") -> PeerInfo:
    """A peer entry (``0 <= rank < world_size``, ``1 <= max_sends <= 64``)."""
    world = integer(data, "world_size", what, 1, MAX_WORLD)
    return PeerInfo(
        peer_id=ident(data, "peer_id", what),
        version=ident(data, "version", what),
        rank=integer(data, "rank", what, 0, world - 1),
        world_size=world,
        manifest_digest=hexdigest(data, "manifest_digest", what),
        transport=choice(data, "transport", what, TRANSPORT_KINDS),
        address=address(data, "address", what),
        started_at=number(data, "started_at", what),
        source=choice(data, "source", what, PEER_SOURCES, "storage"),
        max_sends=integer(data, "max_sends", what, 1, MAX_SENDS, 1),
        device=choice(data, "device", what, DEVICES,
                      "cuda" if data.get("transport") == "nccl" else "cpu"),
        host=label(data, "host", what),
        pid=integer(data, "pid", what, 0, MAX_PID, 0),
        model=label(data, "model", what),
        engine=label(data, "engine", what),
        layout=label(data, "layout", what),
    )


def label(data: dict[str, Any], name: str, what: str) -> str:
    """An operator's label: empty, or a name of ``[A-Za-z0-9._-]`` (see :func:`ident`)."""
    return "" if data.get(name, "") == "" else ident(data, name, what)


def to_label(text: str) -> str:
    """``text`` made fit for :func:`label`: other characters become ``_``, at most 200."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:200]


@dataclass(frozen=True)
class TransferRequest:
    """A receiver's request that a peer serve it one transfer."""

    transfer_id: str
    receiver: str
    version: str
    manifest_digest: str
    transport: str
    device: str | None = None
    claim: str | None = None
    """The receiver's claim token, so the sender can free the slot if the send fails."""
    start: int | None = None
    """The step to start from (a relay member resuming after its upstream failed)."""
    layout: str | None = None
    """A resharding receiver's layout digest: send the plan's pieces, not the tensors."""
    group: str | None = None
    """The digest of the holders' layouts the plan is computed over (a layout record)."""
    holder: int | None = None
    """Which of those holders the request is for."""
    part: int | None = None
    """Send only part ``part`` of the steps split into ``parts`` (both set, or neither)."""
    parts: int | None = None
    sub: int | None = None
    """Of that part, only sub-part ``sub`` of ``subs`` (both set, or neither)."""
    subs: int | None = None

    @property
    def steps_part(self) -> tuple[int, ...] | None:
        """The part of the plan's steps to send, or None: from ``start`` to the end."""
        if self.parts is None:
            return None
        head = (self.part or 0, self.parts)
        return head if self.subs is None else (*head, self.sub or 0, self.subs)

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (absent optional ones stay absent)."""
        return {k: v for k, v in vars(self).items() if v is not None}


def request(data: dict[str, Any], what: str = "transfer request") -> TransferRequest:
    claim = data.get("claim")
    if claim is not None and (not isinstance(claim, str) or not _CLAIM.fullmatch(claim)):
        raise UntrustedRecordError(f"{what}: claim must be a claim token, got {_show(claim)}")
    return TransferRequest(
        transfer_id=ident(data, "transfer_id", what),
        receiver=ident(data, "receiver", what),
        version=ident(data, "version", what),
        manifest_digest=hexdigest(data, "manifest_digest", what),
        transport=choice(data, "transport", what, TRANSPORT_KINDS),
        device=choice(data, "device", what, DEVICES) if "device" in data else None,
        claim=claim,
        start=integer(data, "start", what, 0, MAX_START) if "start" in data else None,
        layout=hexdigest(data, "layout", what) if "layout" in data else None,
        group=hexdigest(data, "group", what) if "group" in data else None,
        holder=integer(data, "holder", what, 0, MAX_WORLD) if "holder" in data else None,
        **_part(data, what),
    )


def _part(data: dict[str, Any], what: str) -> dict[str, int]:
    """A request's ``part`` and ``parts``: both absent, or part ``0 <= part < parts``;
    then ``sub`` and ``subs`` alike, only with a part."""
    if "part" not in data and "parts" not in data:
        if "sub" in data or "subs" in data:
            raise UntrustedRecordError(f"{what}: a sub-part of no part")
        return {}
    parts = integer(data, "parts", what, 1, MAX_PARTS)
    got = {"part": integer(data, "part", what, 0, parts - 1), "parts": parts}
    if "sub" in data or "subs" in data:
        subs = integer(data, "subs", what, 1, MAX_PARTS)
        got |= {"sub": integer(data, "sub", what, 0, subs - 1), "subs": subs}
    return got


@dataclass(frozen=True)
class HandshakeValue:
    """One side's nonce (or its acknowledgement) in the liveness handshake, or a
    sender's refusal (``refused`` set) or abandonment marker (both: ``value`` -1)."""

    by: str
    value: int
    digest: str
    refused: str | None = None
    message: str = ""
    """A refusal's explanation."""

    @property
    def abandoned(self) -> bool:
        return self.value == -1 and self.refused is None


def handshake(data: dict[str, Any], what: str = "handshake value") -> HandshakeValue:
    by = choice(data, "by", what, HANDSHAKE_SIDES)
    if data.get("abandoned") is True and by == "sender":
        return HandshakeValue(by, -1, "")
    if "refused" in data:
        message = data.get("message", "")
        if by != "sender" or not isinstance(message, str) or len(message) > 1000:
            raise UntrustedRecordError(f"{what}: malformed refusal")
        return HandshakeValue(by, -1, "", ident(data, "refused", what), message)
    return HandshakeValue(
        by=by,
        value=integer(data, "value", what, 0, MAX_NONCE),
        digest=ident(data, "digest", what),
    )


def lease(data: dict[str, Any], what: str = "download lease") -> str:
    """The worker a single-flight download lease names its owner (:mod:`.election`)."""
    return ident(data, "owner", what)


def waiter(data: dict[str, Any], what: str = "download group member") -> str:
    """The worker a download group's entry says waits for a version nobody holds."""
    return ident(data, "worker", what)


@dataclass(frozen=True)
class Roster:
    """The members of a cooperative download: the elected worker (member 0, the owner),
    then those it named; member ``i`` reads part ``i`` of ``len(members)``."""

    members: tuple[str, ...]

    @property
    def owner(self) -> str:
        """The worker that named them (member 0)."""
        return self.members[0]

    def index(self, worker: str) -> int | None:
        """``worker``'s member number, or None when it is not named."""
        return self.members.index(worker) if worker in self.members else None


def roster(data: dict[str, Any], what: str = "download roster") -> Roster:
    names = data.get("members")
    if not isinstance(names, list) or not 1 <= len(names) <= MAX_PARTS:
        raise UntrustedRecordError(
            f"{what}: members must be a list of 1 to {MAX_PARTS} worker names, got {_show(names)}")
    members = tuple(ident({"member": n}, "member", what) for n in names)
    if len(set(members)) != len(members):
        raise UntrustedRecordError(f"{what}: members must be distinct")
    return Roster(members=members)


@dataclass(frozen=True)
class Rescue:
    """A failed member's part of a cooperative download, spread over readers ``by`` (the
    elected worker's id, then this download's endpoint ids): ``by[s]`` reads and serves
    sub-part ``s`` of ``len(by)`` of part ``part``."""

    part: int
    by: tuple[str, ...]


def rescues(data: dict[str, Any], what: str = "download rescues") -> tuple[Rescue, ...]:
    items = data.get("rescues")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_PARTS:
        raise UntrustedRecordError(f"{what}: rescues must be a list of 1 to {MAX_PARTS}, got {_show(items)}")
    out: list[Rescue] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("by"), list) \
                or not 1 <= len(item["by"]) < MAX_PARTS:
            raise UntrustedRecordError(f"{what}: each rescue is a part and its readers, got {_show(item)}")
        part = integer(item, "part", what, 0, MAX_PARTS - 1)
        by = tuple(ident({"by": b}, "by", what) for b in item["by"])
        if len(set(by)) != len(by) or part in {r.part for r in out}:
            raise UntrustedRecordError(f"{what}: part {part} spread twice, or to a reader twice")
        out.append(Rescue(part, by))
    return tuple(out)


@dataclass(frozen=True)
class Claim:
    """A receiver's hold on one send slot of a peer."""

    token: str
    receiver: str


def claim(data: dict[str, Any], what: str = "claim") -> Claim:
    token = data.get("token")
    if not isinstance(token, str) or not _CLAIM.fullmatch(token):
        raise UntrustedRecordError(f"{what}: token must be a claim token, got {_show(token)}")
    return Claim(token=token, receiver=ident(data, "receiver", what))


@dataclass(frozen=True)
class Member:
    """One relay endpoint (a cohort member or a streamed download): where to reach it."""

    member_id: str
    address: str
    transport: str
    device: str

    def to_dict(self) -> dict[str, str]:
        return {"member_id": self.member_id, "address": self.address,
                "transport": self.transport, "device": self.device}


def member(data: dict[str, Any], what: str = "relay member") -> Member:
    return Member(
        member_id=ident(data, "member_id", what),
        address=address(data, "address", what),
        transport=choice(data, "transport", what, TRANSPORT_KINDS),
        device=choice(data, "device", what, DEVICES),
    )


def verdict(data: dict[str, Any], what: str = "relay verdict") -> bool:
    """Whether a relay member's own check passed (``{"member_id", "ok"}``; the schema's
    parser checks the member is its key's)."""
    ok = data.get("ok")
    if not isinstance(ok, bool):
        raise UntrustedRecordError(f"{what}: ok must be true or false, got {_show(ok)}")
    return ok


def text(raw: bytes | str | None, what: str, max_bytes: int) -> str:
    """Bytes a Redis reply holds as text (UTF-8, at most ``max_bytes``), or
    :class:`UntrustedRecordError`: the one place a raw reply becomes a ``str``."""
    if raw is None:
        raise UntrustedRecordError(f"{what}: absent")
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, bytes) or len(raw) > max_bytes:
        raise UntrustedRecordError(f"{what}: not a bounded string value")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UntrustedRecordError(f"{what}: not UTF-8 ({e.reason} at byte {e.start})") from e


def _is_ip(text: str, version: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


def _show(value: Any) -> str:
    """A short, safe rendering of a hostile value for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
