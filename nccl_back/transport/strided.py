"""A chunk of a tensor that is not one run of memory (a transposed or permuted view):
its elements, in row-major order, gathered into a buffer or scattered from one.

A chunk is a run of whole elements ``[offset, offset + nbytes)`` of the tensor's bytes
in row-major order, moving on its own (a part may start inside a tensor). It is covered
by at most two partial rows per dimension and one block of whole rows, each a view: a
few copies per chunk, never one of the whole tensor.
"""

from __future__ import annotations

import torch


def gather(src: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The chunk's bytes of ``src``, in a new buffer on its device."""
    data = torch.empty(nbytes, dtype=torch.uint8, device=src.device)
    elems = data.view(src.dtype)
    for view, at in pieces(src, offset, nbytes):
        elems[at:at + view.numel()].view(view.shape).copy_(view)
    return data


def scatter(dst: torch.Tensor, data: torch.Tensor, offset: int) -> None:
    """The chunk's bytes ``data`` (starting at byte ``offset`` of ``dst``) into its elements."""
    elems = data.view(dst.dtype)
    for view, at in pieces(dst, offset, data.numel()):
        view.copy_(elems[at:at + view.numel()].view(view.shape))


def pieces(t: torch.Tensor, offset: int, nbytes: int) -> list[tuple[torch.Tensor, int]]:
    """Views of ``t`` covering the chunk, each with its first element's index in it."""
    item = t.element_size()
    return _pieces(t, offset // item, (offset + nbytes) // item, 0)


def _pieces(t: torch.Tensor, start: int, end: int, at: int) -> list[tuple[torch.Tensor, int]]:
    if t.dim() <= 1:
        return [(t.reshape(-1)[start:end], at)]
    inner = t[0].numel()
    out: list[tuple[torch.Tensor, int]] = []
    pos = start
    while pos < end:
        row, off = divmod(pos, inner)
        if off == 0 and end - pos >= inner:
            rows = (end - pos) // inner
            out.append((t[row:row + rows], at + pos - start))
            pos += rows * inner
        else:
            stop = min(end, (row + 1) * inner)
            out += _pieces(t[row], off, stop - row * inner, at + pos - start)
            pos = stop
    return out
