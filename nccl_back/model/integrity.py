"""Per-layer integrity hashes of a model's weights.

NCCL, gloo and shared memory move bytes without checksums, so the worker that loaded
from storage (ground truth) publishes one hash per *layer* and a worker that got its
weights any other way recomputes them and calls :func:`compare`.

A layer is a module path prefix (:func:`layer_of`): ``model.layers.3.mlp.up.weight``
belongs to ``model.layers.3``, ``model.embed.weight`` to ``model.embed``.

Two modes:

``sampled`` (default, a few ms per GiB)
    For each tensor, ``samples`` elements at indices that depend only on the tensor's
    name and element count, gathered with ``torch.take`` on the tensor's own device (no
    tensor is ever copied whole), and hashed. ``take`` reads a same-width integer view
    of the tensor (it has no kernel for float8, uint16/32/64 or complex32), so every
    dtype is sampled alike on every device. The indices come from SHAKE-128 of the
    name and count rather than from a ``torch.Generator``: the two sides may run
    different torch builds (a rolling upgrade, a CPU and a GPU image), and torch does
    not promise that ``randint`` streams stay the same across releases, whereas SHAKE
    is a fixed standard. Floating values (float64 down to float8) are converted to
    float16 before hashing, so a tensor whose values are exactly representable in
    float16 hashes the same in any wider floating dtype: a bfloat16 tensor and its
    float32 (or float16) upcast agree, and float32 values that differ only below
    float16 precision usually agree. Every NaN hashes as one canonical NaN (a CPU
    conversion keeps NaN payload bits that a GPU's drops). A float32 tensor and its
    bfloat16 *downcast* differ, as they should: the downcast lost information.
    Integer, bool and other non-floating tensors (and float8_e8m0fnu and float4,
    which float16 cannot hold) hash their raw sampled bytes, because float16 cannot
    represent large integers exactly.
    Catches corruption of more than a small fraction of a tensor (whole-buffer
    misplacement, zeroing, a shifted offset), not a single flipped element. It is a
    *corruption* check: without a key, anyone can compute the positions and change
    every other element.

``full``
    A checksum of every byte, computed with integer torch ops on the tensor's own
    device in chunks of 4 MiB through one reused buffer (fresh allocations would pay
    page faults on every chunk). The bytes are read as int64 words ``x_i`` (single
    bytes when the size is not a multiple of 8); each chunk contributes
    ``sum(w_i * x_i) mod 2**64`` with odd position weights ``w_i``, and the chunk sums
    are chained in order with an odd multiplier. An odd number is invertible modulo a
    power of two, so any single changed word changes the result; integer addition is
    associative, so CPU and GPU reductions agree bit for bit. Bytes are read through
    integer views, so every dtype (float8, bool, uint64, ...) is covered. Bit-exact:
    the dtypes on both sides must match (the manifest check guarantees it), and NaN
    payloads count. Unkeyed, it detects accidents, not an adversary: the weights are
    public, so changes can be built to cancel.

Keyed (``key=``, derived from ``Settings.secret``)
    With a key, the two sides share something an adversary lacks. The sample
    positions come from SHAKE-128 of the key, name and count, so they are secret:
    a copy that changes a fraction ``f`` of a tensor passes with probability
    ``(1 - f) ** samples``. The full checksum becomes a keyed universal hash, the
    multilinear hash of Lemire and Kaser ("Strongly universal string hashing is
    fast", 2014): the bytes are read as unsigned 32-bit words ``x_i`` (single bytes
    when the size is not a multiple of 4), each chunk of 2**19 words gives
    ``((m + sum(k_i * x_i)) mod 2**64) >> 32`` with 64-bit weights ``k_i`` and ``m``
    drawn from SHAKE-256 of the key, and the chunk values are kept in order. Any two
    different tensors collide with probability about ``2**-31`` over the key, so a
    payload built without the key passes with that probability per attempt. It runs
    on the tensor's device with the same int64 torch ops (wrapping multiplication and
    addition), so CPU and GPU agree bit for bit. In both modes the layer digest is a
    BLAKE2b keyed by the key, so what Redis holds reveals nothing about positions or
    weights.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from nccl_back.errors import ConfigError, WeightVerificationError
from nccl_back.log import get_logger
from nccl_back.model.skeleton import Model, named_tensors

HashMode = Literal["sampled", "full"]
T = TypeVar("T")

DEFAULT_SAMPLES = 100
#: Words per chunk in ``full`` mode (4 MiB of int64): small enough to stay in cache,
#: large enough to keep per-op overhead negligible (measured best of 2**17..2**20).
_CHUNK_WORDS = 1 << 19
#: Odd multiplier spreading position weights over 64 bits (PCG's LCG constant).
_WEIGHT_MUL = 0x5851F42D4C957F2D
#: Odd multiplier combining per-chunk sums in order (the 64-bit FNV prime).
_CHUNK_MUL = 0x100000001B3
_MASK64 = (1 << 64) - 1
_SHOW = 5

_log = get_logger(__name__)


def layer_of(name: str) -> str:
    """The layer a tensor name belongs to.

    The prefix up to and including the first purely numeric path component
    (``model.layers.3.mlp.up.weight`` -> ``model.layers.3``), otherwise the parent
    module path (``model.embed.weight`` -> ``model.embed``); a top-level name is its
    own layer.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


