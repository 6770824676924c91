"""The hand-off's arena: one allocation holding every canonical tensor of the model
(``skeleton.ALIGN``-ed offsets, a name -> offset map); both halves use this module.

A CPU sidecar builds the skeleton into it before the load (:func:`host`), so the
weights land in shared memory once; a server given its own model packs it at
``start()`` (:func:`pack`: copied, tensors re-pointed). Either way the server's model is
read-only from then on.

- CPU: a POSIX shared-memory segment ``/dev/shm/nccl_back_<random>`` (0600: consumer and
  sidecar run as one user; the sidecar's resource tracker unlinks it if the sidecar
  dies). Each side maps it with its own ``mmap`` given to ``torch.frombuffer``, which
  keeps it alive under live tensors: a ``SharedMemory`` object would unmap on garbage
  collection, and on Python < 3.13 attaching one registers the segment with the
  consumer's tracker, which unlinks it at the consumer's exit. The consumer maps
  copy-on-write (``MAP_PRIVATE``): its writes reach no one else.
- GPU: one CUDA allocation exported through CUDA IPC (:mod:`.cuda`).

/dev/shm must hold the model (containers get 64 MiB: mount a memory ``emptyDir``);
space is reserved at creation, so too small a /dev/shm is an :class:`AttachError`,
not a SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch
from torch import nn

from nccl_back.errors import AttachError
from nccl_back.model.skeleton import (
    ALIGN,
    Manifest,
    Model,
    consolidate_into,
    dtype_from_name,
    flat_layout,
    manifest,
    model_device,
    named_tensors,
)
from nccl_back.sidecar.handoff.perms import check_segment

SHM_DIR = "/dev/shm"
#: The only segment names a server creates, hence the only ones a consumer maps.
SHM_NAME = re.compile(r"nccl_back_[0-9a-f]{16}")
#: Linux >= 5.14; Python < 3.13 lacks the constant. Maps all pages in one call, which
#: is ~25% faster than faulting 4 KiB pages one by one during a copy (measured).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


@dataclass(frozen=True)
class Arena:
    """A packed model: its manifest, each tensor's offset, the bytes, and (CPU) the segment."""

    manifest: Manifest
    layout: list[tuple[str, int]]
    tensor: torch.Tensor
    """The whole arena as one uint8 tensor."""
    shm: shared_memory.SharedMemory | None
    """The segment holding a CPU arena (its creator unlinks it); None on a GPU."""


def pack(model: Model) -> Arena:
    """Copy ``model``'s tensors into a new arena (a CPU model's segment is unlinked again
    on failure) and re-point the model into it; a consolidated CUDA model is used as is."""
    tensors, _ = named_tensors(model)
    man = manifest(model)
    device = model_device(model)
    # The arena's layout is the consolidated skeleton's (same order, same ALIGN).
    offsets, end = flat_layout(man)
    layout = list(offsets.items())
    total = max(end, 1)  # a segment cannot be empty
    shm: shared_memory.SharedMemory | None = None
    if device.type == "cpu":
        shm, arena = create_segment(total)
    elif device.type == "cuda":
        consolidated = laid_out(tensors, offsets, total)
        if consolidated is not None:
            return Arena(man, layout, consolidated, None)
        arena = torch.empty(total, dtype=torch.uint8, device=device)
    else:
        raise AttachError(f"cannot serve a model on {device}: only cpu and cuda")
    try:
        targets = views(arena, man, offsets)
        holders = originals(model)
        with torch.no_grad():
            for name, view in targets.items():
                view.copy_(tensors[name])
        # Re-point every holder (tied names included) only after all copies, so the old
        # storage of each tensor is freed as soon as its last holder moves.
        repoint(holders, targets, man.aliases)
    except BaseException:
        _unlink(shm)
        raise
    return Arena(man, layout, arena, shm)


def host(model: Model, *, keep_buffers: bool = True) -> Arena:
    """A fresh segment with the CPU skeleton ``model``'s tensors made views of it
    (:func:`consolidate_into`), so its load writes into shared memory; removed again on
    failure (:class:`AttachError` if /dev/shm cannot hold it)."""
    man = manifest(model)
    offsets, end = flat_layout(man)
    shm, tensor = create_segment(max(end, 1))
    try:
        consolidate_into(model, tensor, keep_buffers=keep_buffers)
    except BaseException:
        _unlink(shm)
        raise
    return Arena(man, list(offsets.items()), tensor, shm)


def holds(packed: Arena, model: Model) -> bool:
    """Whether ``model`` has the arena's manifest and every tensor still is its view of
    the arena, at its offset (a load that wrote in place leaves it so)."""
    if manifest(model) != packed.manifest:
        return False
    tensors, _ = named_tensors(model)
    found = laid_out(tensors, dict(packed.layout), packed.tensor.numel())
    return found is not None and found.data_ptr() == packed.tensor.data_ptr()


