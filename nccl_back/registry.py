"""The Redis registry: who holds which version, ground-truth hashes, send slots, requests.

Every key lives under ``{namespace}:`` (a hash tag: one cluster slot) and carries a TTL, so a crashed worker
leaves nothing behind for long; every value is JSON (never pickle: a Redis shared by a
fleet must not be able to run code in a worker).

This module is the one place the key schema lives: every other module asks it for
its keys. Keys (``ns`` = namespace; ``v``/``r``/``w`` = version, rank, world size;
``d`` = manifest digest)::

    ns:peer:{v}:{r}:{w}:{peer_id}   PeerInfo JSON              TTL peer_ttl (heartbeat refreshes)
    ns:peers:{v}:{r}:{w}            set of peer_ids (index)    TTL peer_ttl (heartbeat refreshes)
    ns:gt:{v}:{r}:{w}:{d}           {"manifest_digest", "hashes"}, SET NX, TTL ground_truth_ttl
                                    hashes keyed "{mode}|{layer}" (:func:`encode_truth`)
    ns:claim:{peer_id}:{slot}       {"token", "receiver"}      SET NX, TTL claim_ttl, renewed
    ns:req:{peer_id}                list of request JSON       TTL peer_ttl, newest 256 kept
    ns:dl:{v}:{w}                   {"owner": worker_id}       download lease (election.py)
    ns:cohort:{v}:{r}:{w}:{d}       hash {n, epoch}            TTL cohort_window (relay.py)
    ns:cohort:{v}:{r}:{w}:{d}:{e}:{c}  list of member JSON     TTL transfer_timeout + busy_wait
    ns:hs:{transfer_id}:{name}      handshake values, refusals  short TTL (handshake.py)

The index set is only a hint to avoid ``SCAN`` on the hot path: the per-peer key with
its TTL is the truth, and members whose key expired are dropped when read.

Trust (DESIGN.md layer 9). Every record a worker acts on (peer entries, ground truth,
requests, handshake values) is signed when ``Settings.secret`` is set (:mod:`.auth`)
and parsed into a typed, bounded record (:mod:`.records`) when read. A value that is
unsigned, badly signed, expired, malformed or kept without a TTL is skipped, logged
(``record_rejected``) and counted (``on_untrusted``); it never raises out of a list.
``SET NX`` also takes over a key kept without a TTL (it would otherwise hold a claim,
a lease or the ground truth forever).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.exceptions import RedisClusterException

from . import records, redisclient
from .auth import Signer
from .config import Settings
from .errors import ConfigError, RegistryError, UntrustedRecordError
from .log import get_logger
from .records import PeerInfo

log = get_logger(__name__)

T = TypeVar("T")

#: What :meth:`Registry._get_with_ttl` returns for a key of another Redis type.
_WRONG_TYPE: Any = object()

#: Ground truth outlives a few missed heartbeats and the gap between a storage load and
#: the loader's first publish; once nobody relying on it is alive it may expire, and the
#: next storage loader writes it again.
GROUND_TRUTH_TTL_FACTOR = 6

_KEY_UNSAFE = " :*?[]"

#: Requests kept in one peer's queue (the newest); a flood beyond it is trimmed away.
MAX_QUEUED_REQUESTS = 256

#: Separates the hash mode from the layer name in stored ground truth ("sampled|layer0").
TRUTH_SEP = "|"

# Delete a claim only if it still holds our token: a claim that expired and was taken
# by another receiver must survive our late release.
_RELEASE_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, value = pcall(cjson.decode, raw)
if ok and type(value) == 'table' and value['token'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# SET NX that first drops a key kept without a TTL: written by hand or by an attacker,
# such a key would hold its claim, lease or ground truth forever.
_SET_NX_LUA = """
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('DEL', KEYS[1]) end
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 1 end
return 0
"""

# Compare-and-set on the raw JSON value (handshake.py): the side
# that loses the race learns it from the return value, never from a later read.
_CAS_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) and 1 or 0
end
return 0
"""
_CAD_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# Extend a claim only while it still holds our token.
_RENEW_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, value = pcall(cjson.decode, raw)
if ok and type(value) == 'table' and value['token'] == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


