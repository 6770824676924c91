"""The signed key-value layer under every record family of the registry.

It owns the client (one server, Sentinel or Cluster: :mod:`.redisclient`), the one
mapping of redis-py failures to :class:`RegistryError`, the key names (:class:`.Keys`),
the Lua scripts (:mod:`.scripts`), and trust: values are JSON (never pickle: a Redis
shared by a fleet must not be able to run code in a worker), signed when
``Settings.secret`` is set (:mod:`.auth`), and parsed into typed, bounded records
(:mod:`.records`) when read.

Trust (DESIGN.md layer 9). A value that is unsigned, badly signed, expired, malformed
or kept without a TTL is skipped, logged (``record_rejected``) and counted
(``on_untrusted``, under its :class:`~nccl_back.errors.RecordKind`); it never raises out
of a list. ``SET NX`` also takes over a key kept without a TTL or of the wrong Redis type
(it would otherwise hold a claim, a lease or the ground truth forever), and
:meth:`SignedStore.acquire` takes over a holder that does not verify, atomically on the
value it read, so hostile values cost a bounded delay, never the fleet (issue 18).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisClusterException

from nccl_back.config import Settings
from nccl_back.coord import records, redisclient
from nccl_back.coord.auth import Signer
from nccl_back.coord.keys import Keys
from nccl_back.coord.scripts import Scripts
from nccl_back.errors import ConfigError, RecordKind, RegistryError, UntrustedRecordError
from nccl_back.log import get_logger
from nccl_back.redis_url import redact

# The registry's one logger, whichever family logs: operators filter on its name.
log = get_logger("nccl_back.coord.registry")

T = TypeVar("T")

#: What :meth:`SignedStore._get_with_ttl` returns for a key of another Redis type.
WRONG_TYPE: Any = object()

#: A record kept longer than this many times the TTL its writer gives it was not
#: written by a worker (a replayed or forged claim or lease): it is not obeyed.
TTL_SLACK = 2.0


class Raw(str):
    """A value already serialised (and signed): stored and compared as it is."""


class SignedStore:
    """Signed JSON values at the namespace's keys, with the trust rules above.

    Every Redis failure (connection refused, timeout, auth error) is raised as
    :class:`RegistryError`, chained to the redis-py error, so callers fall back on one
    exception type.
    """

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.ns = settings.namespace
        self.keys = Keys(settings.namespace)
        if client is None:
            # One server, Sentinel or Cluster, plain or TLS (see redisclient.py).
            try:
                client = redisclient.connect(settings)
            except (redis.RedisError, RedisClusterException) as e:
                raise RegistryError(
                    f"cannot reach redis ({redact(settings.redis_url)}): {redisclient.explain(e)}"
                ) from e
        elif not redisclient.decodes_responses(client):
            raise ConfigError("Registry needs a redis client made with decode_responses=True")
        self.client: redis.Redis = client
        self.lua = Scripts(client)
        self.signer = Signer.from_settings(settings)
        self.on_untrusted: Callable[[RecordKind | str], None] | None = None
        """Called with the record kind each time a record is rejected (metrics)."""
        self.rejected = 0
        """Records rejected so far (a caller compares it before and after a read)."""

    def key(self, *parts: object) -> str:
        """``{namespace}:part1:part2...`` (:meth:`Keys.key`; the families name their keys
        through :attr:`keys`)."""
        return self.keys.key(*parts)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (redis.RedisError, RedisClusterException) as e:
            raise RegistryError(
                f"redis {what} failed ({redact(self.settings.redis_url)}): {redisclient.explain(e)}"
            ) from e

    # -- writing --------------------------------------------------------------------------

    def set_json(self, key: str, value: Any, ttl: float, *, nx: bool = False) -> bool:
        """Store ``value`` as JSON at ``key`` with a TTL in seconds; ``nx``: only if absent.

        Returns whether the value was written.
        """
        raw = value if isinstance(value, Raw) else _dumps(value)
        if nx:
            return bool(self._call("SET NX", lambda: self.lua.set_nx(keys=[key], args=[raw, ms(ttl)])))
        return bool(self._call("SET", lambda: self.client.set(key, raw, px=ms(ttl))))

    def signed(self, key: str, value: dict[str, Any], ttl: float, *, expires: bool = True) -> Raw:
        """``value`` signed for ``key`` and serialised, ready for :meth:`set_json` or a
        compare-and-set (with an expiry inside the signature unless ``expires`` is
        False, for records kept alive by ``PEXPIRE``)."""
        return Raw(_dumps(self.signer.sign(key, value, ttl if expires else None)))

    def set_signed(
        self, key: str, value: dict[str, Any], ttl: float, *, nx: bool = False, expires: bool = True
    ) -> bool:
        """:meth:`set_json` of ``value`` signed for ``key`` (see :meth:`signed`)."""
        return self.set_json(key, self.signed(key, value, ttl, expires=expires), ttl, nx=nx)

    def acquire(
        self, key: str, value: dict[str, Any], ttl: float, kind: RecordKind,
        parse: Callable[[dict[str, Any]], object], *, expires: bool = True,
    ) -> Raw | None:
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
        if raw is WRONG_TYPE:
            why, seen = "wrong Redis type", ""
        else:
            try:
                self._trusted(key, raw, kind, ttl_ms, parse, ttl)
                return None
            except UntrustedRecordError as e:
                why, seen = str(e), str(raw)
        self.reject(kind, key, f"{why}; taken over")
        return new if self._take(key, seen, new, ttl) else None

    def _take(self, key: str, seen: str, new: Raw, ttl: float) -> bool:
        """Replace what :meth:`acquire` found untrusted (``seen``; '' for a wrong type)."""
        return bool(self._call("take", lambda: self.lua.take(keys=[key], args=[seen, new, ms(ttl)])))

    def compare_and_set(self, key: str, expected: Any, value: Any, ttl: float) -> bool:
        """Replace ``key``'s JSON value by ``value`` only if it is exactly ``expected``."""
        old = expected if isinstance(expected, Raw) else _dumps(expected)
        new = value if isinstance(value, Raw) else _dumps(value)
        return bool(self._call("CAS", lambda: self.lua.cas(keys=[key], args=[old, new, ms(ttl)])))

    def compare_and_delete(self, key: str, expected: str) -> bool:
        """Delete ``key`` only if it holds exactly ``expected`` (a raw value)."""
        return bool(self._call("CAD", lambda: self.lua.cad(keys=[key], args=[expected])))

    def _repair(self, key: str, kind: str, extend: float | None = None, *, what: str = "repair") -> None:
        """Drop ``key`` if it holds another Redis type than ``kind`` ('none': drop it
        whatever it holds); extend it by ``extend`` seconds if given. (A script call of
        its own: a cluster pipeline refuses EVALSHA.)"""
        ttl = "" if extend is None else ms(extend)
        self._call(what, lambda: self.lua.repair(keys=[key], args=[kind, ttl]))

    def delete(self, *keys: str) -> None:
        if keys:
            self._call("DEL", lambda: self.client.delete(*keys))

    # -- reading --------------------------------------------------------------------------

    def get_json(self, key: str) -> Any | None:
        """The JSON value at ``key``, or None if absent."""
        raw = self._call("GET", lambda: self.client.get(key))
        return None if raw is None else _loads(key, raw)

    def _get_with_ttl(self, key: str) -> tuple[Any, int]:
        """``(raw value or None, PTTL in ms)`` in one round trip; :data:`WRONG_TYPE` as the
        value when the key holds a list, set or hash (another writer's, never ours)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        try:
            raw, ttl_ms = self._call("GET", pipe.execute)
        except RegistryError as e:
            if "WRONGTYPE" not in str(e):
                raise
            return WRONG_TYPE, -2
        return raw, int(ttl_ms)

    def _get_with_ttls(self, keys: list[str], kind: RecordKind) -> tuple[list[Any], list[int]]:
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
                    self.reject(kind, key, "wrong Redis type")
                    out += [None, -2]
        return list(out[::2]), [int(t) for t in out[1::2]]

    def get_signed(
        self, key: str, kind: RecordKind, *, parse: Callable[[dict[str, Any]], object] | None = None,
        max_ttl: float | None = None, max_bytes: int = records.MAX_RECORD_BYTES,
    ) -> tuple[dict[str, Any], Raw] | None:
        """The verified record at ``key`` and its raw value (for a compare-and-set);
        None if absent or rejected (logged, counted). ``parse``: the typed parser the
        record must also pass; ``max_ttl``: the longest TTL its writer gives it;
        ``max_bytes``: the largest value its kind may have."""
        raw, ttl_ms = self._get_with_ttl(key)
        if raw is WRONG_TYPE:
            self.reject(kind, key, "wrong Redis type")
            return None
        if raw is None:
            return None
        try:
            return self._trusted(key, raw, kind, ttl_ms, parse, max_ttl, max_bytes), Raw(raw)
        except UntrustedRecordError as e:
            self.reject(kind, key, str(e))
            return None

    def _trusted(
        self, key: str, raw: Any, kind: RecordKind, ttl_ms: int,
        parse: Callable[[dict[str, Any]], object] | None, max_ttl: float | None,
        max_bytes: int = records.MAX_RECORD_BYTES,
    ) -> dict[str, Any]:
        """:meth:`verify`, the typed parser, and the TTL bound; UntrustedRecordError if not."""
        if max_ttl is not None and ttl_ms > max_ttl * TTL_SLACK * 1000:
            raise UntrustedRecordError(f"{key}: TTL {ttl_ms} ms, far beyond the {max_ttl:g} s its"
                                       " writers give it")
        record = self.verify(key, raw, kind, ttl_ms, max_bytes)
        if parse is not None:
            parse(record)
        return record

    def verify(
        self, key: str, raw: Any, kind: RecordKind, ttl_ms: int | None = None,
        max_bytes: int = records.MAX_RECORD_BYTES,
    ) -> dict[str, Any]:
        """Bounded JSON, a TTL, a good signature: the record, or UntrustedRecordError."""
        if ttl_ms is not None and int(ttl_ms) == -1:
            raise UntrustedRecordError(f"{key}: kept without a TTL")
        return self.signer.verify(key, records.load(raw, str(kind), max_bytes))

    def reject(self, kind: RecordKind | str, key: str, reason: str) -> None:
        """Log and count one rejected record (never raises: the metric takes any kind;
        the layer passes a :class:`RecordKind`, a stray string is counted as given)."""
        kind = _kind(kind)
        log.warning("record_rejected", kind=str(kind), key=key, reason=reason)
        self.rejected += 1
        if self.on_untrusted is not None:
            self.on_untrusted(kind)

    # -- the keyspace ---------------------------------------------------------------------

    def ttl(self, key: str) -> float:
        """Seconds left on ``key`` (-2: absent, -1: no TTL), as Redis reports them."""
        got = int(self._call("PTTL", lambda: self.client.pttl(key)))
        return got / 1000 if got >= 0 else float(got)

    def scan(self, pattern: str) -> Iterator[str]:
        """Keys matching ``pattern`` (a glob under the namespace, e.g. ``peer:*``)."""
        return self._scan(self.keys.key(pattern))

    def _scan(self, glob: str) -> Iterator[str]:
        """Keys matching ``glob``, a whole key pattern (:class:`Keys` builds them)."""
        it = self._call("SCAN", lambda: iter(list(self.client.scan_iter(glob, count=500))))
        yield from it

    def ping(self) -> None:
        """Raise :class:`RegistryError` unless Redis answers."""
        self._call("PING", self.client.ping)

    def close(self) -> None:
        self.client.close()


def _kind(kind: RecordKind | str) -> RecordKind | str:
    """``kind`` as its :class:`RecordKind` where it names one (callers may pass the value)."""
    try:
        return RecordKind(kind)
    except ValueError:
        return kind


def ms(seconds: float) -> int:
    """Seconds -> whole milliseconds, at least 1 (Redis rejects a zero expiry)."""
    return max(int(seconds * 1000), 1)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _loads(key: str, raw: str | bytes) -> Any:
    try:
        return records.load(raw, key, records.MAX_GROUND_TRUTH_BYTES)
    except UntrustedRecordError as e:
        raise RegistryError(f"value at {key} is not a bounded JSON object: {e}") from e
