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
    ns:claim:{peer_id}:{slot}       {"token", "receiver"}      signed, SET NX, TTL claim_ttl, renewed
    ns:req:{peer_id}                list of request JSON       TTL peer_ttl, newest 256 kept
    ns:dl:{v}:{w}                   {"owner": worker_id}       signed, expiring: download lease (election.py)
    ns:cohort:{v}:{r}:{w}:{d}       hash {n, epoch}            TTL cohort_window (relay.py)
    ns:cohort:{v}:{r}:{w}:{d}:{e}:{c}  list of member JSON     TTL transfer_timeout + busy_wait
    ns:hs:{transfer_id}:{name}      handshake values, refusals  short TTL (handshake.py)
    ns:stream:{v}:{r}:{w}:{d}       relay endpoint of a download, signed (relay.py)

Each kind of record read back is one :class:`~nccl_back.errors.RecordKind` (the label
it is rejected and counted under).

The index set is only a hint to avoid ``SCAN`` on the hot path: the per-peer key with
its TTL is the truth, and members whose key expired are dropped when read.

Trust (DESIGN.md layer 9). Every record a worker acts on (peer entries, ground truth,
requests, handshake values) is signed when ``Settings.secret`` is set (:mod:`.auth`)
and parsed into a typed, bounded record (:mod:`.records`) when read. A value that is
unsigned, badly signed, expired, malformed or kept without a TTL is skipped, logged
(``record_rejected``) and counted (``on_untrusted``); it never raises out of a list.
``SET NX`` also takes over a key kept without a TTL or of the wrong Redis type (it
would otherwise hold a claim, a lease or the ground truth forever).

Hostile values cost a bounded delay, never the fleet (issue 18): whatever sits at a
key, a writer with the secret repairs it atomically: a claim or lease that does not
verify is taken over (:meth:`Registry.acquire`), a wrong-type index, request list or
cohort is replaced in the same script that writes ours, and holders re-publish the
ground truth they hold at every heartbeat (after a ``FLUSHALL`` or a failover to an
empty replica, or over a forged record).
"""

from __future__ import annotations

import hashlib
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

from nccl_back.config import Settings
from nccl_back.coord import records, redisclient
from nccl_back.coord.auth import Signer
from nccl_back.coord.records import PeerInfo
from nccl_back.errors import ConfigError, RecordKind, RegistryError, UntrustedRecordError
from nccl_back.log import get_logger

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

# SET NX that first drops a key kept without a TTL or holding another Redis type: written
# by hand or by an attacker, such a key would hold its claim, lease or ground truth forever.
_SET_NX_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'none' and (t ~= 'string' or redis.call('PTTL', KEYS[1]) == -1) then
  redis.call('DEL', KEYS[1])
end
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX') then return 1 end
return 0
"""

# Take over a key whose value the caller read and found untrusted (ARGV[1]; '' for a
# wrong type): only if it still holds exactly that, so a genuine writer that got there
# meanwhile keeps it.
_TAKE_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if (t == 'string' and redis.call('GET', KEYS[1]) == ARGV[1]) or (t ~= 'string' and t ~= 'none') then
  redis.call('DEL', KEYS[1])
