"""Every read of Redis goes through the store's bounded reads, and an oversized value,
list item or set member costs its reader its length, not its bytes.

A structural check holds every module outside the store to it (no Redis read command
on a client or pipeline elsewhere). The oversized values come from the record schema:
for every kind, one far over its bound in the kind's own Redis type, read through the
store's read for that type; then the reads the relay and the request queue make on
every lookup, at the sizes of issue 60 (8 tombstones of 32 MiB, a chain of 31 items of
16 MiB, request items of 64 MiB), measured by the bytes Redis sent and the reader's
peak RSS.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path
from typing import Any

import pytest
from hostile import HOUR, HUGE, fill, peak_rss_rise

from nccl_back.config import Settings
from nccl_back.coord import schema
from nccl_back.coord.registry import Registry
from nccl_back.coord.requests import POLL_MAX
from nccl_back.coord.signed_store import WRONG_TYPE, Oversized

PKG = Path(__file__).resolve().parents[1] / "nccl_back"
MiB = 1 << 20

# -- the structure: nobody but the store reads Redis ------------------------------------

#: Where Redis may be read directly: the store and its scripts, the client factory, and
#: the development servers (a local Redis and its Sentinels, never a fleet's).
OWNERS = ("coord/signed_store.py", "coord/scripts.py", "coord/redisclient.py", "dev/")
#: redis-py methods that send a key's value, items, members or fields back (or run a
#: script, or any command by name): only the store's bounded reads may call them.
READS = frozenset([
    "get", "mget", "getrange", "substr", "getex", "getdel", "getset",
    "lrange", "lindex", "lpop", "rpop", "blpop", "brpop", "brpoplpush", "rpoplpush", "lmove",
    "blmove", "lmpop", "blmpop",
    "smembers", "srandmember", "spop", "sscan", "sscan_iter", "sinter", "sunion", "sdiff",
    "hget", "hgetall", "hmget", "hvals", "hkeys", "hrandfield", "hscan", "hscan_iter",
    "zrange", "zrangebyscore", "zrevrange", "zrevrangebyscore", "zrandmember", "zscan",
    "zscan_iter", "zpopmin", "zpopmax", "bzpopmin", "bzpopmax",
    "xrange", "xrevrange", "xread", "xreadgroup", "dump", "sort", "sort_ro",
    "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "register_script", "execute_command",
])
#: What a Redis client or pipeline is called where it is used.
CLIENTS = frozenset({"client", "_client", "pipe", "pipeline", "redis", "conn", "connection"})


def redis_reads(source: str) -> list[str]:
    """Each ``receiver.read(...)`` (or ``receiver.read`` passed along) in ``source``
    whose receiver is a Redis client or pipeline, as ``line: code``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in READS:
            receiver = node.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else (
                receiver.id if isinstance(receiver, ast.Name) else "")
            if name in CLIENTS:
                out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_read_check_finds_reads_on_clients_and_pipelines_only() -> None:
    """The check flags a read on a client, a pipeline or one passed along uncalled, and
    nothing else (a dict's ``get``, the store's own bounded reads)."""
    flagged = redis_reads(
        "self.client.mget(keys)\nregistry.client.get(k)\npipe.lrange(k, 0, -1)\n"
        "partial(self.client.brpop, [k])\nclient.getrange(k, 0, 9)\n"
        "d.get(k)\nself.values(keys, kind)\nself.lua.bounded_get(keys=[k])\nself.client.set(k, v)\n")
    assert [f.split(": ")[1] for f in flagged] == [
        "self.client.mget", "registry.client.get", "pipe.lrange", "self.client.brpop", "client.getrange"]


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py")
                                        if not str(p.relative_to(PKG)).startswith(OWNERS)),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_but_the_store_reads_redis(path: Path) -> None:
    """Outside the store, no module reads a value, list item, set member or hash field
    from Redis itself: every read is one of the store's bounded reads."""
    assert redis_reads(path.read_text()) == []


# -- oversized values of every kind --------------------------------------------------------


@pytest.fixture
def reg(redis_url: str, namespace: str) -> Any:
    # Values of tens of MiB are built and copied on the server: on a busy machine one
    # call may take seconds, which is not what these tests measure (bytes and RSS).
    registry = Registry(Settings(redis_url=redis_url, namespace=namespace, secret="s" * 32,
                                 redis_timeout=30.0))
    yield registry
    keys = list(registry.client.scan_iter(f"{{{namespace}}}:*"))
    if keys:
        registry.client.delete(*keys)
    registry.close()


def sent(reg: Registry) -> int:
    """Bytes the Redis server has sent to all its clients so far."""
    return int(reg.client.info("stats")["total_net_output_bytes"])


def key_of(reg: Registry, kind: schema.KeyKind) -> str:
    return reg.keys.key(kind.prefix, *(f"p{i}" for i in range(len(kind.parts))))


