"""The signed key-value layer under every record family of the registry.

It owns the client (:mod:`.redisclient`), the one mapping of redis-py failures to
:class:`RegistryError`, and trust: values are JSON (never pickle: a shared Redis must not
run code in a worker), signed when ``Settings.secret`` is set (:mod:`.auth`), and read
back bounded, verified and parsed through their kind's schema entry (:mod:`.schema`).

A value that is not UTF-8, unsigned, badly signed, expired, malformed, kept without a
TTL or far beyond its writers' is skipped, logged (``record_rejected``) and counted
(``on_untrusted``); it never raises out of a list. ``SET NX`` and :meth:`SignedStore.acquire`
take over such a value atomically (it would otherwise hold a claim, a lease or the truth
forever), so hostile values cost a bounded delay, never the fleet.
"""

from __future__ import annotations

import contextlib
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
from nccl_back.coord.schema import KeyKind
from nccl_back.coord.scripts import Scripts
from nccl_back.errors import ConfigError, RecordKind, RegistryError, UntrustedRecordError
from nccl_back.log import get_logger
from nccl_back.redis_url import redact
from nccl_back.timing import TTL_SLACK

# The registry's one logger, whichever family logs: operators filter on its name.
log = get_logger("nccl_back.coord.registry")

T = TypeVar("T")

#: What :meth:`SignedStore._get_with_ttl` returns for a key of another Redis type.
WRONG_TYPE: Any = object()


class Oversized:
    """What :meth:`SignedStore._get_with_ttl` returns for a value over its kind's bound:
    its length, not its bytes (they never cross the wire)."""

    def __init__(self, size: int, bound: int) -> None:
        self.size, self.bound = size, bound

    def __repr__(self) -> str:
        return f"<{self.size} bytes, over the bound of {self.bound}>"

#: Keys read per round trip of a batch (:meth:`SignedStore.values`).
BATCH = 256
#: Bytes of the longest key name a scan returns (ours are far shorter).
MAX_KEY_NAME = 1024



class Raw(str):
    """A value already serialised (and signed): stored and compared as it is."""


