"""The data plane: walk a state dict in sorted name order and copy it, rank 0 -> 1
(docs/design.md, "The transfer").

Each copy is a collective: both sides must issue the same calls with the same sizes, or
data lands in the wrong buffer silently. So the calls (:func:`plan`) derive from names,
shapes and dtypes alone, and their digest (covering a transfer's ``start`` step and its
``part``, :mod:`.parts`) is exchanged first: a difference raises
:class:`ManifestMismatchError` on both sides before any tensor is touched. Small tensors
share a bucket (a call each would cost more in latency than in bytes); no step exceeds
one, so a relay forwards step k while k+1 arrives. Every completed wait is reported
through ``transport.progressed()``, which the watchdog's stall bound counts from.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nccl_back.errors import ManifestMismatchError, TransferError
from nccl_back.log import get_logger
from nccl_back.model.skeleton import ALIGN, Manifest, dtype_from_name, dtype_name
from nccl_back.transport.channel import RECEIVER_RANK, SENDER_RANK, Pending, Transport
from nccl_back.transport.parts import Part, part_steps
from nccl_back.transport.prefault import Prefaulter, Range
from nccl_back.transport.strided import gather, scatter

log = get_logger(__name__)

#: A tensor of at least this many bytes travels in place, in its own step, even below
#: ``bucket_bytes``: a gloo call of 2 MiB costs 0.91-1.0 of its bytes in a flat call
#: (benchmarks/gloo_calls.py), less than copying it through a bucket on both sides
#: (1 GiB of 2-5.5 MiB weights in 8 MiB buckets: two extra memcpys of the model).
DIRECT_BYTES = 2 << 20

#: Broadcasts in flight at once: one on the wire while the host packs/unpacks the next.
MAX_IN_FLIGHT = 2


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a step: bytes ``[offset, offset + nbytes)`` of the buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Step:
    """One copy: a packed bucket of small tensors, or one big tensor in place."""

    direct: bool
    nbytes: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class TransferStats:
    """What one side of a transfer did."""

    bytes: int
    """Payload bytes (tensor bytes, without bucket padding)."""
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def plan(source: Mapping[str, torch.Tensor] | Manifest, bucket_bytes: int) -> list[Step]:
    """The copies for ``source``, from names, shapes and dtypes alone, in sorted name
    order: a tensor of ``min(bucket_bytes, DIRECT_BYTES)`` or more in place, in chunks of
    whole elements; smaller ones fill the open bucket at ``ALIGN``-ed offsets (so a slot
    can be viewed as any dtype). Empty tensors get no step.
    """
    if bucket_bytes < 1:
        raise TransferError(f"bucket_bytes={bucket_bytes}: must be positive")
    steps: list[Step] = []
    bucket: list[Slot] = []
    used = 0
    direct_from = min(bucket_bytes, DIRECT_BYTES)
    for name, shape, dtype in sorted(_entries(source)):
        nbytes = math.prod(shape) * dtype_from_name(dtype).itemsize
        if nbytes == 0:
            continue
        if nbytes >= direct_from:
            # Whole elements per chunk, so each lands on its own even in a non-contiguous
            # destination; a direct slot's offset is its chunk's byte offset in the tensor.
            item = dtype_from_name(dtype).itemsize
            chunk = max(bucket_bytes - bucket_bytes % item, item)
            for at in range(0, nbytes, chunk):
                size = min(chunk, nbytes - at)
                steps.append(Step(True, size, (Slot(name, shape, dtype, at, size),)))
            continue
        offset = -(-used // ALIGN) * ALIGN
        if offset + nbytes > bucket_bytes:
            steps.append(Step(False, used, tuple(bucket)))
            bucket, offset = [], 0
        bucket.append(Slot(name, shape, dtype, offset, nbytes))
        used = offset + nbytes
    if bucket:
        steps.append(Step(False, used, tuple(bucket)))
    return steps


def completes(steps: list[Step]) -> dict[int, list[str]]:
    """Per step, the tensors whose last bytes it carries (all in place once it is done)."""
    out: dict[int, list[str]] = {}
    for k, step in enumerate(steps):
        for x in step.slots:
            if not step.direct or x.offset + x.nbytes == math.prod(x.shape) * dtype_from_name(x.dtype).itemsize:
                out.setdefault(k, []).append(x.name)
    return out


def payload_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes a transfer of ``tensors`` moves (what the automatic bucket size scales with)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def moved_bytes(tensors: Mapping[str, torch.Tensor], bucket_bytes: int, start: int = 0,
                part: Part | None = None) -> int:
    """The bytes a transfer of ``tensors`` from step ``start`` (of ``part`` only) moves."""
    steps = plan(tensors, bucket_bytes)
    return sum(steps[k].nbytes for k in _todo(steps, min(max(start, 0), len(steps)), part))


def plan_digest(steps: list[Step], start: int = 0, part: Part | None = None) -> bytes:
    """MD5 of the plan from step ``start`` (of ``part``): equal iff both sides' calls are."""
    def calls(todo: Iterable[int]) -> list[Any]:
        return [[s.direct, s.nbytes, [[x.name, list(x.shape), x.dtype, x.offset] for x in s.slots]]
                for s in (steps[k] for k in todo)]

    whole: list[Any] = [start, calls(range(start, len(steps)))]
    if part is not None:  # names the part and each step's index: parts of one plan differ
        todo = _todo(steps, start, part)
        whole = [start, list(part), todo, calls(todo)]
    return hashlib.md5(json.dumps(whole, separators=(",", ":")).encode()).digest()