@pytest.mark.parametrize("kind", schema.KINDS, ids=lambda k: k.name)
def test_a_value_far_over_its_kinds_bound_costs_its_reader_nothing(reg: Registry,
                                                                   kind: schema.KeyKind) -> None:
    """At a key of each kind, values of 32 MiB (64 MiB + 1 for the 64 MiB kinds) in the
    kind's own Redis type (the string, two list items or set members beside a small
    one, the hash's fields): each read the store has for that type refuses them by their
    length and reads the small one; Redis sends under 1 MiB and the reader's peak RSS
    rises under 16 MiB."""
    t, size = str(kind.redis_type), max(kind.max_bytes + 1, HUGE)
    key = (reg.keys.of(schema.COHORT, "v", 0, 1, "d" * 8) if t == "hash"
           else reg.keys.key(kind.prefix, *(f"p{i}" for i in range(len(kind.parts)))))
    fill(reg.client, key, t, size, 2)
    if t == "list":
        reg.client.lpush(key, b"ok")
    elif t == "set":
        reg.client.sadd(key, b"ok")
    before = sent(reg)
    if t == "string":
        reads = [(lambda: reg.raw_value(key, kind), Oversized),
                 (lambda: reg.values([key, key], kind), [Oversized, Oversized])]
    elif t == "list":
        reads = [(lambda: reg.items(key, kind, 0, 5), [bytes, Oversized, Oversized]),
                 (lambda: reg.pop(key, kind), Oversized)]
    elif t == "set":
        reads = [(lambda: reg.members(key, kind, 10)[1], [bytes])]
    else:  # a hash: read by the join script only, on the server (garbage: a new window)
        reads = [(lambda: reg.join_cohort("v", 0, 1, "d" * 8, {"m": 1}, window=1, max_size=4,
                                          ttl=5)[1], int)]
    for read, want in reads:
        got, rise = peak_rss_rise(read)
        assert rise < 16 * MiB, (kind.name, rise)
        assert ([type(v) for v in got] if isinstance(want, list) else type(got)) == want, got
        assert getattr(got, "size", size) == size
    assert sent(reg) - before < MiB


def test_reads_of_another_redis_type_say_so(reg: Registry) -> None:
    """Each bounded read of a key holding another Redis type answers WRONG_TYPE (the
    caller rejects or repairs it), never a Redis error; of an absent key, nothing."""
    string, lst, absent = reg.keys.key("x"), reg.keys.key("y"), reg.keys.key("z")
    reg.client.set(string, b"x", ex=HOUR)
    reg.client.rpush(lst, b"y")
    assert reg.items(string, schema.CHAIN, 0, 3) is WRONG_TYPE
    assert reg.pop(string, schema.REQUEST) is WRONG_TYPE
    assert reg.members(string, schema.INDEX, 10) is WRONG_TYPE
    assert reg.raw_value(lst, schema.PEER) is WRONG_TYPE
    assert reg.items(absent, schema.CHAIN, 0, 3) == []
    assert reg.pop(absent, schema.REQUEST) is None
    assert reg.members(absent, schema.INDEX, 10) == (0, [])
    assert reg.raw_value(absent, schema.PEER) is None


def test_a_set_over_its_size_bound_is_not_read(reg: Registry) -> None:
    """A set with more members than asked for answers its size alone."""
    key = reg.keys.of(schema.INDEX, "v", 0, 1)
    reg.client.sadd(key, *[f"m{i}" for i in range(50)])
    assert reg.members(key, schema.INDEX, 49) == (50, [])
    assert sorted(set(reg.members(key, schema.INDEX, 50)[1])) == sorted(f"m{i}".encode() for i in range(50))


# -- the reads every lookup makes, at issue 60's sizes ----------------------------------------


def test_eight_tombstones_of_32_mib_cost_a_lookup_under_1_mib(reg: Registry) -> None:
    """``gone_members`` over 8 members whose tombstone keys hold 32 MiB each (anyone may
    write there): under 1 MiB read, peak RSS under 16 MiB, a genuine tombstone beside
    them still seen."""
    ids = [f"m{i}" for i in range(8)]
    for m in ids:
        fill(reg.client, reg.keys.of(schema.GONE, m), "string", 32 * MiB, 1)
    reg.mark_gone("m8", ttl=30)
    before, rejected = sent(reg), reg.rejected
    got, rise = peak_rss_rise(lambda: reg.gone_members([*ids, "m8"]))
    assert got == {"m8"}
    assert sent(reg) - before < MiB
    assert rise < 16 * MiB
    assert reg.rejected - rejected == 8