end
if redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'NX') then return 1 end
return 0
"""

# A peer entry and its index in one step; an index of another type (garbage) is
# replaced, or it would refuse every publication and hide every holder.
_PUBLISH_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local t = redis.call('TYPE', KEYS[2])['ok']
if t ~= 'set' and t ~= 'none' then redis.call('DEL', KEYS[2]) end
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# Drop a key of another Redis type than ARGV[1]; extend it by ARGV[2] ms if given.
_REPAIR_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= ARGV[1] then redis.call('DEL', KEYS[1]) return -1 end
if ARGV[2] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# A request pushed onto a queue that may hold garbage of another type (replaced).
_PUSH_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'list' and t ~= 'none' then redis.call('DEL', KEYS[1]) end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# A holder's heartbeat on the ground truth it holds: 1 and extended if the value is
# still the one it last verified (ARGV[1], its SHA-1), 0 absent, -1 another Redis type,
# 2 changed (the caller reads and verifies it).
_KEEP_TRUTH_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= 'string' then return -1 end
if ARGV[1] ~= '' and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 2
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
# A cohort hash that is not one we write (another type, a counter or epoch that is no
# number or name, no TTL or one far past the window) starts a new window instead of
# refusing every join; so does a chain list of another type.
_JOIN_COHORT_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'hash' then
  local n0 = redis.call('HGET', KEYS[1], 'n')
  local e0 = redis.call('HGET', KEYS[1], 'epoch')
  local ttl = redis.call('PTTL', KEYS[1])
  if not n0 or not e0 or not string.match(n0, '^%d%d?%d?%d?%d?%d?%d?%d?%d?$')
     or not string.match(e0, '^[0-9a-f][0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?[0-9a-f]?$')
     or ttl < 0 or ttl > 2 * tonumber(ARGV[2]) then
    redis.call('DEL', KEYS[1])
  end
elseif t ~= 'none' then
  redis.call('DEL', KEYS[1])
end
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
if n == 1 then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
local epoch = redis.call('HGET', KEYS[1], 'epoch') or ARGV[1]
local size = tonumber(ARGV[3])
local chain = KEYS[1] .. ':' .. epoch .. ':' .. math.floor((n - 1) / size)
local ct = redis.call('TYPE', chain)['ok']
if ct ~= 'list' and ct ~= 'none' then redis.call('DEL', chain) end
redis.call('RPUSH', chain, ARGV[4])
redis.call('PEXPIRE', chain, ARGV[5])
return {chain, (n - 1) % size}
"""

#: Members of a peer index read at most; a bigger index is garbage (real fleets hold
#: far fewer peers of one version and rank): dropped, and the peer keys scanned instead.
MAX_INDEX = 1024

