"""CRC32C arithmetic: combining the CRCs of a file's byte intervals into the file's.

CRC32C is linear over GF(2): ``crc(A || B) = combine(crc(A), crc(B), len(B))``, where
combining shifts ``crc(A)`` through ``len(B)`` zero bytes and XORs ``crc(B)`` (zlib's
``crc32_combine``, with the Castagnoli polynomial). So ranks that each read some
intervals of a file can prove, together, that the whole file is the one its identity
names, without any rank holding the whole file: :func:`file_crc` checks that the
intervals tile the file, that ranks which read the same interval read the same bytes,
and combines them in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import google_crc32c

from nccl_back.errors import ChecksumMismatchError

#: The Castagnoli polynomial, bit-reflected (what CRC32C's tables use).
POLY = 0x82F63B78


def crc32c_hex(data: Any) -> str:
    """CRC32C of a bytes-like object or numpy array, as 8 hex digits."""
    return f"{google_crc32c.value(data):08x}"


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (both reflected, x^0 at bit 31), as zlib does."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


#: x^(2^k) modulo the polynomial, for k in 0..31 (the powers cycle with period 32 here).
_X2N = _powers()


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A || B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (bytes):
    ``crc(A)`` times x^(8 * len(B)), XOR ``crc(B)`` (zlib's ``crc32_combine``)."""
    if not 0 <= len_b < 1 << 64:
        raise ValueError(f"len_b={len_b}: must be in [0, 2**64)")
    p, k = 1 << 31, 3  # x^0; x^(8 * len_b) is x^(len_b * 2^3)
    while len_b:
        if len_b & 1:
            p = _multmodp(_X2N[k & 31], p)
        len_b >>= 1
        k += 1
    return _multmodp(p, crc_a) ^ crc_b


@dataclass(frozen=True, order=True)
class Interval:
    """CRC32C of bytes ``[start, end)`` of file ``uri`` as one rank read them."""

    uri: str
    start: int
    end: int
    crc: int


def file_crc(uri: str, size: int, intervals: Iterable[tuple[int, Interval]],
             who: str = "ranks") -> int:
    """The CRC32C of file ``uri`` (``size`` bytes) from ``(rank, interval)`` pairs that
    cover it, cut at every rank's boundaries (two intervals are equal or disjoint).

    :class:`ChecksumMismatchError` naming the file if two ranks read different bytes
    for the same interval, if intervals overlap without being equal, or if some bytes
    were read by nobody: then the file's content is unproven. ``who`` names the readers
    in messages (the ranks of one worker, or the members of a cooperative download)."""
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, iv in intervals:
        key = (iv.start, iv.end)
        if key in seen and seen[key][1] != iv.crc:
            raise ChecksumMismatchError(
                f"{uri}: {who} {seen[key][0]} and {rank} read different bytes at"
                f" [{iv.start}, {iv.end}) (the file changed during the load?)")
        seen.setdefault(key, (rank, iv.crc))
    crc, at = 0, 0
    for start, end in sorted(seen):
        if start != at:
            what = "unread" if start > at else "read in overlapping intervals"
            raise ChecksumMismatchError(f"{uri}: bytes [{min(at, start)}, {max(at, start)}) {what}")
        crc = crc32c_combine(crc, seen[(start, end)][1], end - start)
        at = end
    if at != size:
        raise ChecksumMismatchError(f"{uri}: bytes [{at}, {size}) unread; nothing proves them")
    return crc


def check_file(uri: str, size: int, expected: str, intervals: Iterable[tuple[int, Interval]],
               who: str = "ranks") -> None:
    """Raise :class:`ChecksumMismatchError` unless the intervals prove file ``uri`` has
    CRC32C ``expected`` (8 hex digits, from its identity)."""
    got = f"{file_crc(uri, size, intervals, who):08x}"
    if got != expected:
        raise ChecksumMismatchError(
            f"{uri}: CRC32C {got} of the bytes loaded (combined over all {who}' ranges)"
            f" differs from {expected} in its identity (changed or corrupted since"
            " fingerprinted, or during the load?)")