def send_tensors(transport: Transport, tensors: Mapping[str, torch.Tensor], bucket_bytes: int, *,
                 start: int = 0, part: Part | None = None, ready: Callable[[int], None] | None = None,
                 pace: Callable[[int], None] | None = None) -> TransferStats:
    """Broadcast ``tensors`` (rank 0, only read) from step ``start`` (of ``part``).
    ``ready(k)`` returns once step k's bytes are in place (raises to end the transfer);
    ``pace(n)`` once ``n`` more bytes may go out."""
    began = time.perf_counter()
    steps, todo, buffers, window = _begin(transport, tensors, bucket_bytes, start, part)
    with torch.no_grad():
        for k in todo:
            step = steps[k]
            if ready is not None:
                ready(k)
            window.make_room()
            if step.direct:
                slot = step.slots[0]
                src = tensors[slot.name]
                if src.is_contiguous():
                    data = _as_bytes(src)[slot.offset: slot.offset + slot.nbytes]
                else:  # this chunk's elements only: a relay forwards each chunk as it lands
                    data = gather(src, slot.offset, slot.nbytes)
            else:
                laid_out = _in_place(step, tensors)
                if laid_out is not None:
                    data = laid_out
                else:
                    data = buffers.next(step.nbytes)
                    for slot in step.slots:
                        _copy(_slot_view(data, slot), tensors[slot.name])
            if pace is not None:
                pace(step.nbytes)
            # The window holds ``data`` until its copy is done: never freed on the wire.
            window.add(transport.copy(data, SENDER_RANK), None, data)
        window.drain()
        _acknowledge(transport)
    return _stats([steps[k] for k in todo], began)


def recv_tensors(transport: Transport, tensors: Mapping[str, torch.Tensor], bucket_bytes: int, *,
                 start: int = 0, part: Part | None = None,
                 on_step: Callable[[int], None] | None = None) -> TransferStats:
    """Receive into ``tensors`` (rank 1) in place from step ``start`` (of ``part``);
    ``on_step(k)`` runs in order once step k's bytes are in place. Fresh CPU memory is
    faulted in a few steps ahead (:mod:`.prefault`)."""
    began = time.perf_counter()
    steps, todo, buffers, window = _begin(transport, tensors, bucket_bytes, start, part)
    ahead = Prefaulter(_destinations(steps, tensors, todo) if transport.device.type == "cpu" else [])

    def stepped(k: int) -> None:
        ahead.advance(k + 1)
        if on_step is not None:
            on_step(k)

    with torch.no_grad(), ahead:
        for k in todo:
            step = steps[k]
            window.make_room()
            finish: Callable[[], None] | None
            if step.direct:
                slot = step.slots[0]
                dst = tensors[slot.name]
                if dst.is_contiguous():
                    data, finish = _as_bytes(dst)[slot.offset: slot.offset + slot.nbytes], None
                else:  # staged, then this chunk's elements written in place on their own
                    data = torch.empty(slot.nbytes, dtype=torch.uint8, device=dst.device)
                    finish = lambda dst=dst, data=data, at=slot.offset: scatter(dst, data, at)  # noqa: E731
            else:
                laid_out = _in_place(step, tensors)
                if laid_out is not None:
                    data, finish = laid_out, None
                else:
                    data = buffers.next(step.nbytes)
                    finish = lambda data=data, slots=step.slots: _unpack(data, slots, tensors)  # noqa: E731
            window.add(transport.copy(data, SENDER_RANK), finish, data, k, stepped)
        window.drain()
        _acknowledge(transport)
    return _stats([steps[k] for k in todo], began)


