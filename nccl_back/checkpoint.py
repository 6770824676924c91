"""Safetensors checkpoints: headers, the shard index, and a skeleton built from headers.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the tensor bytes. We parse headers ourselves rather than through the
``safetensors`` package because we need them from a byte range of a remote object,
before any tensor byte is downloaded, and with offsets we can read in place (mmap,
a downloaded buffer). Every malformation raises :class:`CheckpointFormatError` naming
the file. We are as strict as the reference library: the header is a JSON object
(bounded nesting), and the tensors' ``data_offsets`` tile the data section exactly,
in order, without gaps or overlaps, so a small file cannot declare tensors it does
not hold (20,000 entries over the same bytes would declare a huge skeleton).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import bounded_json
from .config import Settings
from .errors import CheckpointFormatError, SkeletonError
from .index import INDEX_NAME as INDEX_NAME  # re-exported; index.py needs no torch
from .index import parse_index as parse_index
from .skeleton import Manifest, TensorEntry, dtype_from_name, dtype_name, flat_layout
from .storage import Shard, Storage

if TYPE_CHECKING:
    from .identity import ModelSpec

#: safetensors dtype names -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

#: The safetensors library's own limit on the JSON header size.
MAX_HEADER_BYTES = 100 << 20

#: Bytes read speculatively for a header; most headers fit, larger ones cost one more read.
HEADER_PROBE_BYTES = 256 << 10

@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in its file: ``[start, end)`` are absolute byte offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    """The parsed header of one safetensors file."""

    uri: str
    size: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    raw: bytes = b""
    """The header's bytes as read (length field and JSON), to compare with a later read."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicate keys silently; a tensor listed twice is corrupt.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def header_length(prefix: bytes, uri: str, file_size: int) -> int:
    """Bytes taken by the length field plus the JSON header, from the file's first 8 bytes."""
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointFormatError(f"{uri}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"{uri}: header length {n} is implausible (not safetensors?)")
    if 8 + n > file_size:
        raise CheckpointFormatError(f"{uri}: truncated: header needs {8 + n} bytes, file has {file_size}")
    return 8 + n


def parse_header(data: bytes, uri: str, file_size: int) -> ShardHeader:
    """Parse and validate a header; ``data`` starts at byte 0 and covers the whole header."""
    total = header_length(data, uri, file_size)
    if len(data) < total:
        raise CheckpointFormatError(f"{uri}: truncated header ({len(data)} of {total} bytes)")
    if data[8:9] != b"{":
        # The reference library's rule too: a header is an object, nothing before it.
        raise CheckpointFormatError(f"{uri}: malformed safetensors header: does not start with '{{'")
    try:
        raw = bounded_json.loads(
            data[8:total], max_bytes=MAX_HEADER_BYTES, object_pairs_hook=_no_duplicates
        )
    except ValueError as e:
        raise CheckpointFormatError(f"{uri}: malformed safetensors header: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{uri}: malformed safetensors header: not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointFormatError(f"{uri}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in raw.items():
        tensors[name] = _tensor_info(name, entry, uri, total, file_size)
    _check_tiling(tensors, uri, file_size - total, total)
    return ShardHeader(uri, file_size, tensors, metadata, bytes(data[:total]))


def _check_tiling(
    tensors: Mapping[str, TensorInfo], uri: str, data_bytes: int, data_start: int
) -> None:
    """The tensors' byte ranges must cover ``[0, data_bytes)`` of the data section
    exactly once, as the reference library requires: no overlap, no gap, nothing after."""
    covered = 0
    previous = ""
    for info in sorted(tensors.values(), key=lambda i: (i.start, i.end, i.name)):
        begin, end = info.start - data_start, info.end - data_start
        if begin < covered:
            raise CheckpointFormatError(
                f"{uri}: tensor {info.name!r} data_offsets [{begin}, {end}] overlap "
                f"tensor {previous!r} (which ends at {covered})"
            )
        if begin > covered:
            raise CheckpointFormatError(
                f"{uri}: tensor {info.name!r} data_offsets start at {begin}, leaving bytes "
                f"[{covered}, {begin}) of the data section to no tensor"
            )
        covered, previous = end, info.name
    if covered != data_bytes:
        raise CheckpointFormatError(
            f"{uri}: the tensors cover {covered} bytes of a {data_bytes}-byte data section; "
            "safetensors requires them to cover it exactly"
        )


def _tensor_info(name: str, entry: Any, uri: str, data_start: int, file_size: int) -> TensorInfo:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, begin, end)
        ):
            raise ValueError("shape and data_offsets must be non-negative integers")
        if begin > end:
            raise ValueError(f"data_offsets [{begin}, {end}] end before they begin")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointFormatError(f"{uri}: malformed entry for tensor {name!r}: {e!r}") from e
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize:
        raise CheckpointFormatError(
            f"{uri}: tensor {name!r} has {end - begin} bytes, its shape {list(shape)} and "
            f"dtype {entry['dtype']} need {numel * dtype.itemsize}"
        )
    if data_start + end > file_size:
        raise CheckpointFormatError(
            f"{uri}: truncated: tensor {name!r} ends at byte {data_start + end}, file has {file_size}"
        )
    return TensorInfo(name, dtype, shape, data_start + begin, data_start + end)


