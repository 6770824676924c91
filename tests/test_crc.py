"""CRC32C combination: the parts' CRCs of any split combine into the whole's, and the
file check proves a file from its intervals or names what is wrong."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nccl_back.errors import ChecksumMismatchError
from nccl_back.model.crc import Interval, check_file, crc32c_combine, crc32c_hex, file_crc


@given(st.binary(max_size=4096), st.data())
def test_combining_two_parts_gives_the_whole(data: bytes, draw: st.DataObject) -> None:
    """crc(A||B) == combine(crc(A), crc(B), len(B)) for every split point."""
    cut = draw.draw(st.integers(0, len(data)))
    a, b = data[:cut], data[cut:]
    assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == \
        google_crc32c.value(data)


@given(st.binary(max_size=4096), st.lists(st.integers(0, 4096), max_size=8))
def test_combining_many_parts_in_order_gives_the_whole(data: bytes, cuts: list[int]) -> None:
    """Folding combine over any number of parts (empty ones included) gives the whole's CRC."""
    points = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    crc = 0
    for lo, hi in zip(points, points[1:], strict=False):
        crc = crc32c_combine(crc, google_crc32c.value(np.frombuffer(data[lo:hi], np.uint8)), hi - lo)
    assert crc == google_crc32c.value(data)


@given(st.integers(0, 2**32 - 1))
def test_empty_parts_are_neutral(crc: int) -> None:
    """An empty B leaves crc(A); an empty A (CRC 0) gives crc(B)."""
    assert crc32c_combine(crc, 0, 0) == crc
    assert crc32c_combine(0, crc, 123) == crc


def test_combine_holds_from_two_to_the_29_bytes() -> None:
    """A length of 2**29 bytes combines right: zlib's table of 32 powers, reused
    cyclically, is wrong from there for CRC32C's polynomial."""
    zeros = np.zeros(64 << 20, np.uint8)
    whole, tail = google_crc32c.value(b"head"), 0
    for _ in range(8):
        whole, tail = google_crc32c.extend(whole, zeros), google_crc32c.extend(tail, zeros)
    assert crc32c_combine(google_crc32c.value(b"head"), tail, 1 << 29) == whole


def test_a_negative_length_is_refused() -> None:
    """A negative length is an error, not a silent wrong CRC."""
    with pytest.raises(ValueError, match="len_b=-1"):
        crc32c_combine(1, 2, -1)


def _ivs(data: bytes, cuts: list[int], rank: int = 0) -> list[tuple[int, Interval]]:
    return [(rank, Interval("f", lo, hi, google_crc32c.value(data[lo:hi])))
            for lo, hi in zip(cuts, cuts[1:], strict=False)]


def test_file_crc_from_two_ranks_that_read_an_interval_twice() -> None:
    """Intervals read by two ranks count once; the whole file's CRC comes out."""
    data = bytes(range(256)) * 10
    ivs = _ivs(data, [0, 100, 2000]) + _ivs(data, [100, 2000, 2560], rank=1)
    assert f"{file_crc('f', len(data), ivs):08x}" == crc32c_hex(data)
    check_file("f", len(data), crc32c_hex(data), ivs)


def test_file_check_names_the_file_when_ranks_disagree() -> None:
    """Two ranks with different bytes for one interval fail the file, naming both."""
    data = bytes(1000)
    ivs = _ivs(data, [0, 500, 1000]) + [(1, Interval("f", 500, 1000, 7))]
    with pytest.raises(ChecksumMismatchError, match=r"f: ranks 0 and 1 read different bytes"):
        file_crc("f", 1000, ivs)


def test_file_check_refuses_unread_bytes_and_overlaps() -> None:
    """A hole or a partial overlap leaves the file unproven."""
    data = bytes(1000)
    with pytest.raises(ChecksumMismatchError, match=r"bytes \[500, 600\) unread"):
        file_crc("f", 1000, _ivs(data, [0, 500]) + _ivs(data, [600, 1000]))
    with pytest.raises(ChecksumMismatchError, match=r"bytes \[1000, 1200\) unread"):
        file_crc("f", 1200, _ivs(data, [0, 1000]))
    with pytest.raises(ChecksumMismatchError, match="overlapping"):
        file_crc("f", 1000, _ivs(data, [0, 600]) + _ivs(data, [500, 1000]))


def test_file_check_fails_on_a_flipped_byte() -> None:
    """One flipped byte anywhere fails the file's CRC against its identity."""
    data = bytearray(b"x" * 1000)
    want = crc32c_hex(bytes(data))
    data[777] ^= 1
    with pytest.raises(ChecksumMismatchError, match=f"f: CRC32C .* differs from {want}"):
        check_file("f", 1000, want, _ivs(bytes(data), [0, 512, 1000]))
