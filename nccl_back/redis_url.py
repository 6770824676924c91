"""Coordination-store URLs: what a ``redis_url`` names, parsed and checked, and its
redacted form for messages.

A common module (no ``redis`` import, nothing of the coordination layer): :class:`Settings`
validates URLs with it and the metadata CLI commands stay fast; the client that
connects (:mod:`nccl_back.coord.redisclient`) reads the same parse. The URL forms::

    redis://[:password@]host:6379/0                 one server (unix:///path/redis.sock?db=0 too)
    redis+sentinel://[:pw@]h1:26379,h2:26379/SVC/0  the master Sentinel names SVC
    redis+cluster://[:pw@]h1:6379,h2:6379           a Redis Cluster (any nodes, as seeds)
    rediss://, rediss+sentinel://, rediss+cluster://  the same over TLS
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

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
        return RedisTarget(kind, tls, (), parts.username, parts.password, 0, None)
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
    return RedisTarget(kind, tls, hosts, username, password, db, service)


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
    """``url`` without its password, fit for an error message or a log line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
