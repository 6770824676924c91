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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import google_crc32c

from nccl_back.errors import ChecksumMismatchError

#: The Castagnoli polynomial, bit-reflected (what CRC32C's tables use).
POLY = 0x82F63B78


def crc32c_hex(data: Any) -> str:
    """CRC32C of a bytes-like object or numpy array, as 8 hex digits."""
    return f"{google_crc32c.value(data):08x}"


def _times(mat: Sequence[int], vec: int) -> int:
    """``mat`` (32 columns, one int each) times the bit vector ``vec``, over GF(2)."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: Sequence[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _zero_bytes_operators() -> list[list[int]]:
    """Operator ``k`` appends ``2**k`` zero bytes to a message (shifts the CRC register
    through them): one zero bit's operator squared 3 times, then once per ``k``."""
    op = [POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        op = _square(op)
    ops = [op]
    for _ in range(63):
        ops.append(_square(ops[-1]))
    return ops


#: Built once (64 squarings): a combine then costs one product per set bit of ``len_b``.
_ZEROS = _zero_bytes_operators()


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A || B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (bytes).

    ``crc(A)`` is multiplied by the operator of ``len(B)`` zero bytes (zlib's
    ``crc32_combine``: GF(2) 32x32 matrices, powers of two by squaring), then ``crc(B)``
    is XORed in: the register's initial and final inversions cancel in that sum."""
    if not 0 <= len_b < 1 << 64:
        raise ValueError(f"len_b={len_b}: must be in [0, 2**64)")
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _times(_ZEROS[k], crc_a)
        len_b >>= 1
        k += 1
    return (crc_a ^ crc_b) & 0xFFFFFFFF


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
