"""Loading a checkpoint from storage into a skeleton, in place, with load tracking.

Name mapping: a checkpoint tensor fills the skeleton tensor of the same name; a name
that is an alias of a tied tensor (``lm_head.weight`` tied to ``embed.weight``) fills
its canonical tensor. A mapping model (``{"transformer": ..., "vae": ...}``, a
pipeline's components) or a module with one child per pipeline component takes the
full prefixed names (``transformer.blocks.0.weight``, as
:func:`nccl_back.model.skeleton.named_tensors` gives them), so one checkpoint serves a
whole pipeline. A rank passing a mapping of some sub-modules skips the tensors of the
others (shards holding only those are not read); every tensor under a held
sub-module's name must still fit exactly.

Order of work: read every header, check every tensor's dtype and shape and that the
checkpoint and skeleton hold exactly the same tensors, and only then copy, so a
mismatch raises :class:`WeightLoadError` before any byte is written. Local shards are
read with positional reads straight into the skeleton's tensors (never memory-mapped:
a mapped file truncated meanwhile kills the process with SIGBUS); remote shards are
downloaded into one buffer each and copied from it.

Every shard's CRC32C is checked against the identity: downloads as they arrive, before
their tensors are copied; local files over exactly the bytes read into the tensors, as
they are read (a file changed during the load is an error naming it, never a silent
mix). A warm restart reads each local shard once: the identity comes from the CRC32C
cache, the load reads the bytes.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import google_crc32c
import numpy as np
import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    ShardNotFoundError,
    WeightLoadError,
)
from nccl_back.log import get_logger
from nccl_back.model.checkpoint import ShardHeader, TensorInfo, locate, model_headers
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import Model, dtype_name, named_tensors
from nccl_back.model.storage import Shard, Storage, parse_uri
from nccl_back.result import LoadResult

log = get_logger("nccl_back.model.loader")

#: ``progress(done_bytes, total_bytes, bytes_per_second)``, called after each tensor.
Progress = Callable[[int, int, float], None]


class StorageLoader(Protocol):
    """Fills a skeleton from storage when no peer serves it (the weight service's
    storage path): :func:`load_from_storage` by default; an engine adapter passes its
    engine's own loader (:mod:`nccl_back.engines.common`)."""

    def __call__(self, model: Model, spec: ModelSpec, settings: Settings, /) -> LoadResult:
        ...

_MAX_LISTED = 10


@dataclass(frozen=True)
class _Copy:
    """One checkpoint tensor and the skeleton tensor it fills."""

    info: TensorInfo
    target: torch.Tensor
    canonical: str


