"""The Redis registry: who holds which version, ground-truth hashes, send slots, requests.

Every key lives under ``{settings.namespace}:`` and carries a TTL, so a crashed worker
leaves nothing behind for long; every value is JSON (never pickle: a Redis shared by a
fleet must not be able to run code in a worker).

Keys (``ns`` = namespace; ``v``/``r``/``w`` = version, rank, world size)::

    ns:peer:{v}:{r}:{w}:{peer_id}   PeerInfo JSON              TTL peer_ttl (heartbeat refreshes)
    ns:peers:{v}:{r}:{w}            set of peer_ids (index)    TTL peer_ttl (heartbeat refreshes)
    ns:gt:{v}:{r}:{w}               {"manifest_digest", "hashes"}, SET NX, TTL ground_truth_ttl
    ns:claim:{peer_id}:{slot}       {"token", "receiver"}      SET NX, TTL given by the claimer
    ns:req:{peer_id}                list of request JSON       TTL peer_ttl
    ns:hs:{transfer_id}:...         handshake / rendezvous     short TTL (see handshake.py)

The index set is only a hint to avoid ``SCAN`` on the hot path: the per-peer key with
its TTL is the truth, and members whose key expired are dropped when read.

Trust (DESIGN.md layer 9). Every record a worker acts on (peer entries, ground truth,
requests, handshake values) is signed when ``Settings.secret`` is set (:mod:`.auth`)
and parsed into a typed, bounded record (:mod:`.records`) when read. A value that is
unsigned, badly signed, expired, malformed or kept without a TTL is skipped, logged
(``record_rejected``) and counted (``on_untrusted``); it never raises out of a list.
A key without a TTL is also taken over by ``SET NX`` (it would otherwise hold a
claim, a lease or the ground truth forever).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis

from . import records
from .auth import Signer
from .config import Settings
from .errors import ConfigError, RegistryError, UntrustedRecordError
from .log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

#: Ground truth outlives a few missed heartbeats and the gap between a storage load and
#: the loader's first publish; once nobody relying on it is alive it may expire, and the
#: next storage loader writes it again.
GROUND_TRUTH_TTL_FACTOR = 6

_KEY_UNSAFE = " :*?[]"

# Delete a claim only if it still holds our token: a claim that expired and was taken
# by another receiver must survive our late release.
# SET NX that first drops a key kept without a TTL: written by hand or by an attacker,
# such a key would hold its claim, lease or ground truth forever.
_SET_NX_LUA = """
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('DEL', KEYS[1]) end
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 1 end
return 0
"""

_RELEASE_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, value = pcall(cjson.decode, raw)
if ok and type(value) == 'table' and value['token'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


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
    """``host:port`` of the sender's transport rendezvous (its TCPStore)."""
    started_at: float = field(default_factory=time.time)
    """Wall-clock time the peer finished loading (for ``status``)."""
    source: str = "storage"
    """Where this peer got its weights: ``storage`` or ``peer``."""
    max_sends: int = 1
    """How many receivers this peer serves at once (number of claim slots)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> PeerInfo:
        """Parse a registry value; :class:`UntrustedRecordError` (a
        :class:`RegistryError`) if it is not a valid, bounded PeerInfo."""
        return cls.from_record(records.load(raw, "peer entry"))

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> PeerInfo:
        """From a parsed (and verified) record; :class:`UntrustedRecordError` if invalid."""
        return cls(**vars(records.peer(data)))


@dataclass(frozen=True)
class PeerStatus:
    """One peer as :meth:`Registry.list_all` reports it."""

    info: PeerInfo
    age: float
    """Seconds since the peer finished loading."""
    ttl: float
    """Seconds until the entry expires without a heartbeat."""
    active_claims: int

    @property
    def busy(self) -> bool:
        return self.active_claims >= self.info.max_sends


class Registry:
    """Typed access to the coordination keys in Redis.

    Every Redis failure (connection refused, timeout, auth error) is raised as
    :class:`RegistryError`, chained to the redis-py error, so callers fall back on one
    exception type.
    """

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.ns = settings.namespace
        if client is None:
            try:
                client = redis.Redis.from_url(
                    settings.redis_url,
                    socket_timeout=settings.redis_timeout,
                    socket_connect_timeout=settings.redis_timeout,
                    health_check_interval=30,
                    decode_responses=True,
                )
            except ValueError as e:
                raise RegistryError(f"cannot use redis_url: {e}") from e
        elif not client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ConfigError("Registry needs a redis client made with decode_responses=True")
        self.client: redis.Redis = client
        self._release = self.client.register_script(_RELEASE_LUA)
        self._set_nx = self.client.register_script(_SET_NX_LUA)
        self.signer = Signer.from_settings(settings)
        self.on_untrusted: Callable[[str], None] | None = None
        """Called with the record kind each time a record is rejected (metrics)."""
        self.rejected = 0
        """Records rejected so far (a caller compares it before and after a read)."""

    # -- generic helpers ----------------------------------------------------------------

    def key(self, *parts: object) -> str:
        """``namespace:part1:part2...``."""
        return ":".join([self.ns, *(str(p) for p in parts)])

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except redis.RedisError as e:
            raise RegistryError(f"redis {what} failed ({_redact(self.settings.redis_url)}): {e}") from e

    def set_json(self, key: str, value: Any, ttl: float, *, nx: bool = False) -> bool:
        """Store ``value`` as JSON at ``key`` with a TTL in seconds; ``nx``: only if absent.

        Returns whether the value was written.
        """
        raw = json.dumps(value, separators=(",", ":"))
        if nx:
            return bool(self._call("SET NX", lambda: self._set_nx(keys=[key], args=[raw, _ms(ttl)])))
        return bool(self._call("SET", lambda: self.client.set(key, raw, px=_ms(ttl))))

    def set_signed(
        self, key: str, value: dict[str, Any], ttl: float, *, nx: bool = False, expires: bool = True
    ) -> bool:
        """:meth:`set_json` of ``value`` signed for ``key`` (with an expiry inside the
        signature unless ``expires`` is False, for records refreshed by ``PEXPIRE``)."""
        return self.set_json(key, self.signer.sign(key, value, ttl if expires else None), ttl, nx=nx)

    def get_signed(self, key: str, kind: str) -> dict[str, Any] | None:
        """The verified record at ``key``; None if absent or rejected (logged, counted)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        try:
            raw, ttl_ms = self._call("GET", pipe.execute)
        except RegistryError as e:
            if "WRONGTYPE" not in str(e):
                raise
            self.reject(kind, key, "wrong Redis type")
            return None
        if raw is None:
            return None
        try:
            return self.verify(key, raw, kind, ttl_ms)
        except UntrustedRecordError as e:
            self.reject(kind, key, str(e))
            return None

    def verify(
        self, key: str, raw: Any, kind: str, ttl_ms: int | None = None,
        max_bytes: int = records.MAX_RECORD_BYTES,
    ) -> dict[str, Any]:
        """Bounded JSON, a TTL, a good signature: the record, or UntrustedRecordError."""
        if ttl_ms is not None and int(ttl_ms) == -1:
            raise UntrustedRecordError(f"{key}: kept without a TTL")
        return self.signer.verify(key, records.load(raw, kind, max_bytes))

    def reject(self, kind: str, key: str, reason: str) -> None:
        """Log and count one rejected record."""
        log.warning("record_rejected", kind=kind, key=key, reason=reason)
        self.rejected += 1
        if self.on_untrusted is not None:
            self.on_untrusted(kind)

    def get_json(self, key: str) -> Any | None:
        """The JSON value at ``key``, or None if absent."""
        raw = self._call("GET", lambda: self.client.get(key))
        return None if raw is None else _loads(key, raw)

    def delete(self, *keys: str) -> None:
        if keys:
            self._call("DEL", lambda: self.client.delete(*keys))

    def ttl(self, key: str) -> float:
        """Seconds left on ``key`` (-2: absent, -1: no TTL), as Redis reports them."""
        ms = int(self._call("PTTL", lambda: self.client.pttl(key)))
        return ms / 1000 if ms >= 0 else float(ms)

    def scan(self, pattern: str) -> Iterator[str]:
        """Keys matching ``pattern`` (a glob under the namespace, e.g. ``peer:*``)."""
        it = self._call("SCAN", lambda: iter(list(self.client.scan_iter(self.key(pattern), count=500))))
        yield from it

    def ping(self) -> None:
        """Raise :class:`RegistryError` unless Redis answers."""
        self._call("PING", self.client.ping)

    def close(self) -> None:
        self.client.close()

    # -- availability ---------------------------------------------------------------------

    def _peer_key(self, version: str, rank: int, world_size: int, peer_id: str) -> str:
        return self.key("peer", version, rank, world_size, peer_id)

    def _index_key(self, version: str, rank: int, world_size: int) -> str:
        return self.key("peers", version, rank, world_size)

    def publish_peer(self, info: PeerInfo) -> None:
        """Announce that ``info.peer_id`` holds ``info.version`` (visible for ``peer_ttl``)."""
        for field_name in ("peer_id", "version"):
            value = getattr(info, field_name)
            # Both are parts of key names that are split and globbed later.
            if not value or any(c in value for c in _KEY_UNSAFE):
                raise ConfigError(f"{field_name}={value!r}: must be non-empty, without ':', spaces or globs")
        ttl = _ms(self.settings.peer_ttl)
        key = self._peer_key(info.version, info.rank, info.world_size, info.peer_id)
        # Re-signed at every heartbeat, so the expiry inside the signature moves too.
        value = json.dumps(self.signer.sign(key, asdict(info), self.settings.peer_ttl),
                           separators=(",", ":"))
        pipe = self.client.pipeline(transaction=True)
        pipe.set(key, value, px=ttl)
        index = self._index_key(info.version, info.rank, info.world_size)
        pipe.sadd(index, info.peer_id)
        pipe.pexpire(index, ttl)
        self._call("publish", pipe.execute)
        log.debug("peer_published", peer_id=info.peer_id, version=info.version, rank=info.rank)

    def heartbeat(self, info: PeerInfo) -> None:
        """Refresh the TTLs of the peer's keys and of the ground truth it relies on.

        Re-writes the entry rather than only extending it, so a peer whose entry already
        expired (a long GC pause, a Redis restart) becomes visible again.
        """
        self.publish_peer(info)
        gt = self.key("gt", info.version, info.rank, info.world_size)
        req = self.key("req", info.peer_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.pexpire(gt, _ms(self._ground_truth_ttl))
        pipe.pexpire(req, _ms(self.settings.peer_ttl))
        self._call("heartbeat", pipe.execute)

    def withdraw(self, peer_id: str, version: str) -> None:
        """Remove every availability entry of ``peer_id`` for ``version`` (all ranks)."""
        keys = list(self.scan(f"peer:{version}:*:*:{peer_id}"))
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            _, _, _, rank, world, _ = key.rsplit(":", 5)
            pipe.srem(self.key("peers", version, rank, world), peer_id)
        if keys:
            pipe.delete(*keys)
        pipe.delete(self.key("req", peer_id))
        self._call("withdraw", pipe.execute)
        log.debug("peer_withdrawn", peer_id=peer_id, version=version)

    def find_peers(self, version: str, rank: int, world_size: int) -> list[PeerInfo]:
        """Live peers holding ``version`` for this rank, least-claimed first.

        Ties are broken at random so that receivers starting together spread across
        peers instead of all asking the first one.
        """
        index = self._index_key(version, rank, world_size)
        ids = sorted(str(m) for m in self._call("SMEMBERS", lambda: self.client.smembers(index)))
        if not ids:
            return []
        keys = [self._peer_key(version, rank, world_size, pid) for pid in ids]
        raws, ttls = self._get_with_ttls(keys)
        dead = [pid for pid, raw in zip(ids, raws, strict=True) if raw is None]
        if dead:
            self._call("SREM", lambda: self.client.srem(index, *dead))
        peers: list[PeerInfo] = []
        for key, raw, ttl_ms in zip(keys, raws, ttls, strict=True):
            if raw is None:
                continue
            try:
                info = PeerInfo.from_record(self.verify(key, raw, "peer", ttl_ms))
                if (info.version, info.rank, info.world_size) != (version, rank, world_size) or (
                    key != self._peer_key(version, rank, world_size, info.peer_id)
                ):
                    raise UntrustedRecordError(f"{key}: entry describes another key")
            except UntrustedRecordError as e:
                self.reject("peer", key, str(e))
                continue
            peers.append(info)
        claims = self._claim_counts(peers)
        random.shuffle(peers)
        peers.sort(key=lambda p: claims[p.peer_id] / max(p.max_sends, 1))
        return peers

    def _get_with_ttls(self, keys: list[str]) -> tuple[list[Any], list[int]]:
        """Values (None for absent or non-string keys) and PTTLs, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.mget(keys)
        for key in keys:
            pipe.pttl(key)
        out = self._call("MGET", pipe.execute)
        return list(out[0]), [int(t) for t in out[1:]]

    def list_all(self) -> dict[str, list[PeerStatus]]:
        """Every live peer, grouped by version (for ``nccl-back status``)."""
        keys = list(self.scan("peer:*"))
        if not keys:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
            pipe.pttl(key)
        values = self._call("list", pipe.execute)
        peers: list[tuple[PeerInfo, float]] = []
        for key, raw, ttl_ms in zip(keys, values[::2], values[1::2], strict=True):
            if raw is not None:
                try:
                    info = PeerInfo.from_record(self.verify(key, raw, "peer", ttl_ms))
                except UntrustedRecordError as e:
                    self.reject("peer", key, str(e))
                    continue
                peers.append((info, max(int(ttl_ms), 0) / 1000))
        claims = self._claim_counts([p for p, _ in peers])
        now = time.time()
        out: dict[str, list[PeerStatus]] = {}
        for info, ttl in sorted(peers, key=lambda x: (x[0].version, x[0].rank, x[0].peer_id)):
            out.setdefault(info.version, []).append(
                PeerStatus(info, max(now - info.started_at, 0.0), ttl, claims[info.peer_id])
            )
        return out

    # -- ground truth ---------------------------------------------------------------------

    @property
    def _ground_truth_ttl(self) -> float:
        return self.settings.peer_ttl * GROUND_TRUTH_TTL_FACTOR

    def put_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str, hashes: dict[str, str]
    ) -> bool:
        """Store the integrity hashes of a storage load, unless some already exist.

        SET NX: ground truth is never overwritten (a worker that loaded from a peer must
        not replace what storage said). Returns True if this call stored it.
        """
        value = {"manifest_digest": manifest_digest, "hashes": hashes}
        # No expiry in the signature: heartbeats keep it alive with PEXPIRE.
        return self.set_signed(
            self.key("gt", version, rank, world_size), value, self._ground_truth_ttl, nx=True,
            expires=False,
        )

    def replace_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str, hashes: dict[str, str]
    ) -> None:
        """Overwrite the ground truth: a storage loader holds CRC32C-checked bytes, so
        its view wins over a stored record that is untrusted or disagrees with it."""
        value = {"manifest_digest": manifest_digest, "hashes": hashes}
        self.set_signed(self.key("gt", version, rank, world_size), value,
                        self._ground_truth_ttl, expires=False)

    def get_ground_truth(
        self, version: str, rank: int, world_size: int
    ) -> tuple[str, dict[str, str]] | None:
        """``(manifest_digest, hashes)`` stored by a storage load, or None.

        :class:`UntrustedRecordError` (logged, counted) if the stored record is
        unsigned, badly signed, malformed or kept without a TTL: never acted on.
        """
        key = self.key("gt", version, rank, world_size)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        try:
            raw, ttl_ms = self._call("GET", pipe.execute)
        except RegistryError as e:
            if "WRONGTYPE" not in str(e):
                raise
            raw, ttl_ms = [], -1  # a list or set: refused below as a wrong type
        if raw is None:
            return None
        try:
            value = self.verify(key, raw, "ground_truth", ttl_ms, records.MAX_GROUND_TRUTH_BYTES)
            return records.ground_truth(value)
        except UntrustedRecordError as e:
            self.reject("ground_truth", key, str(e))
            raise

    def has_ground_truth(self, version: str, rank: int, world_size: int) -> bool:
        key = self.key("gt", version, rank, world_size)
        return bool(self._call("EXISTS", lambda: self.client.exists(key)))

    # -- send slots -----------------------------------------------------------------------

    def _claim_key(self, peer_id: str, slot: int) -> str:
        return self.key("claim", peer_id, slot)

    def claim(self, peer_id: str, receiver_id: str, max_sends: int, ttl: float) -> str | None:
        """Take one of ``peer_id``'s ``max_sends`` send slots for ``ttl`` seconds.

        Returns a token for :meth:`release`, or None when every slot is taken. The slot
        expires by itself if the receiver dies holding it.
        """
        for slot in random.sample(range(max_sends), max_sends):
            token = f"{slot}:{uuid.uuid4().hex}"
            if self.set_json(
                self._claim_key(peer_id, slot), {"token": token, "receiver": receiver_id}, ttl, nx=True
            ):
                return token
        return None

    def release(self, peer_id: str, token: str) -> None:
        """Free the slot ``token`` holds, if it still holds it (compare-and-delete)."""
        slot, sep, _ = token.partition(":")
        if not sep or not slot.isdigit():
            raise RegistryError(f"malformed claim token {token!r}")
        key = self._claim_key(peer_id, int(slot))
        self._call("release", lambda: self._release(keys=[key], args=[token]))

    def active_claims(self, peer_id: str) -> int:
        """How many send slots of ``peer_id`` are taken now."""
        return sum(1 for _ in self.scan(f"claim:{peer_id}:*"))

    def _claim_counts(self, peers: list[PeerInfo]) -> dict[str, int]:
        if not peers:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for p in peers:
            pipe.exists(*[self._claim_key(p.peer_id, s) for s in range(max(p.max_sends, 1))])
        counts = self._call("EXISTS", pipe.execute)
        return {p.peer_id: int(c) for p, c in zip(peers, counts, strict=True)}

    # -- transfer requests ----------------------------------------------------------------

    def push_request(self, peer_id: str, request: dict[str, Any]) -> None:
        """Ask ``peer_id`` to serve one transfer (``request`` is JSON-serialisable)."""
        key = self.key("req", peer_id)
        signed = self.signer.sign(key, request, self.settings.peer_ttl)
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(key, json.dumps(signed, separators=(",", ":")))
        pipe.pexpire(key, _ms(self.settings.peer_ttl))
        self._call("push_request", pipe.execute)

    def pop_request(
        self, peer_id: str, timeout: float, *, clock: Callable[[], float] = time.monotonic
    ) -> dict[str, Any] | None:
        """The next valid request for ``peer_id``, waiting at most ``timeout`` seconds;
        else None. Invalid ones (unsigned, malformed, expired) are skipped and counted."""
        key = self.key("req", peer_id)
        deadline = clock() + timeout
        # Each BLPOP must end well within the socket timeout, or redis-py would report a
        # healthy idle wait as a dead connection.
        step = max(self.settings.redis_timeout / 2, 0.01)
        while True:
            left = deadline - clock()
            if left <= 0.001:
                # BLPOP 0 blocks forever: a last non-blocking look instead.
                raw = self._call("LPOP", lambda: self.client.lpop(key))
                return None if raw is None else self._request(key, cast(str, raw))
            got = self._call("BLPOP", partial(self.client.blpop, [key], timeout=min(left, step)))
            if got is not None:
                request = self._request(key, cast("tuple[str, str]", got)[1])
                if request is not None:
                    return request

    def _request(self, key: str, raw: str) -> dict[str, Any] | None:
        try:
            return vars(records.request(self.verify(key, raw, "request")))
        except UntrustedRecordError as e:
            self.reject("request", key, str(e))
            return None


def _redact(url: str) -> str:
    """``url`` without its password, fit for an error message or a log line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _ms(seconds: float) -> int:
    """Seconds -> whole milliseconds, at least 1 (Redis rejects a zero expiry)."""
    return max(int(seconds * 1000), 1)


def _loads(key: str, raw: str | bytes) -> Any:
    try:
        return records.load(raw, key, records.MAX_GROUND_TRUTH_BYTES)
    except UntrustedRecordError as e:
        raise RegistryError(f"value at {key} is not a bounded JSON object: {e}") from e