def release(packed: Arena | None) -> None:
    """Unlink the arena's segment, if it has one (mappings keep their pages until unmapped)."""
    if packed is not None:
        _unlink(packed.shm)


def create_segment(size: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    """A fresh ``size``-byte segment and its writable mapping; :class:`AttachError` if
    /dev/shm cannot hold it (the segment is removed again)."""
    name = f"nccl_back_{secrets.token_hex(8)}"
    shm: shared_memory.SharedMemory | None = None
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        # Python's own mapping is not used: see the module docstring.
        shm.close()
        return shm, map_segment(name, size, writable=True)
    except OSError as e:
        _unlink(shm)
        raise AttachError(
            f"cannot create a {size}-byte shared-memory segment in {SHM_DIR}: {e}"
            " (a container's /dev/shm is 64 MiB unless a larger one is mounted)"
        ) from e
    except BaseException:
        _unlink(shm)
        raise


def _unlink(shm: shared_memory.SharedMemory | None) -> None:
    if shm is not None:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


def map_segment(
    name: str, size: int, *, writable: bool, populate: bool = False, owner: int | None = None
) -> torch.Tensor:
    """The segment as a uint8 tensor that keeps its own mmap alive; ``populate`` maps
    every page up front for a caller about to read them all.

    A consumer (not ``writable``) maps only what :func:`check_segment` accepts for
    ``owner``, opened without following links and checked on the very descriptor it
    maps, so the file cannot be swapped between check and map.
    """
    path = os.path.join(SHM_DIR, name)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    # A consumer opens non-blocking: a FIFO put in the segment's place would block it.
    flags |= os.O_RDWR if writable else os.O_RDONLY | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AttachError(f"segment {name} is a symbolic link; refusing to map it") from e
        raise
    try:
        if writable:
            # Reserve the pages now: a write into a sparse tmpfs file that cannot grow
            # kills the process with SIGBUS, whereas this raises ENOSPC.
            os.posix_fallocate(fd, 0, size)
        else:
            check_segment(name, os.fstat(fd), size, os.geteuid() if owner is None else owner)
        actual = os.fstat(fd).st_size
        if actual < size:
            raise AttachError(f"segment {name} has {actual} bytes, expected {size}")
        # Copy-on-write for consumers: reads share the pages, writes stay private.
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if populate:
        with contextlib.suppress(OSError):  # older kernels: pages fault in on first read
            mapping.madvise(_MADV_POPULATE_READ)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def laid_out(
    tensors: dict[str, torch.Tensor], offsets: dict[str, int], total: int
) -> torch.Tensor | None:
    """The one allocation holding every tensor at its arena offset, as uint8, or None."""
    if not tensors:
        return None
    first = next(iter(tensors.values()))
    storage = first.untyped_storage()
    base = first.data_ptr() - offsets[next(iter(tensors))]
    for name, t in tensors.items():
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() != base + offsets[name]):
            return None
    start = base - storage.data_ptr()
    if start < 0 or start + total > storage.nbytes():
        return None
    view = torch.empty(0, dtype=torch.uint8, device=first.device)
    return view.set_(storage, start, (total,), (1,))


def checked_layout(raw: Any, mine: Manifest, size: int) -> dict[str, int]:
    """A reply's ``[[name, offset], ...]`` as a map, if it places exactly ``mine``'s
    tensors, ALIGN-ed, inside a ``size``-byte arena; ``ValueError``/``TypeError`` else."""
    layout = {str(name): int(offset) for name, offset in raw}
    if sorted(layout) != sorted(mine.names):
        raise ValueError("layout names differ from the manifest")
    for entry in mine.entries:
        offset = layout[entry.name]
        if offset < 0 or offset % ALIGN or offset + entry.nbytes > size:
            raise ValueError(f"offset {offset} of {entry.name} is outside the arena")
    return layout


def views(arena: torch.Tensor, man: Manifest, layout: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Every tensor of ``man`` as a typed, shaped view of ``arena`` at its offset."""
    out: dict[str, torch.Tensor] = {}
    for entry in man.entries:
        start = layout[entry.name]
        raw = arena[start : start + entry.nbytes]
        out[entry.name] = raw.view(dtype_from_name(entry.dtype)).view(entry.shape)
    return out


def originals(model: Model) -> dict[str, torch.Tensor]:
    """Every state-dict name -> the live Parameter or buffer object (not ``.data``)."""
    modules = (
        [("", model)] if isinstance(model, nn.Module) else [(k + ".", model[k]) for k in model]
    )
    return {
        prefix + name: t
        for prefix, module in modules
        for name, t in module.state_dict(keep_vars=True).items()
    }


def repoint(
    holders: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
) -> None:
    """Make every holder (tied names through ``aliases``) use its view's storage."""
    with torch.no_grad():
        for name, t in holders.items():
            view = targets[aliases.get(name, name)]
            if isinstance(t, nn.Parameter):
                t.data = view
            else:
                t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
