"""The signed key-value layer under every record family of the registry.

It owns the client (one server, Sentinel or Cluster: :mod:`.redisclient`), the one
mapping of redis-py failures to :class:`RegistryError`, the key names (:class:`.Keys`),
the Lua scripts (:mod:`.scripts`), and trust: values are JSON (never pickle: a Redis
shared by a fleet must not be able to run code in a worker), signed when
``Settings.secret`` is set (:mod:`.auth`), and read back through their kind's entry in
the record schema (:mod:`.schema`): bytes, bounded, decoded, verified, parsed into the
kind's typed record.

Trust. A value that is not UTF-8, unsigned, badly signed, expired, malformed, kept
without a TTL or far beyond the one its writers give it is skipped, logged
(``record_rejected``) and counted (``on_untrusted``, under its
:class:`~nccl_back.errors.RecordKind`); it never raises out of a list. ``SET NX`` also
takes over a key kept without a TTL or of the wrong Redis type (it would otherwise
hold a claim, a lease or the ground truth forever), and :meth:`SignedStore.acquire`
takes over a holder that does not verify, atomically on the value it read, so hostile
values cost a bounded delay, never the fleet.
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
        elif redisclient.decodes_responses(client):
            # Replies are parsed from bytes by each kind's parser: a client that decodes
            # them raises UnicodeDecodeError inside redis-py on bytes that are not UTF-8.
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

    def tidy(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run a write that only tidies (pruning an index, refreshing an expiry, dropping
        what expires anyway): a failure (an outage, or another Redis type an attacker left
        there) is logged (``tidy_failed``) and counted (:attr:`tidy_failed`), and None
        returned, never raised. Only the writes a load needs are errors: a registry error
        sends each worker to storage on its own, past the single flight, so garbage at one
        key would otherwise turn a fleet's one download into one per worker."""
        try:
            return self._call(what, fn)
        except RegistryError as e:
            self.tidy_failed += 1
            log.warning("tidy_failed", what=what, error=str(e))
            return None

    # -- writing --------------------------------------------------------------------------

    def set_json(self, key: str, value: Any, ttl: float, *, nx: bool = False) -> bool:
        """Store ``value`` as JSON at ``key`` with a TTL in seconds; ``nx``: only if absent.

        Returns whether the value was written.
        """
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
        """``SET NX`` of ``value`` (signed) at ``key``, taking over a holder that is not
        to be obeyed: another Redis type, not UTF-8, unsigned or badly signed, expired,
        malformed, or kept far beyond ``ttl``. The takeover is atomic on the value read,
        so two workers that both found garbage never both win. Returns the raw value
        stored (for :meth:`compare_and_set` renewals), or None if a trusted holder has it."""
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
        """Drop ``key`` if it holds another Redis type than ``kind`` ('none': drop it
        whatever it holds); extend it by ``extend`` seconds if given. It only tidies (see
        :meth:`tidy`). (A script call of its own: a cluster pipeline refuses EVALSHA.)"""
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

    # Every value, list item and set member this package reads from Redis is read here,
    # by a script that refuses one over its kind's bound by its length on the server:
    # its bytes never cross the wire (tests/test_bounded_reads.py holds every other
    # module to it).

    def _get_with_ttl(self, key: str, kind: KeyKind) -> tuple[Any, int]:
        """``(raw bytes or None, PTTL in ms)`` in one round trip; :data:`WRONG_TYPE` as the
        value when the key holds a list, set or hash (another writer's, never ours), an
        :class:`Oversized` one (its bytes left on the server) when it is longer than
        ``kind``'s bound."""
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
        """Values and PTTLs in as few round trips as :meth:`_values` takes, as it gives
        them, keys of another Redis type rejected (logged, counted)."""
        values, ttls = self._values(keys, kind)
        for key, raw in zip(keys, values, strict=True):
            if raw is WRONG_TYPE:
                self.reject(kind.kind, key, "wrong Redis type")
        return values, ttls

    def raw_value(self, key: str, kind: KeyKind) -> Any:
        """The bytes at ``key``, or None (absent), :data:`WRONG_TYPE` or an
        :class:`Oversized` (see :meth:`_get_with_ttl`): for values whose format another
        module owns (the rendezvous, ``check``'s probe)."""
        return self._get_with_ttl(key, kind)[0]

    def values(self, keys: list[str], kind: KeyKind) -> list[Any]:
        """The raw values at ``keys`` (a batch, MGET's job): None where absent or of another
        Redis type (rejected), an :class:`Oversized` where over ``kind``'s bound (which
        :meth:`parse` rejects), else the bytes."""
        return [None if raw is WRONG_TYPE else raw for raw in self._get_with_ttls(keys, kind)[0]]

    def items(self, key: str, kind: KeyKind, first: int, last: int) -> Any:
        """The items at positions ``first..last`` of the list at ``key`` (LRANGE's
        indexes; the range bounds their count): each its bytes, or an :class:`Oversized`
        left on the server; [] if absent, :data:`WRONG_TYPE` if another Redis type."""
        got = self._call("LRANGE", lambda: self.lua.bounded_range(
            keys=[key], args=[first, last, kind.max_bytes]))
        state = _state(got, key)
        if state <= 0:
            return WRONG_TYPE if state else []
        return [Oversized(item, kind.max_bytes) if isinstance(item, int) else item for item in got[1:]]

    def pop(self, key: str, kind: KeyKind) -> Any:
        """The last item of the list at ``key``, popped (RPOP's job, without blocking): its
        bytes, an :class:`Oversized` (dropped on the server), None if there is none,
        :data:`WRONG_TYPE` if the key holds another Redis type."""
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
        """The typed record at ``key`` (``kind``'s parser's) and its raw value (for a
        compare-and-set); None if absent or rejected (logged, counted). ``ttl``: the
        longest TTL its writer gives it, if not the kind's."""
        try:
            return self.read(key, kind, ttl=ttl)
        except UntrustedRecordError:
            return None

    def read(self, key: str, kind: KeyKind, *, ttl: float | None = None) -> tuple[Any, Raw] | None:
        """As :meth:`get_signed`, but a value that is there and not to be trusted raises
        :class:`UntrustedRecordError` (rejected: logged, counted) instead of reading as
        absent: for records whose absence and forgery call for different answers."""
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

    def _trusted(self, key: str, raw: Any, kind: KeyKind, ttl_ms: int | None,
                 ttl: float | None = None) -> Any:
        """:meth:`verify` and the kind's parser: the typed record, or UntrustedRecordError."""
        body = self.verify(key, raw, kind, ttl_ms, ttl)
        if kind.parse is None:
            return body
        return kind.parse(body, kind.parts_of(key), self.settings)

    def verify(self, key: str, raw: Any, kind: KeyKind, ttl_ms: int | None = None,
               ttl: float | None = None, *, signed_for: str | None = None) -> dict[str, Any]:
        """Bounded UTF-8 JSON, a TTL (within ``ttl`` x :data:`TTL_SLACK` if given), a good
        signature (for
        ``signed_for``, the key it was signed for, if not ``key``): the record's body, or
        :class:`UntrustedRecordError`."""
        if ttl_ms is not None:
            if int(ttl_ms) == -1:
                raise UntrustedRecordError(f"{key}: kept without a TTL")
            # The caller's own TTL for what it competes for (a lease, a slot): kept far
            # beyond it, a value is not a live writer's. Other records' writers may run
            # other settings; their expiry is inside the signature.
            if ttl is not None and int(ttl_ms) > ttl * TTL_SLACK * 1000:
                raise UntrustedRecordError(f"{key}: TTL {ttl_ms} ms, far beyond the {ttl:g} s"
                                           " its writers give it")
        text = records.text(raw, key, kind.max_bytes)
        return self.signer.verify(signed_for or key, records.load(text, str(kind.kind), kind.max_bytes))

    def parse(self, key: str, raw: Any, kind: KeyKind, *, signed_for: str | None = None) -> Any:
        """One list item or value read outside :meth:`read` (a queue, a chain, a
        batch): the typed record, or None (rejected: logged, counted)."""
        try:
            body = self.verify(key, raw, kind, signed_for=signed_for)
            if kind.parse is None:
                return body
            return kind.parse(body, kind.parts_of(key), self.settings)
        except UntrustedRecordError as e:
            self.reject(kind.kind, key, str(e))
            return None

    def reject(self, kind: RecordKind | str | None, key: str, reason: str) -> None:
        """Log and count one rejected record (never raises: the metric takes any kind;
        the layer passes a :class:`RecordKind`, a stray string is counted as given)."""
        kind = _kind(kind or "unknown")
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
        """Keys matching ``glob``, a whole key pattern of the namespace (:class:`Keys`
        builds them), at most ``limit`` of them; a name that is not ASCII, or longer than
        :data:`MAX_KEY_NAME` (left on the server), is no key of ours (skipped)."""
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