def test_a_chain_of_31_items_of_16_mib_costs_a_look_under_1_s_and_64_mib(reg: Registry) -> None:
    """``chain_members`` over a chain whose 31 items hold 16 MiB each, behind a genuine
    member: one look costs a peak RSS rise under 64 MiB (the whole chain's 496 MiB before)
    and seconds at most (under 1 s quiet: benchmarks/RESULTS.md); the genuine member is
    read, the rest skipped with a reason."""
    v, d = "v", "d" * 8
    chain, _ = reg.join_cohort(v, 0, 1, d, {"member_id": "m0", "address": "127.0.0.1:1",
                                            "transport": "gloo", "device": "cpu"},
                               window=5, max_size=64, ttl=30)
    fill(reg.client, chain, "list", 16 * MiB, 31, append=True)
    start = time.monotonic()
    got, rise = peak_rss_rise(lambda: reg.chain_members(chain, 0, 31))
    took = time.monotonic() - start
    assert [m.member_id if m is not None else None for m in got] == ["m0"] + [None] * 31
    assert rise < 64 * MiB
    assert took < 10.0  # a bound against a spin, not a timing: this machine may be busy


def test_request_items_of_64_mib_cost_a_pop_nothing(reg: Registry) -> None:
    """Two 64 MiB items pushed onto a request queue above a genuine request: the pop
    drops them on the server (skipped, counted) and returns the request, with a peak
    RSS rise under 16 MiB and under 1 MiB read."""
    key = reg.keys.of(schema.REQUEST, "p1")
    reg.push_request("p1", {"transfer_id": "t1", "receiver": "r", "version": "v",
                            "manifest_digest": "d" * 8, "transport": "gloo", "device": "cpu"})
    fill(reg.client, key, "list", 64 * MiB, 2, append=True)
    before, rejected = sent(reg), reg.rejected
    # A deadline against a hang, not a timing: each skipped item is copied once on the
    # server, seconds apart on a loaded machine; the pop returns at the request.
    got, rise = peak_rss_rise(lambda: reg.pop_request("p1", timeout=20.0))
    assert got is not None and got.transfer_id == "t1"
    assert rise < 16 * MiB and sent(reg) - before < MiB
    assert reg.rejected - rejected == 2


def test_download_group_and_index_items_of_64_mib_cost_nothing(reg: Registry) -> None:
    """A download group's list and a peer index hold 64 MiB items beside genuine ones:
    each read returns the genuine ones, with under 1 MiB read and a peak RSS rise under
    16 MiB."""
    reg.join_download_group("v", 1, "w1")
    fill(reg.client, reg.keys.of(schema.DOWNLOAD_GROUP, "v", 1), "list", 64 * MiB, 2, append=True)
    index = reg.keys.of(schema.INDEX, "v", 0, 1)
    reg.client.sadd(index, "p1")
    fill(reg.client, index, "set", 64 * MiB, 1, append=True)
    before = sent(reg)
    got, rise = peak_rss_rise(lambda: reg.download_group("v", 1))
    assert got == ["w1"] and rise < 16 * MiB
    got, rise = peak_rss_rise(lambda: reg._peer_ids(index, "v", 0, 1))
    assert got == ["p1"] and rise < 16 * MiB
    assert sent(reg) - before < MiB


@pytest.mark.timeout(20)
def test_a_pop_polls_an_empty_queue_without_spinning(reg: Registry) -> None:
    """Waiting on an empty queue for 1 s costs a few dozen Redis calls, not a spin, and an
    idle queue's next wait about 1/POLL_MAX (its pause carries over)."""
    calls = int(reg.client.info("stats")["total_commands_processed"])
    start = time.monotonic()
    assert reg.pop_request("p2", timeout=1.0) is None
    assert time.monotonic() - start >= 1.0
    assert int(reg.client.info("stats")["total_commands_processed"]) - calls < 200
    # An idle endpoint keeps its slowest pause from one wait to the next: 20 looks a second.
    def looks() -> int:  # script calls (the commands a script runs count apart)
        return int(reg.client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    calls = looks()
    assert reg.pop_request("p2", timeout=1.0) is None
    assert looks() - calls <= 1 / POLL_MAX + 3


def test_a_key_name_of_32_mib_costs_a_scan_nothing(reg: Registry) -> None:
    """A key of 32 MiB named like a peer entry (key names need no secret): listing the
    peers skips it on the server, with under 1 MiB read and a peak RSS rise under 16 MiB
    (+192 MiB and 32 MiB read before), and still finds the genuine entry."""
    from nccl_back.coord.records import PeerInfo

    reg.client.eval("redis.call('SET', KEYS[1] .. string.rep('x', ARGV[1]), 'v', 'EX', 3600)",
                    1, reg.keys.of(schema.PEER, "v1", 0, 1, ""), HUGE)
    reg.publish_peer(PeerInfo(peer_id="good", version="v1", rank=0, world_size=1,
                              manifest_digest="d" * 32, transport="gloo", address="127.0.0.1:1"))
    before = sent(reg)
    got, rise = peak_rss_rise(reg.list_all)
    assert [s.info.peer_id for s in got["v1"]] == ["good"]
    assert rise < 16 * MiB and sent(reg) - before < MiB