@functools.lru_cache(maxsize=8)
def _shake(key: bytes | None) -> Any:
    """SHAKE-128 state having absorbed the key (copied per use, absorbed once)."""
    # A length-prefixed key keeps the framing unambiguous; no key absorbs nothing.
    return hashlib.shake_128(b"" if key is None else len(key).to_bytes(2, "little") + key)


def sample_indices(
    name: str, numel: int, samples: int = DEFAULT_SAMPLES, key: bytes | None = None
) -> torch.Tensor:
    """The flat indices sampled from tensor ``name`` with ``numel`` elements (CPU, int64).

    A pure function of its arguments, identical on every machine; all indices when
    ``numel <= samples``. With a ``key`` they cannot be predicted without it.
    """
    return torch.from_numpy(sample_picks_of([(name, numel)], samples, key)[0])


def sample_picks_of(tensors: list[tuple[str, int]], samples: int,
                    key: bytes | None) -> list[np.ndarray]:
    """:func:`sample_indices` of each ``(name, numel)`` as numpy int64 arrays, the
    arithmetic done once for all (per-tensor numpy calls cost more than the hashing)."""
    base = _shake(key)
    digests: list[bytes] = []
    sizes: list[int] = []
    for name, numel in tensors:
        if numel > samples:
            stream = base.copy()
            stream.update(f"{name}\0{numel}".encode())
            digests.append(stream.digest(8 * samples))
            sizes.append(numel)
    # The modulo bias is below numel / 2**64: irrelevant for choosing samples.
    picks = iter(np.split((np.frombuffer(b"".join(digests), dtype="<u8")
                           % np.repeat(np.array(sizes, dtype=np.uint64), samples)).astype(np.int64),
                          np.arange(1, len(sizes)) * samples))
    return [next(picks) if numel > samples else np.arange(numel, dtype=np.int64)
            for _, numel in tensors]


def layer_hashes(
    model: Model,
    mode: HashMode = "sampled",
    samples: int = DEFAULT_SAMPLES,
    key: bytes | None = None,
) -> dict[str, str]:
    """``{layer: hex digest}`` over the model's canonical tensors (tied ones counted once).

    ``mode`` is ``"sampled"`` (``samples`` elements per tensor) or ``"full"`` (every
    byte); see the module docstring for what each catches and tolerates. ``key`` (16
    to 64 bytes, e.g. ``Settings.key("integrity")``) keys positions, checksum and
    digest; both sides must use the same one. A bad ``mode``, ``samples`` or ``key``
    raises :class:`ConfigError`.
    """
    if mode not in ("sampled", "full"):
        raise ConfigError(f"mode={mode!r}: choose 'sampled' or 'full'")
    if samples < 1:
        raise ConfigError(f"samples={samples!r}: must be at least 1")
    if key is not None and not 16 <= len(key) <= 64:
        raise ConfigError(f"key: {len(key)} bytes; use 16 to 64 (Settings.key gives 32)")
    tensors, _ = named_tensors(model)
    if mode == "sampled":
        payloads = _sampled_payloads(tensors, samples, key)
    else:
        payloads = _full_payloads(tensors) if key is None else _keyed_full_payloads(tensors, key)
    layers: dict[str, hashlib.blake2b] = {}
    for name in sorted(tensors):
        t = tensors[name]
        layer = layer_of(name)
        h = layers.get(layer)
        if h is None:
            h = layers[layer] = hashlib.blake2b(digest_size=16, key=key or b"")
        payload = payloads[name]
        # Length-prefixed framing, so no two different inputs concatenate alike.
        h.update(f"{name}\0{list(t.shape)}\0{len(payload)}\0".encode())
        h.update(payload)
    return {layer: h.hexdigest() for layer, h in layers.items()}


