"""The safetensors header, parsed by the reference library's rules, without torch.

A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the tensor bytes. We parse headers ourselves rather than through the
``safetensors`` package because we need them from a byte range of a remote object,
before any tensor byte is downloaded. So the rules are those of the reference
(``safetensors`` 0.8, Rust ``serde_json`` into ``HashMap<String, TensorInfo>``),
and ``tests/test_safetensors_conformance.py`` holds us to them, file by file:

- N is at most 100,000,000 and the header fits in the file; the JSON is UTF-8, may
  be surrounded by JSON whitespace, and is one object, nested at most 127 deep (serde's
  recursion limit). Strings hold no lone surrogate (``"\\ud800"``), numbers are finite.
- ``__metadata__`` (once) is ``null`` or an object of strings. Every other key is a
  tensor: an object with exactly one ``dtype`` (a known name), ``shape`` (unsigned
  64-bit integers: ``-0``, ``2.0`` and ``1e3`` are floats to serde, refused) and
  ``data_offsets`` (two of them); other fields are ignored. A tensor (or metadata key)
  named twice: the last one counts, as in a ``HashMap``.
- Sorted by offsets, the tensors tile the data section exactly: each begins where
  the previous ended (no overlap, no gap), ``shape x bits`` (checked for overflow at
  every step, a whole number of bytes) is its size, and the last ends at the file's end.

One rule is ours, not the reference's: torch's sizes are int64, so a dimension, a
contiguous stride or an element count over 2**63 - 1 is refused here (the reference
opens ``[0, 2**63]``; no tensor can have that shape).

This module needs no torch, so ``nccl-back fingerprint`` validates headers and reads the
shard index (:func:`parse_index`) quickly; :mod:`nccl_back.model.checkpoint` maps the
dtypes to torch's.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from nccl_back import bounded_json
from nccl_back.errors import CheckpointFormatError
from nccl_back.model.storage import Shard, Storage

T = TypeVar("T")

#: The reference library's limit on the JSON header size (``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000

#: serde_json's recursion limit: a header nested deeper is refused by the reference.
MAX_HEADER_DEPTH = 127

#: Bytes read speculatively for a header; most headers fit, larger ones cost one more read.
HEADER_PROBE_BYTES = 256 << 10

#: Every dtype the reference knows, with its size in bits (``Dtype::bitsize``).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

_U64_MAX = (1 << 64) - 1
#: Torch's sizes are int64: a dimension or element count past this cannot be a tensor.
_I64_MAX = (1 << 63) - 1
_FIELDS = ("dtype", "shape", "data_offsets")

#: The file that maps each tensor of a sharded checkpoint to its shard.
INDEX_NAME = "model.safetensors.index.json"
#: Largest index file read (an index of 100,000 tensors is a few MiB).
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor of a header; ``begin``/``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class HeaderRecord:
    """A validated header: ``length`` is the bytes before the data (8 + N)."""

    uri: str
    size: int
    length: int
    tensors: Mapping[str, TensorRecord]
    metadata: Mapping[str, str]


class _Object(list[Any]):
    """A JSON object kept as its (key, value) pairs, so that duplicates stay visible:
    the reference refuses some (``__metadata__``, a tensor's fields), keeps the last of
    others (tensor names, metadata keys)."""


def _parse_int(text: str) -> int | float:
    # serde_json reads "-0" and integers beyond u64 as floats, which no usize accepts
    # (an ignored field may hold them; a float that overflows f64 it refuses).
    value = int(text)
    if (value == 0 and text.startswith("-")) or value > _U64_MAX or value < -(1 << 63):
        return _parse_float(text)
    return value


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except OverflowError:
        value = math.inf
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _check_strings(value: Any) -> None:
    """Refuse lone surrogates anywhere (serde_json does, in ignored fields too)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"lone surrogate in string {v[:40]!r}") from e
        elif isinstance(v, _Object):
            for k, item in v:
                stack.append(k)
                stack.append(item)
        elif isinstance(v, list):
            stack.extend(v)