def _plan_load(
    tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    headers: Sequence[ShardHeader],
    held: tuple[str, ...] | None = None,
) -> dict[str, list[_Copy]]:
    """Shard URI -> the copies it feeds; raises :class:`WeightLoadError` on any mismatch.

    Checks, before any copy: every checkpoint tensor has a skeleton tensor of the same
    dtype and shape, no skeleton tensor is filled twice (a tied tensor stored under
    two names), and every skeleton tensor is filled.
    """
    plan: dict[str, list[_Copy]] = defaultdict(list)
    filled_by: dict[str, str] = {}
    mismatched: list[str] = []
    unexpected: list[str] = []
    twice: list[str] = []
    for name, (header, info) in locate(headers).items():
        if held is not None and not name.startswith(held):
            continue  # a sub-module another rank of the pipeline holds
        canonical = name if name in tensors else aliases.get(name)
        if canonical is None:
            unexpected.append(name)
            continue
        if canonical in filled_by:
            twice.append(f"{canonical} (as {filled_by[canonical]} and {name})")
            continue
        filled_by[canonical] = name
        target = tensors[canonical]
        if target.dtype != info.dtype or tuple(target.shape) != info.shape:
            mismatched.append(
                f"{name}: skeleton expects {list(target.shape)} {dtype_name(target.dtype)}, "
                f"{header.uri} has {list(info.shape)} {dtype_name(info.dtype)}"
            )
        plan[header.uri].append(_Copy(info, target, canonical))
    missing = sorted(set(tensors) - set(filled_by))
    problems = [
        f"{label}: {items[:_MAX_LISTED]}" + (f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")
        for label, items in (
            ("dtype/shape mismatch (never cast)", mismatched),
            ("missing from the checkpoint", missing),
            ("unexpected (not in the skeleton)", unexpected),
            ("filled twice", twice),
        )
        if items
    ]
    if problems:
        raise WeightLoadError("checkpoint does not fit the skeleton; " + "; ".join(problems))
    return dict(plan)


class _Tracker:
    """Counts fills per tensor and reports progress; shared by the copy threads."""

    def __init__(self, total: int, progress: Progress | None,
                 on_filled: Callable[[str], None] | None = None) -> None:
        self.total = total
        self.on_filled = on_filled
        self.done = 0
        self.fills: Counter[str] = Counter()
        self.progress = progress
        self.start = _clock.perf()
        self.lock = threading.Lock()

    def copied(self, c: _Copy) -> None:
        # Under the lock: the callback sees one call at a time, with growing counts.
        with self.lock:
            self.fills[c.canonical] += 1
            self.done += c.info.nbytes
            if self.progress is not None:
                elapsed = _clock.perf() - self.start
                self.progress(self.done, self.total, self.done / elapsed if elapsed > 0 else 0.0)
            if self.on_filled is not None:
                self.on_filled(c.canonical)

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        wrong = sorted(n for n in tensors if self.fills[n] != 1)
        if wrong:
            detail = [f"{n} x{self.fills[n]}" for n in wrong[:_MAX_LISTED]]
            raise WeightLoadError(f"load tracking: tensors not filled exactly once: {detail}")


def _copy_from(buffer: Any, copies: Sequence[_Copy], tracker: _Tracker) -> None:
    """Copy each tensor from a zero-copy view of ``buffer`` into its skeleton tensor."""
    with torch.no_grad():
        for c in copies:
            numel = c.target.numel()
            if numel:
                src = torch.frombuffer(buffer, dtype=c.info.dtype, count=numel, offset=c.info.start)
                try:
                    c.target.copy_(src.view(c.info.shape))
                finally:
                    del src  # release the view so the mapping can be closed
            tracker.copied(c)


def _check_header(buf: Any, header: ShardHeader) -> None:
    """The plan's offsets came from a separate (unchecksummed) header read: make sure
    that header is byte-identical to the start of the CRC-verified download."""
    if bytes(buf[: len(header.raw)]) != header.raw:
        raise ChecksumMismatchError(
            f"{header.uri}: header read before the download differs from the verified bytes"
            " (object changed or corrupted in transit); retry the load"
        )


#: Bytes read and checksummed at a time: small enough that the CRC32C reads them from
#: the CPU cache right after the kernel wrote them.
_CHUNK_BYTES = 1 << 20


def read_exact(fd: int, dest: np.ndarray, offset: int, path: str, size: int) -> None:
    """Fill ``dest`` from ``offset`` of the file; a short read means the file shrank."""
    done = 0
    while done < dest.size:
        n = os.preadv(fd, [dest[done:].data], offset + done)
        if n == 0:
            raise CheckpointFormatError(
                f"{path}: ended at byte {offset + done} while being loaded, its identity says"
                f" {size} bytes: the file was truncated or replaced during the load"
            )
        done += n


def open_shard(path: str, size: int) -> int:
    """A read-only descriptor of a local shard, whose size must be its identity's ``size``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"shard {path!r} does not exist") from e
    if (got := os.fstat(fd).st_size) != size:
        os.close(fd)
        raise CheckpointFormatError(
            f"{path}: {got} bytes, its identity says {size} (changed since fingerprinted?)")
    return fd


def _byte_view(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's bytes as a flat uint8 tensor sharing its memory, if it is contiguous."""
    if not t.is_contiguous() or t.numel() == 0:
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def _load_local(shard: Shard, copies: Sequence[_Copy], header: ShardHeader,
                tracker: _Tracker) -> None:
    """Read the shard with positional reads straight into the skeleton's tensors, and
    checksum exactly the bytes read as they arrive: what is copied is what is checked
    (a mapped file rewritten in place would hand over bytes after their check). A
    change is an error naming the shard; its tensors count as filled (``on_filled``)
    only after the whole file's CRC32C passed."""
    path = parse_uri(shard.uri).path
    fd = open_shard(path, shard.size)
    try:
        head = np.empty(len(header.raw), dtype=np.uint8)
        read_exact(fd, head, 0, path, shard.size)
        if head.tobytes() != header.raw:
            raise ChecksumMismatchError(
                f"{path}: its header changed between the header read and the load"
                " (file rewritten during the load?)"
            )
        crc = google_crc32c.extend(0, head)
        by_name = {c.info.name: c for c in copies}
        bounce = np.empty(_CHUNK_BYTES, dtype=np.uint8)
        with torch.no_grad():
            # Every tensor, held or not, in file order: the tensors tile the data section,
            # so together with the header this is the whole file, the CRC32C's input.
            for info in sorted(header.tensors.values(), key=lambda i: i.start):
                c = by_name.get(info.name)
                crc = _read_tensor(fd, info, c.target if c else None, bounce, crc, path, shard.size)
        if f"{crc:08x}" != shard.crc32c:
            raise ChecksumMismatchError(
                f"{path}: CRC32C {crc:08x} of the bytes loaded differs from {shard.crc32c} in"
                " its identity (changed or corrupted since fingerprinted, or during the load?)"
            )
    finally:
        os.close(fd)
    for c in copies:
        tracker.copied(c)


def _read_tensor(fd: int, info: TensorInfo, target: torch.Tensor | None, bounce: np.ndarray,
                 crc: int, path: str, size: int) -> int:
    """Read one tensor's bytes into ``target`` (or only checksum them, when no tensor of
    this rank wants them); returns the CRC32C extended over them."""
    flat = _byte_view(target) if target is not None else None
    host = flat.numpy() if flat is not None and flat.device.type == "cpu" else None
    whole: np.ndarray | None = None
    if target is not None and flat is None and info.nbytes:
        whole = np.empty(info.nbytes, dtype=np.uint8)  # a strided tensor: one copy at the end
    for off in range(0, info.nbytes, _CHUNK_BYTES):
        n = min(_CHUNK_BYTES, info.nbytes - off)
        if host is not None:
            dest = host[off : off + n]
        elif whole is not None:
            dest = whole[off : off + n]
        else:
            dest = bounce[:n]
        read_exact(fd, dest, info.start + off, path, size)
        # A numpy array, not a memoryview: google_crc32c is several times slower on those.
        crc = google_crc32c.extend(crc, dest)
        if flat is not None and host is None:
            flat[off : off + n].copy_(torch.from_numpy(dest))  # another device, via the bounce
    if target is not None and whole is not None:
        target.copy_(torch.from_numpy(whole).view(target.dtype).view(target.shape))
    return crc


def _held_shards(model: Model, spec: ModelSpec) -> tuple[Shard, ...]:
    """The shards a load into ``model`` reads: for a pipeline rank, its components' only."""
    if not spec.components or not isinstance(model, Mapping):
        return spec.shards
    weighted = spec.weighted_components
    unknown = sorted(k for k in model if k not in weighted)
    if unknown:
        raise WeightLoadError(
            f"pipeline component(s) {unknown} have no weights in this pipeline"
            f" (components with weights: {list(weighted)})"
        )
    return tuple(s for s in spec.shards if spec.component_of(s) in model)


def load_from_storage(
    model: Model,
    spec: ModelSpec,
    progress: Progress | None = None,
    settings: Settings | None = None,
    *,
    storage: Storage | None = None,
    on_download: Callable[[int], None] | None = None,
    on_filled: Callable[[str], None] | None = None,
) -> LoadResult:
    """Fill ``model`` (a skeleton) in place from the checkpoint ``spec`` names.

    Raises :class:`WeightLoadError` (mismatch, missing or unexpected tensors, before any
    copy), :class:`CheckpointFormatError` (bad safetensors, naming the file),
    :class:`ShardNotFoundError`, :class:`ChecksumMismatchError` or :class:`StorageError`.
    ``on_download(n)`` is told of each downloaded chunk of a remote shard (progress bars).
    ``on_filled(name)`` is told of each skeleton tensor once its bytes are in place, after
    its shard's CRC32C passed (a download streamed to waiting workers, relay.py). A local
    shard is checked over the bytes read into its tensors, so when it fails (changed on
    disk) those tensors hold what was read: never reported filled, and the load raises.
    """
    settings = settings or (storage.settings if storage is not None else Settings())
    storage = storage or Storage(settings)
    start = _clock.perf()
    tensors, aliases = named_tensors(model)
    needed = _held_shards(model, spec)
    headers = model_headers(storage, spec, needed)
    held = tuple(f"{k}." for k in model) if isinstance(model, Mapping) else None
    try:
        plan = _plan_load(tensors, aliases, headers, held)
    except WeightLoadError as e:
        if spec.components:
            which = sorted(model) if isinstance(model, Mapping) else "all"
            raise WeightLoadError(f"pipeline components {which}"
                                  f" (tensors named component.tensor): {e}") from e
        raise
    t_headers = _clock.perf() - start
    total = sum(c.info.nbytes for copies in plan.values() for c in copies)
    tracker = _Tracker(total, progress, on_filled)

    shards = [s for s in spec.shards if s.uri in plan]
    local = [s for s in shards if parse_uri(s.uri).is_local]
    remote = [s for s in shards if not parse_uri(s.uri).is_local]
    waited = 0.0
    headers_by_uri = {h.uri: h for h in headers}
    if local:
        # copy_ releases the GIL: shards copy in parallel.
        workers = min(settings.storage_workers, len(local))
        with ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-load") as pool:
            for f in [pool.submit(_load_local, s, plan[s.uri], headers_by_uri[s.uri], tracker)
                      for s in local]:
                f.result()
    if remote:
        downloads = storage.download_many(remote, on_bytes=on_download)
        try:
            while True:
                t0 = _clock.perf()
                item = next(downloads, None)
                waited += _clock.perf() - t0
                if item is None:
                    break
                shard, buf = item
                _check_header(buf, headers_by_uri[shard.uri])
                _copy_from(buf, plan[shard.uri], tracker)
                del item, buf
        finally:
            downloads.close()
    tracker.check(tensors)
    if spec.components:
        by_component: Counter[str] = Counter()
        for c in (c for copies in plan.values() for c in copies):
            by_component[c.canonical.split(".", 1)[0]] += c.info.nbytes
        for component, nbytes in sorted(by_component.items()):
            log.info("component_loaded", version=spec.version, component=component, bytes=nbytes)
    seconds = _clock.perf() - start
    timings = {"headers": t_headers, "copy": seconds - t_headers - waited}
    if remote:
        timings["download"] = waited
    log.info("storage_load_done", version=spec.version, bytes=total, seconds=round(seconds, 3),
             shards=len(shards))
    return LoadResult("storage", spec.version, total, seconds, timings=timings, storage_bytes=total)
