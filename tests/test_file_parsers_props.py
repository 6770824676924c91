"""Property tests of every parser of files a checkpoint directory contains.

Each parser (bounded JSON, safetensors headers, the shard index, ``config.json``,
``model_index.json``) gets arbitrary input: it returns a typed result or raises its own
typed error naming the file, never another exception (KeyError, TypeError,
RecursionError, UnicodeError...), and what it accepts it reads correctly.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nccl_back import bounded_json
from nccl_back.errors import CheckpointFormatError, NcclBackError
from nccl_back.model import safetensors_format as fmt
from nccl_back.model.checkpoint import parse_header
from nccl_back.model.identity import ModelSpec

pytestmark = pytest.mark.timeout(300)

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)
# Bytes that stress the structural scan: brackets, quotes and backslashes in any order.
_SOUP = st.lists(st.sampled_from(list(b'{}[]"\\ a:,0')), max_size=200).map(bytes)


def _reference_depth(data: bytes) -> int:
    """The scan's meaning, one byte at a time: a quote after an even run of backslashes
    toggles a string; brackets outside strings nest."""
    depth = deepest = run = 0
    in_string = False
    for c in data:
        if c == ord("\\"):
            run += 1
            continue
        if c == ord('"') and run % 2 == 0:
            in_string = not in_string
        elif not in_string and c in b"{[":
            depth += 1
            deepest = max(deepest, depth)
        elif not in_string and c in b"}]":
            depth -= 1
        run = 0
    return deepest


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@PROPS
@given(data=_SOUP, block=st.sampled_from([1, 2, 3, 7, 64, 1 << 18]))
def test_the_depth_scan_matches_its_byte_by_byte_meaning(data: bytes, block: int) -> None:
    """At any block size (state carried across blocks: strings, backslash runs), the
    vectorised scan finds the depth the byte-by-byte definition gives."""
    saved = bounded_json._BLOCK
    bounded_json._BLOCK = block
    try:
        assert bounded_json.nesting_depth(data) == _reference_depth(data)
    finally:
        bounded_json._BLOCK = saved


@PROPS
@given(value=_JSON, ascii_only=st.booleans())
def test_loads_reads_json_within_bounds_as_json_does(value: Any, ascii_only: bool) -> None:
    """Valid JSON within the bounds parses to what json.loads gives, and its depth is the
    value's nesting."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert bounded_json.nesting_depth(text.encode()) == _depth(value)
    assert bounded_json.loads(text, max_bytes=1 << 20) == json.loads(text)


@PROPS
@given(data=st.binary(max_size=200) | _SOUP, depth=st.integers(0, 3000))
def test_loads_refuses_anything_else_with_a_value_error(data: bytes, depth: int) -> None:
    """Arbitrary bytes, deep nesting included, are JSON or one ValueError: never a
    RecursionError or a UnicodeDecodeError escaping as something else."""
    blob = b"[" * depth + data + b"]" * depth
    with contextlib.suppress(ValueError):
        bounded_json.loads(blob, max_bytes=1 << 20)


@PROPS
@given(data=st.binary(max_size=300) | _SOUP.map(lambda b: b'{"a":' + b + b"}"))
def test_a_header_is_a_record_or_a_format_error(data: bytes) -> None:
    """Any bytes after a correct length field: a validated record or a
    CheckpointFormatError naming the file."""
    blob = struct.pack("<Q", len(data)) + data
    try:
        fmt.parse(blob, "soup.safetensors", len(blob))
    except CheckpointFormatError as e:
        assert str(e).startswith("soup.safetensors: ")