def resume_point(steps: list[Step], done: int) -> int:
    """Where a receiver holding steps ``[0, done)`` resumes: ``done`` (every step, a
    chunk of a non-contiguous tensor too, is in place once reported)."""
    return min(max(done, 0), len(steps))


# -- helpers --------------------------------------------------------------------------------


def _todo(steps: list[Step], start: int, part: Part | None) -> list[int]:
    """The step indices a transfer from ``start`` (of ``part``) moves, in order."""
    if part is None:
        return list(range(start, len(steps)))
    return [k for k in part_steps(steps, part) if k >= start]


def _begin(
    transport: Transport, tensors: Mapping[str, torch.Tensor], bucket_bytes: int, start: int,
    part: Part | None,
) -> tuple[list[Step], list[int], _Buffers, _Window]:
    """Both sides: plan, check devices, agree on the plan, set up buffers and window."""
    steps = plan(tensors, bucket_bytes)
    if not 0 <= start <= len(steps):
        raise TransferError(f"start={start}: the plan has {len(steps)} steps")
    todo = _todo(steps, start, part)
    for name, t in tensors.items():
        if t.device.type != transport.device.type:
            raise TransferError(f"{name} is on {t.device} but the {transport.kind} transport"
                                f" moves {transport.device.type} tensors")
    _agree_on_plan(transport, steps, start, part)
    return steps, todo, _Buffers([steps[k] for k in todo], transport.device), _Window(transport)


def _destinations(steps: list[Step], tensors: Mapping[str, torch.Tensor],
                  todo: list[int]) -> list[list[Range]]:
    """Per step, the CPU memory its bytes end in (for :class:`Prefaulter`); nothing for
    steps this transfer does not move."""
    out: list[list[Range]] = [[] for _ in steps]
    for k in todo:
        step = steps[k]
        laid_out = None if step.direct else _in_place(step, tensors)
        if laid_out is not None:
            out[k] = [(laid_out.data_ptr(), step.nbytes)] if laid_out.device.type == "cpu" else []
            continue
        for slot in step.slots:
            t = tensors[slot.name]
            if t.device.type == "cpu" and t.is_contiguous():
                out[k].append((t.data_ptr() + (slot.offset if step.direct else 0), slot.nbytes))
    return out


