"""Typed, bounded records of content read from Redis: ground truth, truth in checkpoint
coordinates, layouts, reshard groups and artifact sets.

As in :mod:`.records`, each parser returns the typed record or raises
:class:`~nccl_back.errors.UntrustedRecordError`; it also gets the parts of the key the
record was read at, so one describing another key (another version's truth, a layout
not hashing to its digest) is refused here, in one place.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nccl_back.config import MAX_ARTIFACT_BYTES
from nccl_back.coord import records
from nccl_back.errors import ArtifactError, UntrustedRecordError
from nccl_back.model import layout as layouts
from nccl_back.model.artifact_sets import ArtifactManifest, parse_manifest

if TYPE_CHECKING:
    from nccl_back.model.layout import Layout

#: Hex digits of one position MAC (:data:`nccl_back.model.position_truth.MAC_BYTES` x 2).
MAC_HEX = 8
#: A position nobody holds, in a stored MAC string.
ABSENT = "." * MAC_HEX
#: Positions of one checkpoint tensor a record may carry.
MAX_POSITIONS = 4096
#: Marginal entries (8 bytes each) of one record, over all its tensors.
MAX_MARGINALS = 8 << 20
_LAYER = 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MACS = re.compile(rf"(?:[0-9a-f]{{{MAC_HEX}}}|\.{{{MAC_HEX}}})*")
_HEXDIGEST = re.compile(r"[0-9a-f]{8,64}")

Macs = dict[str, list[str | None]]
"""Checkpoint tensor -> one hex MAC per sampled position (None: not held)."""
Marginals = dict[str, list[tuple[int, int, bytes]]]
"""Checkpoint tensor -> ``(dim, start, little-endian uint64 sums)`` runs
(:mod:`nccl_back.model.position_truth`)."""


#: Most factors in an artifact index record, and the longest name or value.
MAX_FACTORS = 32
MAX_FACTOR_CHARS = 200


# -- the records --------------------------------------------------------------------------


@dataclass(frozen=True)
class GroundTruth:
    """Layer hashes of a storage load of one skeleton flavour, under one scheme."""

    manifest_digest: str
    scheme: str
    hashes: dict[str, str]
    """``{"mode|layer": hex digest}`` (:func:`nccl_back.coord.truth.encode_truth`)."""


@dataclass(frozen=True)
class PositionTruth:
    """Truth in checkpoint coordinates that one rank of one layout holds."""

    layout: str
    scheme: str
    macs: Macs
    marginals: Marginals = field(default_factory=dict)
    """Per-index sums along a dim of each held range (``full`` mode only)."""


@dataclass(frozen=True)
class ArtifactSetRecord:
    """A published set: under which lookup key, served as which version, what it holds."""

    lookup: str
    version: str
    manifest: ArtifactManifest

    def to_json(self) -> dict[str, object]:
        return {"lookup": self.lookup, "version": self.version, "manifest": self.manifest.to_json()}


@dataclass(frozen=True)
class ArtifactIndex:
    """The newest set of one model: its lookup key and the factors it was derived from."""

    lookup: str
    factors: dict[str, str]


# -- their parsers ----------------------------------------------------------------------


def of_key(data: dict[str, Any], name: str, parts: Mapping[str, str], part: str, what: str) -> str:
    """Field ``name`` (a name or digest), which must equal the key's part ``part`` where
    the key names it: a record never describes another key than its own."""
    value = records.ident(data, name, what)
    if part in parts and value != parts[part]:
        raise UntrustedRecordError(f"{what}: {name} {value[:16]!r} under another key"
                                   f" (stored under {parts[part][:16]!r})")
    return value


def ground_truth(data: dict[str, Any], parts: Mapping[str, str]) -> GroundTruth:
    what = "ground truth"
    digest = of_key(data, "manifest_digest", parts, "manifest", what)
    hashes = data.get("hashes")
    if not isinstance(hashes, dict):
        raise UntrustedRecordError(f"{what}: hashes must be an object")
    for k, v in hashes.items():
        if len(k) > _LAYER or not isinstance(v, str) or not records.IDENT.fullmatch(v):
            raise UntrustedRecordError(f"{what}: hashes must map layer names to digests")
    return GroundTruth(digest, of_key(data, "scheme", parts, "scheme", what), dict(hashes))


def encode_macs(macs: Macs) -> dict[str, str]:
    return {name: "".join(ABSENT if m is None else m for m in ms) for name, ms in macs.items()}


def decode_macs(data: object, what: str = "position truth") -> Macs:
    if not isinstance(data, dict) or len(data) > layouts.MAX_TENSORS:
        raise UntrustedRecordError(f"{what}: macs must be a bounded object")
    out: Macs = {}
    # One regex pass (C speed) per tensor: a TP=1 receiver parses ~28 000 MACs for a
    # 24-layer model.
    for name, text in data.items():
        if not isinstance(name, str) or len(name) > 512 or not isinstance(text, str) \
                or len(text) > MAC_HEX * MAX_POSITIONS or not _MACS.fullmatch(text):
            raise UntrustedRecordError(f"{what}: bad MACs for {str(name)[:40]!r}")
        out[name] = [None if c == ABSENT else c for c in
                     (text[i:i + MAC_HEX] for i in range(0, len(text), MAC_HEX))]
    return out


def encode_marginals(marginals: Marginals) -> dict[str, list[list[Any]]]:
    return {name: [[d, s, base64.b64encode(b).decode()] for d, s, b in runs]
            for name, runs in marginals.items()}


def decode_marginals(data: object, what: str = "position truth") -> Marginals:
    if not isinstance(data, dict) or len(data) > layouts.MAX_TENSORS:
        raise UntrustedRecordError(f"{what}: marginals must be a bounded object")
    out: Marginals = {}
    total = 0
    for name, runs in data.items():
        if not isinstance(name, str) or len(name) > 512 or not isinstance(runs, list) \
                or len(runs) > layouts.MAX_PARTS:
            raise UntrustedRecordError(f"{what}: bad marginals for {str(name)[:40]!r}")
        got = []
        for run in runs:
            try:
                dim, start, text = run
                if not (isinstance(dim, int) and isinstance(start, int) and isinstance(text, str)
                        and 0 <= dim < layouts.MAX_DIMS and 0 <= start < layouts.MAX_EXTENT):
                    raise ValueError
                raw = base64.b64decode(text, validate=True)
            except (ValueError, TypeError, binascii.Error) as e:
                raise UntrustedRecordError(f"{what}: bad marginals for {name[:40]!r}") from e
            total += len(raw) // 8
            if len(raw) % 8 or total > MAX_MARGINALS:
                raise UntrustedRecordError(f"{what}: marginals for {name[:40]!r} out of bounds")
            got.append((dim, start, raw))
        out[name] = got
    return out


def position_truth(data: dict[str, Any], parts: Mapping[str, str]) -> PositionTruth:
    what = "position truth"
    return PositionTruth(of_key(data, "layout", parts, "layout", what),
                         of_key(data, "scheme", parts, "scheme", what),
                         decode_macs(data.get("macs"), what),
                         decode_marginals(data.get("marginals", {}), what))


def layout_record(data: dict[str, Any], parts: Mapping[str, str]) -> Layout:
    """A layout, hashing to the digest it is stored under."""
    text = data.get("layout")
    if not isinstance(text, str):
        raise UntrustedRecordError("layout record: layout must be a string")
    return layouts.parse(text, parts.get("layout"))


def group(data: dict[str, Any], parts: Mapping[str, str]) -> list[str]:
    """A reshard group's holder layouts: at most :data:`records.MAX_WORLD` layout digests
    (sha256, hex) joined by commas, hashing to the digest it is stored under."""
    text = data.get("group")
    if not isinstance(text, str) or len(text) > 65 * records.MAX_WORLD or not text.isascii():
        raise UntrustedRecordError("group record: group must be a bounded string")
    if "group" in parts and hashlib.sha256(text.encode()).hexdigest() != parts["group"]:
        raise UntrustedRecordError("group record: does not hash to its key")
    digests = text.split(",")
    if not all(_SHA256.fullmatch(d) for d in digests):
        raise UntrustedRecordError("group record: must list layout digests")
    return digests


def hex_token(value: object, what: str) -> str:
    if not isinstance(value, str) or not _HEXDIGEST.fullmatch(value):
        raise UntrustedRecordError(f"{what} must be 8 to 64 hex characters")
    return value


def artifact_set(data: dict[str, Any], parts: Mapping[str, str]) -> ArtifactSetRecord:
    lookup = hex_token(data.get("lookup"), "lookup")
    if "lookup" in parts and lookup != parts["lookup"]:
        raise UntrustedRecordError("an artifact set record of another lookup key")
    try:
        manifest = parse_manifest(data.get("manifest"), MAX_ARTIFACT_BYTES)
    except ArtifactError as e:
        raise UntrustedRecordError(str(e)) from e
    return ArtifactSetRecord(lookup, hex_token(data.get("version"), "version"), manifest)


def artifact_index(data: dict[str, Any]) -> ArtifactIndex:
    factors = data.get("factors")
    if not isinstance(factors, dict) or len(factors) > MAX_FACTORS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_FACTOR_CHARS
            and len(v) <= MAX_FACTOR_CHARS for k, v in factors.items()):
        raise UntrustedRecordError("factors must be a bounded object of strings")
    return ArtifactIndex(hex_token(data.get("lookup"), "lookup"), dict(factors))
