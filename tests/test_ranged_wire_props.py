"""What ranks of a ranged load send each other, as integers: every Needs and interval
list survives the trip exactly, and any list of integers another rank could send
decodes to something within this rank's own spec or is refused with ValueError."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nccl_back.model.crc import Interval
from nccl_back.model.identity import ModelSpec
from nccl_back.model.ranged import Need, Needs
from nccl_back.model.ranged_wire import (
    decode_intervals,
    decode_needs,
    encode_intervals,
    encode_needs,
)
from nccl_back.model.storage import Shard

NAMES = sorted(f"model.layers.{i}.w" for i in range(5))
SIZES = st.lists(st.integers(0, 1 << 40), min_size=1, max_size=4)


def _spec(sizes: list[int]) -> ModelSpec:
    return ModelSpec({}, shards=tuple(
        Shard(f"/m/model-{i}.safetensors", "00000000", size) for i, size in enumerate(sizes)))


@st.composite
def _needs(draw: Any) -> tuple[ModelSpec, Needs]:
    spec = _spec(draw(SIZES))

    def place(size: int) -> tuple[int, int]:
        start = draw(st.integers(0, size))
        return start, draw(st.integers(start, size))

    heads = []
    for _ in range(draw(st.integers(0, 3))):
        s = draw(st.sampled_from(spec.shards))
        heads.append((s.uri, *place(s.size)))
    sources = []
    for _ in range(draw(st.integers(0, 4))):
        s = draw(st.sampled_from(spec.shards))
        start = draw(st.integers(0, s.size))
        row = draw(st.integers(0, 1 << 20))
        rows = (s.size - start) // row if row else 1 << 30
        lo = draw(st.integers(0, min(rows, 1 << 30)))
        hi = draw(st.integers(lo, min(rows, 1 << 30)))
        sources.append(Need(draw(st.sampled_from(NAMES)), s.uri, start, row, lo, hi))
    return spec, Needs(tuple(heads), tuple(sources), draw(st.integers(0, 1 << 40)))


@settings(max_examples=200, deadline=None)
@given(_needs())
def test_needs_survive_the_trip_exactly(case: tuple[ModelSpec, Needs]) -> None:
    """encode_needs then decode_needs gives back the same Needs."""
    spec, needs = case
    assert decode_needs(encode_needs(needs, spec, NAMES), spec, NAMES) == needs


@settings(max_examples=200, deadline=None)
@given(SIZES, st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 40),
                                 st.integers(0, 1 << 40), st.integers(0, (1 << 32) - 1)), max_size=6))
def test_intervals_survive_the_trip_exactly(sizes: list[int], raw: list[tuple[int, int, int, int]]) -> None:
    """encode_intervals then decode_intervals gives back the same intervals."""
    spec = _spec(sizes)
    ivs = [Interval(spec.shards[f % len(sizes)].uri, *sorted((a % (spec.shards[f % len(sizes)].size + 1),
                                                               b % (spec.shards[f % len(sizes)].size + 1))), crc)
           for f, a, b, crc in raw]
    assert decode_intervals(encode_intervals(ivs, spec), spec) == ivs


ANY_INTS = st.lists(st.one_of(st.integers(0, 8), st.integers(0, 1 << 63)), max_size=40)


@settings(max_examples=400, deadline=None)
@given(SIZES, ANY_INTS)
def test_any_integers_decode_within_the_spec_or_are_refused(sizes: list[int], ints: list[int]) -> None:
    """Whatever integers arrive, decoding returns needs and intervals inside this rank's
    own files and names, or raises ValueError: nothing else escapes."""
    spec = _spec(sizes)
    size = {s.uri: s.size for s in spec.shards}
    try:
        needs = decode_needs(ints, spec, NAMES)
    except ValueError:
        pass
    else:
        assert all(0 <= a <= b <= size[u] for u, a, b in needs.heads)
        assert all(n.name in NAMES and n.lo <= n.hi and n.start + n.hi * n.row_bytes <= size[n.uri]
                   for n in needs.sources)
    try:
        ivs = decode_intervals(ints, spec)
    except ValueError:
        pass
    else:
        assert all(0 <= iv.start <= iv.end <= size[iv.uri] and 0 <= iv.crc < 1 << 32 for iv in ivs)


@pytest.mark.parametrize(("ints", "match"), [
    ([1, 1, 0, 0], "ends before its span end"),
    ([1, 0, 0, 0, 0, 9], "integers past its end"),
    ([1, 0, 1, 0, 5, 0, 1, 0, 0], r"file index 5 outside \[0, 1\)"),
])
def test_a_bad_needs_message_names_what_is_wrong(ints: list[int], match: str) -> None:
    """A message cut short, too long or pointing outside the spec: one ValueError naming it."""
    with pytest.raises(ValueError, match=match):
        decode_needs(ints, _spec([100]), NAMES)
