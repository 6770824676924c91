"""Property tests of every parser of outside data (the record schema's parsers,
bounded_json.py, auth.py).

One hand-written hostile value per field proves that one value is refused; these prove
the class: for arbitrary input and for every single mutation of a valid record, every
parser the record schema (``coord/schema.py``) names returns a typed record or raises
UntrustedRecordError (bounded_json: ValueError), never anything else; valid records
round-trip exactly. The parsers come from the schema, so a new key kind is tested here
as soon as it has a parser, and fails until it has valid examples.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nccl_back import bounded_json
from nccl_back.config import Settings
from nccl_back.coord import content, records, schema
from nccl_back.coord.auth import Signer
from nccl_back.errors import UntrustedRecordError

pytestmark = pytest.mark.timeout(120)

PROPS = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- strategies --------------------------------------------------------------------------

#: Every JSON value, including the ones hostile writers like: huge and negative
#: integers, floats at the edges, long and non-ASCII strings, nesting.
JSON_SCALARS = (st.none() | st.booleans() | st.integers()
                | st.integers(min_value=-(1 << 70), max_value=1 << 70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)

NAME = st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True)
HEX = st.from_regex(r"[0-9a-f]{32}", fullmatch=True)
DIGEST = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)  # a layout's sha256
PORT = st.integers(min_value=1, max_value=65535)
ADDRESS = st.one_of(
    st.tuples(st.ip_addresses(v=4), PORT).map(lambda t: f"{t[0]}:{t[1]}"),
    st.tuples(st.ip_addresses(v=6), PORT).map(lambda t: f"[{t[0]}]:{t[1]}"),
    st.tuples(st.from_regex(r"[a-z][a-z0-9-]{0,20}[a-z0-9](\.[a-z][a-z0-9]{0,10}){0,3}",
                            fullmatch=True), PORT).map(lambda t: f"{t[0]}:{t[1]}"),
)


@st.composite
def peer_infos(draw: st.DrawFn) -> records.PeerInfo:
    world = draw(st.integers(min_value=1, max_value=records.MAX_WORLD))
    transport = draw(st.sampled_from(records.TRANSPORT_KINDS))
    return records.PeerInfo(
        peer_id=draw(NAME), version=draw(NAME), rank=draw(st.integers(0, world - 1)),
        world_size=world, manifest_digest=draw(HEX), transport=transport,
        address=draw(ADDRESS), started_at=draw(st.floats(0, 4e9)),
        source=draw(st.sampled_from(records.PEER_SOURCES)),
        max_sends=draw(st.integers(1, records.MAX_SENDS)),
        device=draw(st.sampled_from(records.DEVICES)),
        host=draw(st.just("") | NAME), pid=draw(st.integers(0, records.MAX_PID)),
        model=draw(st.just("") | NAME), engine=draw(st.just("") | NAME),
        layout=draw(st.just("") | DIGEST),
    )


@PROPS
@given(st.text(max_size=300))
def test_any_text_made_a_label_parses_as_one(text: str) -> None:
    """Whatever a host, folder or engine is called, its label is one a reader accepts."""
    label = records.to_label(text)
    assert records.label({"model": label}, "model", "peer entry") == label


@st.composite
def requests(draw: st.DrawFn) -> records.TransferRequest:
    parts = draw(st.none() | st.integers(1, records.MAX_PARTS))
    subs = None if parts is None else draw(st.none() | st.integers(1, records.MAX_PARTS))
    return records.TransferRequest(
        transfer_id=draw(NAME), receiver=draw(NAME), version=draw(NAME),
        manifest_digest=draw(HEX), transport=draw(st.sampled_from(records.TRANSPORT_KINDS)),
        device=draw(st.none() | st.sampled_from(records.DEVICES)),
        claim=draw(st.none() | st.tuples(st.integers(0, 999), HEX).map(lambda t: f"{t[0]}:{t[1]}")),
        start=draw(st.none() | st.integers(0, records.MAX_START)),
        layout=draw(st.none() | DIGEST), group=draw(st.none() | DIGEST),
        holder=draw(st.none() | st.integers(0, records.MAX_WORLD)),
        part=None if parts is None else draw(st.integers(0, parts - 1)), parts=parts,
        sub=None if subs is None else draw(st.integers(0, subs - 1)), subs=subs,
    )


CLAIMS = st.builds(records.Claim, token=st.tuples(st.integers(0, 999), HEX).map(
    lambda t: f"{t[0]}:{t[1]}"), receiver=NAME)
LEASES = NAME.map(lambda n: {"owner": n})
WAITERS = NAME.map(lambda n: {"worker": n})
ROSTERS = st.lists(NAME, min_size=1, max_size=records.MAX_PARTS, unique=True).map(
    lambda ms: records.Roster(members=tuple(ms)))
MEMBERS = st.builds(records.Member, member_id=NAME, address=ADDRESS,
                    transport=st.sampled_from(records.TRANSPORT_KINDS), device=st.sampled_from(records.DEVICES))
HANDSHAKES = st.one_of(
    st.builds(lambda by, v, d: {"by": by, "value": v, "digest": d},
              st.sampled_from(records.HANDSHAKE_SIDES), st.integers(0, records.MAX_NONCE), NAME),
    st.builds(lambda r, m: {"by": "sender", "refused": r, "message": m}, NAME, st.text(max_size=50)),
    st.just({"by": "sender", "abandoned": True}),
)
TRUTHS = st.builds(lambda d, h: {"manifest_digest": d, "scheme": "nb1", "hashes": h}, HEX,
                   st.dictionaries(st.text(min_size=1, max_size=30), HEX, max_size=8))
MAC_TEXT = st.lists(st.none() | st.from_regex(r"[0-9a-f]{8}", fullmatch=True), max_size=6).map(
    lambda ms: "".join(m or "." * 8 for m in ms))
POSITIONS = st.builds(lambda lay, macs: {"layout": lay, "scheme": "nb1", "macs": macs}, DIGEST,
                      st.dictionaries(NAME, MAC_TEXT, max_size=4))
GROUPS = st.lists(DIGEST, min_size=1, max_size=4).map(lambda ds: {"group": ",".join(ds)})
LAYOUTS = st.just({"layout": json.dumps({"tensors": [["w", [4, 2], "float32", 0, [["w", 0, 0, 4]]]],
                                         "sources": [["w", [4, 2]]]}, separators=(",", ":"))})
ARTIFACT_INDEXES = st.builds(lambda lk, f: {"lookup": lk, "factors": f}, HEX,
                             st.dictionaries(NAME, NAME, max_size=4))
ARTIFACT_SETS = st.builds(lambda lk, v: {"lookup": lk, "version": v, "manifest": {
    "units": ["u"], "files": [["u/a", 1]], "digest": "d" * 64}}, HEX, HEX)
NAMED = NAME.map(lambda m: {"member_id": m})


@st.composite
def rescues(draw: st.DrawFn) -> tuple[records.Rescue, ...]:
    parts = draw(st.lists(st.integers(0, records.MAX_PARTS - 1), min_size=1, max_size=8, unique=True))
    return tuple(records.Rescue(p, tuple(draw(st.lists(NAME, min_size=1, max_size=8, unique=True))))
                 for p in parts)


def _rescues_wire(rs: tuple[records.Rescue, ...]) -> dict[str, Any]:
    return {"rescues": [{"part": r.part, "by": list(r.by)} for r in rs]}

#: Valid records (as dicts) of every key kind the schema gives a parser, to mutate.
VALID: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "peer": peer_infos().map(asdict),
    "gt": TRUTHS,
    "layout": LAYOUTS,
    "group": GROUPS,
    "ct": POSITIONS,
    "claim": CLAIMS.map(asdict),
    "req": requests().map(lambda r: r.to_dict()),
    "dl": LEASES,
    "dlg": WAITERS,
    "dlr": ROSTERS.map(asdict),
    "dlm": MEMBERS.map(lambda m: m.to_dict()),
    "dlx": rescues().map(_rescues_wire),
    "chain": MEMBERS.map(lambda m: m.to_dict()),
    "stream": MEMBERS.map(lambda m: m.to_dict()),
    "gone": NAMED,
    "alive": NAMED,
    "verdict": st.builds(lambda m, ok: {"member_id": m, "ok": ok}, NAME, st.booleans()),
    "hs": HANDSHAKES,
    "art": ARTIFACT_SETS,
    "artidx": ARTIFACT_INDEXES,
}
SETTINGS = Settings()


def _parser(kind: schema.KeyKind) -> Callable[[dict[str, Any]], object]:
    """The kind's parser on a body alone (no key parts: nothing to match against)."""
    assert kind.parse is not None
    return lambda body: kind.parse(body, {}, SETTINGS)  # type: ignore[misc]


