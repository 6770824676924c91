"""A cooperative download's shares: which byte spans of the checkpoint each of ``n``
workers reads from storage.

The split follows the transfer plan's parts (:func:`nccl_back.transport.parts.parts`):
worker ``i`` reads the bytes of the tensors in part ``i`` of the steps, so what it read
is exactly what it then sends the others as part ``i``, and the shares are as balanced
as the parts (each within one unit, a step or a tensor sent in chunks, of an even share
of the tensors' bytes). A step sent in place carries one chunk of its tensor: its share
is that chunk's bytes; a bucket's slots are whole tensors.

Every byte of every file is read by exactly one worker, so the workers can prove each
file's CRC32C together (:func:`nccl_back.model.crc.file_crc`) without any of them
reading it whole: bytes no step carries (a file's header, alignment padding, tensors the
model does not load) go to the worker whose span ends where they start (the file's
first span's worker for a leading header), keeping each worker's reads few and
contiguous. Pure: no I/O, no torch beyond the plan's records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nccl_back.errors import CheckpointFormatError
from nccl_back.model.ranged import Span
from nccl_back.transport.parts import parts

if TYPE_CHECKING:
    from nccl_back.transport.broadcast import Step

def shares(steps: Sequence[Step], where: Mapping[str, Span], sizes: Mapping[str, int],
           n: int) -> list[list[Span]]:
    """Each of ``n`` workers' spans, in file order (files by name), adjacent ones merged.

    ``steps``: the plan over the tensors as the checkpoint names them; ``where``: each
    such tensor's bytes in its file, ``(uri, start, end)``; ``sizes``: every file of the checkpoint (each must
    be read by someone). :class:`CheckpointFormatError` if a step's tensor has no place,
    or its bytes are not its place's size, or two tensors overlap or leave their file.
    """
    owner: dict[str, list[tuple[int, int, int]]] = {uri: [] for uri in sizes}
    for i, part in enumerate(parts(list(steps), n)):
        for k in part:
            for slot in steps[k].slots:
                uri, start, end = _place(slot.name, where, sizes)
                if steps[k].direct:
                    lo = start + slot.offset
                    owner[uri].append((lo, lo + slot.nbytes, i))
                elif slot.nbytes != end - start:
                    raise CheckpointFormatError(
                        f"{slot.name}: {slot.nbytes} bytes in the plan, {end - start} in {uri}")
                else:
                    owner[uri].append((start, end, i))
    out: list[list[Span]] = [[] for _ in range(n)]
    for uri in sorted(owner):
        for lo, hi, i in _tiles(uri, sizes[uri], sorted(owner[uri])):
            spans = out[i]
            if spans and spans[-1][0] == uri and spans[-1][2] == lo:
                spans[-1] = (uri, spans[-1][1], hi)
            else:
                spans.append((uri, lo, hi))
    return out


def _place(name: str, where: Mapping[str, Span], sizes: Mapping[str, int]) -> Span:
    if name not in where:
        raise CheckpointFormatError(f"{name}: in the plan but not in the checkpoint")
    uri, start, end = where[name]
    if uri not in sizes or not 0 <= start <= end <= sizes[uri]:
        raise CheckpointFormatError(f"{name}: bytes [{start}, {end}) outside {uri}")
    return uri, start, end


def _tiles(uri: str, size: int, owned: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``owned`` (sorted) extended to tile ``[0, size)``: each gap goes to the owner of
    the bytes before it (the first owner for a leading gap; worker 0 for a file no step
    touches)."""
    tiles: list[tuple[int, int, int]] = []
    at = 0
    for lo, hi, i in owned:
        if lo < at:
            raise CheckpointFormatError(f"{uri}: tensors overlap at byte {lo}")
        if lo > at:
            tiles.append((at, lo, tiles[-1][2] if tiles else i))
        if hi > lo:
            tiles.append((lo, hi, i))
        at = max(at, hi)
    if at < size:
        tiles.append((at, size, tiles[-1][2] if tiles else 0))
    return tiles
