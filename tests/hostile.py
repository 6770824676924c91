"""What an attacker (or an accident) can leave at a key of each kind of the record
schema: the corruptions the hostile-Redis tests and the soak both write, generated from
each kind's schema entry (its Redis type), never from a hand list of kinds."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis

from nccl_back.coord import schema

T = TypeVar("T")

#: Seconds a corruption is kept (no TTL rescue within a test or a rollout).
HOUR = 3600
#: Bytes of an oversized value, list item, set member or hash field, at least (over
#: every kind's bound by far: what one costs a reader that reads it whole shows in its RSS).
HUGE = 32 << 20


def corruptions(kind: schema.KeyKind) -> list[str]:
    """What an attacker (or an accident) can leave at a key of ``kind``: every value
    corruption, and every Redis type but the kind's own."""
    values = ["stale", "no_ttl", "bad_sig", "garbage", "raw_bytes", "oversized", "huge_numbers",
              "wrong_fields"]
    return values + [f"type_{t}" for t in schema.REDIS_TYPES if t != str(kind.redis_type)]


def corrupt(client: redis.Redis, key: str, kind: schema.KeyKind, how: str,
            genuine: tuple[str, Any]) -> None:
    """Write corruption ``how`` at ``key`` (kept for an hour: no TTL rescue)."""
    gtype, gvalue = genuine
    if how.startswith("type_"):
        t = how[len("type_"):]
        client.delete(key)
        {"string": lambda: client.set(key, "x"), "list": lambda: client.rpush(key, "x"),
         "set": lambda: client.sadd(key, "x"), "hash": lambda: client.hset(key, "n", "1"),
         "zset": lambda: client.zadd(key, {"x": 1})}[t]()
        client.expire(key, HOUR)
        return
    if how == "stale":
        write(client, key, gtype, gvalue, HOUR)
        return
    if how == "no_ttl":
        write(client, key, gtype, gvalue, None)
        return
    sample = gvalue if gtype == "string" else next(iter(sorted(gvalue) if gtype != "hash" else [b""]), b"")
    try:
        record = json.loads(sample) if isinstance(sample, bytes) and sample.startswith(b"{") else {}
    except ValueError:
        record = {}
    bad: bytes
    if how == "bad_sig":
        bad = json.dumps({**record, "sig": "0" * 64}).encode()
    elif how == "garbage":
        bad = b"\x00{not json" + b"[" * 64
    elif how == "raw_bytes":  # not UTF-8: a client decoding replies would raise on it
        bad = b"\xff\xfe\xfa{\"sig\": \xc3\x28}" + bytes(range(128, 256))
    elif how == "oversized":  # made on the server: the writer holds none of it
        head = json.dumps({**record, "pad": ""}).encode()[:-2]
        fill(client, key, gtype, max(kind.max_bytes + 1, HUGE), 2, head, b'"}')
        return
    elif how == "huge_numbers":
        bad = json.dumps({k: (10**30 if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                          for k, v in record.items()} or {"n": 10**30}).replace(
                              "1000000000000000000000000000000", "1e400", 1).encode()
    else:  # wrong_fields
        bad = json.dumps({"owner": ["a"], "token": {"x": 1}, "peer_id": 7, "hashes": [1], "by": "x",
                          "layout": 3, "macs": [1], "group": 5, "lookup": None}).encode()
    if gtype == "string":
        client.set(key, bad, ex=HOUR)
    elif gtype == "list":
        client.rpush(key, bad, bad)
        client.expire(key, HOUR)
    elif gtype == "set":
        members = [bad] if how != "huge_numbers" else [f"g{i}" for i in range(3000)]
        client.sadd(key, *members)
        client.expire(key, HOUR)
    else:  # hash
        fields = {"garbage": {"n": "x", "epoch": "../../x"}, "huge_numbers": {"n": "1" * 40, "epoch": "a"},
                  "bad_sig": {"n": "-5", "epoch": "0" * 64}, "raw_bytes": {"n": b"\xff", "epoch": b"\xfe"},
                  }.get(how, {"n": "2", "epoch": "{}"})
        client.hset(key, mapping=fields)  # type: ignore[arg-type]
        client.expire(key, HOUR)


#: Moves each staged value (KEYS[2..]) into KEYS[1] as the Redis type ARGV[1] stores
#: them, then drops the staging keys. Set members and hash fields pass through Lua (one
#: copy each); strings are renamed and list items moved by SORT ... STORE, in C.
_PLACE_LUA = """
local t = ARGV[1]
for i = 2, #KEYS do
  if t == 'set' then redis.call('SADD', KEYS[1], redis.call('GET', KEYS[i]))
  elseif t == 'hash' then
    redis.call('HSET', KEYS[1], ({'n', 'epoch'})[i - 1] or ('f' .. (i - 1)), redis.call('GET', KEYS[i]))
  end
  redis.call('DEL', KEYS[i])
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

#: Moves every item of list KEYS[1] to the end of list KEYS[2], replying nothing.
_MOVE_LUA = """
while redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT') do end
return 1
"""

#: Bytes sent per APPEND while a value is staged: what the writer holds at once.
FILL_CHUNK = 1 << 20


def fill(client: redis.Redis, key: str, t: str, size: int, n: int, head: bytes = b"",
         tail: bytes = b"", *, append: bool = False) -> None:
    """Replace ``key`` by ``n`` values of ``size`` bytes each (``head``, padding, a
    number, ``tail``) of Redis type ``t`` (``append``: add them to what is there), kept
    for an hour.

    Each value is staged at a key of its own in appends of :data:`FILL_CHUNK`, then moved
    into place on the server: the writer never holds or receives a value (it may share a process,
    and so a peak RSS, with the reader under test), and Redis is never held for long (a
    script building 32 MiB strings held it for seconds on a loaded machine, and every
    holder's heartbeat timed out)."""
    staged = [f"{key}:staged:{i}" for i in range(1, n + 1)]
    pad = size - len(head) - len(tail) - 8
    chunk = b"x" * min(FILL_CHUNK, max(pad, 0))
    for i, tmp in enumerate(staged, 1):
        client.delete(tmp)
        client.append(tmp, head)
        for off in range(0, pad, FILL_CHUNK):
            client.append(tmp, chunk[:min(FILL_CHUNK, pad - off)])
        client.append(tmp, b"%08d" % i + tail)
    if not append:
        client.delete(key)
    if t == "string":
        client.rename(staged[-1], key)
        if n > 1:
            client.delete(*staged[:-1])
        client.expire(key, HOUR)
    elif t == "list":
        names = f"{key}:staged"
        client.delete(names)
        client.rpush(names, *staged)
        # SORT ... STORE copies the staged values into a list in C, replying a count
        # (LMOVE from here would send each moved item back whole).
        client.sort(names, by="nosort", get="*", store=key if not append else names)
        if append:
            client.eval(_MOVE_LUA, 2, names, key)
        client.delete(names, *staged)
        client.expire(key, HOUR)
    else:
        client.eval(_PLACE_LUA, 1 + n, key, *staged, t, HOUR)


def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert found is not None, field
    return int(found.group(1))


def peak_rss_rise(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()``, and how far this process's peak RSS rose above its RSS before, in bytes:
    the kernel's high-water mark, reset first (``clear_refs``), so what the process held
    at its worst while ``fn`` ran, threads included."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    got = fn()
    return got, (_status_kib("VmHWM") - before) << 10


def write(client: redis.Redis, key: str, t: str, value: Any, ttl: int | None) -> None:
    client.delete(key)
    if t == "string":
        client.set(key, value)
    elif t == "list" and value:
        client.rpush(key, *value)
    elif t == "set" and value:
        client.sadd(key, *value)
    elif t == "hash" and value:
        client.hset(key, mapping=value)
    if ttl is not None:
        client.expire(key, ttl)




def read_key(client: redis.Redis, key: str) -> tuple[str, Any] | None:
    """``(type, value)`` of ``key`` now (bytes, as stored), or None if it is gone (or
    rewritten as another type at each of ten tries)."""
    for _ in range(10):
        t = client.type(key).decode()
        try:
            value: Any = {"string": client.get, "list": lambda k: client.lrange(k, 0, -1),
                          "set": client.smembers, "hash": client.hgetall,
                          "zset": lambda k: client.zrange(k, 0, -1)}.get(t, lambda k: None)(key)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            continue  # rewritten as another type between the two calls: read it again
        return None if value is None else (t, value)
    return None


# -- every key of a rollout at once ------------------------------------------------------

#: What :func:`overwrite_all` writes at every key at once: a string of garbage, another
#: Redis type, or the key's real value with bytes flipped.
AT_ONCE = ("garbage", "type", "mutated")
#: The strings of garbage, the keys of each kind taking them in turn (the first the empty
#: string, a value that reads as none; every eleventh 64 random bytes).
GARBAGE = (b"", b"{", b"1e400", b"null", b"[]", b"\x00", b'{"sig": 1}', b"-1", b"\xff\xfe",
           b'"' + b"[" * 512)


def overwrite_all(client: redis.Redis, keys: dict[str, tuple[str, Any]], how: str,
                  rng: random.Random) -> None:
    """Overwrite every key of ``keys`` (``{key: (type, value)}``, as :func:`read_key`
    gives them) at once with the family ``how`` of :data:`AT_ONCE`, the choice within it
    turning from key to key of each kind, each kept for an hour (no TTL rescue)."""
    pipe = client.pipeline(transaction=True)  # at once: no reader sees half of it
    seen: dict[str, int] = {}
    for key, (t, value) in sorted(keys.items()):
        kind = schema.kind_of(key)
        i = seen[kind.name if kind else ""] = seen.get(kind.name if kind else "", -1) + 1
        pipe.delete(key)
        if how == "garbage":
            pipe.set(key, GARBAGE[i % 11] if i % 11 < len(GARBAGE) else rng.randbytes(64), ex=HOUR)
            continue
        if how == "type":
            others = [o for o in schema.REDIS_TYPES if o != t]
            {"string": lambda k: pipe.set(k, "{"), "list": lambda k: pipe.rpush(k, "x", "{"),
             "set": lambda k: pipe.sadd(k, "x", "1e400"), "hash": lambda k: pipe.hset(k, "n", "1"),
             "zset": lambda k: pipe.zadd(k, {"x": 1})}[others[i % len(others)]](key)
        elif t == "string" or not value:  # mutated: one bit of each part flipped
            pipe.set(key, _flip(value if isinstance(value, bytes) else b"", rng))
        elif t == "list":
            pipe.rpush(key, *[_flip(v, rng) for v in value])
        elif t == "set":
            pipe.sadd(key, *[_flip(v, rng) for v in sorted(value)])
        elif t == "hash":
            pipe.hset(key, mapping={k: _flip(v, rng) for k, v in value.items()})
        else:  # zset
            pipe.zadd(key, {_flip(v, rng): 1 for v in value})
        pipe.expire(key, HOUR)
    pipe.execute()


def _flip(value: bytes, rng: random.Random) -> bytes:
    """``value`` with one bit flipped at a random place (one byte where it is empty)."""
    if not value:
        return b"\x01"
    i = rng.randrange(len(value))
    return value[:i] + bytes([value[i] ^ (1 << rng.randrange(8))]) + value[i + 1:]
