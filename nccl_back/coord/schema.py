"""The record schema: every kind of Redis key nccl_back writes, in one table.

Each :class:`KeyKind` gives a key's prefix and parts, the
:class:`~nccl_back.errors.RecordKind` it is rejected under, its Redis type, signing, TTL,
size bound and typed parser. :mod:`.keys` builds names from it, :mod:`.signed_store`
reads through it, and the hostile-Redis tests and the soak generate their corruptions
from it (ARCHITECTURE.md, "A new record kind"). Values are decoded by their parser,
never the Redis client, so any bytes end in a parsed record or an
:class:`~nccl_back.errors.UntrustedRecordError`.

Signing rules, by what a record does:

- ``GRANT``: it grants something or says someone is alive: an expiry inside the
  signature, re-signed to renew, so a copy replayed after its writer stopped is refused.
- ``CONTENT``: it states content (truth, layouts): no expiry, kept by ``PEXPIRE``; a
  replayed copy says what the original said, so replaying it grants nothing.
- ``HMAC``: the rendezvous' own MAC over raw bytes.
- ``NONE``: hints checked against signed records (the peer index, the cohort counter)
  and ``check``'s round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nccl_back.config import Settings
from nccl_back.coord import content, records
from nccl_back.errors import RecordKind, StrEnum, UntrustedRecordError
from nccl_back.timing import (
    ARTIFACT_TTL_FACTOR,
    CHECK_TTL,
    GROUND_TRUTH_TTL_FACTOR,
    HANDSHAKE_KEY_TTL,
)

Parser = Callable[[dict[str, Any], Mapping[str, str], Settings], Any]
"""A verified record's body, its key's parts, the reader's settings -> the typed record."""

#: Bytes of one peer entry, request, claim, lease or handshake value (real ones < 1 KiB).
SMALL = records.MAX_RECORD_BYTES
#: Bytes of a ground-truth or position-truth record.
TRUTH = 64 << 20
#: Bytes of a layout record (a 100-layer model's is ~100 KiB).
LAYOUT = 4 << 20
#: Bytes of an artifact set's manifest record.
ARTIFACT = 8 << 20


class RedisType(StrEnum):
    """The Redis type a genuine writer gives a key."""

    STRING = "string"
    LIST = "list"
    SET = "set"
    HASH = "hash"


#: Every Redis type a key may be found holding (the hostile tests write each).
REDIS_TYPES = ("string", "list", "set", "hash", "zset")


class Signing(StrEnum):
    """How a kind's values are signed (see the module docstring)."""

    GRANT = "grant"
    CONTENT = "content"
    HMAC = "hmac"
    NONE = "none"


@dataclass(frozen=True)
class KeyKind:
    """One kind of key: ``{namespace}:{prefix}:{parts...}``."""

    name: str
    """The kind's name (unique; the prefix, but for a cohort's chains: ``chain``)."""
    prefix: str
    parts: tuple[str, ...]
    """What follows the prefix, in order (a chain key has its cohort's parts first)."""
    kind: RecordKind | None
    """What a rejected value is counted as (None: nothing of it is ever rejected)."""
    redis_type: RedisType
    signing: Signing
    ttl: Callable[[Settings], float]
    """The TTL its writers give it, in seconds (values kept far beyond it are refused)."""
    max_bytes: int
    """The largest value (or list item) a genuine writer stores."""
    doc: str
    parse: Parser | None = None
    """The typed parser every value (or list item) must pass; None: a hint, or a format
    another module owns."""

    @property
    def expires(self) -> bool:
        """Whether its signature carries an expiry."""
        return self.signing is Signing.GRANT

    def matches(self, parts: list[str]) -> bool:
        """Whether a key's parts after the namespace (``[prefix, ...]``) are of this kind."""
        return bool(parts) and parts[0] == self.prefix and len(parts) - 1 == len(self.parts)

    def parts_of(self, key: str) -> dict[str, str]:
        """The named parts of one of its keys (:class:`UntrustedRecordError` if not one)."""
        _, sep, rest = key.partition("}:")
        got = rest.split(":")
        if not sep or not self.matches(got):
            raise UntrustedRecordError(f"{key[:80]!r} is not a {self.name} key")
        return dict(zip(self.parts, got[1:], strict=True))


def _peer_ttl(s: Settings) -> float:
    return s.peer_ttl


def _truth_ttl(s: Settings) -> float:
    return s.peer_ttl * GROUND_TRUTH_TTL_FACTOR