#: Every parser of a Redis record, from the schema, with valid records to mutate.
PARSERS: dict[str, tuple[Callable[[dict[str, Any]], object], st.SearchStrategy[dict[str, Any]]]] = {
    k.name: (_parser(k), VALID[k.name]) for k in schema.KINDS if k.parse is not None and k.name in VALID
}


def test_every_parsed_key_kind_has_valid_examples() -> None:
    """Each key kind the schema parses has valid records here, so its parser is tested."""
    assert set(VALID) == {k.name for k in schema.KINDS if k.parse is not None}


def test_valid_examples_parse() -> None:
    """The valid examples of every kind parse (they are what genuine writers store)."""

    @PROPS
    @given(st.sampled_from(sorted(VALID)).flatmap(lambda n: st.tuples(st.just(n), VALID[n])))
    def check(item: tuple[str, dict[str, Any]]) -> None:
        name, body = item
        PARSERS[name][0](json.loads(json.dumps(body)))

    check()


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A valid record with one field replaced by any JSON value, dropped, or one added."""
    record = dict(draw(valid))
    how = draw(st.sampled_from(["replace", "drop", "add"]))
    if how == "add" or not record:
        record[draw(st.text(max_size=10))] = draw(JSON)
    else:
        name = draw(st.sampled_from(sorted(record)))
        if how == "drop":
            del record[name]
        else:
            record[name] = draw(JSON)
    return record


def _parses_or_refuses(parse: Callable[[dict[str, Any]], object], data: Any) -> None:
    with contextlib.suppress(UntrustedRecordError):  # the one outcome besides a record
        parse(data)


# -- records.py ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_arbitrary_objects_parse_or_are_refused(kind: str) -> None:
    """Any JSON object given to any record parser: a record or UntrustedRecordError."""
    parse, _ = PARSERS[kind]

    @PROPS
    @given(st.dictionaries(st.text(max_size=16), JSON, max_size=10))
    def check(data: dict[str, Any]) -> None:
        _parses_or_refuses(parse, data)

    check()


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_every_mutation_of_a_valid_record_parses_or_is_refused(kind: str) -> None:
    """One field of a valid record replaced, dropped or added: a record or UntrustedRecordError."""
    parse, valid = PARSERS[kind]

    @PROPS
    @given(mutated(valid))
    def check(data: dict[str, Any]) -> None:
        _parses_or_refuses(parse, data)

    check()


@PROPS
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300),
                 JSON.map(lambda v: json.dumps(v)), st.integers(), st.lists(st.text(), max_size=3)))
@example(b"\xff\xfe")
@example('{"a": NaN}')
@example("[" * 100 + "]" * 100)
@example("\ud800")  # a lone surrogate: not encodable as UTF-8
def test_raw_redis_values_load_or_are_refused(raw: Any) -> None:
    """Any raw value at a key (bytes, text, JSON, a reply of another type) loads into a
    bounded object or is one UntrustedRecordError."""
    try:
        value = records.load(raw, "value")
    except UntrustedRecordError:
        return
    assert isinstance(value, dict)


@PROPS
@given(peer_infos())
def test_peer_entries_round_trip(info: records.PeerInfo) -> None:
    """A valid PeerInfo survives its JSON form exactly."""
    assert records.peer(records.load(json.dumps(asdict(info)), "peer entry")) == info


@PROPS
@given(requests())
def test_requests_round_trip(req: records.TransferRequest) -> None:
    """A valid request survives its wire form exactly (absent fields stay absent)."""
    wire = json.loads(json.dumps(req.to_dict()))
    assert records.request(wire) == req


@PROPS
@given(requests(), st.one_of(st.none(), st.integers(-3, 9), st.booleans(), st.text(max_size=3)),
       st.one_of(st.none(), st.integers(-3, 9), st.booleans(), st.text(max_size=3)))
def test_a_request_names_a_real_part_of_its_steps_or_is_refused(
    req: records.TransferRequest, part: Any, parts: Any
) -> None:
    """part/parts parse only together, as integers with 0 <= part < parts <= MAX_PARTS."""
    wire = {k: v for k, v in req.to_dict().items() if k not in ("part", "parts", "sub", "subs")}
    wire |= {k: v for k, v in (("part", part), ("parts", parts)) if v is not None}
    ok = (part is None and parts is None) or (
        type(part) is int and type(parts) is int and 0 <= part < parts <= records.MAX_PARTS)
    if ok:
        got = records.request(wire)
        assert (got.part, got.parts) == (part, parts)
    else:
        with pytest.raises(UntrustedRecordError, match=r"transfer request: part"):
            records.request(wire)


@PROPS
@given(requests(), st.one_of(st.none(), st.integers(-3, 9), st.booleans(), st.text(max_size=3)),
       st.one_of(st.none(), st.integers(-3, 9), st.booleans(), st.text(max_size=3)))
def test_a_request_names_a_real_sub_part_of_its_part_or_is_refused(
    req: records.TransferRequest, sub: Any, subs: Any
) -> None:
    """sub/subs parse only together, with a part, as integers with 0 <= sub < subs <= MAX_PARTS."""
    wire = {k: v for k, v in req.to_dict().items() if k not in ("sub", "subs")}
    wire |= {k: v for k, v in (("sub", sub), ("subs", subs)) if v is not None}
    given_any = sub is not None or subs is not None
    ok = not given_any or (req.parts is not None and type(sub) is int and type(subs) is int
                           and 0 <= sub < subs <= records.MAX_PARTS)
    if ok:
        got = records.request(wire)
        assert (got.sub, got.subs) == (sub, subs)
    else:
        with pytest.raises(UntrustedRecordError, match=r"transfer request: (a sub-part of no part|sub)"):
            records.request(wire)


@PROPS
@given(rescues())
def test_rescues_round_trip(rs: tuple[records.Rescue, ...]) -> None:
    """The elected worker's spread parts parse back to what it wrote, readers in order."""
    assert records.rescues(json.loads(json.dumps(_rescues_wire(rs)))) == rs


