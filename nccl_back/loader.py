"""Loading a checkpoint from storage into a skeleton, in place, with load tracking.

Name mapping: a checkpoint tensor fills the skeleton tensor of the same name; a name
that is an alias of a tied tensor (``lm_head.weight`` tied to ``embed.weight``) fills
its canonical tensor. For a mapping model (``{"transformer": ..., "vae": ...}``) the
checkpoint's names are the full prefixed names (``transformer.blocks.0.weight``), the
same names :func:`nccl_back.skeleton.named_tensors` gives, so one checkpoint (any
number of shards, in any grouping) serves a whole pipeline. A rank that holds only
some sub-modules passes a mapping of just those: checkpoint tensors under other
sub-module names belong to other ranks and are skipped (shards holding only those
are not read); every tensor under a held sub-module's name must still fit exactly.

Order of work: read every header, check every tensor's dtype and shape and that the
checkpoint and skeleton hold exactly the same tensors, and only then copy. So a
mismatch raises :class:`WeightLoadError` before any byte is written. Local shards are
memory-mapped and each tensor is copied once, from a zero-copy view of the mapping
into the skeleton's existing tensor; remote shards are downloaded into one buffer each
and copied the same way.

A diffusers pipeline spec (:attr:`ModelSpec.components`) loads into a mapping of
component skeletons (``{"unet": unet, "vqvae": vq}``, all or some of its components)
or into a module with one child per component: each component's files fill the
tensors under its name, and only the held components' files are read.

Every shard's CRC32C is checked against the identity before its tensors are copied:
downloads as they arrive, local files over their mapping (or from the identity's CRC32C
cache, so a warm restart reads nothing twice).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .checkpoint import ShardHeader, TensorInfo, locate, model_headers
from .config import Settings
from .errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    ShardNotFoundError,
    WeightLoadError,
)
from .identity import CrcCache, ModelSpec, cached_crc32c
from .log import get_logger
from .result import LoadResult
from .skeleton import Model, dtype_name, named_tensors
from .storage import Shard, Storage, crc32c_hex, parse_uri

log = get_logger("nccl_back.loader")

#: ``progress(done_bytes, total_bytes, bytes_per_second)``, called after each tensor.
Progress = Callable[[int, int, float], None]

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

    def __init__(self, total: int, progress: Progress | None, clock: Callable[[], float],
                 on_filled: Callable[[str], None] | None = None) -> None:
        self.total = total
        self.on_filled = on_filled
        self.done = 0
        self.fills: Counter[str] = Counter()
        self.progress = progress
        self.clock = clock
        self.start = clock()
        self.lock = threading.Lock()

    def copied(self, c: _Copy) -> None:
        # Under the lock: the callback sees one call at a time, with growing counts.
        with self.lock:
            self.fills[c.canonical] += 1
            self.done += c.info.nbytes
            if self.progress is not None:
                elapsed = self.clock() - self.start
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


def _load_local(shard: Shard, copies: Sequence[_Copy], tracker: _Tracker, cache: CrcCache) -> None:
    path = parse_uri(shard.uri).path
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"shard {path!r} does not exist") from e
    try:
        st = os.fstat(fd)
        if st.st_size != shard.size:
            raise CheckpointFormatError(
                f"{path}: {st.st_size} bytes, its identity says {shard.size} (changed since fingerprinted?)"
            )
        if st.st_size == 0:
            return
        # ACCESS_COPY (private, copy-on-write) gives a writable buffer, which
        # torch.frombuffer wants; nothing writes to it, so no page is ever copied.
        with mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY) as mapping:
            # Checked before any copy, over the mapping the copies then read (the
            # checksum warms its pages); the identity's cache makes a warm restart free.
            crc = cached_crc32c(path, st, cache, lambda: crc32c_hex(np.frombuffer(mapping, np.uint8)))
            if crc != shard.crc32c:
                raise ChecksumMismatchError(
                    f"{path}: CRC32C {crc} differs from {shard.crc32c} in its identity"
                    " (changed or corrupted since fingerprinted?)"
                )
            _copy_from(mapping, copies, tracker)
    finally:
        os.close(fd)


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


def _bytes_by_component(plan: Mapping[str, Sequence[_Copy]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for copies in plan.values():
        for c in copies:
            out[c.canonical.split(".", 1)[0]] += c.info.nbytes
    return dict(out)


def load_from_storage(
    model: Model,
    spec: ModelSpec,
    progress: Progress | None = None,
    settings: Settings | None = None,
    *,
    storage: Storage | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_download: Callable[[int], None] | None = None,
    on_filled: Callable[[str], None] | None = None,
) -> LoadResult:
    """Fill ``model`` (a skeleton) in place from the checkpoint ``spec`` names.

    Raises :class:`WeightLoadError` (mismatch, missing or unexpected tensors, before any
    copy), :class:`CheckpointFormatError` (bad safetensors, naming the file),
    :class:`ShardNotFoundError`, :class:`ChecksumMismatchError` or :class:`StorageError`.
    ``on_download(n)`` is told of each downloaded chunk of a remote shard (progress bars).
    ``on_filled(name)`` is told of each skeleton tensor once its bytes are in place, after
    its shard's CRC32C passed (a download streamed to waiting workers, relay.py).
    """
    settings = settings or (storage.settings if storage is not None else Settings())
    storage = storage or Storage(settings)
    start = clock()
    tensors, aliases = named_tensors(model)
    needed = _held_shards(model, spec)
    headers = model_headers(storage, spec, needed)
    # A mapping model (one rank of a pipeline) holds some sub-modules of the checkpoint:
    # tensors of the others are skipped, and shards holding only those are not read.
    held = tuple(f"{k}." for k in model) if isinstance(model, Mapping) else None
    try:
        plan = _plan_load(tensors, aliases, headers, held)
    except WeightLoadError as e:
        if spec.components:
            which = sorted(model) if isinstance(model, Mapping) else "all"
            raise WeightLoadError(f"pipeline components {which}"
                                  f" (tensors named component.tensor): {e}") from e
        raise
    t_headers = clock() - start
    total = sum(c.info.nbytes for copies in plan.values() for c in copies)
    tracker = _Tracker(total, progress, clock, on_filled)

    shards = [s for s in spec.shards if s.uri in plan]
    local = [s for s in shards if parse_uri(s.uri).is_local]
    remote = [s for s in shards if not parse_uri(s.uri).is_local]
    waited = 0.0
    if local:
        # copy_ releases the GIL: shards copy in parallel.
        workers = min(settings.storage_workers, len(local))
        cache = CrcCache(settings.cache_dir)
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-load") as pool:
                for f in [pool.submit(_load_local, s, plan[s.uri], tracker, cache) for s in local]:
                    f.result()
        finally:
            cache.save()
    if remote:
        headers_by_uri = {h.uri: h for h in headers}
        downloads = storage.download_many(remote, on_bytes=on_download)
        try:
            while True:
                t0 = clock()
                item = next(downloads, None)
                waited += clock() - t0
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
        for component, nbytes in sorted(_bytes_by_component(plan).items()):
            log.info("component_loaded", version=spec.version, component=component, bytes=nbytes)
    seconds = clock() - start
    timings = {"headers": t_headers, "copy": seconds - t_headers - waited}
    if remote:
        timings["download"] = waited
    log.info("storage_load_done", version=spec.version, bytes=total, seconds=round(seconds, 3),
             shards=len(shards))
    return LoadResult("storage", spec.version, total, seconds, timings=timings)