def _chain_ttl(s: Settings) -> float:
    return s.transfer_timeout + s.busy_wait


def _download_ttl(s: Settings) -> float:
    return s.transfer_timeout + s.single_flight_max_wait


def _artifact_ttl(s: Settings) -> float:
    return s.peer_ttl * ARTIFACT_TTL_FACTOR


def _plain(parse: Callable[[dict[str, Any]], Any]) -> Parser:
    """A parser of the body alone (the key is bound by the signature)."""
    return lambda body, parts, settings: parse(body)


def _strip(parse: Callable[[dict[str, Any], Mapping[str, str]], Any]) -> Parser:
    """A parser that checks the body describes its own key's parts."""
    return lambda body, parts, settings: parse(body, parts)


def _peer(body: dict[str, Any], parts: Mapping[str, str], settings: Settings) -> records.PeerInfo:
    info = records.peer(body)
    if parts and (info.version, str(info.rank), str(info.world_size), info.peer_id) != (
            parts.get("version"), parts.get("rank"), parts.get("world"), parts.get("peer_id")):
        raise UntrustedRecordError("peer entry: the entry describes another key")
    return info


def _named(what: str) -> Parser:
    """A parser of ``{"member_id": ...}`` naming its own key's member."""
    return _strip(lambda body, parts: content.of_key(body, "member_id", parts, "member_id", what))


def _verdict(body: dict[str, Any], parts: Mapping[str, str], settings: Settings) -> bool:
    """Whether the member its key names passed its own check."""
    _named("relay verdict")(body, parts, settings)
    return records.verdict(body)


_VRW = ("version", "rank", "world")
S, L, SET, H = RedisType.STRING, RedisType.LIST, RedisType.SET, RedisType.HASH
G, C = Signing.GRANT, Signing.CONTENT

PEER = KeyKind("peer", "peer", (*_VRW, "peer_id"), RecordKind.PEER, S, G, _peer_ttl, SMALL,
               "a holder's entry: how to reach it, what it holds",
              parse=_peer)
INDEX = KeyKind("peers", "peers", _VRW, RecordKind.INDEX, SET, Signing.NONE, _peer_ttl, 300,
                "the peer ids of one rank (a hint: the entries are the truth)")
GROUND_TRUTH = KeyKind("gt", "gt", (*_VRW, "manifest", "scheme"), RecordKind.GROUND_TRUTH, S, C,
                       _truth_ttl, TRUTH, "layer hashes of a storage load, per skeleton flavour",
                      parse=_strip(content.ground_truth))
LAYOUT_RECORD = KeyKind("layout", "layout", ("layout",), RecordKind.LAYOUT, S, C, _truth_ttl,
                        LAYOUT, "a layout description, content-addressed",
                       parse=_strip(content.layout_record))
GROUP = KeyKind("group", "group", ("group",), RecordKind.GROUP, S, C, _truth_ttl, SMALL * 64,
                "the holder layouts a reshard plan is computed over, content-addressed",
               parse=_strip(content.group))
POSITION_TRUTH = KeyKind("ct", "ct", (*_VRW, "layout", "scheme"), RecordKind.POSITION_TRUTH, S, C,
                         _truth_ttl, TRUTH, "truth in checkpoint coordinates of one layout's rank",
                        parse=_strip(content.position_truth))
CLAIM = KeyKind("claim", "claim", ("peer_id", "slot"), RecordKind.CLAIM, S, G,
                lambda s: s.claim_ttl, SMALL, "a receiver's hold on one send slot",
               parse=_plain(records.claim))
REQUEST = KeyKind("req", "req", ("peer_id",), RecordKind.REQUEST, L, G, _peer_ttl, SMALL,
                  "the transfer requests a sender serves (a list of signed records)",
                 parse=_plain(records.request))
LEASE = KeyKind("dl", "dl", ("version", "world"), RecordKind.LEASE, S, G,
                lambda s: s.download_lease, SMALL, "the single-flight download lease",
               parse=_plain(records.lease))
DOWNLOAD_GROUP = KeyKind("dlg", "dlg", ("version", "world"), RecordKind.DOWNLOAD_GROUP, L, G,
                         lambda s: s.single_flight_max_wait, SMALL,
                         "the workers waiting together for a version nobody holds, in arrival"
                         " order", parse=_plain(records.waiter))
DOWNLOAD_ROSTER = KeyKind("dlr", "dlr", ("version", "world"), RecordKind.DOWNLOAD_ROSTER, S, G,
                          lambda s: s.single_flight_max_wait, SMALL,
                          "the members of a cooperative download, named by the worker elected",
                          parse=_plain(records.roster))