@pytest.mark.parametrize(("value", "match"), [
    ([], r"rescues must be a list of 1 to 64"),
    ([{"part": 1, "by": []}], "each rescue is a part and its readers"),
    ([{"part": 1, "by": ["a", "a"]}], "spread twice, or to a reader twice"),
    ([{"part": 1, "by": ["a"]}, {"part": 1, "by": ["b"]}], "part 1 spread twice"),
    ([{"part": 64, "by": ["a"]}], r"part must be an integer in \[0, 63\]"),
    ([{"part": 1, "by": [True]}], "by must be a name of"),
    ([{"part": 1, "by": ["no spaces"]}], "by must be a name of"),
    ([{"part": 1, "by": [f"w{i}" for i in range(64)]}], "each rescue is a part and its readers"),
    ("x", "rescues must be a list"),
])
def test_a_rescue_naming_a_part_or_a_reader_twice_is_refused(value: Any, match: str) -> None:
    """A spread record is refused unless it names each failed part once, each reader once."""
    with pytest.raises(UntrustedRecordError, match=match):
        records.rescues({"rescues": value})


@PROPS
@given(CLAIMS, LEASES, MEMBERS, TRUTHS)
def test_claims_leases_members_and_truth_round_trip(
    claim: records.Claim, lease: dict[str, Any], member: records.Member, truth: dict[str, Any]
) -> None:
    """Claim, lease, cohort member and ground truth parse back to what was written."""
    assert records.claim(json.loads(json.dumps(asdict(claim)))) == claim
    assert records.lease(json.loads(json.dumps(lease))) == lease["owner"]
    assert records.member(json.loads(json.dumps(member.to_dict()))) == member
    got = content.ground_truth(json.loads(json.dumps(truth)), {})
    assert (got.manifest_digest, got.hashes) == (truth["manifest_digest"], truth["hashes"])


