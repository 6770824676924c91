"""Safetensors checkpoints: headers in torch's dtypes and shapes, and a skeleton built from headers.

Headers are parsed by :mod:`nccl_back.model.safetensors_format` (the reference library's
rules, without torch); here their dtypes and shapes become torch's, as
``safetensors.torch.load_file`` makes them. Every malformation raises
:class:`CheckpointFormatError` naming the file.

``F4`` (FP4 E2M1) is stored two elements to a byte; torch holds it as
``float4_e2m1fn_x2``, one element per *pair*, so the header's last dimension is twice
torch's (a header ``[3, 8]`` is a torch ``[3, 4]``). A header whose last dimension is odd
(or a 0-d F4 tensor, which the format itself refuses) has no torch shape: like the
reference, such a tensor is refused when it is to be loaded. A dtype the reference knows
but torch has no element type for (``F6_E2M3``, ``F6_E3M2``; ``F4`` on a torch without
``float4_e2m1fn_x2``) is a valid header too, refused the same way, by name and dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from nccl_back.config import Settings
from nccl_back.errors import CheckpointFormatError, SkeletonError
from nccl_back.model import safetensors_format as fmt
from nccl_back.model.safetensors_format import HEADER_PROBE_BYTES as HEADER_PROBE_BYTES
from nccl_back.model.safetensors_format import INDEX_NAME as INDEX_NAME
from nccl_back.model.skeleton import Manifest, TensorEntry, dtype_from_name, dtype_name, flat_layout
from nccl_back.model.storage import Shard, Storage

if TYPE_CHECKING:
    from nccl_back.model.identity import ModelSpec

# safetensors dtype names -> torch dtype names (looked up on the installed torch: the
# newer float8 kinds are missing from older releases).
_TORCH_NAMES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F4": "float4_e2m1fn_x2",
}

#: Header elements per torch element, along the last dimension, where they differ.
PACKED: dict[str, int] = {"F4": 2}

#: safetensors dtype names -> torch dtypes, for those this torch has.
DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, name) for st, name in _TORCH_NAMES.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in its file: ``[start, end)`` are absolute byte offsets;
    ``st_dtype`` is the header's dtype name, ``shape`` torch's (:func:`torch_shape`)."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    uri: str = ""
    refused: str = ""
    """Why torch cannot hold this tensor as the header gives it (empty: it can)."""

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype; :class:`CheckpointFormatError` for a tensor torch cannot hold."""
        found = DTYPES.get(self.st_dtype)
        if found is None:
            raise CheckpointFormatError(
                f"{self.uri}: tensor {self.name!r} has dtype {self.st_dtype}, which this torch"
                f" {torch.__version__} has no element type for; nccl_back cannot load it"
            )
        if self.refused:
            raise CheckpointFormatError(f"{self.uri}: tensor {self.name!r} has dtype"
                                        f" {self.st_dtype}: {self.refused}")
        return found

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


def torch_shape(st_dtype: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """The torch shape of a header's tensor, and why there is none (then ``shape`` as
    given): a packed dtype's last dimension counts torch elements, as the reference's
    ``load_file`` reads it."""
    per = PACKED.get(st_dtype, 1)
    if per == 1:
        return shape, ""
    if not shape or shape[-1] % per:
        return shape, (f"its last dimension must be a multiple of {per} (torch holds {per}"
                       f" elements in one), got shape {list(shape)}")
    return (*shape[:-1], shape[-1] // per), ""


def parse_header(data: bytes, uri: str, file_size: int) -> ShardHeader:
    """Parse and validate a header; ``data`` starts at byte 0 and covers the whole header."""
    rec = fmt.parse(data, uri, file_size)
    tensors = {}
    for name, t in rec.tensors.items():
        shape, refused = torch_shape(t.dtype, t.shape)
        tensors[name] = TensorInfo(name, t.dtype, shape, rec.length + t.begin, rec.length + t.end,
                                   uri, refused)
    return ShardHeader(uri, file_size, tensors, rec.metadata, bytes(data[: rec.length]))


def model_headers(
    storage: Storage, spec: ModelSpec, shards: Sequence[Shard] | None = None
) -> list[ShardHeader]:
    """Headers of ``shards`` (default: all of ``spec``'s), tensors named as the model names them.

    A pipeline component's files name their tensors without the component
    (``conv_in.weight`` in ``unet/…safetensors``); the model (a mapping of components,
    or a module with one child per component) names them ``unet.conv_in.weight``.
    """
    shards = spec.shards if shards is None else shards
    headers = fmt.per_shard(storage, shards, parse_header)
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


def manifest_of(located: Mapping[str, tuple[ShardHeader, TensorInfo]]) -> Manifest:
    """The :class:`Manifest` of :func:`locate`'s tensors: the whole checkpoint, by name."""
    return Manifest(tuple(TensorEntry(name, tuple(info.shape), dtype_name(info.dtype))
                          for name, (_, info) in sorted(located.items())))


def flat_skeleton(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    *,
    storage: Storage | None = None,
    settings: Settings | None = None,
) -> nn.Module:
    """A skeleton built from the checkpoint's headers alone, without Python model code:
    a :func:`buffer_module` of views of one allocation on ``device``, laid out as
    :func:`nccl_back.model.skeleton.consolidate` would. For a pipeline the root has one
    child per weighted component (``unet.conv_in.weight``), the names a mapping of
    component skeletons has, so both exchange weights. Headers are read through
    ``storage``, else a :class:`Storage` with ``settings``."""
    man = manifest_of(locate(model_headers(storage or Storage(settings), spec)))
    offsets, total = flat_layout(man)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    return buffer_module(
        (e.name, flat[offsets[e.name]: offsets[e.name] + e.nbytes]
         .view(dtype_from_name(e.dtype)).view(e.shape)) for e in man.entries)


def buffer_module(tensors: Iterable[tuple[str, torch.Tensor]]) -> nn.Module:
    """Nested empty ``nn.Module``s holding each tensor as a persistent buffer at its
    dotted name, so the module's ``state_dict`` names are exactly those names.

    Raises :class:`SkeletonError` for a name that cannot be a module path.
    """
    root = nn.Module()
    for name, t in tensors:
        *path, leaf = name.split(".")
        module = root
        try:
            for part in path:
                child = module._modules.get(part)
                if child is None:
                    child = nn.Module()
                    module.add_module(part, child)
                module = child
            module.register_buffer(leaf, t)
        except (KeyError, TypeError) as err:
            # e.g. both "a" and "a.b" are tensors, or a name part is empty.
            raise SkeletonError(f"tensor name {name!r} cannot be a module path: {err}") from err
    return root