DOWNLOAD_MEMBER = KeyKind("dlm", "dlm", (*_VRW, "member"), RecordKind.DOWNLOAD_MEMBER, S, G,
                          lambda s: s.claim_ttl, SMALL,
                          "the relay endpoint a cooperative download's member serves its part from",
                          parse=_plain(records.member))
DOWNLOAD_RESCUE = KeyKind("dlx", "dlx", _VRW, RecordKind.DOWNLOAD_RESCUE, S, G,
                          lambda s: s.single_flight_max_wait, SMALL,
                          "failed members' parts of a cooperative download, spread over the others",
                          parse=_plain(records.rescues))
COHORT = KeyKind("cohort", "cohort", (*_VRW, "manifest"), None, H, Signing.NONE,
                 lambda s: s.cohort_window, SMALL, "a cohort's arrival counter and epoch")
CHAIN = KeyKind("chain", "cohort", (*_VRW, "manifest", "epoch", "chain"), RecordKind.COHORT_MEMBER,
                L, G, _chain_ttl, SMALL, "the member records of one chain, in seat order",
               parse=_plain(records.member))
STREAM = KeyKind("stream", "stream", (*_VRW, "manifest"), RecordKind.DOWNLOAD_STREAM, S, G,
                 _download_ttl, SMALL, "the relay endpoint a download is streamed from",
                parse=_plain(records.member))
GONE = KeyKind("gone", "gone", ("member_id",), RecordKind.GONE, S, G, _chain_ttl, SMALL,
               "a relay endpoint that has stopped",
              parse=_named("tombstone"))
VERDICT = KeyKind("verdict", "verdict", ("member_id",), RecordKind.VERDICT, S, G, _chain_ttl, SMALL,
                  "a relay member's own check, passed or failed (whether it forwarded wrong bytes)",
                  parse=_verdict)
ALIVE = KeyKind("alive", "alive", ("member_id",), RecordKind.ALIVE, S, G, lambda s: s.claim_ttl, SMALL,
                "a relay endpoint that serves: renewed every third of its TTL (a stopped one's lapses)",
                parse=_named("liveness mark"))
HANDSHAKE = KeyKind("hs", "hs", ("transfer_id", "name"), RecordKind.HANDSHAKE, S, G,
                    lambda s: HANDSHAKE_KEY_TTL, SMALL, "handshake values and refusals",
                   parse=_plain(records.handshake))
RENDEZVOUS = KeyKind("rdv", "rdv", ("scope", "name"), RecordKind.RENDEZVOUS, S, Signing.HMAC,
                     _download_ttl, 32 << 10,
                     "a process group's bootstrap values")
CHECK = KeyKind("check", "check", ("token",), None, S, Signing.NONE, lambda s: CHECK_TTL, 1,
                "nccl-back check's write/read round trip")
ARTIFACT_SET = KeyKind("art", "art", ("lookup",), RecordKind.ARTIFACT_SET, S, G, _artifact_ttl,
                       ARTIFACT, "an artifact set's manifest by lookup key",
                      parse=_strip(content.artifact_set))
ARTIFACT_INDEX = KeyKind("artidx", "artidx", ("scope",), RecordKind.ARTIFACT_INDEX, S, G,
                         _artifact_ttl, SMALL, "a model's newest artifact set and its factors",
                        parse=_plain(content.artifact_index))

#: Every kind of key, in the order of the key schema.
KINDS: tuple[KeyKind, ...] = (
    PEER, INDEX, GROUND_TRUTH, LAYOUT_RECORD, GROUP, POSITION_TRUTH, CLAIM, REQUEST, LEASE,
    DOWNLOAD_GROUP, DOWNLOAD_ROSTER, DOWNLOAD_MEMBER, DOWNLOAD_RESCUE, COHORT, CHAIN, STREAM, GONE,
    VERDICT, ALIVE, HANDSHAKE, RENDEZVOUS, CHECK,
    ARTIFACT_SET, ARTIFACT_INDEX,
)
BY_NAME: dict[str, KeyKind] = {k.name: k for k in KINDS}


def kind_of(key: str) -> KeyKind | None:
    """The kind of a key of any namespace (``{ns}:prefix:...``), or None."""
    _, sep, rest = key.partition("}:")
    if not sep:
        return None
    parts = rest.split(":")
    return next((k for k in KINDS if k.matches(parts)), None)