@PROPS
@given(HANDSHAKES)
def test_handshake_values_parse(value: dict[str, Any]) -> None:
    """Every handshake value a worker writes parses, refusals and abandonment included."""
    got = records.handshake(json.loads(json.dumps(value)))
    assert got.by == value["by"]


# -- bounded_json.py -------------------------------------------------------------------


@PROPS
@given(st.one_of(st.binary(max_size=500), st.text(max_size=500)),
       st.integers(1, 600), st.integers(0, 40))
@example(b'"\\', 100, 4)
@example("\ud800", 100, 4)
def test_bounded_json_raises_only_value_error(data: bytes | str, max_bytes: int, max_depth: int) -> None:
    """Any input and bounds: a value, or ValueError (never RecursionError, TypeError...)."""
    with contextlib.suppress(ValueError):
        bounded_json.loads(data, max_bytes=max_bytes, max_depth=max_depth)


@PROPS
@given(JSON)
def test_bounded_json_round_trips_values_within_bounds(value: Any) -> None:
    """A JSON value within the bounds parses back to itself; one byte less is refused."""
    text = json.dumps(value)
    depth = bounded_json.nesting_depth(text.encode())
    assert bounded_json.loads(text, max_bytes=len(text.encode()), max_depth=max(depth, 0)) == value
    with pytest.raises(ValueError, match="over the limit"):
        bounded_json.loads(text, max_bytes=len(text.encode()) - 1)


# -- auth.py ---------------------------------------------------------------------------

SIGNER = Signer(b"k" * 32)


@PROPS
@given(st.dictionaries(st.text(max_size=10).filter(lambda k: k not in ("sig", "exp")), JSON,
                       max_size=6), st.text(max_size=30))
