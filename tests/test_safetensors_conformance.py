"""Conformance: our header parser accepts exactly the files ``safetensors.safe_open`` opens.

Files are generated (hypothesis): every dtype the reference knows, zero-sized and scalar
tensors, names with non-ASCII and escaped characters, ``__metadata__`` variants, and one
mutation each from the rules of the format (overlapping, gapped, reversed, overflowing
offsets; shapes with ``-0``, floats, booleans, 2**64; unknown and repeated fields and
names; lone surrogates; whitespace around the JSON; deep nesting in an ignored field; a
wrong length field; bytes missing or left over). For each, both parsers run: the same
verdict, and for an accepted file the same tensors (name, dtype, shape) and metadata,
but for one rule of ours: a shape torch cannot hold (a dimension, contiguous stride or
element count over 2**63 - 1, as in ``[0, 2**63]``) is refused, though the reference
opens it. A refusal of ours is a CheckpointFormatError naming the file.

Then torch's view, against ``safetensors.torch.load_file``: generated files of every
dtype torch holds (FP4 ``F4`` often, with odd and even last dimensions) are loaded by
nccl_back's storage loader into a skeleton built from their headers; the same verdict,
and for a loaded file the same names, dtypes, shapes and bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nccl_back.errors import CheckpointFormatError
from nccl_back.model import safetensors_format as fmt
from nccl_back.model.checkpoint import DTYPES, PACKED, flat_skeleton, parse_header
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.skeleton import manifest, named_tensors

pytestmark = pytest.mark.timeout(300)

Pairs = list[tuple[str, str]]  # an object as (key, JSON text of the value), duplicates kept


def _obj(pairs: Pairs) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


def _reference(path: str) -> tuple[bool, dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    try:
        with safe_open(path, "np") as f:
            tensors = {}
            for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                s = f.get_slice(k)
                tensors[k] = (s.get_dtype(), tuple(s.get_shape()))
            return True, tensors, f.metadata() or {}
    except Exception:  # the reference raises SafetensorError and a few builtins
        return False, {}, {}


def _ours(blob: bytes, uri: str) -> tuple[bool, dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    try:
        rec = fmt.parse(blob, uri, len(blob))
    except CheckpointFormatError as e:
        assert str(e).startswith(uri + ":"), str(e)
        return False, {}, {}
    return True, {n: (t.dtype, t.shape) for n, t in rec.tensors.items()}, dict(rec.metadata)


_I64_MAX = 2**63 - 1


def _torch_holds(shape: tuple[int, ...]) -> bool:
    """torch.empty(shape) works: every size, contiguous stride and the element count are int64."""
    strides = [math.prod(max(d, 1) for d in shape[i + 1:]) for i in range(len(shape))]
    return max([*shape, *strides, math.prod(shape)], default=0) <= _I64_MAX


def _agree(blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.safetensors")
        Path(path).write_bytes(blob)
        theirs = _reference(path)
        if not all(_torch_holds(shape) for _, shape in theirs[1].values()):
            theirs = (False, {}, {})  # our one rule beyond the reference's
        ours = _ours(blob, path)
    assert ours == theirs, (blob[:300], ours, theirs)


# ------------------------------------------------------------------- the generator

_NAMES = st.text(st.characters(codec="utf-8"), max_size=6)
_SHAPES = st.lists(st.integers(0, 5), max_size=3)


@st.composite
def _tensors(draw: st.DrawFn) -> list[dict[str, Any]]:
    names = draw(st.lists(_NAMES, max_size=5, unique=True))
    out, offset = [], 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(fmt.DTYPE_BITS)))
        shape = draw(_SHAPES)
        nbytes = math.prod(shape) * fmt.DTYPE_BITS[dtype] // 8  # sub-byte remainders: invalid
        out.append({"name": name, "dtype": dtype, "shape": shape, "offsets": [offset, offset + nbytes]})
        offset += nbytes
    return out


def _entry_pairs(t: dict[str, Any]) -> Pairs:
    return [("dtype", json.dumps(t["dtype"])), ("shape", json.dumps(t["shape"])),
            ("data_offsets", json.dumps(t["offsets"]))]


Mutation = Callable[[list[dict[str, Any]], Pairs, st.DrawFn], None]


def _first(ts: list[dict[str, Any]]) -> dict[str, Any] | None:
    return ts[0] if ts else None


def _set_field(field: str, text: str) -> Mutation:
    def m(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
        if ts:
            ts[draw(st.integers(0, len(ts) - 1))].setdefault("raw", {})[field] = text
    return m


def _shift(which: int, delta: int) -> Mutation:
    def m(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
        if ts:
            t = ts[draw(st.integers(0, len(ts) - 1))]
            t["offsets"][which] = max(0, t["offsets"][which] + delta)
    return m


def _extra(text: str) -> Mutation:
    def m(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
        if ts:
            ts[draw(st.integers(0, len(ts) - 1))].setdefault("extra", []).append(("x", text))
    return m


def _top(key: str, text: str) -> Mutation:
    def m(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
        top.append((key, text))
    return m


def _repeat_tensor(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
    if ts:  # the same name again: the last counts (a HashMap), the tiling must still hold
        t = dict(ts[draw(st.integers(0, len(ts) - 1))])
        t["shape"] = draw(_SHAPES)
        ts.append(t)


def _repeat_field(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
    if ts:
        ts[0].setdefault("extra", []).append(("dtype", json.dumps(ts[0]["dtype"])))


def _drop_field(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
    if ts:
        ts[0]["drop"] = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))


def _rename(text: str) -> Mutation:
    def m(ts: list[dict[str, Any]], top: Pairs, draw: st.DrawFn) -> None:
        if ts:
            ts[0]["rawname"] = text
    return m


MUTATIONS: dict[str, Mutation | None] = {
    "none": None,
    "overlap": _shift(0, -1), "gap": _shift(0, 1), "short": _shift(1, -1), "long": _shift(1, 1),
    "reversed": lambda ts, top, draw: ts and ts[0]["offsets"].reverse(),
    "offsets-3": _set_field("data_offsets", "[0,0,0]"), "offsets-1": _set_field("data_offsets", "[0]"),
    "offsets-null": _set_field("data_offsets", "null"), "offsets-str": _set_field("data_offsets", '"0"'),
    "shape-minus-zero": _set_field("shape", "[-0]"), "shape-float": _set_field("shape", "[1.0]"),
    "shape-exp": _set_field("shape", "[1e0]"), "shape-bool": _set_field("shape", "[true]"),
    "shape-negative": _set_field("shape", "[-1]"), "shape-2**64": _set_field("shape", f"[{2**64},0]"),
    "shape-u64max-0": _set_field("shape", f"[{2**64 - 1},0]"), "shape-overflow-0": _set_field("shape", f"[{2**32},{2**32},0]"),
    "shape-zero-first": _set_field("shape", f"[0,{2**40},{2**40}]"), "shape-object": _set_field("shape", "{}"),
    "shape-0-2**63": _set_field("shape", f"[0,{2**63}]"), "shape-0-i64max": _set_field("shape", f"[0,{2**63 - 1}]"),
    "shape-stride-2**63": _set_field("shape", f"[0,2,{2**62}]"), "shape-2**62-2-0": _set_field("shape", f"[{2**62},2,0]"),
    "offsets-minus-zero": _set_field("data_offsets", "[-0,0]"), "offsets-float": _set_field("data_offsets", "[0.0,0]"),
    "dtype-lower": _set_field("dtype", '"f32"'), "dtype-unknown": _set_field("dtype", '"F8_E4M3FN"'),
    "dtype-int": _set_field("dtype", "1"),
    "extra-int": _extra("-1"), "extra-float": _extra("1.5"), "extra-minus-zero": _extra("-0"),
    "extra-nested": _extra('{"a":[1,{"b":null}]}'), "extra-surrogate": _extra('"\\ud800"'),
    "extra-pair": _extra('"\\ud83d\\ude00"'), "extra-nan": _extra("NaN"), "extra-inf": _extra("1e400"),
    "extra-bigint": _extra("9" * 400), "extra-deep-125": _extra("[" * 125 + "]" * 125),
    "extra-deep-126": _extra("[" * 126 + "]" * 126),
    "repeat-field": _repeat_field, "drop-field": _drop_field, "repeat-tensor": _repeat_tensor,
    "name-surrogate": _rename('"\\udc00x"'), "name-pair": _rename('"\\ud83d\\ude00"'),
    "name-escapes": _rename('"a\\/b\\u0041\\n"'), "name-control": _rename('"a\tb"'),
    "meta-null": _top("__metadata__", "null"), "meta-empty": _top("__metadata__", "{}"),
    "meta-strings": _top("__metadata__", '{"format":"pt","k":"v","k":"w"}'),
    "meta-list": _top("__metadata__", "[]"), "meta-string": _top("__metadata__", '"x"'),
    "meta-int-value": _top("__metadata__", '{"k":1}'), "meta-nested": _top("__metadata__", '{"k":{}}'),
    "meta-twice": lambda ts, top, draw: top.extend([("__metadata__", "{}"), ("__metadata__", "{}")]),
    "meta-surrogate": _top("__metadata__", '{"k":"\\ud800"}'),
    "tensor-null": _top("t-null", "null"), "tensor-string": _top("t-str", '"x"'),
    "tensor-list": _top("t-list", "[]"),
}

TEXT_EDITS: dict[str, Callable[[str], str]] = {
    "none": lambda s: s, "lead-space": lambda s: " " + s, "lead-tab-nl-cr": lambda s: "\t\n\r" + s,
    "lead-vt": lambda s: "\x0b" + s, "lead-nbsp": lambda s: "\u00a0" + s, "lead-bom": lambda s: "\ufeff" + s,
    "trail-spaces": lambda s: s + "        ", "trail-nul": lambda s: s + "\0", "trail-junk": lambda s: s + "x",
    "trail-object": lambda s: s + "{}", "top-list": lambda s: "[" + s + "]", "empty": lambda s: "",
}

FILE_EDITS = ["none", "data+1", "data-1", "length+1", "length-1", "length-limit", "tiny"]


def _build(ts: list[dict[str, Any]], top: Pairs, ensure_ascii: bool) -> str:
    pairs: Pairs = []
    for t in ts:
        fields = _entry_pairs(t)
        fields = [(k, t.get("raw", {}).get(k, v)) for k, v in fields if k != t.get("drop")]
        fields += t.get("extra", [])
        value = "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields) + "}"
        key = t.get("rawname") or json.dumps(t["name"], ensure_ascii=ensure_ascii)
        pairs.append((key, value))
    pairs += [(json.dumps(k), v) for k, v in top]
    return "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    ts = draw(_tensors())
    top: Pairs = []
    # Each kind of change half the time, so that many files break no rule or one.
    mutation = MUTATIONS[draw(st.one_of(st.just("none"), st.sampled_from(sorted(MUTATIONS))))]
    if mutation is not None:
        mutation(ts, top, draw)
    text = TEXT_EDITS[draw(st.one_of(st.just("none"), st.sampled_from(sorted(TEXT_EDITS))))](_build(ts, top, draw(st.booleans())))
    header = text.encode("utf-8", "surrogatepass")
    data_len = max((t["offsets"][1] for t in ts), default=0)
    data = bytes(draw(st.integers(0, 255)) for _ in range(1)) * data_len
    length = len(header)
    edit = draw(st.one_of(st.just("none"), st.sampled_from(FILE_EDITS)))
    if edit == "data+1":
        data += b"\0"
    elif edit == "data-1":
        data = data[:-1]
    elif edit == "length+1":
        length += 1
    elif edit == "length-1":
        length -= 1
    elif edit == "length-limit":
        length = fmt.MAX_HEADER_BYTES + 1
    elif edit == "tiny":
        return struct.pack("<Q", length)[: draw(st.integers(0, 7))]
    return struct.pack("<Q", max(0, length)) + header + data


@settings(max_examples=400, deadline=None)
@given(safetensors_files())
@example(b"")
def test_we_accept_exactly_what_the_reference_accepts(blob: bytes) -> None:
    """Generated files, valid and broken by one rule each: our verdict is the reference's,
    and so are the tensors (name, dtype, shape) and the metadata of an accepted file."""
    _agree(blob)


# ------------------------------------------------------------------- fixed cases

def _file(header: str | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


_E = '"dtype":"U8","shape":[2],"data_offsets":[0,2]'

# After the reference's own tests (safetensors lib.rs / bindings tests) and its rules.
FIXED = {
    "empty-object": _file("{}"),
    "whitespace-padded": _file('{"a":{' + _E + "}}" + " " * 6, b"xx"),
    "leading-whitespace": _file('   {"a":{' + _E + "}}", b"xx"),
    "zero-sized": _file('{"a":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]}}'),
    "two-zero-sized-one-shape": _file('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                                      '"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'),
    "scalar": _file('{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', bytes(4)),
    "json-attack": _file(_obj([(f"t{i}", '{"dtype":"F32","shape":[2],"data_offsets":[0,8]}') for i in range(10)]), bytes(8)),
    "invalid-info": _file('{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,4]}}', bytes(4)),
    "incomplete-buffer": _file('{"a":{' + _E + "}}", b"xxx"),
    "truncated": _file('{"a":{' + _E + "}}", b"x"),
    "not-utf8": _file(b'{"\xff":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'),
    "not-json": _file("{"),
    "header-too-large": _file("{}", length=100_000_001),
    "header-longer-than-file": _file("{}", length=3),
    "f4-even": _file('{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}', b"xx"),
    "f4-odd": _file('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', b"xx"),
    "f4-odd-last-dim": _file('{"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}', b"xxx"),
    "f4-scalar": _file('{"a":{"dtype":"F4","shape":[],"data_offsets":[0,0]}}'),
    "f6": _file('{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}', b"xxx"),
    "c64": _file('{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}', bytes(8)),
    "order-reversed": _file('{"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},'
                            '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"xx"),
    "metadata-only": _file('{"__metadata__":{"format":"pt"}}'),
    "metadata-null": _file('{"__metadata__":null}'),
    "metadata-not-a-map": _file('{"__metadata__":[]}'),
    "name-lone-surrogate": _file('{"\\ud800":{' + _E + "}}", b"xx"),
    "shape-minus-zero": _file('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
    "offsets-minus-zero": _file('{"a":{"dtype":"U8","shape":[0],"data_offsets":[-0,0]}}'),
    "depth-127": _file('{"a":{' + _E + ',"x":' + "[" * 125 + "]" * 125 + "}}", b"xx"),
    "depth-128": _file('{"a":{' + _E + ',"x":' + "[" * 126 + "]" * 126 + "}}", b"xx"),
    "shape-beyond-int64": _file(f'{{"a":{{"dtype":"F32","shape":[0,{2**63}],"data_offsets":[0,0]}}}}'),
    "stride-beyond-int64": _file(f'{{"a":{{"dtype":"U8","shape":[0,2,{2**62}],"data_offsets":[0,0]}}}}'),
    "shape-int64-max": _file(f'{{"a":{{"dtype":"U8","shape":[0,{2**63 - 1}],"data_offsets":[0,0]}}}}'),
}


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_cases_agree_with_the_reference(name: str) -> None:
    """The reference's own test cases and the edges of its rules: the same verdict."""
    _agree(FIXED[name])


