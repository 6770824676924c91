"""The rendezvous: each transfer's process group bootstraps through signed, bounded keys
in the Redis the workers share, never a ``TCPStore`` port (docs/security.md, "The
rendezvous opens no port"). :class:`RedisStore` signs every value under
``Settings.key("rendezvous")`` over its Redis key and bytes, so a forged or moved value
reads as absent; each side polls for the keys it waits on, by the transport's deadline.
``init_process_group`` is never called: the user's worker may already have one.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import hashlib
import hmac
import ipaddress
import socket
import threading
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.signed_store import Raw
from nccl_back.errors import (
    ConfigError,
    TransferError,
    TransferStalledError,
    TransferTimeoutError,
)
from nccl_back.log import get_logger
from nccl_back.redis_url import parse_redis_url
from nccl_back.timing import KEY_TTL_SLACK
from nccl_back.timing import STORE_POLL_MAX as POLL_MAX
from nccl_back.timing import STORE_POLL_MIN as POLL_MIN
from nccl_back.transport.channel import RECEIVER_RANK, SENDER_RANK, Rendezvous, Transport

if TYPE_CHECKING:
    from nccl_back.coord.registry import Registry

log = get_logger(__name__)

#: Longest bootstrap value accepted or written (gloo's addresses and NCCL's 128-byte
#: unique id are far smaller).
MAX_VALUE_BYTES = 16 << 10
#: Longest key name a process group may use (torch's are short: ``{prefix}/0/{rank}``).
MAX_NAME_CHARS = 256
#: Kinds of call from other threads kept per store (a bound on what they can make us hold).
MAX_FOREIGN = 32

# Stored form: "{hex hmac}:{base64 value}" ("-" instead of the hmac in unsigned mode).
_UNSIGNED = "-"
_MAC_HEX = 64
# Base64 of MAX_VALUE_BYTES plus the MAC and separator: what a read takes at most.
_MAX_STORED = _MAC_HEX + 1 + 4 * (-(-MAX_VALUE_BYTES // 3))


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) -> ``(host, port)``; :class:`ConfigError` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"transport address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP or a name) means this machine only (127/8, ::1, localhost)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addrs = {str(info[4][0]) for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)


def redis_is_local(settings: Settings) -> bool:
    """Whether every Redis host of ``settings`` is on this machine (loopback or a socket)."""
    target = parse_redis_url(settings.redis_url)
    return all(is_loopback(host) for host, _ in target.hosts)


def unreachable_reason(settings: Settings, address: str) -> str | None:
    """Why a peer advertising ``address`` cannot be reached from here, or None: a loopback
    address while Redis is on another host (the fleet spans hosts; trying it would only
    cost the connect deadline)."""
    try:
        host, _ = split_address(address)
    except ConfigError as e:
        return str(e)
    if is_loopback(host) and not redis_is_local(settings):
        return (f"it advertises the loopback address {address!r} while Redis is on another"
                " host: only its own machine can reach it (its advertise_host is wrong)")
    return None


class RedisStore(dist.Store):
    """One transfer's bootstrap keys in Redis, HMAC-signed and size-bounded: ``set``,
    ``get``, ``wait``, ``check``, ``delete_key``. Every wait ends by ``deadline``, or at
    once after ``aborted`` is set, with :class:`TransferTimeoutError`."""

    def __init__(self, registry: Registry, scope: str, key: bytes | None, deadline: float,
                 aborted: threading.Event | None = None) -> None:
        super().__init__()
        self._registry = registry
        self._aborted = aborted
        self._scope = scope
        self._key = key
        self.deadline = deadline
        self._written: set[str] = set()
        self._lock = threading.Lock()
        self.rejected = 0
        """Values found at this transfer's keys that failed the check (forged, too long)."""
        self.foreign_calls: collections.Counter[tuple[str, str]] = collections.Counter()
        """Calls from threads Python did not start (NCCL's watchdog, heartbeat monitor), by
        (method, OS thread name); each first one logged, at most :data:`MAX_FOREIGN` kept."""

    # -- encoding ----------------------------------------------------------------------------

    def _redis_key(self, name: str) -> str:
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
            raise TransferError(f"rendezvous key name of {len(str(name))} chars: over {MAX_NAME_CHARS}")
        return self._registry.keys.of(schema.RENDEZVOUS, self._scope, name)

    def _mac(self, redis_key: str, value: bytes) -> str:
        if self._key is None:
            return _UNSIGNED
        return hmac.new(self._key, redis_key.encode() + b"\0" + value, hashlib.sha256).hexdigest()

    def encode(self, redis_key: str, value: bytes) -> str:
        """The stored form of ``value`` at ``redis_key``."""
        return self._mac(redis_key, value) + ":" + base64.b64encode(value).decode()

    def decode(self, redis_key: str, stored: Any) -> bytes | None:
        """The value a stored string carries, if it is to be trusted; None otherwise."""
        if not isinstance(stored, str) or len(stored) > _MAX_STORED or not stored.isascii():
            return None  # (compare_digest refuses non-ASCII strings: never let it raise)
        mac, sep, body = stored.partition(":")
        if not sep:
            return None
        try:
            value = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            return None
        # Base64 has spellings that decode alike ("AB==" and "AA=="): only the one this
        # module writes is genuine, so a changed stored value is never accepted.
        if base64.b64encode(value).decode() != body:
            return None
        if len(value) > MAX_VALUE_BYTES or not hmac.compare_digest(mac, self._mac(redis_key, value)):
            return None
        return value

    # -- Redis -------------------------------------------------------------------------------

    def _left(self, what: str) -> float:
        if self._aborted is not None and self._aborted.is_set():
            # A forming communicator's constructor cannot be interrupted otherwise.
            raise TransferTimeoutError(f"rendezvous {what}: aborted")
        left = self.deadline - _clock.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"rendezvous {what}: deadline passed")
        return left

    def _read(self, name: str) -> bytes | None:
        redis_key = self._redis_key(name)
        raw = self._registry.raw_value(redis_key, schema.RENDEZVOUS)
        if not raw:
            return None
        # Another Redis type, oversized, or bytes no genuine writer produces (ours are
        # ASCII): rejected, never decoded.
        stored = raw.decode("ascii") if isinstance(raw, bytes) and raw.isascii() else "\ufffd"
        value = self.decode(redis_key, stored)
        if value is None:
            with self._lock:
                self.rejected += 1
            log.warning("rendezvous_value_rejected", key=redis_key, chars=len(stored))
        return value

    def _poll(self, names: list[str], what: str) -> list[bytes]:
        pauses = _clock.pauses(POLL_MIN, POLL_MAX)
        while True:
            values = [self._read(n) for n in names]
            if all(v is not None for v in values):
                return [v for v in values if v is not None]
            _clock.sleep(min(next(pauses), self._left(what)))

    def _note(self, method: str) -> None:
        """Record a call from a thread Python did not start (see :attr:`foreign_calls`)."""
        if not isinstance(threading.current_thread(), threading._DummyThread):
            return
        kind = (method, _thread_name())
        with self._lock:
            first = kind not in self.foreign_calls
            if first and len(self.foreign_calls) >= MAX_FOREIGN:
                return
            self.foreign_calls[kind] += 1
        if first:
            log.info("rendezvous_called_from_another_thread", method=method, thread=kind[1],
                     scope=self._scope)

    # -- dist.Store --------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._note("set")
        data = bytes(value) if not isinstance(value, str) else value.encode()
        if len(data) > MAX_VALUE_BYTES:
            raise TransferError(f"rendezvous value of {len(data)} bytes: over {MAX_VALUE_BYTES}")
        redis_key = self._redis_key(key)
        self._registry.set_json(redis_key, Raw(self.encode(redis_key, data)),
                                self._left("set") + KEY_TTL_SLACK)
        with self._lock:
            self._written.add(redis_key)

    def get(self, key: str) -> bytes:
        self._note("get")
        return self._poll([key], f"get {key!r}")[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._note("wait")
        if timeout is not None:
            self.deadline = min(self.deadline, _clock.monotonic() + timeout.total_seconds())
        self._poll(list(keys), f"wait {list(keys)!r}")

    def check(self, keys: list[str]) -> bool:
        self._note("check")
        return all(self._read(k) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        self._note("delete_key")
        redis_key = self._redis_key(key)
        client = self._registry.client
        return bool(self._registry._call("DEL", lambda: client.delete(redis_key)))

    def add(self, key: str, value: int) -> int:
        # A counter cannot carry a signature; no bootstrap we run uses one.
        self._refuse("add", "the Redis rendezvous does not support add()")

    def num_keys(self) -> int:
        self._refuse("num_keys", "the Redis rendezvous cannot count keys")

    def _refuse(self, method: str, why: str) -> NoReturn:
        self._note(method)
        log.warning("rendezvous_call_refused", method=method, thread=_thread_name(),
                    scope=self._scope)
        raise TransferError(why)

    def close(self) -> None:
        """Delete the keys this side wrote (best effort; their TTL bounds them anyway)."""
        with self._lock:
            written, self._written = list(self._written), set()
        if not written:
            return
        client = self._registry.client
        self._registry.tidy("rendezvous DEL", lambda: client.delete(*written))


def _thread_name() -> str:
    """The calling thread's OS name (NCCL names its own "pt_nccl_watchdg", ...)."""
    try:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()[:64]
    except OSError:
        return threading.current_thread().name[:64]


S = TypeVar("S", bound="StoreTransport")


class StoreTransport(Transport):
    """A transport whose process group bootstraps through :class:`RedisStore` (what gloo
    and NCCL share)."""

    def __init__(self, rank: int, transfer_id: str, settings: Settings, registry: Registry, *,
                 device: torch.device) -> None:
        super().__init__(rank, transfer_id, device)
        self.settings = settings
        self._registry = registry  # the bootstrap keys' Redis
        self._store: RedisStore | None = None
        self.store_calls: collections.Counter[tuple[str, str]] = collections.Counter()
        """:attr:`RedisStore.foreign_calls`, once the keys are dropped."""
        self._aborted = threading.Event()
        """An abort was asked for (from any thread); every later wait fails at once."""

    @classmethod
    def receiver(cls: type[S], settings: Settings, registry: Registry, address: str,
                 transfer_id: str, *, device: torch.device) -> S:
        """The rank-1 side of a transfer with the sender at ``address`` (checked for form)."""
        split_address(address)
        return cls(RECEIVER_RANK, transfer_id, settings, registry, device=device)

    @property
    def _name(self) -> str:
        return f"{self.kind} transfer {self.transfer_id}"

    def _left(self, what: str) -> float:
        """Seconds left to the deadline; :class:`TransferTimeoutError` when none, or aborted."""
        if self._aborted.is_set():
            raise TransferTimeoutError(f"{self._name} aborted during {what}")
        left = self._deadline - _clock.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"{self._name}: {what} passed the deadline")
        return left

    def _bootstrap(self) -> dist.Store:
        """This transfer's bootstrap keys, every wait on them ending by the connect deadline."""
        self._store = RedisStore(self._registry, f"{self.kind}/{self.transfer_id}",
                                 self.settings.key("rendezvous"),
                                 _clock.monotonic() + self._left("connect"), self._aborted)
        return dist.PrefixStore(self.kind, self._store)

    def _drop_bootstrap(self) -> None:
        """Delete this side's bootstrap keys (not right after connect: the peer may still
        be reading them; their TTL bounds them anyway)."""
        if self._store is not None:
            self._store.close()
            self.store_calls.update(self._store.foreign_calls)
        self._store = None

    def _error(self, what: str, e: BaseException) -> TransferError:
        """The error a failed call of ``what`` raises, by why it failed."""
        if self._aborted.is_set():
            return TransferTimeoutError(f"{self._name} aborted during {what}: {e}")
        # The libraries word their timeouts differently by where they fire ("Timed out
        # waiting ...", "Application timeout caused pair closure").
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        past = _clock.monotonic() >= self._deadline
        if timed_out and not past and self.per_call_timeout:
            # The per-call timeout fired before the deadline: it was the stall bound.
            return TransferStalledError(f"{self._name}: {what} stalled"
                                        f" (no progress for {self.call_timeout:g} s): {e}")
        if timed_out or past:
            return TransferTimeoutError(f"{self._name}: {what} timed out: {e}")
        return TransferError(f"{self._name}: {what} failed (peer gone?): {e}")


class StoreRendezvous(Rendezvous):
    """The sender's endpoint: no listener; :attr:`address` is ``{advertise_host}:0`` (port
    0: no rendezvous port). A kind's subclass names its :attr:`transport` and ``kind``."""

    transport: type[StoreTransport]
    """The kind's transport; its rank-0 side is made per transfer."""

    def __init__(self, settings: Settings, registry: Registry, *, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self._registry: Registry | None = registry
        if is_loopback(settings.advertise_host) and not redis_is_local(settings):
            log.warning(
                "advertising_loopback",
                advertise_host=settings.advertise_host,
                message="this worker advertises a loopback address while Redis is on another"
                " host: no other machine can receive weights from it (receivers skip it). Set"
                " NCCL_BACK_ADVERTISE_HOST to an address peers reach.",
            )
        log.debug("rendezvous_started", kind=self.kind, address=self.address)

    @property
    def address(self) -> str:
        host = self.settings.advertise_host
        return f"[{host}]:0" if ":" in host else f"{host}:0"  # an IPv6 host in brackets

    def sender(self, transfer_id: str) -> Transport:
        if self._registry is None:
            raise TransferError(f"the {self.kind} rendezvous is closed")
        return self.transport(SENDER_RANK, transfer_id, self.settings, self._registry,
                              device=self.device)

    def close(self) -> None:
        self._registry = None
