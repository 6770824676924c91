"""Settings: one frozen dataclass, validated on construction; ``from_env`` is the only
code in nccl_back that reads the environment."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nccl_back.errors import ConfigError
from nccl_back.redis_url import parse_redis_url
from nccl_back.timing import DerivedBounds
from nccl_back.transport_kinds import MAX_HOLDER_PARTS, TRANSPORT_KINDS, TransportKind

ENV_PREFIX = "NCCL_BACK_"
#: Names a file holding the secret (a mounted Kubernetes Secret), instead of the value.
SECRET_FILE_ENV = ENV_PREFIX + "SECRET_FILE"
#: Shortest secret accepted: 16 bytes of entropy at best, enough for an HMAC key.
MIN_SECRET_BYTES = 16
#: Longest secret file read (a secret is a key, not a document).
MAX_SECRET_FILE_BYTES = 4096
#: Largest artifact set (compile caches) published or accepted, in bytes.
MAX_ARTIFACT_BYTES = 1 << 30
#: Automatic ``bucket_bytes`` (the setting at 0, :meth:`Settings.bucket_for`): about
#: 1/:data:`STEPS_PER_MODEL` of the model, a power of two within the transport's range.
AUTO_BUCKET_BYTES = {"gloo": (1 << 20, 8 << 20), "nccl": (8 << 20, 8 << 20)}
#: Steps a model is cut into at least: a path of D relay hops costs one transfer x
#: (1 + (D - 1) / STEPS_PER_MODEL). Not more: each gloo call has a fixed cost
#: (benchmarks/RESULTS.md).
STEPS_PER_MODEL = 64

#: Retired settings and what replaces each: setting one anywhere is an error naming the
#: replacement, never silently ignored.
RETIRED: dict[str, str] = {
    "sender_handshake_timeout": "derived: a tenth of handshake_timeout, at least 1 s",
    "receiver_handshake_timeout": "set handshake_timeout",
    "relay_stall_timeout": "set stall_timeout (it bounds relay members too)",
    "busy_wait": "derived: half of transfer_timeout",
    "peer_budget": "derived: busy_wait + transfer_timeout + 3 x handshake_timeout; set transfer_timeout",
    "artifact_wait": "derived: half of transfer_timeout",
    "single_flight_wait": "derived: 2.5 x transfer_timeout",
    "single_flight_max_wait": "derived: 30 x transfer_timeout",
    "claim_ttl": "derived: 0.6 x peer_ttl",
    "download_lease": "derived: 1.5 x peer_ttl",
    "download_group_window": "derived: cohort_window / 10; cooperative_download=false turns the split off",
    "max_peer_attempts": "fixed at 3 (nccl_back.timing.MAX_PEER_ATTEMPTS)",
    "max_artifact_bytes": "fixed at 1 GiB (nccl_back.config.MAX_ARTIFACT_BYTES)",
    "redis_ca_file": "put ?ssl_ca_certs=PATH in redis_url",
    "redis_cert_file": "put ?ssl_certfile=PATH in redis_url",
    "redis_key_file": "put ?ssl_keyfile=PATH in redis_url",
    "redis_sentinel_password": "put ?sentinel_password=PASSWORD in redis_url",
    "relay_fan_out": "the two trees are the one fan-out (chains retired): remove it",
}

TransportName = Literal["auto", TransportKind]
VerifyMode = Literal["sampled", "full", "none"]


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "nccl_back")


def default_advertise_host(redis_url: str) -> str:
    """The address of this machine's interface that reaches Redis (peers sharing it most
    likely reach this worker there too), else the host name's address, else 127.0.0.1.

    A UDP ``connect`` sends nothing but makes the kernel pick the route's source address;
    the host name alone often resolves to 127.0.0.1 through ``/etc/hosts``.
    """
    try:
        target = parse_redis_url(redis_url)
    except ConfigError:
        target = None
    for host, port in target.hosts if target is not None else ():
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except (OSError, UnicodeError):
            continue
        for family, kind, proto, _, addr in infos:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.connect(addr)
                    return str(probe.getsockname()[0]).split("%", 1)[0]
            except OSError:
                continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True)
class Settings(DerivedBounds):
    """Everything a worker needs to know to load weights from a peer or from storage."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Coordination store, password in the URL: ``redis://`` (``rediss://``: TLS),
    ``redis+sentinel://h1:26379,h2:26379/SERVICE/0`` or ``redis+cluster://h1:6379,h2:6379``;
    TLS files and the sentinels' password as query parameters (:mod:`nccl_back.redis_url`)."""

    namespace: str = "nccl_back"
    """Prefix of every Redis key, so several fleets can share one Redis."""

    transport: TransportName = "auto"
    """``gloo`` (CPU tensors), ``nccl`` (GPU tensors) or ``auto`` (by the model's device)."""

    advertise_host: str = ""
    """Address other workers reach this one's transports at. Empty: the interface that
    reaches Redis (:func:`default_advertise_host`); loopback with a remote Redis is warned
    about, and receivers on other hosts skip it."""

    handshake_timeout: float = 10.0
    """Seconds a receiver waits in the liveness handshake (the peer may just be busy); a
    sender waits a tenth of it, at least 1 s (:attr:`sender_handshake`)."""

    transfer_timeout: float = 120.0
    """Seconds one copy of the model from a peer may take (communicator creation plus the
    broadcast); the scale every wait of a load is carved from (:mod:`nccl_back.timing`)."""

    redis_timeout: float = 2.0
    """Socket timeout in seconds for every Redis call."""

    peer_ttl: float = 10.0
    """Seconds a published peer stays visible without a heartbeat (a crashed worker
    vanishes); the liveness of claims, leases and heartbeats derives from it."""

    max_concurrent_sends: int = 1
    """How many receivers one sender serves at once (one worker's resharding ranks count
    as one: together they take one model's worth of bytes)."""

    holder_parts: int = 2
    """How many idle holders (with a free send slot) a receiver pulls from at once, each
    sending its byte-balanced part under its own ``max_send_gbps``; not for a receiver with
    relay members below it, and two at most for a cohort seat (one per tree). 1: one holder
    sends everything. At most 4."""

    strict: bool = False
    """Raise instead of falling back to storage when a peer load fails."""

    verify: VerifyMode = "sampled"
    """Integrity check after a peer load: sampled hashes, a full checksum, or none."""

    bucket_bytes: int = 0
    """The broadcast's unit: smaller tensors are coalesced into buckets of this size, larger
    ones sent in chunks of it; also what a relay forwards. 0: per transport and model size
    (:meth:`bucket_for`). Both sides derive it from the same manifest."""

    max_send_gbps: float = 0.0
    """Cap on this worker's outgoing weight traffic in GB/s (10^9 B/s), shared by all its
    sends and relays, so serving never starves its own traffic. 0: unlimited."""

    cohort_window: float = 2.0
    """Receivers of one version and rank arriving within this many seconds of the cohort's
    previous arrival join it (the relay's two pipelined trees, joinable in flight) instead
    of queueing for whole copies; after a quiet window the next starts a new cohort."""

    cohort_max_size: int = 0
    """Most receivers in one cohort; the next start another. 0: 1,024 (:attr:`cohort_limit`).
    1: no relay (whole copies from holders: a binomial fan-out)."""

    stall_timeout: float = 10.0
    """Seconds a transfer may go without a completed step before it is aborted (a silent
    holder or relay upstream) and the receiver moves on (re-attaches, or storage) instead
    of waiting out ``transfer_timeout``. Must exceed one bucket at the slowest cap."""

    storage_workers: int = 8
    """Parallel downloads (shards and ranged chunks) from storage."""

    chunk_bytes: int = 64 << 20
    """Size of one ranged read from remote storage."""

    storage_attempts: int = 5
    """Attempts per storage request (exponential backoff with jitter between them)."""

    s3_endpoint_url: str = ""
    """Endpoint of the S3-compatible store ``s3://`` URIs name (``http(s)://host[:port]``:
    MinIO, R2, Ceph). Empty: boto3's own choice (``AWS_ENDPOINT_URL_S3`` ..., else AWS)."""

    cache_dir: str = field(default_factory=_default_cache_dir)
    """Where the CRC32C cache lives, so a restart reads no shard bytes."""

    cooperative_download: bool = True
    """Split a download nobody else holds: the elected worker waits
    :attr:`download_group_window`, then each member reads one part from storage and serves
    it to the elected worker, which proves every file and streams the whole
    (:mod:`nccl_back.load.cooperative`). False: no split."""

    compile_caches: bool = True
    """Engines share their compile caches with peers (received during the weight load,
    published when ready). Needs ``secret``, as caches hold code the engine runs; without
    one they are skipped (a warning, once)."""

    secret: str | None = field(default=None, repr=False)
    """The fleet's shared secret (``NCCL_BACK_SECRET``, or a file ``NCCL_BACK_SECRET_FILE``
    names), at least 16 bytes. It signs every record and keys the integrity checks, so
    write access to Redis cannot feed a worker weights. ``None``: as trusting as Redis."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # Values also come from JSON (vLLM's extra config): check types before use.
            if f.type == "str" and not isinstance(value, str):
                raise ConfigError(f"{f.name}={value!r}: must be a string")
            if f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{f.name}={value!r}: must be true or false")
            try:
                if isinstance(value, str):
                    value.encode("utf-8")
            except UnicodeEncodeError:
                # os.environ holds undecodable bytes as lone surrogates; never echo a secret.
                shown = "" if f.name in ("secret", "redis_url") else f"={value!r}"
                raise ConfigError(f"{f.name}{shown}: not UTF-8 text") from None
        parse_redis_url(self.redis_url)
        if not self.advertise_host:
            object.__setattr__(self, "advertise_host", default_advertise_host(self.redis_url))
        # No braces either: the namespace becomes a Redis Cluster hash tag, {namespace}.
        if not self.namespace or any(c in self.namespace for c in " :*?[]{}"):
            raise ConfigError(
                f"namespace={self.namespace!r}: must be non-empty, without spaces, ':', braces or glob characters"
            )
        if self.transport not in ("auto", *TRANSPORT_KINDS):
            raise ConfigError(f"transport={self.transport!r}: choose {', '.join(('auto', *TRANSPORT_KINDS[:-1]))} or {TRANSPORT_KINDS[-1]}")
        if self.verify not in ("sampled", "full", "none"):
            raise ConfigError(f"verify={self.verify!r}: choose sampled, full or none")
        for name in (
            "handshake_timeout", "transfer_timeout", "redis_timeout", "peer_ttl", "cohort_window", "stall_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r}: must be a positive number of seconds")
        for name in (
            "max_concurrent_sends", "storage_workers", "chunk_bytes", "storage_attempts",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if not isinstance(self.holder_parts, int) or isinstance(self.holder_parts, bool) or not (
            1 <= self.holder_parts <= MAX_HOLDER_PARTS
        ):
            raise ConfigError(f"holder_parts={self.holder_parts!r}: must be an integer from 1"
                              f" (one holder sends everything) to {MAX_HOLDER_PARTS}")
        for name in ("bucket_bytes", "max_send_gbps", "cohort_max_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                name != "max_send_gbps" and not isinstance(value, int)
            ):
                raise ConfigError(f"{name}={value!r}: must be 0 (automatic/unlimited) or positive")
        if self.s3_endpoint_url and (
            not re.match(r"^https?://[^\s/?#]+/?$", self.s3_endpoint_url)
        ):
            raise ConfigError(f"s3_endpoint_url={self.s3_endpoint_url!r}: give http(s)://host[:port]"
                              " (the store's endpoint, no bucket or path), or leave it empty")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name}={value!r}: must be a finite number")
        if self.secret is not None and (
            not isinstance(self.secret, str) or len(self.secret.encode()) < MIN_SECRET_BYTES
        ):
            # Never echo the value: it is a secret even when it is a bad one.
            raise ConfigError(
                f"secret: must be a string of at least {MIN_SECRET_BYTES} bytes"
                " (e.g. `openssl rand -hex 32`), or unset"
            )

    def key(self, purpose: str) -> bytes | None:
        """A 32-byte key for one ``purpose`` derived from :attr:`secret` (``None`` without
        one): what one use reveals says nothing about another's key."""
        if self.secret is None:
            return None
        return hmac.new(self.secret.encode(), b"nccl_back/" + purpose.encode(), hashlib.sha256).digest()

    def bucket_for(self, kind: str, model_bytes: int = 0) -> int:
        """:attr:`bucket_bytes`, or if 0 the power of two nearest ``model_bytes`` /
        :data:`STEPS_PER_MODEL` within ``kind``'s :data:`AUTO_BUCKET_BYTES` range."""
        if self.bucket_bytes:
            return self.bucket_bytes
        lo, hi = AUTO_BUCKET_BYTES.get(kind, (1 << 20, 1 << 20))
        want = model_bytes // STEPS_PER_MODEL
        nearest = 1 << round(math.log2(want)) if want > 0 else lo  # in log scale
        return min(max(nearest, lo), hi)

    @property
    def cohort_limit(self) -> int:
        """:attr:`cohort_max_size`, or when it is 0 1,024 seats."""
        return self.cohort_max_size or 1024

    def __new__(cls, *args: Any, **kwargs: Any) -> Settings:
        # Runs before the dataclass's __init__: a retired name gets its replacement, not
        # a bare "unexpected keyword argument".
        retired_error(kwargs, "{name}")
        return super().__new__(cls)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (validated again)."""
        retired_error(changes, "{name}")
        if ("redis_url" in changes and "advertise_host" not in changes
                and self.advertise_host == default_advertise_host(self.redis_url)):
            changes["advertise_host"] = ""  # automatic: chosen again for the new Redis
        copy = dataclasses.replace(self, **changes)
        if "_caps" in self.__dict__:
            object.__setattr__(copy, "_caps", self.caps)  # a carved phase stays carved
        return copy

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``NCCL_BACK_<FIELD>`` variables; ``overrides`` win. A bad value's
        :class:`ConfigError` names the variable; ``NCCL_BACK_SECRET_FILE`` and
        ``NCCL_BACK_SECRET`` both set is one."""
        env = os.environ if environ is None else environ
        retired_error({k[len(ENV_PREFIX):].lower() for k in env if k.startswith(ENV_PREFIX)},
                      ENV_PREFIX + "{NAME}")
        values: dict[str, Any] = {}
        secret_file = env.get(SECRET_FILE_ENV)
        if secret_file is not None:
            if env.get(ENV_PREFIX + "SECRET") is not None:
                raise ConfigError(
                    f"{SECRET_FILE_ENV} and {ENV_PREFIX}SECRET are both set; set one of them"
                )
            values["secret"] = _read_secret_file(secret_file)
        for f in dataclasses.fields(cls):
            key = ENV_PREFIX + f.name.upper()
            raw = env.get(key)
            # Compare with None, not truthiness: "0" and "" are values a user may set.
            if raw is not None:
                values[f.name] = _parse(key, raw, f.type)
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as e:
            # The check names the field; the user set a variable: name that too.
            from_env = [n for n in values if n not in overrides]
            named = [
                SECRET_FILE_ENV if n == "secret" and secret_file is not None else ENV_PREFIX + n.upper()
                for n in from_env
                if re.search(rf"\b{n}\b", str(e))
            ]
            if not named:
                raise
            # A suffix: the message still starts with the field, as Settings(...) says it.
            raise ConfigError(f"{e} (from {', '.join(named)})") from e