#: A record kept longer than this many times the TTL its writer gives it was not
#: written by a worker (a replayed or forged claim or lease): it is not obeyed.
TTL_SLACK = 2.0


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
        self._take = self.client.register_script(_TAKE_LUA)
        self._publish = self.client.register_script(_PUBLISH_LUA)
        self._repair = self.client.register_script(_REPAIR_LUA)
        self._push = self.client.register_script(_PUSH_LUA)
        self._keep_truth = self.client.register_script(_KEEP_TRUTH_LUA)
        self._good_truth: dict[str, str] = {}
        """SHA-1 of the ground-truth value a heartbeat last verified, by key."""
        self.signer = Signer.from_settings(settings)
        self.on_untrusted: Callable[[RecordKind | str], None] | None = None
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

    def get_signed(
        self, key: str, kind: RecordKind | str, *, parse: Callable[[dict[str, Any]], object] | None = None,
        max_ttl: float | None = None,
    ) -> tuple[dict[str, Any], _Raw] | None:
        """The verified record at ``key`` and its raw value (for a compare-and-set);
        None if absent or rejected (logged, counted). ``parse``: the typed parser the
        record must also pass; ``max_ttl``: the longest TTL its writer gives it."""
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is _WRONG_TYPE:
            self.reject(kind, key, "wrong Redis type")
            return None
        if raw is None:
            return None
        try:
            return self._trusted(key, raw, kind, ttl_ms, parse, max_ttl), _Raw(raw)
        except UntrustedRecordError as e:
            self.reject(kind, key, str(e))
            return None

    def _trusted(
        self, key: str, raw: Any, kind: RecordKind | str, ttl_ms: int,
        parse: Callable[[dict[str, Any]], object] | None, max_ttl: float | None,
    ) -> dict[str, Any]:
        """:meth:`verify`, the typed parser, and the TTL bound; UntrustedRecordError if not."""
        if max_ttl is not None and ttl_ms > max_ttl * TTL_SLACK * 1000:
            raise UntrustedRecordError(f"{key}: TTL {ttl_ms} ms, far beyond the {max_ttl:g} s its"
                                       " writers give it")
        record = self.verify(key, raw, kind, ttl_ms)
        if parse is not None:
            parse(record)
        return record

    def verify(
        self, key: str, raw: Any, kind: RecordKind | str, ttl_ms: int | None = None,
        max_bytes: int = records.MAX_RECORD_BYTES,
    ) -> dict[str, Any]:
        """Bounded JSON, a TTL, a good signature: the record, or UntrustedRecordError."""
        if ttl_ms is not None and int(ttl_ms) == -1:
            raise UntrustedRecordError(f"{key}: kept without a TTL")
        return self.signer.verify(key, records.load(raw, str(kind), max_bytes))

    def acquire(
        self, key: str, value: dict[str, Any], ttl: float, kind: RecordKind,
        parse: Callable[[dict[str, Any]], object], *, expires: bool = True,
    ) -> _Raw | None:
        """``SET NX`` of ``value`` (signed) at ``key``, taking over a holder that is not
        to be obeyed: another Redis type, unsigned or badly signed, expired, malformed,
        or kept far beyond ``ttl``. The takeover is atomic on the value read, so two
        workers that both found garbage never both win. Returns the raw value stored
        (for :meth:`compare_and_set` renewals), or None if a trusted holder has it."""
        new = self.signed(key, value, ttl, expires=expires)
        if self.set_json(key, new, ttl, nx=True):
            return new
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is None:  # expired between the two calls
            return new if self.set_json(key, new, ttl, nx=True) else None
        if raw is _WRONG_TYPE:
            why, seen = "wrong Redis type", ""
        else:
            try:
                self._trusted(key, raw, kind, ttl_ms, parse, ttl)
                return None
            except UntrustedRecordError as e:
                why, seen = str(e), str(raw)
        self.reject(kind, key, f"{why}; taken over")
        got = self._call("take", lambda: self._take(keys=[key], args=[seen, new, _ms(ttl)]))
        return new if got else None

    def compare_and_delete(self, key: str, expected: str) -> bool:
        """Delete ``key`` only if it holds exactly ``expected`` (a raw value)."""
        return bool(self._call("CAD", lambda: self._cad(keys=[key], args=[expected])))

    def reject(self, kind: RecordKind | str, key: str, reason: str) -> None:
        """Log and count one rejected record (never raises: the metric takes any kind)."""
        kind = _kind(kind)
        log.warning("record_rejected", kind=str(kind), key=key, reason=reason)
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
        index = self._index_key(info.version, info.rank, info.world_size)
        self._call("publish", lambda: self._publish(keys=[key, index], args=[value, ttl, info.peer_id]))
        log.debug("peer_published", peer_id=info.peer_id, version=info.version, rank=info.rank)

    def heartbeat(self, info: PeerInfo, truth: dict[str, str] | None = None) -> None:
        """Refresh the TTLs of the peer's keys and of the ground truth it relies on.

        Re-writes the entry rather than only extending it, so a peer whose entry already
        expired (a long GC pause, a Redis restart) becomes visible again. ``truth``: the
        ground truth this peer holds (stored form, :func:`encode_truth`), re-published
        signed when the record is gone (Redis lost its data) or not to be trusted, and
        before the entry, so receivers never find the peer without its truth.
        """
        gt = self.ground_truth_key(info.version, info.rank, info.world_size, info.manifest_digest)
        if truth:
            self.keep_ground_truth(info, truth)
        self.publish_peer(info)
        req = self.key("req", info.peer_id)
        if not truth:
            self._call("heartbeat", lambda: self.client.pexpire(gt, _ms(self._ground_truth_ttl)))
        # Our own queue: garbage of another type there would refuse every request. (A
        # script call of its own: a cluster pipeline refuses EVALSHA.)
        self._call("heartbeat", lambda: self._repair(
            keys=[req], args=["list", _ms(self.settings.peer_ttl)]))

    def keep_ground_truth(self, info: PeerInfo, truth: dict[str, str]) -> None:
        """Keep the ground-truth record of ``info``'s flavour alive and trustworthy: extend
        it while it is the value last verified; write ``truth`` (signed) if it is absent,
        of another type, or untrusted; leave a trusted record that says otherwise (a
        storage loader's replacement rules, see ``WeightService``)."""
        key = self.ground_truth_key(info.version, info.rank, info.world_size, info.manifest_digest)
        ttl = self._ground_truth_ttl
        state = int(self._call("keep_truth", lambda: self._keep_truth(
            keys=[key], args=[self._good_truth.get(key, ""), _ms(ttl)])))
        if state == 1:
            return
        value = {"manifest_digest": info.manifest_digest, "hashes": truth}
        if state in (0, -1):  # SET NX drops another type first
            if self.set_signed(key, value, ttl, nx=True, expires=False):
                log.info("ground_truth_republished", key=key, was="absent" if state == 0 else "wrong type")
            self._good_truth.pop(key, None)
            return
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is None or raw is _WRONG_TYPE:
            return  # changed again meanwhile: the next beat sees it
        try:
            found = self.verify(key, raw, RecordKind.GROUND_TRUTH, ttl_ms, records.MAX_GROUND_TRUTH_BYTES)
            digest, _ = records.ground_truth(found)
            if digest != info.manifest_digest:
                raise UntrustedRecordError(f"{key}: digest {digest!r} under another key")
        except UntrustedRecordError as e:
            self.reject(RecordKind.GROUND_TRUTH, key, f"{e}; replaced by a holder")
            new = self.signed(key, value, ttl, expires=False)
            if self._call("take", lambda: self._take(keys=[key], args=[str(raw), new, _ms(ttl)])):
                log.info("ground_truth_republished", key=key, was="untrusted")
            return
        self._good_truth[key] = hashlib.sha1(str(raw).encode()).hexdigest()
        self._call("PEXPIRE", lambda: self.client.pexpire(key, _ms(ttl)))

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
        ids = self._peer_ids(index, version, rank, world_size)
        if not ids:
            return []
        keys = [self._peer_key(version, rank, world_size, pid) for pid in ids]
        raws, ttls = self._get_with_ttls(keys)
        dead = [pid for pid, raw in zip(ids, raws, strict=True) if raw is None]
        if dead:
            self._call("SREM", lambda: self.client.srem(index, *dead))
        if len(dead) == len(ids):
            # An index of dead peers only: stale (a restored copy) or forged. It must not
            # hide a live holder until its next heartbeat: the peer keys are the truth.
            prefix = self._peer_key(version, rank, world_size, "")
            keys = sorted(self.scan(f"peer:{version}:{rank}:{world_size}:*"))
            if not keys:
                return []
            self.reject(RecordKind.INDEX, index, f"{len(ids)} members, none alive; peer keys scanned")
            raws, ttls = self._get_with_ttls(keys)
            keys = [k if k.startswith(prefix) else "" for k in keys]
        peers: list[PeerInfo] = []
        for key, raw, ttl_ms in zip(keys, raws, ttls, strict=True):
            if raw is None:
                continue
            try:  # one bad entry must not hide the good ones
                info = PeerInfo.from_record(self.verify(key, raw, RecordKind.PEER, ttl_ms))
                if key != self._peer_key(info.version, info.rank, info.world_size, info.peer_id) or (
                    (info.version, info.rank, info.world_size) != (version, rank, world_size)
                ):
                    raise UntrustedRecordError(f"{key}: the entry describes another key")
            except UntrustedRecordError as e:
                self.reject(RecordKind.PEER, key, str(e))
                continue
            peers.append(info)
        claims = self._claim_counts(peers)
        random.shuffle(peers)
        peers.sort(key=lambda p: claims[p.peer_id] / max(p.max_sends, 1))
        return peers

    def _peer_ids(self, index: str, version: str, rank: int, world_size: int) -> list[str]:
        """The peer ids of the index, or of the peer keys themselves when the index is
        garbage (another Redis type, or oversized): it is dropped, and the holders'
        next heartbeats rebuild it. A hint must never hide the truth it points to."""
        pipe = self.client.pipeline(transaction=False)
        pipe.scard(index)
        pipe.srandmember(index, MAX_INDEX)  # every member when there are at most that many
        try:
            n, members = self._call("SMEMBERS", pipe.execute)
        except RegistryError as e:
            if "WRONGTYPE" not in str(e):
                raise
            why = "wrong Redis type"
        else:
            if int(n) <= MAX_INDEX:
                return sorted(str(m) for m in members if isinstance(m, str) and len(m) <= 300)
            why = f"{n} members, more than {MAX_INDEX}"
        self.reject(RecordKind.INDEX, index, f"{why}; peer keys scanned instead")
        self._call("repair", lambda: self._repair(keys=[index], args=["none", ""]))
        prefix = self._peer_key(version, rank, world_size, "")
        return sorted(k[len(prefix):] for k in self.scan(f"peer:{version}:{rank}:{world_size}:*"))

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
                    self.reject(RecordKind.PEER, key, "wrong Redis type")
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
                    info = PeerInfo.from_record(self.verify(key, raw, RecordKind.PEER, ttl_ms))
                except UntrustedRecordError as e:
                    self.reject(RecordKind.PEER, key, str(e))
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
            value = self.verify(key, raw, RecordKind.GROUND_TRUTH, ttl_ms, records.MAX_GROUND_TRUTH_BYTES)
            digest, hashes = records.ground_truth(value)
            if digest != manifest_digest:
                raise UntrustedRecordError(f"{key}: digest {digest!r} under another key")
            return hashes
        except UntrustedRecordError as e:
            self.reject(RecordKind.GROUND_TRUTH, key, str(e))
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
            # Signed; no expiry inside (renewals extend it): a claim that does not verify,
            # or kept far beyond claim_ttl, is taken over rather than obeyed.
            if self.acquire(self._claim_key(peer_id, slot), {"token": token, "receiver": receiver_id},
                            ttl, RecordKind.CLAIM, records.claim, expires=False) is not None:
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
                out.append(self.verify(cohort, raw, RecordKind.COHORT_MEMBER))
            except UntrustedRecordError as e:
                self.reject(RecordKind.COHORT_MEMBER, chain, str(e))
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
                              RecordKind.DOWNLOAD_STREAM)
        return None if got is None else got[0]

    def drop_stream(self, version: str, rank: int, world_size: int, manifest_digest: str,
                    member_id: str) -> None:
        """Remove the stream record if it is still ours (a new downloader's stays)."""
        key = self.stream_key(version, rank, world_size, manifest_digest)
        got = self.get_signed(key, RecordKind.DOWNLOAD_STREAM)
        if got is not None and got[0].get("member_id") == member_id:
            self._call("DEL", lambda: self._cad(keys=[key], args=[str(got[1])]))

    # -- transfer requests ----------------------------------------------------------------

    def push_request(self, peer_id: str, request: dict[str, Any]) -> None:
        """Ask ``peer_id`` to serve one transfer (``request`` is JSON-serialisable)."""
        key = self.key("req", peer_id)
        # Keep only the newest requests: a flood written before ours cannot bury it.
        raw = self.signed(key, request, self.settings.peer_ttl)
        self._call("push_request", lambda: self._push(
            keys=[key], args=[raw, MAX_QUEUED_REQUESTS, _ms(self.settings.peer_ttl)]))

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
            try:
                got = self._call("BRPOP", partial(self.client.brpop, [key], timeout=min(left, step)))
            except RegistryError as e:
                if "WRONGTYPE" not in str(e):
                    raise
                # Our own queue holds garbage of another type: drop it, receivers re-ask.
                self.reject(RecordKind.REQUEST, key, "wrong Redis type; dropped")
                self._call("repair", lambda: self._repair(keys=[key], args=["list", ""]))
                continue
            if got is not None:
                request = self._request(key, cast("tuple[str, str]", got)[1])
                if request is not None:
                    return request

    def _request(self, key: str, raw: str) -> dict[str, Any] | None:
        try:
            return records.request(self.verify(key, raw, RecordKind.REQUEST)).to_dict()
        except UntrustedRecordError as e:
            self.reject(RecordKind.REQUEST, key, str(e))
            return None


def _kind(kind: RecordKind | str) -> RecordKind | str:
    """``kind`` as its :class:`RecordKind` where it names one (callers may pass the value)."""
    try:
        return RecordKind(kind)
    except ValueError:
        return kind


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
