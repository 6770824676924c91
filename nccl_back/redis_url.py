"""Coordination-store URLs: what a ``redis_url`` names, parsed and checked, and its
redacted form for messages. No ``redis`` import: :class:`Settings` validates with it and
the client (:mod:`nccl_back.coord.redisclient`) reads the same parse. The forms::

    redis://[:password@]host:6379/0                 one server (unix:///path/redis.sock?db=0 too)
    redis+sentinel://[:pw@]h1:26379,h2:26379/SVC/0  the master Sentinel names SVC
    redis+cluster://[:pw@]h1:6379,h2:6379           a Redis Cluster (any nodes, as seeds)
    rediss://, rediss+sentinel://, rediss+cluster://  the same over TLS

Query parameters (redis-py's names, :data:`OPTIONS`; see :class:`RedisTarget`):
``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile`` (TLS URLs; verification is always
on) and ``sentinel_password`` (the sentinels' own; the URL's is the data nodes').
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from nccl_back.errors import ConfigError

Kind = Literal["single", "sentinel", "cluster"]

_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}
_DEFAULT_PORT = {"single": 6379, "sentinel": 26379, "cluster": 6379}
_EXAMPLE = (
    "redis://[:password@]host:6379/0, rediss://..., unix:///path.sock,"
    " redis+sentinel://[:password@]h1:26379,h2:26379/SERVICE/0 or redis+cluster://h1:6379,h2:6379"
)


@dataclass(frozen=True)
class RedisTarget:
    """What a ``redis_url`` names, parsed and checked."""

    kind: Kind
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    """``(host, port)`` of the server, the sentinels, or the cluster's seed nodes."""
    username: str | None
    password: str | None
    db: int
    service: str | None
    """The master's name in Sentinel (``sentinel`` only)."""
    ca_file: str | None = None
    """``ssl_ca_certs``: the PEM CA bundle that verifies the server (None: the system's)."""
    cert_file: str | None = None
    """``ssl_certfile``: the PEM client certificate for mutual TLS."""
    key_file: str | None = None
    """``ssl_keyfile``: the PEM private key of ``cert_file`` (None: in the certificate file)."""
    sentinel_password: str | None = field(default=None, repr=False)
    """``sentinel_password``: the sentinels' own (``sentinel`` only)."""

#: The query parameters :func:`parse_redis_url` reads (the rest go to redis-py as they are).
OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "sentinel_password")


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a coordination-store URL; :class:`ConfigError` naming the problem otherwise."""
    if not isinstance(url, str):
        raise ConfigError(f"redis_url={url!r}: must be a string ({_EXAMPLE})")
    if any(c.isspace() or not c.isprintable() for c in url):
        # urlsplit silently drops tabs and newlines: what it parsed is not what was given.
        raise ConfigError(f"redis_url={url!r}: whitespace or control characters; percent-encode them")
    try:
        parts = urlsplit(url)
    except ValueError as e:  # an unbalanced [IPv6] bracket
        raise ConfigError(f"redis_url={url!r}: {e} ({_EXAMPLE})") from e
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ConfigError(f"redis_url={url!r}: scheme must be redis://, rediss:// or unix:// ({_EXAMPLE})")
    kind, tls = _SCHEMES[scheme]
    if scheme == "unix":
        return _options(url, parts.query, RedisTarget(kind, tls, (), parts.username, parts.password, 0, None))
    userinfo, sep, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if sep:
        user, _, pw = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    hosts = tuple(_host_port(url, h, _DEFAULT_PORT[kind]) for h in hostlist.split(","))
    if kind == "single" and len(hosts) > 1:
        raise ConfigError(
            f"redis_url={url!r}: several hosts; use redis+sentinel:// or redis+cluster:// for those"
        )
    path = [p for p in parts.path.split("/") if p]
    service = None
    if kind == "sentinel":
        if not path:
            raise ConfigError(f"redis_url={url!r}: name the master, redis+sentinel://h1:26379,h2:26379/SERVICE/0")
        service, path = unquote(path[0]), path[1:]
    if len(path) > 1 or (path and not (path[0].isascii() and path[0].isdigit())):
        raise ConfigError(f"redis_url={url!r}: the database must be a number, e.g. /0")
    db = int(path[0]) if path else 0
    if kind == "cluster" and db != 0:
        raise ConfigError(f"redis_url={url!r}: a Redis Cluster has only database 0")
    return _options(url, parts.query, RedisTarget(kind, tls, hosts, username, password, db, service))


def _options(url: str, query: str, target: RedisTarget) -> RedisTarget:
    """``target`` with the :data:`OPTIONS` of the URL's query, checked."""
    got: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in OPTIONS:
            continue
        if key in got or not value:
            raise ConfigError(f"redis_url={redact(url)!r}: {key} given twice or empty")
        got[key] = value
    tls_files = [k for k in OPTIONS[:3] if k in got]
    if tls_files and not target.tls:
        # Silently ignoring them would let a user believe the link is encrypted.
        raise ConfigError(f"redis_url={redact(url)!r}: {', '.join(tls_files)} given but the URL is not"
                          " TLS; use rediss://, rediss+sentinel:// or rediss+cluster://")
    if "ssl_keyfile" in got and "ssl_certfile" not in got:
        raise ConfigError(f"redis_url={redact(url)!r}: ssl_keyfile given without ssl_certfile"
                          " (the client certificate)")
    if "sentinel_password" in got and target.kind != "sentinel":
        raise ConfigError(f"redis_url={redact(url)!r}: sentinel_password is for redis+sentinel:// URLs")
    return replace(target, ca_file=got.get("ssl_ca_certs"), cert_file=got.get("ssl_certfile"),
                   key_file=got.get("ssl_keyfile"), sentinel_password=got.get("sentinel_password"))


def without_options(url: str) -> str:
    """``url`` without the query parameters :func:`parse_redis_url` reads itself (for redis-py,
    which would pass them on to the connection as they are)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in OPTIONS]
    return urlunsplit(parts._replace(query=urlencode(query)))


def _host_port(url: str, item: str, default: int) -> tuple[str, int]:
    if not item:
        raise ConfigError(f"redis_url={url!r}: no host; use redis://host:6379/0")
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ConfigError(f"redis_url={url!r}: no host; use redis://host:6379/0")
    if not port_text:
        return host, default
    # ASCII only: str.isdigit() is also true of '²', which int() refuses.
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ConfigError(f"redis_url={url!r}: bad port ({port_text!r})")
    return host, int(port_text)


def redact(url: str) -> str:
    """``url`` without its passwords, fit for an error message or a log line."""
    parts = urlsplit(url)
    if "sentinel_password=" in parts.query:
        query = "&".join("sentinel_password=***" if p.startswith("sentinel_password=") else p
                         for p in parts.query.split("&"))
        parts = parts._replace(query=query)
    if parts.password is None:
        return urlunsplit(parts)
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