class SignedStore:
    """Signed JSON values at the namespace's keys; every Redis failure is raised as
    :class:`RegistryError`, so callers fall back on one exception type."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.settings = settings
        self.ns = settings.namespace
        self.keys = Keys(settings.namespace)
        if client is None:
            try:
                client = redisclient.connect(settings)
            except (redis.RedisError, RedisClusterException) as e:
                raise RegistryError(
                    f"cannot reach redis ({redact(settings.redis_url)}): {redisclient.explain(e)}"
                ) from e
        elif redisclient.decodes_responses(client):
            # A decoding client raises inside redis-py on bytes that are not UTF-8.
            raise ConfigError("Registry needs a redis client made with decode_responses=False")
        self.client: redis.Redis = client
        self.lua = Scripts(client)
        self.signer = Signer.from_settings(settings)
        self.on_untrusted: Callable[[RecordKind | str], None] | None = None
        """Called with the record kind each time a record is rejected (metrics)."""
        self.rejected = 0
        """Records rejected so far (a caller compares it before and after a read)."""
        self.tidy_failed = 0
        """Writes that only tidy and failed so far (see :meth:`tidy`)."""

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (redis.RedisError, RedisClusterException) as e:
            raise RegistryError(
                f"redis {what} failed ({redact(self.settings.redis_url)}): {redisclient.explain(e)}"
            ) from e

    def tidy(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run a write that only tidies (pruning, refreshing an expiry, dropping what
        expires anyway): a failure is logged, counted and returned as None, never raised.
        A registry error sends each worker to storage past the single flight, so garbage
        at one key would otherwise turn a fleet's one download into one per worker."""
        try:
            return self._call(what, fn)
        except RegistryError as e:
            self.tidy_failed += 1
            log.warning("tidy_failed", what=what, error=str(e))
            return None

    # -- writing --------------------------------------------------------------------------

    def set_json(self, key: str, value: Any, ttl: float, *, nx: bool = False) -> bool:
        """Store ``value`` as JSON at ``key`` with a TTL (``nx``: only if absent); whether
        it was written."""
        raw = value if isinstance(value, Raw) else _dumps(value)
        if nx:
            return bool(self._call("SET NX", lambda: self.lua.set_nx(keys=[key], args=[raw, ms(ttl)])))
        return bool(self._call("SET", lambda: self.client.set(key, raw, px=ms(ttl))))

    def signed(self, key: str, value: dict[str, Any], kind: KeyKind, ttl: float | None = None) -> Raw:
        """``value`` signed for ``key`` and serialised, ready for :meth:`set_json` or a
        compare-and-set, with an expiry inside the signature for the kinds that grant
        something (:attr:`KeyKind.expires`); ``ttl``: the writer's, else the kind's."""
        ttl = kind.ttl(self.settings) if ttl is None else ttl
        return Raw(_dumps(self.signer.sign(key, value, ttl if kind.expires else None)))

    def set_signed(self, key: str, value: dict[str, Any], kind: KeyKind, ttl: float | None = None,
                   *, nx: bool = False) -> bool:
        """:meth:`set_json` of ``value`` signed for ``key`` (see :meth:`signed`)."""
        ttl = kind.ttl(self.settings) if ttl is None else ttl
        return self.set_json(key, self.signed(key, value, kind, ttl), ttl, nx=nx)

    def acquire(self, key: str, value: dict[str, Any], kind: KeyKind, ttl: float) -> Raw | None:
        """``SET NX`` of ``value`` (signed) at ``key``, taking over an untrusted holder
        atomically on the value read (two workers finding garbage never both win). The
        raw value stored (for renewals), or None if a trusted holder has it."""
        new = self.signed(key, value, kind, ttl)
        if self.set_json(key, new, ttl, nx=True):
            return new
        raw, ttl_ms = self._get_with_ttl(key, kind)
        if raw is None:  # expired between the two calls
            return new if self.set_json(key, new, ttl, nx=True) else None
        if raw is WRONG_TYPE:
            why, seen = "wrong Redis type", b""
        else:
            try:
                self._trusted(key, raw, kind, ttl_ms, ttl)
                return None
            except UntrustedRecordError as e:
                why, seen = str(e), raw
        self.reject(kind.kind, key, f"{why}; taken over")
        return new if self._take(key, seen, new, ttl) else None

    def _take(self, key: str, seen: bytes | Oversized, new: Raw, ttl: float) -> bool:
        """Replace what :meth:`acquire` found untrusted (``seen``; b'' for a wrong type; an
        :class:`Oversized` value while it still is)."""
        args = ([b"", new, ms(ttl), seen.bound] if isinstance(seen, Oversized)
                else [seen, new, ms(ttl), ""])
        return bool(self._call("take", lambda: self.lua.take(keys=[key], args=args)))

    def compare_and_set(self, key: str, expected: Any, value: Any, ttl: float) -> bool:
        """Replace ``key``'s JSON value by ``value`` only if it is exactly ``expected``."""
        old = expected if isinstance(expected, (Raw, bytes)) else _dumps(expected)
        new = value if isinstance(value, Raw) else _dumps(value)
        return bool(self._call("CAS", lambda: self.lua.cas(keys=[key], args=[old, new, ms(ttl)])))

    def compare_and_delete(self, key: str, expected: str | bytes) -> bool:
        """Delete ``key`` only if it holds exactly ``expected`` (a raw value); False also
        when that failed (it only tidies: see :meth:`tidy`)."""
        return bool(self.tidy("CAD", lambda: self.lua.cad(keys=[key], args=[expected])))

    def _repair(self, key: str, kind: str, extend: float | None = None, *, what: str = "repair") -> None:
        """Drop ``key`` if it holds another Redis type than ``kind`` ('none': any); extend
        it by ``extend`` seconds if given; only tidies. (Its own script call: a cluster
        pipeline refuses EVALSHA.)"""
        ttl = "" if extend is None else ms(extend)
        self.tidy(what, lambda: self.lua.repair(keys=[key], args=[kind, ttl]))

    def extend(self, key: str, seconds: float, *, what: str = "PEXPIRE") -> None:
        """Refresh ``key``'s expiry to ``seconds`` from now (it only tidies: see :meth:`tidy`)."""
        self.tidy(what, lambda: self.client.pexpire(key, ms(seconds)))

    def delete(self, *keys: str) -> None:
        """Delete ``keys``: what expires anyway (it only tidies: see :meth:`tidy`)."""
        if keys:
            self.tidy("DEL", lambda: self.client.delete(*keys))

    # -- reading --------------------------------------------------------------------------

    # Every read from Redis is here, by a script that refuses an item over its kind's bound
    # by its length on the server (tests/test_bounded_reads.py holds every module to it).

    def _get_with_ttl(self, key: str, kind: KeyKind) -> tuple[Any, int]:
        """``(raw bytes or None, PTTL in ms)`` in one round trip; the value may be
        :data:`WRONG_TYPE` or :class:`Oversized`."""
        values, ttls = self._values([key], kind)
        return values[0], ttls[0]

    def _values(self, keys: list[str], kind: KeyKind) -> tuple[list[Any], list[int]]:
        """Values and PTTLs of ``keys`` as :meth:`_get_with_ttl` gives them, :data:`BATCH`
        keys per round trip (one script each: a longer one would hold the server)."""
        values: list[Any] = []
        ttls: list[int] = []
        for i in range(0, len(keys), BATCH):
            part = keys[i:i + BATCH]
            got = self._call("GET", partial(self.lua.bounded_get, keys=part, args=[kind.max_bytes]))
            try:
                if len(got) != 3 * len(part):
                    raise ValueError(len(got))
                for state, ttl, value in zip(got[::3], got[1::3], got[2::3], strict=True):
                    state = int(state)
                    values.append(None if state == 0 else WRONG_TYPE if state == -1
                                  else Oversized(int(value), kind.max_bytes) if state == 2 else value)
                    ttls.append(int(ttl))
            except (TypeError, ValueError) as e:
                raise RegistryError(f"bounded GET of {part[0]}: unexpected reply {got!r}"[:200]) from e
        return values, ttls

    def _get_with_ttls(self, keys: list[str], kind: KeyKind) -> tuple[list[Any], list[int]]:
        """:meth:`_values`, keys of another Redis type rejected (logged, counted)."""
        values, ttls = self._values(keys, kind)
        for key, raw in zip(keys, values, strict=True):
            if raw is WRONG_TYPE:
                self.reject(kind.kind, key, "wrong Redis type")
        return values, ttls

    def raw_value(self, key: str, kind: KeyKind) -> Any:
        """The value at ``key`` as :meth:`_get_with_ttl` gives it, for formats another
        module owns (the rendezvous, ``check``'s probe)."""
        return self._get_with_ttl(key, kind)[0]

    def values(self, keys: list[str], kind: KeyKind) -> list[Any]:
        """The raw values at ``keys`` (MGET's job): None where absent or of another Redis
        type (rejected), else the bytes or an :class:`Oversized`."""
        return [None if raw is WRONG_TYPE else raw for raw in self._get_with_ttls(keys, kind)[0]]

    def items(self, key: str, kind: KeyKind, first: int, last: int) -> Any:
        """Items ``first..last`` (LRANGE's indexes) of the list at ``key``, each bytes or
        :class:`Oversized`; [] if absent, :data:`WRONG_TYPE` if another Redis type."""
        got = self._call("LRANGE", lambda: self.lua.bounded_range(
            keys=[key], args=[first, last, kind.max_bytes]))
        state = _state(got, key)
        if state <= 0:
            return WRONG_TYPE if state else []
        return [Oversized(item, kind.max_bytes) if isinstance(item, int) else item for item in got[1:]]

    def pop(self, key: str, kind: KeyKind) -> Any:
        """The list's last item, popped (RPOP without blocking): bytes, an
        :class:`Oversized`, None if none, :data:`WRONG_TYPE` if another Redis type."""
        got = self._call("RPOP", lambda: self.lua.bounded_pop(keys=[key], args=[kind.max_bytes]))
        state = _state(got, key)
        if state <= 0:
            return WRONG_TYPE if state else None
        return Oversized(int(got[1]), kind.max_bytes) if state == 2 else got[1]

    def members(self, key: str, kind: KeyKind, most: int) -> Any:
        """``(size, members)`` of the set at ``key``: its members within ``kind``'s bound
        (a member may repeat), none when it has more than ``most`` (they are not read);
        ``(0, [])`` if absent, :data:`WRONG_TYPE` if another Redis type."""
        got = self._call("SMEMBERS", lambda: self.lua.bounded_members(
            keys=[key], args=[most, kind.max_bytes]))
        state = _state(got, key)
        if state <= 0:
            return WRONG_TYPE if state else (0, [])
        return int(got[1]), ([] if state == 2 else [m for m in got[3:] if isinstance(m, bytes)])

    def get_signed(self, key: str, kind: KeyKind, *, ttl: float | None = None) -> tuple[Any, Raw] | None:
        """The typed record at ``key`` and its raw value (for a compare-and-set); None if
        absent or rejected. ``ttl``: the longest its writer gives it, if not the kind's."""
        try:
            return self.read(key, kind, ttl=ttl)
        except UntrustedRecordError:
            return None

    def record(self, key: str, kind: KeyKind, *, ttl: float | None = None) -> Any:
        """The typed record at ``key`` (:meth:`get_signed`'s), or None."""
        got = self.get_signed(key, kind, ttl=ttl)
        return None if got is None else got[0]

    def read(self, key: str, kind: KeyKind, *, ttl: float | None = None) -> tuple[Any, Raw] | None:
        """As :meth:`get_signed`, but an untrusted value raises
        :class:`UntrustedRecordError` (after rejecting it): for records whose absence and
        forgery call for different answers."""
        raw, ttl_ms = self._get_with_ttl(key, kind)
        if raw is None:
            return None
        try:
            if raw is WRONG_TYPE:
                raise UntrustedRecordError(f"{key}: wrong Redis type")
            record = self._trusted(key, raw, kind, ttl_ms, ttl)
        except UntrustedRecordError as e:
            self.reject(kind.kind, key, str(e))
            raise
        return record, Raw(raw.decode())

    def _trusted(self, key: str, raw: Any, kind: KeyKind, ttl_ms: int | None = None,
                 ttl: float | None = None, *, signed_for: str | None = None) -> Any:
        """:meth:`verify` and the kind's parser: the typed record, or UntrustedRecordError."""
        body = self.verify(key, raw, kind, ttl_ms, ttl, signed_for=signed_for)
        if kind.parse is None:
            return body
        return kind.parse(body, kind.parts_of(key), self.settings)

    def verify(self, key: str, raw: Any, kind: KeyKind, ttl_ms: int | None = None,
               ttl: float | None = None, *, signed_for: str | None = None) -> dict[str, Any]:
        """Bounded UTF-8 JSON, a TTL (within ``ttl`` x :data:`TTL_SLACK` if given), a good
        signature (for ``signed_for`` if not ``key``): the body, or
        :class:`UntrustedRecordError`."""
        if ttl_ms is not None:
            if int(ttl_ms) == -1:
                raise UntrustedRecordError(f"{key}: kept without a TTL")
            # The caller's own TTL for what it competes for (a lease, a slot): kept far
            # beyond it, a value is not a live writer's (others' expiry is signed).
            if ttl is not None and int(ttl_ms) > ttl * TTL_SLACK * 1000:
                raise UntrustedRecordError(f"{key}: TTL {ttl_ms} ms, far beyond the {ttl:g} s"
                                           " its writers give it")
        text = records.text(raw, key, kind.max_bytes)
        return self.signer.verify(signed_for or key, records.load(text, str(kind.kind), kind.max_bytes))

    def parse(self, key: str, raw: Any, kind: KeyKind, *, ttl_ms: int | None = None,
              signed_for: str | None = None) -> Any:
        """One list item or value read outside :meth:`read` (a queue, a chain, a
        batch): the typed record, or None (rejected: logged, counted)."""
        try:
            return self._trusted(key, raw, kind, ttl_ms, signed_for=signed_for)
        except UntrustedRecordError as e:
            self.reject(kind.kind, key, str(e))
            return None

    def reject(self, kind: RecordKind | str | None, key: str, reason: str) -> None:
        """Log and count one rejected record (never raises)."""
        kind = kind or "unknown"
        with contextlib.suppress(ValueError):  # callers may pass the value
            kind = RecordKind(kind)
        log.warning("record_rejected", kind=str(kind), key=key, reason=reason)
        self.rejected += 1
        if self.on_untrusted is not None:
            self.on_untrusted(kind)

    # -- the keyspace ---------------------------------------------------------------------

    def ttl(self, key: str) -> float:
        """Seconds left on ``key`` (-2: absent, -1: no TTL), as Redis reports them."""
        got = int(self._call("PTTL", lambda: self.client.pttl(key)))
        return got / 1000 if got >= 0 else float(got)

    def scan(self, pattern: str, limit: int | None = None) -> Iterator[str]:
        """Keys matching ``pattern`` (a glob under the namespace, e.g. ``peer:*``)."""
        return self._scan(self.keys.key(pattern), limit)

    def _scan(self, glob: str, limit: int | None = None) -> Iterator[str]:
        """At most ``limit`` keys matching ``glob`` (built by :class:`Keys`); a name not
        ASCII or over :data:`MAX_KEY_NAME` is no key of ours (skipped)."""
        def keys() -> list[str]:
            out: list[str] = []
            cursor: Any = 0
            while True:
                got = self.lua.bounded_scan(keys=[self.keys.key("scan")],
                                            args=[cursor, glob, 500, MAX_KEY_NAME])
                cursor = got[0]
                for k in got[1:]:
                    if isinstance(k, bytes) and k.isascii():
                        out.append(k.decode())
                        if limit is not None and len(out) >= limit:
                            return out
                if int(cursor) == 0:
                    return out
        yield from self._call("SCAN", keys)

    def ping(self) -> None:
        """Raise :class:`RegistryError` unless Redis answers."""
        self._call("PING", self.client.ping)

    def close(self) -> None:
        self.client.close()


def _state(got: Any, key: str) -> int:
    """The state a bounded read's script put first in its reply (0: absent, -1: another
    Redis type, 1: read, 2: over a bound)."""
    try:
        return int(got[0])
    except (TypeError, ValueError, IndexError) as e:
        raise RegistryError(f"bounded read of {key}: unexpected reply {got!r}"[:200]) from e


def ms(seconds: float) -> int:
    """Seconds -> whole milliseconds, at least 1 (Redis rejects a zero expiry)."""
    return max(int(seconds * 1000), 1)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