# Take a seat in the current cohort: the n-th arrival of a window sits at position
# (n-1) % max in chain (n-1) // max; the record is pushed in the same step, so the
# list index is the position. A new window (the hash expired) gets a new epoch.
_JOIN_COHORT_LUA = """
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
if n == 1 then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
local epoch = redis.call('HGET', KEYS[1], 'epoch') or ARGV[1]
local size = tonumber(ARGV[3])
local chain = KEYS[1] .. ':' .. epoch .. ':' .. math.floor((n - 1) / size)
redis.call('RPUSH', chain, ARGV[4])
redis.call('PEXPIRE', chain, ARGV[5])
return {chain, (n - 1) % size}
"""


def encode_truth(by_mode: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{mode: {layer: hash}}`` -> the flat ``{"mode|layer": hash}`` stored in Redis."""
    return {f"{mode}{TRUTH_SEP}{layer}": h for mode, hashes in by_mode.items()
            for layer, h in hashes.items()}


def truth_for_mode(hashes: dict[str, str], mode: str) -> dict[str, str]:
    """The ``mode`` part of stored ground truth, keyed by layer (inverse of :func:`encode_truth`)."""
    prefix = mode + TRUTH_SEP
    return {k[len(prefix):]: v for k, v in hashes.items() if k.startswith(prefix)}


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
            # One server, Sentinel or Cluster, plain or TLS (see redisclient.py).
            try:
                client = redisclient.connect(settings)
            except (redis.RedisError, RedisClusterException) as e:
                raise RegistryError(
                    f"cannot reach redis ({_redact(settings.redis_url)}): {redisclient.explain(e)}"
                ) from e
        elif not redisclient.decodes_responses(client):
            raise ConfigError("Registry needs a redis client made with decode_responses=True")
        self.client: redis.Redis = client
        self._release = self.client.register_script(_RELEASE_LUA)
        self._renew = self.client.register_script(_RENEW_LUA)
        self._cas = self.client.register_script(_CAS_LUA)
        self._cad = self.client.register_script(_CAD_LUA)
        self._join_cohort = self.client.register_script(_JOIN_COHORT_LUA)
        self._set_nx = self.client.register_script(_SET_NX_LUA)
        self.signer = Signer.from_settings(settings)
        self.on_untrusted: Callable[[str], None] | None = None
        """Called with the record kind each time a record is rejected (metrics)."""
        self.rejected = 0
        """Records rejected so far (a caller compares it before and after a read)."""

    # -- generic helpers ----------------------------------------------------------------

    def key(self, *parts: object) -> str:
        """``{namespace}:part1:part2...``: the namespace is a hash tag, so on a Redis
        Cluster every key of a namespace is in one slot (multi-key commands, transactions
        and scripts need that); on one server it is just a prefix."""
        return ":".join(["{" + self.ns + "}", *(str(p) for p in parts)])

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (redis.RedisError, RedisClusterException) as e:
            raise RegistryError(
                f"redis {what} failed ({_redact(self.settings.redis_url)}): {redisclient.explain(e)}"
            ) from e

    def set_json(self, key: str, value: Any, ttl: float, *, nx: bool = False) -> bool:
        """Store ``value`` as JSON at ``key`` with a TTL in seconds; ``nx``: only if absent.

        Returns whether the value was written.
        """
        raw = value if isinstance(value, _Raw) else _dumps(value)
        if nx:
            return bool(self._call("SET NX", lambda: self._set_nx(keys=[key], args=[raw, _ms(ttl)])))
        return bool(self._call("SET", lambda: self.client.set(key, raw, px=_ms(ttl))))

    def signed(self, key: str, value: dict[str, Any], ttl: float, *, expires: bool = True) -> _Raw:
        """``value`` signed for ``key`` and serialised, ready for :meth:`set_json` or a
        compare-and-set (with an expiry inside the signature unless ``expires`` is
        False, for records kept alive by ``PEXPIRE``)."""
        return _Raw(_dumps(self.signer.sign(key, value, ttl if expires else None)))

    def set_signed(
        self, key: str, value: dict[str, Any], ttl: float, *, nx: bool = False, expires: bool = True
    ) -> bool:
        """:meth:`set_json` of ``value`` signed for ``key`` (see :meth:`signed`)."""
        return self.set_json(key, self.signed(key, value, ttl, expires=expires), ttl, nx=nx)

    def _get_with_ttl(self, key: str) -> tuple[Any, int]:
        """``(raw value or None, PTTL in ms)`` in one round trip; ``_WRONG_TYPE`` as the
        value when the key holds a list, set or hash (another writer's, never ours)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        try:
            raw, ttl_ms = self._call("GET", pipe.execute)
        except RegistryError as e:
            if "WRONGTYPE" not in str(e):
                raise
            return _WRONG_TYPE, -2
        return raw, int(ttl_ms)

    def get_signed(self, key: str, kind: str) -> tuple[dict[str, Any], _Raw] | None:
        """The verified record at ``key`` and its raw value (for a compare-and-set);
        None if absent or rejected (logged, counted)."""
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is _WRONG_TYPE:
            self.reject(kind, key, "wrong Redis type")
            return None
        if raw is None:
            return None
        try:
            return self.verify(key, raw, kind, ttl_ms), _Raw(raw)
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

    def compare_and_set(self, key: str, expected: Any, value: Any, ttl: float) -> bool:
        """Replace ``key``'s JSON value by ``value`` only if it is exactly ``expected``."""
        old = expected if isinstance(expected, _Raw) else _dumps(expected)
        new = value if isinstance(value, _Raw) else _dumps(value)
        return bool(self._call("CAS", lambda: self._cas(keys=[key], args=[old, new, _ms(ttl)])))

    # -- key schema -------------------------------------------------------------------

    def lease_key(self, version: str, world_size: int) -> str:
        """The single-flight download lease of ``version`` for workers of ``world_size``
        ranks: one per worker (taken by its rank 0), never one per rank."""
        return self.key("dl", version, world_size)

    def handshake_key(self, transfer_id: str, name: str) -> str:
        """A per-transfer key (handshake nonces, refusals), scoped by ``transfer_id``."""
        return self.key("hs", transfer_id, name)

    def ground_truth_key(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """Ground truth of one rank's skeleton flavour (keyed by its manifest digest)."""
        return self.key("gt", version, rank, world_size, manifest_digest)

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
        value = self.signed(key, asdict(info), self.settings.peer_ttl)
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
        gt = self.ground_truth_key(info.version, info.rank, info.world_size, info.manifest_digest)
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
            try:  # one bad entry must not hide the good ones
                info = PeerInfo.from_record(self.verify(key, raw, "peer", ttl_ms))
                if key != self._peer_key(info.version, info.rank, info.world_size, info.peer_id) or (
                    (info.version, info.rank, info.world_size) != (version, rank, world_size)
                ):
                    raise UntrustedRecordError(f"{key}: the entry describes another key")
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
        for key in keys:  # GETs, not MGET: a cluster pipeline refuses MGET
            pipe.get(key)
            pipe.pttl(key)
        try:
            out = self._call("GET", pipe.execute)
        except RegistryError as e:
            if "WRONGTYPE" not in str(e):
                raise
            # Some key holds a list or a set: read them one by one, wrong types as absent.
            out = []
            for key in keys:
                try:
                    out += [self._call("GET", partial(self.client.get, key)), self.ttl(key)]
                except RegistryError:
                    self.reject("peer", key, "wrong Redis type")
                    out += [None, -2]
        return list(out[::2]), [int(t) for t in out[1::2]]

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

        Keyed by the manifest digest too, so each skeleton flavour (equally valid, with
        another layout) has its own. SET NX: ground truth is never overwritten (a worker
        that loaded from a peer must not replace what storage said). Returns True if this
        call stored it.
        """
        value = {"manifest_digest": manifest_digest, "hashes": hashes}
        key = self.ground_truth_key(version, rank, world_size, manifest_digest)
        # No expiry inside the signature: heartbeats keep it alive with PEXPIRE.
        return self.set_signed(key, value, self._ground_truth_ttl, nx=True, expires=False)

    def replace_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str, hashes: dict[str, str]
    ) -> None:
        """Overwrite the ground truth: a storage loader holds CRC32C-checked bytes, so
        its view wins over a stored record that is untrusted or disagrees with it."""
        value = {"manifest_digest": manifest_digest, "hashes": hashes}
        key = self.ground_truth_key(version, rank, world_size, manifest_digest)
        self.set_signed(key, value, self._ground_truth_ttl, expires=False)

    def get_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str
    ) -> dict[str, str] | None:
        """The hashes a storage load stored for this skeleton flavour, or None.

        :class:`UntrustedRecordError` (logged, counted) if the stored record is
        unsigned, badly signed, malformed or kept without a TTL: never acted on.
        """
        key = self.ground_truth_key(version, rank, world_size, manifest_digest)
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is _WRONG_TYPE:
            raw = []  # a list or set: refused below as a wrong type
        if raw is None:
            return None
        try:
            value = self.verify(key, raw, "ground_truth", ttl_ms, records.MAX_GROUND_TRUTH_BYTES)
            digest, hashes = records.ground_truth(value)
            if digest != manifest_digest:
                raise UntrustedRecordError(f"{key}: digest {digest!r} under another key")
            return hashes
        except UntrustedRecordError as e:
            self.reject("ground_truth", key, str(e))
            raise

    def has_ground_truth(
        self, version: str, rank: int, world_size: int, manifest_digest: str | None = None
    ) -> bool:
        """Whether ground truth exists for this rank (of one flavour, or of any)."""
        if manifest_digest is not None:
            key = self.ground_truth_key(version, rank, world_size, manifest_digest)
            return bool(self._call("EXISTS", lambda: self.client.exists(key)))
        return any(True for _ in self.scan(f"gt:{version}:{rank}:{world_size}:*"))

    # -- send slots -----------------------------------------------------------------------

    def _claim_key(self, peer_id: str, slot: int) -> str:
        return self.key("claim", peer_id, slot)

    def claim(self, peer_id: str, receiver_id: str, max_sends: int, ttl: float) -> str | None:
        """Take one of ``peer_id``'s ``max_sends`` send slots for ``ttl`` seconds.

        Returns a token for :meth:`renew_claim` and :meth:`release`, or None when every
        slot is taken. The slot expires by itself if the receiver dies holding it.
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
        key = self._claim_key(peer_id, _claim_slot(token))
        self._call("release", lambda: self._release(keys=[key], args=[token]))

    def renew_claim(self, peer_id: str, token: str, ttl: float) -> bool:
        """Extend the slot ``token`` holds by ``ttl`` seconds; False if it is no longer ours."""
        key = self._claim_key(peer_id, _claim_slot(token))
        return bool(self._call("renew_claim", lambda: self._renew(keys=[key], args=[token, _ms(ttl)])))

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

    # -- cohorts (relay.py) ---------------------------------------------------------------

    def cohort_key(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """The current cohort of receivers of one rank's skeleton flavour."""
        return self.key("cohort", version, rank, world_size, manifest_digest)

    def join_cohort(
        self, version: str, rank: int, world_size: int, manifest_digest: str,
        member: dict[str, Any], *, window: float, max_size: int, ttl: float,
    ) -> tuple[str, int]:
        """Append ``member`` to the current cohort's chain: ``(chain key, position)``."""
        key = self.cohort_key(version, rank, world_size, manifest_digest)
        record = self.signed(key, member, ttl)  # bound to the cohort, like every record
        got = self._call("join_cohort", lambda: self._join_cohort(
            keys=[key], args=[uuid.uuid4().hex[:12], _ms(window), max(int(max_size), 1),
                              str(record), _ms(ttl)]))
        try:
            chain, position = got
            return str(chain), int(position)
        except (TypeError, ValueError) as e:
            raise RegistryError(f"join_cohort: unexpected reply {got!r}") from e

    def chain_members(self, chain: str, first: int, last: int) -> list[dict[str, Any] | None]:
        """Member records at positions ``first..last`` of ``chain``, signature checked
        (None where a record is untrusted: skipped with a reason, counted)."""
        if not chain.startswith(self.key("cohort", "")):
            raise RegistryError(f"{chain!r} is not a cohort chain key")
        cohort = chain.rsplit(":", 2)[0]
        raws = self._call("LRANGE", lambda: self.client.lrange(chain, first, last))
        out: list[dict[str, Any] | None] = []
        for raw in raws:
            try:
                out.append(self.verify(cohort, raw, "cohort member"))
            except UntrustedRecordError as e:
                self.reject("cohort member", chain, str(e))
                out.append(None)
        return out

    # -- downloads streamed to waiting workers (relay.py) ----------------------------------

    def stream_key(self, version: str, rank: int, world_size: int, manifest_digest: str) -> str:
        """The relay endpoint of the worker downloading one rank's skeleton flavour."""
        return self.key("stream", version, rank, world_size, manifest_digest)

    def put_stream(self, version: str, rank: int, world_size: int, manifest_digest: str,
                   member: dict[str, Any], ttl: float) -> None:
        """Announce (signed, with a TTL) the relay endpoint a download is streamed from."""
        self.set_signed(self.stream_key(version, rank, world_size, manifest_digest), member, ttl)

    def get_stream(self, version: str, rank: int, world_size: int,
                   manifest_digest: str) -> dict[str, Any] | None:
        """The verified stream record, or None (absent, or untrusted: skipped with a reason)."""
        got = self.get_signed(self.stream_key(version, rank, world_size, manifest_digest),
                              "download stream")
        return None if got is None else got[0]

    def drop_stream(self, version: str, rank: int, world_size: int, manifest_digest: str,
                    member_id: str) -> None:
        """Remove the stream record if it is still ours (a new downloader's stays)."""
        key = self.stream_key(version, rank, world_size, manifest_digest)
        got = self.get_signed(key, "download stream")
        if got is not None and got[0].get("member_id") == member_id:
            self._call("DEL", lambda: self._cad(keys=[key], args=[str(got[1])]))

    # -- transfer requests ----------------------------------------------------------------

    def push_request(self, peer_id: str, request: dict[str, Any]) -> None:
        """Ask ``peer_id`` to serve one transfer (``request`` is JSON-serialisable)."""
        key = self.key("req", peer_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(key, self.signed(key, request, self.settings.peer_ttl))
        # Keep only the newest requests: a flood written before ours cannot bury it.
        pipe.ltrim(key, -MAX_QUEUED_REQUESTS, -1)
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
                raw = self._call("RPOP", lambda: self.client.rpop(key))
                return None if raw is None else self._request(key, cast(str, raw))
            # Newest first: its receiver is still waiting; older ones may have given up,
            # and a flood pushed earlier must not delay it.
            got = self._call("BRPOP", partial(self.client.brpop, [key], timeout=min(left, step)))
            if got is not None:
                request = self._request(key, cast("tuple[str, str]", got)[1])
                if request is not None:
                    return request

    def _request(self, key: str, raw: str) -> dict[str, Any] | None:
        try:
            return records.request(self.verify(key, raw, "request")).to_dict()
        except UntrustedRecordError as e:
            self.reject("request", key, str(e))
            return None


def _claim_slot(token: str) -> int:
    slot, sep, _ = token.partition(":")
    if not sep or not slot.isdigit():
        raise RegistryError(f"malformed claim token {token!r}")
    return int(slot)


class _Raw(str):
    """A value already serialised (and signed): stored and compared as it is."""


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


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