def test_signed_records_verify_at_their_key_only(record: dict[str, Any], key: str) -> None:
    """A signed record verifies as itself at its key, and at no other key."""
    stored = json.loads(json.dumps(SIGNER.sign(key, record, ttl=60)))
    assert SIGNER.verify(key, stored) == json.loads(json.dumps(record))
    with pytest.raises(UntrustedRecordError, match="bad signature"):
        SIGNER.verify(key + "x", stored)


@PROPS
@given(mutated(st.just({"owner": "w-1", "n": 3})))
def test_every_mutation_of_a_signed_record_is_refused(mutation: dict[str, Any]) -> None:
    """One field of a signed record changed, dropped or added: refused, never accepted."""
    stored = SIGNER.sign("ns:k", {"owner": "w-1", "n": 3}, ttl=60)
    changed = {**stored, **{k: v for k, v in mutation.items()}}
    for k in set(stored) - set(mutation) - {"sig", "exp"}:
        changed.pop(k, None)
    if {k: v for k, v in changed.items() if k != "sig"} == {k: v for k, v in stored.items() if k != "sig"}:
        return  # the mutation put back the same value
    with pytest.raises(UntrustedRecordError):
        SIGNER.verify("ns:k", changed)


@PROPS
@given(JSON)
@example({"sig": "\u00e9"})
@example({"sig": "a", "exp": 1e308})
@example({"sig": 1})
def test_arbitrary_values_verify_only_as_untrusted(value: Any) -> None:
    """Any value (a non-ASCII signature too) given to verify: UntrustedRecordError only."""
    with pytest.raises(UntrustedRecordError):
        SIGNER.verify("ns:k", value)


# -- coord/layouts.py: the reshard records ------------------------------------------------

MACS = st.dictionaries(NAME, st.lists(st.none() | st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
                                      min_size=1, max_size=6), max_size=5)


@PROPS
@given(MACS)
def test_position_truth_macs_round_trip(macs: dict[str, list[str | None]]) -> None:
    """Sampled-position MACs (absent ones included) survive their record form exactly."""
    from nccl_back.coord.content import decode_macs, encode_macs

    assert decode_macs(json.loads(json.dumps(encode_macs(macs)))) == macs


@PROPS
@given(JSON | MACS.map(lambda m: {k: "".join(x or "." * 8 for x in v) + "." for k, v in m.items()}))
def test_position_truth_macs_parse_or_are_refused(data: Any) -> None:
    """Any value where a position truth's MACs belong: MACs of the one width, or refused."""
    from nccl_back.coord.content import decode_macs

    with contextlib.suppress(UntrustedRecordError):
        for name, macs in decode_macs(data).items():
            assert isinstance(name, str) and all(m is None or len(m) == 8 for m in macs)


@PROPS
@given(st.lists(DIGEST, min_size=1, max_size=8), st.one_of(st.none(), JSON, st.text(max_size=80)))
def test_group_records_parse_only_when_they_are_what_their_key_names(
        digests: list[str], other: Any) -> None:
    """A group record lists layout digests and hashes to its key; anything else is refused."""
    import hashlib

    text = ",".join(digests)
    key = hashlib.sha256(text.encode()).hexdigest()
    assert content.group({"group": text}, {"group": key}) == digests
    forged = {"group": other}
    if other != text:
        with pytest.raises(UntrustedRecordError):
            content.group(forged, {"group": key})
    # A value that hashes to its key but is no list of digests is refused too.
    if isinstance(other, str) and other:
        with pytest.raises(UntrustedRecordError, match="group"):
            content.group({"group": other}, {"group": hashlib.sha256(other.encode()).hexdigest()})


@PROPS
@given(ROSTERS)
def test_rosters_round_trip(roster: records.Roster) -> None:
    """A roster parses back to what its owner named, each member at its number."""
    got = records.roster(json.loads(json.dumps(asdict(roster))))
    assert got == roster
    assert [got.index(m) for m in roster.members] == list(range(len(roster.members)))


@pytest.mark.parametrize(("members", "match"), [
    ([], r"members must be a list of 1 to 64 worker names, got \[\]"),
    (["A"] * 2, "members must be distinct"),
    (["A", "B", "A"], "members must be distinct"),
    ([f"w{i}" for i in range(65)], "members must be a list of 1 to 64"),
    (["A", "no spaces"], "member must be a name of"),
])
def test_a_roster_naming_nobody_twice_or_too_many_is_refused(
    members: list[str], match: str
) -> None:
    """A roster is refused unless it names 1 to 64 distinct workers (its owner first)."""
    with pytest.raises(UntrustedRecordError, match=match):
        records.roster({"members": members})