def retired_error(names: Any, shown: str) -> None:
    """:class:`ConfigError` naming the first retired setting among ``names`` (as ``shown``
    formats it: ``{name}`` or ``{NAME}``, ``{flag}``) and what replaces it."""
    for name in sorted(n for n in names if n in RETIRED):
        spelled = shown.format(name=name, NAME=name.upper(), flag=name.replace("_", "-"))
        raise ConfigError(f"{spelled}: setting retired; {RETIRED[name]}")


def _read_secret_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{SECRET_FILE_ENV}={path!r}: cannot read the secret: {e.strerror}") from e
    except ValueError as e:  # a NUL in the path
        raise ConfigError(f"{SECRET_FILE_ENV}={path!r}: not a file path ({e})") from e
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{SECRET_FILE_ENV}={path!r}: over {MAX_SECRET_FILE_BYTES} bytes")
    try:
        # Kubernetes Secrets and `echo` leave a trailing newline that is no part of the key.
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{SECRET_FILE_ENV}={path!r}: the secret is not UTF-8 text") from e


def _parse(key: str, raw: str, type_: Any) -> Any:
    t = str(type_)
    try:
        if t == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if t == "int":
            return int(raw)
        if t == "float":
            return float(raw)
    except ValueError as e:
        raise ConfigError(f"{key}={raw!r}: {e}; expected a {t}") from e
    return raw