def _entries(source: Mapping[str, torch.Tensor] | Manifest) -> Iterable[tuple[str, tuple[int, ...], str]]:
    if isinstance(source, Manifest):
        return [(e.name, tuple(e.shape), e.dtype) for e in source.entries]
    return [(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in source.items()]


def _agree_on_plan(transport: Transport, steps: list[Step], start: int = 0,
                   part: Part | None = None) -> None:
    """Sender sends the plan digest, receiver answers with a verdict byte."""
    mine = torch.frombuffer(bytearray(plan_digest(steps, start, part)),
                            dtype=torch.uint8).to(transport.device)
    theirs = mine.clone() if transport.rank == SENDER_RANK else torch.zeros_like(mine)
    transport.copy(theirs, SENDER_RANK).wait()
    transport.progressed()
    verdict = torch.tensor([int(torch.equal(mine, theirs))], dtype=torch.uint8, device=transport.device)
    transport.copy(verdict, RECEIVER_RANK).wait()
    transport.progressed()
    if not int(verdict.item()):
        raise ManifestMismatchError(
            f"transfer {transport.transfer_id}: sender and receiver planned different copies"
            " (different tensors, bucket_bytes, start step or part); nothing was transferred"
        )


def _acknowledge(transport: Transport) -> None:
    """The receiver tells the sender it holds everything; the sender waits for it.

    A sender's last copy can complete while its bytes are still in flight (NCCL's proxy,
    gloo's send buffers); tearing down then could cut the receiver's tail off.
    """
    ack = torch.ones(1, dtype=torch.uint8, device=transport.device)
    transport.copy(ack, RECEIVER_RANK).wait()
    transport.progressed()


def _in_place(step: Step, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The bucket's bytes as a view of this side's memory where a consolidated skeleton
    already lays its tensors out at the bucket's offsets (no packing; padding travels
    too), else None (a staging buffer is used)."""
    first = tensors[step.slots[0].name]
    storage = first.untyped_storage()
    base = first.data_ptr()
    for slot in step.slots:
        t = tensors[slot.name]
        if (
            not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.data_ptr() != base + slot.offset
        ):
            return None
    start = base - storage.data_ptr()
    if start + step.nbytes > storage.nbytes():
        return None
    view = torch.empty(0, dtype=torch.uint8, device=first.device)
    return view.set_(storage, start, (step.nbytes,), (1,))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _slot_view(buf: torch.Tensor, slot: Slot) -> torch.Tensor:
    raw = buf[slot.offset : slot.offset + slot.nbytes]
    return raw.view(dtype_from_name(slot.dtype)).view(slot.shape)


def _unpack(buf: torch.Tensor, slots: tuple[Slot, ...], tensors: Mapping[str, torch.Tensor]) -> None:
    for slot in slots:
        _copy(tensors[slot.name], _slot_view(buf, slot))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between contiguous CPU tensors, one single-threaded memcpy:
    torch's OpenMP threads spin after each copy and starve the transport's (2 cores:
    packing 1 GiB took 2.5 s instead of 0.2 s while gloo sent)."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
    ):
        np.copyto(_as_bytes(dst.detach()).numpy(), _as_bytes(src.detach()).numpy())
        return
    with torch.no_grad():
        dst.copy_(src)


def _stats(steps: list[Step], start: float) -> TransferStats:
    return TransferStats(
        bytes=sum(x.nbytes for s in steps for x in s.slots),
        seconds=time.perf_counter() - start,
    )


class _Buffers:
    """Two bucket buffers, allocated on first use at the largest bucket's size."""

    def __init__(self, steps: list[Step], device: torch.device) -> None:
        self._size = max((s.nbytes for s in steps if not s.direct), default=0)
        self._device = device
        self._bufs: list[torch.Tensor] = []
        self._turn = 0

    def next(self, nbytes: int) -> torch.Tensor:
        if len(self._bufs) < MAX_IN_FLIGHT:
            self._bufs.append(torch.empty(self._size, dtype=torch.uint8, device=self._device))
        buf = self._bufs[self._turn % len(self._bufs)]
        self._turn += 1
        return buf[:nbytes]


class _Window:
    """Broadcasts in flight, oldest first, each with what to do once it is done."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._pending: deque[tuple[Pending, Callable[[], None] | None, torch.Tensor, int,
                                   Callable[[int], None] | None]] = deque()

    def add(self, pending: Pending, finish: Callable[[], None] | None, data: torch.Tensor,
            step: int = -1, on_step: Callable[[int], None] | None = None) -> None:
        """Track ``pending``, holding ``data`` until done; then ``finish()``, ``on_step(step)``."""
        self._pending.append((pending, finish, data, step, on_step))

    def make_room(self) -> None:
        while len(self._pending) >= MAX_IN_FLIGHT:
            self._complete_oldest()

    def drain(self) -> None:
        while self._pending:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        pending, finish, _, step, on_step = self._pending.popleft()
        pending.wait()
        self._transport.progressed()
        if finish is not None:
            finish()
        if on_step is not None:
            on_step(step)