def compare(expected: Mapping[str, str], actual: Mapping[str, str]) -> None:
    """Raise :class:`WeightVerificationError` (``bad``: the layers) unless ``actual``
    equals ``expected``.

    The message names the mismatching, missing (expected only) and unexpected (actual
    only) layers: the first few of each and how many there are.
    """
    mismatching = sorted(k for k in expected.keys() & actual.keys() if expected[k] != actual[k])
    missing = sorted(expected.keys() - actual.keys())
    unexpected = sorted(actual.keys() - expected.keys())
    if not (mismatching or missing or unexpected):
        return
    parts = [
        f"{len(names)} {label} {_first(names)}"
        for label, names in (
            ("mismatching", mismatching),
            ("missing", missing),
            ("unexpected", unexpected),
        )
        if names
    ]
    message = f"integrity check failed over {len(expected)} layers: " + "; ".join(parts)
    _log.error(
        "integrity_mismatch",
        mismatching=len(mismatching),
        missing=len(missing),
        unexpected=len(unexpected),
        first=(mismatching or missing or unexpected)[0],
    )
    raise WeightVerificationError(message, set(mismatching) | set(missing) | set(unexpected))


def _first(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    more = f", ... (+{len(names) - _SHOW} more)" if len(names) > _SHOW else ""
    return f"[{shown}{more}]"


#: Integer dtype of each element width: samples are gathered through such a view (the
#: dtypes ``torch.take`` has kernels for everywhere), then read as their own dtype.
_WORD_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Floating dtypes hashed as float16: those that convert to it on CPU and GPU alike.
#: float8_e8m0fnu (powers of two up to 2**127) would overflow and float4 has no
#: conversion kernel: both hash their raw bytes.
_TO_HALF = frozenset(
    getattr(torch, name)
    for name in (
        "float16", "bfloat16", "float32", "float64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
)
#: The one NaN every NaN hashes as (conversions keep or drop payload and sign bits).
_HALF_NAN = 0x7E00


def _as_words(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype, int]:
    """``t`` as a same-width integer tensor (any strides, no copy), its element dtype
    as read back, and integer words per element of ``t`` (2 for complex: real pairs)."""
    t = t.detach()
    if t.is_complex():
        real = torch.view_as_real(t)
        return real.view(_WORD_DTYPE[real.element_size()]), real.dtype, 2
    return t.view(_WORD_DTYPE[t.element_size()]), t.dtype, 1


def _word_index(index: np.ndarray, per: int) -> np.ndarray:
    """Element indices as word indices when each element is ``per`` words."""
    if per == 1:
        return index
    return (index[:, None] * per + np.arange(per)).reshape(-1)


def _normalise(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sampled words of element dtype ``dtype`` as a flat byte tensor: float16 with one
    canonical NaN for the floating dtypes of ``_TO_HALF``, the raw bytes otherwise."""
    if dtype in _TO_HALF:
        values = words.view(dtype)
        if dtype == torch.float64:
            # Spelled out so that every device rounds twice the same way (via float32).
            values = values.to(torch.float32)
        half = values.to(torch.float16)
        words = half.view(torch.int16).masked_fill(torch.isnan(half), _HALF_NAN)
    return words.reshape(-1).view(torch.uint8)


def _sampled_payloads(
    tensors: Mapping[str, torch.Tensor], samples: int, key: bytes | None
) -> dict[str, bytes]:
    from nccl_back.model import fused_hash  # it builds on this module's helpers

    fused, left = fused_hash.sampled(tensors, samples, key)
    payloads, rest = _sampled_in_place({n: tensors[n] for n in left}, samples, key)
    payloads.update(fused)
    for device, names in _by_device({n: tensors[n] for n in rest}).items():
        picks = sample_picks_of([(n, tensors[n].numel()) for n in names], samples, key)
        index = [torch.from_numpy(_word_index(p, _as_words(tensors[n])[2]))
                 for n, p in zip(names, picks, strict=True)]
        # One host-to-device copy of all indices and one copy of all samples back, so a
        # GPU model costs two synchronisations rather than two per tensor.
        all_index = torch.cat(index).to(device)
        picked: list[torch.Tensor] = []
        for n, idx in zip(names, cut(all_index, [i.numel() for i in index]), strict=True):
            words, dtype, _ = _as_words(tensors[n])
            picked.append(_normalise(torch.take(words, idx), dtype))
        blob = torch.cat(picked).cpu().numpy() if picked else np.empty(0, np.uint8)
        for n, part in zip(names, cut(blob, [p.numel() for p in picked]), strict=True):
            payloads[n] = part.tobytes()
    return payloads


def _sampled_in_place(
    tensors: Mapping[str, torch.Tensor], samples: int, key: bytes | None
) -> tuple[dict[str, bytes], list[str]]:
    """Sampled payloads of tensors sharing one allocation, one ``torch.take`` per dtype.

    A consolidated skeleton (:func:`nccl_back.model.skeleton.consolidate`) keeps every tensor
    in one storage, so the samples of all tensors of a dtype are gathered by a single
    ``take`` over that storage, with each tensor's element offset added to its own
    indices: the same elements, and so the same bytes, as one ``take`` per tensor, at
    a fraction of the per-call cost. Returns the payloads and the names left for the
    per-tensor path (non-contiguous, complex, empty or misaligned tensors).
    """
    groups: dict[tuple[torch.device, torch.dtype, int], list[tuple[str, torch.Tensor, np.ndarray]]] = (
        defaultdict(list)
    )
    rest: list[str] = []
    taken: list[tuple[str, torch.Tensor, int]] = []
    for name, t in tensors.items():
        offset = t.data_ptr() - t.untyped_storage().data_ptr()
        if t.numel() and t.is_contiguous() and not t.is_complex() and offset % t.element_size() == 0:
            taken.append((name, t, offset // t.element_size()))
        else:
            rest.append(name)
    picks = sample_picks_of([(n, t.numel()) for n, t, _ in taken], samples, key)
    for (name, t, off), pick in zip(taken, picks, strict=True):
        groups[(t.device, t.dtype, t.untyped_storage().data_ptr())].append((name, t, pick + off))
    payloads: dict[str, bytes] = {}
    for (device, dtype, _), members in groups.items():
        index = [idx for _, _, idx in members]
        first = members[0][1]
        storage = first.untyped_storage()
        word = _WORD_DTYPE[first.element_size()]
        whole = torch.empty(0, dtype=word, device=device).set_(
            storage, 0, (storage.nbytes() // first.element_size(),), (1,)
        )
        flat_index = torch.from_numpy(np.concatenate(index)).to(device)
        blob = _normalise(torch.take(whole, flat_index), dtype).cpu().numpy().tobytes()
        width = len(blob) // len(flat_index)  # bytes per sample after normalising
        for (name, _, _), part in zip(members, cut(blob, [len(i) * width for i in index]),
                                      strict=True):
            payloads[name] = part
    return payloads, rest


def cut(seq: T, sizes: Iterable[int]) -> list[T]:
    """``seq`` (anything sliceable) cut into consecutive pieces of ``sizes``."""
    bounds = [0, *itertools.accumulate(sizes)]
    return [seq[a:b] for a, b in itertools.pairwise(bounds)]  # type: ignore[index]


def _by_device(tensors: Mapping[str, torch.Tensor]) -> dict[torch.device, list[str]]:
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for name, t in tensors.items():
        by_device[t.device].append(name)
    return by_device


def _host_sums(names: list[str], tensors: Mapping[str, torch.Tensor], size: int,
               weights: torch.Tensor, scratch: torch.Tensor) -> dict[str, list[int]]:
    """Each named tensor's :func:`_chunk_sums` over ``size``-byte words (one device),
    fused where :mod:`fused_hash` can, the rest in one device-to-host copy."""
    from nccl_back.model import fused_hash  # it builds on this module's helpers

    fused: dict[str, list[int]] = {}
    if names and fused_hash.usable(tensors[names[0]].device):
        fused, names = fused_hash.chunk_sums(names, tensors, size, weights)
    partials: list[torch.Tensor] = []
    counts: list[int] = []
    for n in names:
        sums = _chunk_sums(tensors[n], weights, scratch, size)
        partials.extend(sums)
        counts.append(len(sums))
    flat = torch.stack(partials).cpu().tolist() if partials else []
    fused.update(zip(names, cut(flat, counts), strict=True))
    return fused


def _full_payloads(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    payloads: dict[str, bytes] = {}
    for device, names in _by_device(tensors).items():
        longest = max((_word_count(tensors[n], 8) for n in names), default=0)
        weights = torch.arange(min(longest, _CHUNK_WORDS), dtype=torch.int64, device=device)
        weights = weights.mul_(_WEIGHT_MUL).bitwise_or_(1)  # wraps mod 2**64; odd
        scratch = torch.empty_like(weights)
        for n, sums in _host_sums(names, tensors, 8, weights, scratch).items():
            acc = 0
            for s in sums:
                acc = (acc * _CHUNK_MUL + (s & _MASK64)) & _MASK64
            payloads[n] = acc.to_bytes(8, "little")
    return payloads


def _word_count(t: torch.Tensor, size: int) -> int:
    nbytes = t.numel() * t.element_size()
    return nbytes // size if nbytes % size == 0 else nbytes


def _chunk_sums(t: torch.Tensor, weights: torch.Tensor, scratch: torch.Tensor,
                size: int) -> list[torch.Tensor]:
    """``sum(w_i * x_i) mod 2**64`` per chunk of the tensor's ``size``-byte words (8:
    int64 words; 4: unsigned 32-bit words; bytes when its byte count is not a multiple
    of ``size``), one 0-d int64 tensor per chunk, in order."""
    sums: list[torch.Tensor] = []
    for chunk, word in _word_chunks(t, size):
        n = chunk.numel() // word
        out = scratch[:n]
        if word == 8:
            torch.mul(chunk.view(torch.int64), weights[:n], out=out)
        else:
            if word == 4:
                # Sign-extended into int64, then masked: the word as an unsigned 32-bit value.
                out.copy_(chunk.view(torch.int32)).bitwise_and_(0xFFFFFFFF)
            else:
                out.copy_(chunk)
            out.mul_(weights[:n])
        sums.append(out.sum())  # int64 additions wrap mod 2**64, in any order
    return sums


def _word_chunks(t: torch.Tensor, size: int) -> Iterator[tuple[torch.Tensor, int]]:
    """The tensor's bytes in chunks of ``_CHUNK_WORDS`` words, each aligned for a view
    as ``size``-byte words, with the word size: ``size``, or 1 when the byte count is
    not a multiple of it (it depends on the count alone, so both sides read alike)."""
    # Non-contiguous tensors are copied once; state dict tensors practically never are.
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    word = size if flat.numel() % size == 0 else 1
    chunk_bytes = _CHUNK_WORDS * word
    for start in range(0, flat.numel(), chunk_bytes):
        chunk = flat[start : start + chunk_bytes]
        if word > 1 and chunk.storage_offset() % word:
            chunk = chunk.clone()  # a misaligned view cannot be read as wider words
        yield chunk, word


class _KeyedWeights:
    """SHAKE-256 weights of the keyed checksum, per key and device, grown on demand.

    SHAKE's output for a longer length starts with its output for a shorter one, so
    a cached prefix stays valid; a small model never pays for a full chunk's weights.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[bytes, torch.device], torch.Tensor] = {}

    def get(self, key: bytes, n: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            have = self._cache.get((key, device))
            if have is None or have.numel() < n + 1:
                stream = hashlib.shake_256(b"nccl_back/weights\0" + key).digest(8 * (n + 1))
                words = np.frombuffer(stream, dtype="<u8").view(np.int64)
                have = torch.from_numpy(words.copy()).to(device)
                if len(self._cache) >= 8:
                    self._cache.clear()  # keys rarely change; bound memory all the same
                self._cache[(key, device)] = have
            return have


_KEYED_WEIGHTS = _KeyedWeights()


def _keyed_full_payloads(tensors: Mapping[str, torch.Tensor], key: bytes) -> dict[str, bytes]:
    """Per tensor, the keyed multilinear hash of each chunk, 4 bytes each, in order."""
    payloads: dict[str, bytes] = {}
    for device, names in _by_device(tensors).items():
        longest = max((_word_count(tensors[n], 4) for n in names), default=0)
        n_weights = min(longest, _CHUNK_WORDS)
        stream = _KEYED_WEIGHTS.get(key, n_weights, device)
        # Word 0 of the stream is the additive key m; the weights k_i follow it.
        offset = int(stream[0].item()) & _MASK64 if stream.numel() else 0
        weights = stream[1 : n_weights + 1]
        scratch = torch.empty(n_weights, dtype=torch.int64, device=device)
        for n, sums in _host_sums(names, tensors, 4, weights, scratch).items():
            payloads[n] = b"".join((((s + offset) & _MASK64) >> 32).to_bytes(4, "little")
                                   for s in sums)
    return payloads