@PROPS
@given(shape=st.lists(st.integers(0, 9), max_size=4), skew=st.sampled_from([0, 0, 0, -1, 1]))
def test_an_fp4_header_is_torch_shaped_or_refused_with_its_reason(shape: list[int], skew: int) -> None:
    """Any F4 shape and byte count: a record whose torch shape is the header's with the last
    dimension halved (float4_e2m1fn_x2 packs two), or a CheckpointFormatError naming the
    file and why: a half byte, a size the shape does not give, an odd last dimension (when
    the tensor is used: the header itself is valid, as for the reference)."""
    numel = math.prod(shape)
    nbytes = max(0, numel // 2 + skew)
    header = json.dumps({"w": {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + bytes(nbytes)
    try:
        info = parse_header(blob, "fp4.safetensors", len(blob)).tensors["w"]
    except CheckpointFormatError as e:
        assert str(e).startswith("fp4.safetensors: ")
        assert numel % 2 or nbytes != numel // 2, e
        return
    assert numel % 2 == 0 and nbytes == numel // 2
    if not shape or shape[-1] % 2:
        with pytest.raises(CheckpointFormatError, match="fp4.safetensors: tensor 'w' has dtype F4:"
                                                        " its last dimension must be a multiple of 2"):
            _ = info.dtype
        return
    assert str(info.dtype) == "torch.float4_e2m1fn_x2"
    assert info.shape == (*shape[:-1], shape[-1] // 2) and info.nbytes == nbytes


#: Dimensions small and at torch's edges: int32's, int64's (2**63 - 1 holds, 2**63 not), u64's.
_DIMS = (st.integers(0, 3) | st.sampled_from([2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1])
         | st.integers(0, 2**64 - 1))


@PROPS
@given(shape=st.lists(_DIMS, max_size=4), empty_at=st.none() | st.integers(0, 4),
       dtype=st.sampled_from(["U8", "F32", "F4"]))
@example(shape=[0, 2**63], empty_at=None, dtype="F32")
def test_a_header_shape_is_one_torch_holds_or_a_format_error(
    shape: list[int], empty_at: int | None, dtype: str
) -> None:
    """Any shape, dimensions up to 2**64 - 1 (a 0 among them makes the tensor empty, so
    its size checks pass): a record whose tensor torch builds as a skeleton does (a view
    of its bytes), or a CheckpointFormatError naming the file (a dimension or an element
    count over int64: refused where the header is parsed)."""
    if empty_at is not None:
        shape.insert(min(empty_at, len(shape)), 0)
    bits = math.prod(shape) * fmt.DTYPE_BITS[dtype]
    nbytes = bits // 8 if bits % 8 == 0 and bits < 1 << 15 else 0
    header = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + bytes(nbytes)
    try:
        info = parse_header(blob, "shape.safetensors", len(blob)).tensors["w"]
    except CheckpointFormatError as e:
        assert str(e).startswith("shape.safetensors: ")
        return
    assert all(d < 2**63 for d in shape) and math.prod(shape) < 2**63
    if info.refused:  # an odd F4 last dimension: refused when used, as tested above
        return
    t = torch.empty(info.nbytes, dtype=torch.uint8).view(info.dtype).view(info.shape)
    assert tuple(t.shape) == info.shape


_FILE_NAMES = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["model.safetensors", "a/b.safetensors", "..", ".", "", "/etc/passwd", "x\\y"])


@PROPS
@given(weight_map=st.dictionaries(st.text(max_size=8), _FILE_NAMES, max_size=6)
       | _JSON.map(lambda v: v if not isinstance(v, dict) else {"m": v}),
       wrap=st.booleans())
def test_the_shard_index_is_a_map_of_plain_file_names_or_a_format_error(
    weight_map: Any, wrap: bool
) -> None:
    """An index is tensor name -> a plain file name next to it; anything else (other
    types, paths, '..') is a CheckpointFormatError naming the index."""
    doc = {"metadata": {}, "weight_map": weight_map} if wrap else weight_map
    data = json.dumps(doc).encode()
    try:
        got = fmt.parse_index(data, "idx.json")
    except CheckpointFormatError as e:
        assert str(e).startswith("idx.json: ")
        return
    assert wrap and got == weight_map
    assert all("/" not in f and f not in ("", ".", "..") for f in got.values())


def _shard(directory: Path) -> None:
    header = b'{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"ab")


_CONFIGS = (_JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)
            | st.integers(1, 200).map(lambda d: b'{"a":' + b"[" * d + b"]" * d + b"}")
            | st.sampled_from([b"{\"a\": NaN}", b"{\"a\": Infinity}", b"\xef\xbb\xbf{}", b"{\"a\":1,\"a\":2}"]))


@PROPS
@given(config=_CONFIGS)
def test_config_json_is_an_object_or_a_format_error_naming_it(config: bytes) -> None:
    """Any config.json: the spec's config is the JSON object it holds (Python's NaN and
    Infinity allowed, as model configs written by Python hold them), or a
    CheckpointFormatError naming config.json."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _shard(root)
        (root / "config.json").write_bytes(config)
        try:
            spec = ModelSpec.from_dir(tmp, cache_dir=str(root / "cache"))
        except CheckpointFormatError as e:
            assert "config.json: " in str(e)
            return
        assert isinstance(spec.config, dict)
        assert json.dumps(spec.config, sort_keys=True) == json.dumps(json.loads(config), sort_keys=True)


_COMPONENT_NAMES = st.sampled_from(["unet", "vae", "scheduler", "_class_name", "../up", "a b", "",
                                    "9lives", "text_encoder", "__x"])
_ENTRIES = (st.tuples(st.sampled_from(["diffusers", "transformers", "os"]),
                      st.sampled_from(["UNet2DModel", "AutoencoderKL", "system"])).map(list)
            | st.just([None, None]) | _JSON)


@PROPS
@given(index=st.dictionaries(_COMPONENT_NAMES, _ENTRIES, max_size=5),
       folders=st.sets(st.sampled_from(["unet", "vae", "scheduler", "text_encoder"])),
       weights=st.booleans(), bad_component_config=st.booleans())
def test_model_index_json_is_a_pipeline_or_a_typed_error(
    index: dict[str, Any], folders: set[str], weights: bool, bad_component_config: bool
) -> None:
    """Any model_index.json, with any of its components' folders present: a pipeline spec
    whose components are exactly the listed [library, class] entries, or one typed
    nccl_back error (never a KeyError, TypeError or OSError)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model_index.json").write_text(json.dumps(index))
        for name in folders:
            (root / name).mkdir()
            (root / name / "config.json").write_bytes(b"[" if bad_component_config else b"{}")
            if weights:
                _shard(root / name)
        try:
            spec = ModelSpec.from_dir(tmp, cache_dir=str(root / "cache"))
        except NcclBackError:
            return
        listed = {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)
                  and len(v) == 2 and all(isinstance(x, str) for x in v)}
        assert set(spec.components) == listed and listed <= folders
