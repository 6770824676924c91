"""The integrity hashes' Triton kernels. Imported only by :mod:`fused_hash`, and only
where Triton is (torch's CUDA builds ship it); the arithmetic is integrity's, in one pass.

Tensors arrive as raw addresses (int64), so one launch covers every tensor of a model
whatever their dtypes and allocations: per-tensor launches, not bytes, were what kept
the hashes far below memory speed on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def weighted_sums(addr_ptr, count_ptr, pos_ptr, weights_ptr, out_ptr,
                  WORD: tl.constexpr, KEYED: tl.constexpr, MUL: tl.constexpr,
                  BLOCK: tl.constexpr):
    """``out[p] = sum(w_i * x_i) mod 2**64`` over piece ``p``: ``count[p]`` words
    (int64 if ``WORD`` is 8, unsigned 32-bit if 4) from byte address ``addr[p]``, at
    positions ``pos[p] + i`` of their chunk. The weight at position ``j`` is
    ``weights[j]`` when ``KEYED``, else ``(j * MUL) | 1`` (integrity's odd position
    weights, computed here rather than read). Each word is read once; int64
    multiplication and addition wrap mod 2**64 in any order, as torch's do."""
    p = tl.program_id(0)
    count = tl.load(count_ptr + p)
    pos = tl.load(pos_ptr + p)
    if WORD == 8:
        words = tl.load(addr_ptr + p).to(tl.pointer_type(tl.int64))
    else:
        words = tl.load(addr_ptr + p).to(tl.pointer_type(tl.uint32))
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for start in range(0, count, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        live = offs < count
        x = tl.load(words + offs, mask=live, other=0).to(tl.int64)  # uint32: zero-extended
        if KEYED:
            w = tl.load(weights_ptr + pos + offs, mask=live, other=0)
        else:
            w = ((pos + offs).to(tl.int64) * MUL) | 1
        acc += x * w
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


@triton.jit
def gather(addr_ptr, out_ptr, n, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i]`` = the ``WIDTH``-byte word at byte address ``addr[i]``, for ``i < n``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    addr = tl.load(addr_ptr + offs, mask=live, other=0)
    if WIDTH == 1:
        x = tl.load(addr.to(tl.pointer_type(tl.int8)), mask=live, other=0)
    elif WIDTH == 2:
        x = tl.load(addr.to(tl.pointer_type(tl.int16)), mask=live, other=0)
    elif WIDTH == 4:
        x = tl.load(addr.to(tl.pointer_type(tl.int32)), mask=live, other=0)
    else:
        x = tl.load(addr.to(tl.pointer_type(tl.int64)), mask=live, other=0)
    tl.store(out_ptr + offs, x, mask=live)