def _usize(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be non-negative integers, got {value!r}")
    return value


def header_length(prefix: bytes, uri: str, file_size: int) -> int:
    """Bytes taken by the length field plus the JSON header, from the file's first 8 bytes."""
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointFormatError(f"{uri}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointFormatError(
            f"{uri}: header length {n} is over the safetensors limit of {MAX_HEADER_BYTES}"
            " (not safetensors?)"
        )
    if 8 + n > file_size:
        raise CheckpointFormatError(f"{uri}: truncated: header needs {8 + n} bytes, file has {file_size}")
    return 8 + n


def parse(data: bytes, uri: str, file_size: int) -> HeaderRecord:
    """Parse and validate a header; ``data`` starts at byte 0 and covers the whole header.

    Raises :class:`CheckpointFormatError` naming ``uri`` and the rule broken.
    """
    total = header_length(data, uri, file_size)
    if len(data) < total:
        raise CheckpointFormatError(f"{uri}: truncated header ({len(data)} of {total} bytes)")
    try:
        raw = bounded_json.loads(
            data[8:total], max_bytes=MAX_HEADER_BYTES, max_depth=MAX_HEADER_DEPTH,
            object_pairs_hook=_Object, parse_int=_parse_int, parse_float=_parse_float,
        )
        _check_strings(raw)
    except ValueError as e:
        raise CheckpointFormatError(f"{uri}: malformed safetensors header: {e}") from e
    if not isinstance(raw, _Object):
        raise CheckpointFormatError(f"{uri}: malformed safetensors header: not a JSON object")
    metadata: dict[str, str] = {}
    seen_metadata = False
    tensors: dict[str, TensorRecord] = {}
    for name, entry in raw:
        if name == "__metadata__":
            if seen_metadata:
                raise CheckpointFormatError(f"{uri}: malformed safetensors header: __metadata__ twice")
            seen_metadata = True
            if entry is None:
                continue
            if not isinstance(entry, _Object) or not all(isinstance(v, str) for _, v in entry):
                raise CheckpointFormatError(f"{uri}: __metadata__ must map strings to strings")
            metadata = dict(entry)
            continue
        tensors[name] = _tensor(name, entry, uri)  # the last of a repeated name counts
    del raw
    _check_tiling(tensors, uri, file_size - total)
    return HeaderRecord(uri, file_size, total, tensors, metadata)


def _tensor(name: str, entry: Any, uri: str) -> TensorRecord:
    try:
        if not isinstance(entry, _Object):
            raise ValueError(f"expected an object, got {type(entry).__name__}")
        fields: dict[str, Any] = {}
        for key, value in entry:
            if key in _FIELDS:
                if key in fields:
                    raise ValueError(f"duplicate field {key!r}")
                fields[key] = value
        missing = [f for f in _FIELDS if f not in fields]
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        dtype = fields["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise ValueError(f"unknown dtype {dtype!r} (known: {sorted(DTYPE_BITS)})")
        shape, offsets = fields["shape"], fields["data_offsets"]
        if not isinstance(shape, list) or isinstance(shape, _Object):
            raise ValueError("shape must be a list")
        if not isinstance(offsets, list) or isinstance(offsets, _Object) or len(offsets) != 2:
            raise ValueError("data_offsets must be [begin, end]")
        dims = tuple(_usize(d, "shape and data_offsets") for d in shape)
        begin, end = (_usize(d, "shape and data_offsets") for d in offsets)
        _check_torch_sizes(dims)
    except ValueError as e:
        raise CheckpointFormatError(f"{uri}: malformed entry for tensor {name!r}: {e}") from e
    return TensorRecord(name, dtype, dims, begin, end)


def _check_torch_sizes(dims: tuple[int, ...]) -> None:
    """Torch's sizes and contiguous strides are int64: ``[0, 2**63]`` or ``[0, 2, 2**62]``
    (its first stride is 2**63) has no tensor, though a 0 makes it empty."""
    stride = 1
    for d in reversed(dims):
        if d > _I64_MAX or stride > _I64_MAX:  # stride: this dimension's, the ones after it
            shown = list(dims) if len(dims) <= 8 else [*dims[:8], "..."]
            raise ValueError(f"shape {shown} has a dimension or stride over 2**63 - 1,"
                             " more than torch can hold")
        stride *= max(d, 1)


def _nbytes(t: TensorRecord, uri: str) -> int:
    """The tensor's size by its shape and dtype, overflow-checked at every step as the
    reference does (``[2**40, 2**40, 0]`` overflows before the 0)."""
    numel = 1
    for d in t.shape:
        numel *= d
        if numel > _U64_MAX:
            raise CheckpointFormatError(f"{uri}: tensor {t.name!r}: shape {list(t.shape)} overflows 64 bits")
    if numel > _I64_MAX:  # no file holds so many (its size is an int64): said all the same
        raise CheckpointFormatError(f"{uri}: tensor {t.name!r}: shape {list(t.shape)} has"
                                    " over 2**63 - 1 elements, more than torch can hold")
    bits = numel * DTYPE_BITS[t.dtype]
    if bits > _U64_MAX:
        raise CheckpointFormatError(f"{uri}: tensor {t.name!r}: size of shape {list(t.shape)} overflows")
    if bits % 8:
        raise CheckpointFormatError(
            f"{uri}: tensor {t.name!r}: {numel} elements of {t.dtype} are not a whole number of bytes"
        )
    return bits // 8


def _check_tiling(tensors: Mapping[str, TensorRecord], uri: str, data_bytes: int) -> None:
    """The tensors' byte ranges must cover ``[0, data_bytes)`` of the data section
    exactly once, in offset order: no overlap, no gap, nothing after."""
    covered = 0
    previous = ""
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end, t.name)):
        if t.begin > t.end:
            raise CheckpointFormatError(
                f"{uri}: malformed entry for tensor {t.name!r}: "
                f"data_offsets [{t.begin}, {t.end}] end before they begin"
            )
        if t.begin < covered:
            raise CheckpointFormatError(
                f"{uri}: tensor {t.name!r} data_offsets [{t.begin}, {t.end}] overlap "
                f"tensor {previous!r} (which ends at {covered})"
            )
        if t.begin > covered:
            raise CheckpointFormatError(
                f"{uri}: tensor {t.name!r} data_offsets start at {t.begin}, leaving bytes "
                f"[{covered}, {t.begin}) of the data section to no tensor"
            )
        need = _nbytes(t, uri)
        if t.end - t.begin != need:
            raise CheckpointFormatError(
                f"{uri}: tensor {t.name!r} has {t.end - t.begin} bytes, its shape "
                f"{list(t.shape)} and dtype {t.dtype} need {need}"
            )
        covered, previous = t.end, t.name
    if covered > data_bytes:
        raise CheckpointFormatError(
            f"{uri}: truncated: tensor {previous!r} ends at byte {covered} of the data section,"
            f" which has {data_bytes}"
        )
    if covered != data_bytes:
        raise CheckpointFormatError(
            f"{uri}: the tensors cover {covered} bytes of a {data_bytes}-byte data section; "
            "safetensors requires them to cover it exactly"
        )