def read_header(storage: Storage, shard: Shard) -> ShardHeader:
    """Read one shard's header (one ranged read, two for headers over 256 KiB)."""
    prefix = storage.read_range(shard.uri, 0, min(shard.size, HEADER_PROBE_BYTES))
    if len(prefix) != min(shard.size, HEADER_PROBE_BYTES):
        raise CheckpointFormatError(
            f"{shard.uri}: truncated: {len(prefix)} bytes read, its identity says {shard.size}"
        )
    total = header_length(prefix, shard.uri, shard.size)
    if total > len(prefix):
        prefix += storage.read_range(shard.uri, len(prefix), total)
    return parse_header(prefix, shard.uri, shard.size)


def read_headers(storage: Storage, shards: Sequence[Shard]) -> list[ShardHeader]:
    """All shards' headers, read in parallel (remote reads are round-trip bound)."""
    workers = max(1, min(storage.settings.storage_workers, len(shards)))
    with ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-header") as pool:
        return list(pool.map(lambda s: read_header(storage, s), shards))


def model_headers(
    storage: Storage, spec: ModelSpec, shards: Sequence[Shard] | None = None
) -> list[ShardHeader]:
    """Headers of ``shards`` (default: all of ``spec``'s), tensors named as the model names them.

    A pipeline component's files name their tensors without the component
    (``conv_in.weight`` in ``unet/…safetensors``); the model (a mapping of components,
    or a module with one child per component) names them ``unet.conv_in.weight``.
    """
    shards = spec.shards if shards is None else shards
    headers = read_headers(storage, shards)
    if not spec.components:
        return headers
    return [_prefixed(h, spec.component_of(s) + ".") for h, s in zip(headers, shards, strict=True)]


def _prefixed(header: ShardHeader, prefix: str) -> ShardHeader:
    tensors = {prefix + n: replace(i, name=prefix + n) for n, i in header.tensors.items()}
    return replace(header, tensors=tensors)


def locate(headers: Sequence[ShardHeader]) -> dict[str, tuple[ShardHeader, TensorInfo]]:
    """Tensor name -> (its shard, where in it), sorted by name; a name in two shards is an error."""
    found: dict[str, tuple[ShardHeader, TensorInfo]] = {}
    for h in headers:
        for name, info in h.tensors.items():
            if name in found:
                raise CheckpointFormatError(
                    f"tensor {name!r} is stored twice: in {found[name][0].uri} and {h.uri}"
                )
            found[name] = (h, info)
    return dict(sorted(found.items()))


def flat_skeleton(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    *,
    storage: Storage | None = None,
    settings: Settings | None = None,
) -> nn.Module:
    """A skeleton built from the checkpoint's headers alone, without Python model code.

    Nested empty ``nn.Module``s hold each tensor as a persistent buffer, so the
    module's ``state_dict`` names are exactly the checkpoint's names; tensors are
    views of one allocation on ``device`` (:func:`nccl_back.skeleton.consolidate`).
    For a pipeline the root has one child per weighted component (``unet.conv_in.weight``),
    the names a mapping of component skeletons has, so both exchange weights.
    Headers are read through ``storage``, else a :class:`Storage` with ``settings``.
    """
    headers = model_headers(storage or Storage(settings), spec)
    located = locate(headers)
    man = Manifest(tuple(
        TensorEntry(name, tuple(info.shape), dtype_name(info.dtype))
        for name, (_, info) in sorted(located.items())
    ))
    # One allocation, laid out as consolidate() would, instead of one per tensor.
    offsets, total = flat_layout(man)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    root = nn.Module()
    for e in man.entries:
        *path, leaf = e.name.split(".")
        module = root
        try:
            for part in path:
                child = module._modules.get(part)
                if child is None:
                    child = nn.Module()
                    module.add_module(part, child)
                module = child
            view = flat[offsets[e.name] : offsets[e.name] + e.nbytes]
            module.register_buffer(leaf, view.view(dtype_from_name(e.dtype)).view(e.shape))
        except (KeyError, TypeError) as err:
            # e.g. both "a" and "a.b" are tensors, or a name part is empty.
            raise SkeletonError(
                f"checkpoint tensor name {e.name!r} cannot be a module path: {err}"
            ) from err
    return root