def test_the_header_size_limit_is_the_references() -> None:
    """A header of exactly 100,000,000 bytes is accepted, one byte more refused, as by
    the reference (not our former 100 MiB)."""
    for n, ok in ((fmt.MAX_HEADER_BYTES, True), (fmt.MAX_HEADER_BYTES + 1, False)):
        blob = _file("{}" + " " * (n - 2))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "big.safetensors")
            Path(path).write_bytes(blob)
            assert _reference(path)[0] is ok
            assert _ours(blob, path)[0] is ok
        del blob


@pytest.mark.parametrize("dtype", sorted(fmt.DTYPE_BITS))
def test_every_reference_dtype_parses_and_maps_or_is_refused_by_name(dtype: str) -> None:
    """Every dtype the reference knows parses and maps to torch's, F4 as float4_e2m1fn_x2
    with its last dimension halved; one torch has no element type for (F6_*) is refused
    when its tensor is used, naming the tensor and the dtype."""
    bits = fmt.DTYPE_BITS[dtype]
    blob = _file(f'{{"w":{{"dtype":"{dtype}","shape":[8],"data_offsets":[0,{bits}]}}}}', bytes(bits))
    info = parse_header(blob, "x.safetensors", len(blob)).tensors["w"]
    if dtype in DTYPES:
        per = PACKED.get(dtype, 1)
        assert info.dtype.itemsize * 8 == bits * per and info.shape == (8 // per,)
    else:
        assert dtype in ("F6_E2M3", "F6_E3M2")
        with pytest.raises(CheckpointFormatError, match=rf"x\.safetensors: tensor 'w' has dtype {dtype}"):
            _ = info.dtype


@pytest.mark.parametrize("shape", [[2, 3], [0, 3], [5]])
def test_an_fp4_tensor_with_an_odd_last_dimension_is_refused_by_name(shape: list[int]) -> None:
    """An F4 header whose last dimension is odd is a valid header with no torch shape (the
    reference's load_file refuses it too): refused when used, naming tensor and shape."""
    nbytes = math.prod(shape) // 2
    blob = _file(f'{{"w":{{"dtype":"F4","shape":{shape},"data_offsets":[0,{nbytes}]}}}}', bytes(nbytes))
    if math.prod(shape) % 2:  # a half byte: the format itself refuses it
        with pytest.raises(CheckpointFormatError, match="not a whole number of bytes"):
            parse_header(blob, "x.safetensors", len(blob))
        return
    info = parse_header(blob, "x.safetensors", len(blob)).tensors["w"]
    with pytest.raises(CheckpointFormatError,
                       match=r"x\.safetensors: tensor 'w' has dtype F4: its last dimension must be"
                             r" a multiple of 2 .*got shape " + re.escape(str(shape))):
        _ = info.dtype


# ------------------------------------------------------------------- torch's view: load_file

#: F4 half the time, else any dtype torch holds.
_TORCH_DTYPES = st.one_of(st.just("F4"), st.sampled_from(sorted(DTYPES)))


@st.composite
def torch_files(draw: st.DrawFn) -> bytes:
    header, data = {}, b""
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(_TORCH_DTYPES)
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        bits = math.prod(shape) * fmt.DTYPE_BITS[dtype]
        blob = draw(st.binary(min_size=bits // 8, max_size=bits // 8))  # a half byte: invalid
        header[f"w{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    return _file(json.dumps(header), data)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _loaded_by_reference(path: str) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    try:
        loaded = load_file(path)
    except Exception:  # SafetensorError, and builtins for some refusals
        return None
    return {n: (str(t.dtype), tuple(t.shape), _raw(t)) for n, t in loaded.items()}


def _loaded_by_us(directory: str) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    path = os.path.join(directory, "model.safetensors")
    try:
        spec = ModelSpec.from_dir(directory, cache_dir=os.path.join(directory, "cache"))
        skeleton = flat_skeleton(spec)
        load_from_storage(skeleton, spec)
    except CheckpointFormatError as e:
        assert path in str(e), str(e)
        return None
    tensors, _ = named_tensors(skeleton)
    assert [e.dtype for e in manifest(skeleton).entries] == [
        str(tensors[e.name].dtype).removeprefix("torch.") for e in manifest(skeleton).entries]
    return {n: (str(t.dtype), tuple(t.shape), _raw(t)) for n, t in tensors.items()}


@settings(max_examples=120, deadline=None)
@given(torch_files())
@example(_file('{"w":{"dtype":"F4","shape":[3,8],"data_offsets":[0,12]}}', bytes(range(12))))
@example(_file('{"w":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}', b"abc"))
@example(_file('{"w":{"dtype":"F4","shape":[0,3],"data_offsets":[0,0]}}'))
@example(_file('{"w":{"dtype":"F4","shape":[4,0],"data_offsets":[0,0]}}'))
@example(_file(f'{{"w":{{"dtype":"F32","shape":[0,{2**63}],"data_offsets":[0,0]}}}}'))
@example(_file(f'{{"w":{{"dtype":"U8","shape":[0,2,{2**62}],"data_offsets":[0,0]}}}}'))
@example(_file(f'{{"w":{{"dtype":"U8","shape":[0,{2**63 - 1}],"data_offsets":[0,0]}}}}'))
def test_we_load_exactly_what_load_file_loads(blob: bytes) -> None:
    """Generated files (FP4 among every dtype torch holds): loaded by our storage loader
    into a skeleton built from the headers, the same verdict as ``load_file`` and, for a
    loaded file, the same names, dtypes, shapes and bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "model.safetensors").write_bytes(blob)
        Path(tmp, "config.json").write_text("{}")
        theirs = _loaded_by_reference(os.path.join(tmp, "model.safetensors"))
        ours = _loaded_by_us(tmp)
    assert ours == theirs, (blob[:300], ours, theirs)


def test_an_fp4_checkpoint_saved_by_safetensors_loads_byte_for_byte(tmp_path: Path) -> None:
    """A checkpoint saved by ``safetensors.torch.save_file`` with float4_e2m1fn_x2 tensors
    loads into a skeleton of that dtype (built from the headers, or the user's own) with
    load_file's shapes and bytes."""
    g = torch.Generator().manual_seed(0)
    saved = {"w": torch.randint(0, 256, (3, 4), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2),
             "scale": torch.rand(3, generator=g).to(torch.float8_e4m3fn)}
    save_file(saved, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    reference = load_file(str(tmp_path / "model.safetensors"))
    assert tuple(reference["w"].shape) == (3, 4)
    spec = ModelSpec.from_dir(str(tmp_path), cache_dir=str(tmp_path / "cache"))
    built = flat_skeleton(spec)
    assert {e.name: (e.shape, e.dtype) for e in manifest(built).entries}["w"] == ((3, 4), "float4_e2m1fn_x2")
    own = torch.nn.Module()
    own.register_buffer("w", torch.empty(3, 4, dtype=torch.float4_e2m1fn_x2))
    own.register_buffer("scale", torch.empty(3, dtype=torch.float8_e4m3fn))
    for model in (built, own):
        assert load_from_storage(model, spec).bytes == 12 + 3
        got, _ = named_tensors(model)
        assert {n: (t.dtype, tuple(t.shape), _raw(t)) for n, t in got.items()} == \
            {n: (t.dtype, tuple(t.shape), _raw(t)) for n, t in reference.items()}


@pytest.mark.parametrize("kind", ["string", "escapes", "tensors"])
def test_bounding_a_header_costs_little_memory(kind: str) -> None:
    """Parsing a 20 MB header (5 MB of tensor entries) allocates a small multiple of its size (the regex-based
    bound cost ~115 bytes per character of a string: 2.3 GiB)."""
    n = 20_000_000 if kind != "tensors" else 5_000_000  # tracemalloc slows many objects
    if kind == "string":
        header = b'{"__metadata__":{"k":"' + b"a" * n + b'"}}'
    elif kind == "escapes":
        header = b'{"__metadata__":{"k":"' + b"\\n" * (n // 2) + b'"}}'
    else:
        entry = b'"%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
        header = b"{" + b",".join(entry % i for i in range(n // 55)) + b"}"
    blob = _file(header)
    tracemalloc.start()
    try:
        fmt.parse(blob, "big.safetensors", len(blob))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The copies (bytes, str) and the parsed records; the string cases are ~3x the size.
    limit = 16 * len(header) if kind == "tensors" else 4 * len(header)
    assert peak < limit, f"{peak / len(header):.1f} bytes per header byte"
    print(f"{kind}: {peak / len(header):.1f} bytes per header byte")