def read_raw_header(storage: Storage, shard: Shard) -> bytes:
    """A shard's length field and JSON header, as read (one ranged read, two for headers
    over 256 KiB); its size is checked against the shard's, the JSON is not parsed."""
    want = min(shard.size, HEADER_PROBE_BYTES)
    prefix = storage.read_range(shard.uri, 0, want)
    if len(prefix) != want:
        raise CheckpointFormatError(
            f"{shard.uri}: truncated: {len(prefix)} bytes read, its identity says {shard.size}"
        )
    total = header_length(prefix, shard.uri, shard.size)
    if total > len(prefix):
        prefix += storage.read_range(shard.uri, len(prefix), total)
    return prefix[:total]


def per_shard(storage: Storage, shards: Sequence[Shard], parser: Callable[[bytes, str, int], T]) -> list[T]:
    """Every shard's header (:func:`read_raw_header`) as ``parser(data, uri, file_size)``
    gives it, read in parallel (remote reads are round-trip bound)."""
    workers = max(1, min(storage.settings.storage_workers, len(shards)))
    with ThreadPoolExecutor(workers, thread_name_prefix="nccl-back-header") as pool:
        return list(pool.map(lambda s: parser(read_raw_header(storage, s), s.uri, s.size), shards))


def validate_headers(storage: Storage, shards: Sequence[Shard]) -> list[HeaderRecord]:
    """Every shard's header, validated; the first malformed one raises
    :class:`CheckpointFormatError` naming it."""
    return per_shard(storage, shards, parse)


def parse_index(data: bytes, uri: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a safetensors index."""
    try:
        raw = bounded_json.loads(data, max_bytes=MAX_INDEX_BYTES)
        weight_map = raw["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map must map tensor names to file names")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointFormatError(f"{uri}: malformed index: {e!r}") from e
    for filename in set(weight_map.values()):
        # Shards live next to the index; a path would let an index point anywhere.
        if "/" in filename or filename in ("", ".", ".."):
            raise CheckpointFormatError(f"{uri}: shard name {filename!r} is not a plain file name")
    return weight_map
