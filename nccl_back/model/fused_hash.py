"""The integrity hashes of a GPU model in a few launches (Triton), bit-identical to the
torch path of :mod:`nccl_back.model.integrity`.

The torch path costs a handful of kernel launches per tensor and, in ``full`` mode,
writes each product to memory and reads it back to sum it: on one H200 it ran at
100-270 GB/s where a device-to-device copy ran at ~2,100 GB/s. Here:

``full``
    One launch for every tensor of a device: each program sums ``sum(w_i * x_i)``
    over one piece of a chunk (each word read once, the weights computed in the
    kernel or, keyed, read from the key's weights, which stay in cache), and the
    pieces' partial sums are added per chunk on the host. Integer addition wraps mod
    2**64 in any order, so the chunk sums are the torch path's, bit for bit.
``sampled``
    One gather launch per dtype over the raw addresses of every tensor's samples, then
    the dtype's normalisation (:func:`integrity._normalise`) once over all of them.

Used for CUDA tensors where Triton imports (torch's CUDA builds ship it), and for CPU
tensors under ``TRITON_INTERPRET=1``, Triton's interpreter: how the tests run these
very kernels on a machine without a GPU. Tensors a kernel cannot read as words
(non-contiguous, misaligned, a byte count that is not a whole number of words) are
left to the torch path. If Triton is missing or a launch fails, the torch path does
everything (logged once): slower, never a different hash.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from types import ModuleType

import numpy as np
import torch

from nccl_back.log import get_logger
from nccl_back.model import integrity

_log = get_logger(__name__)

#: Words per program: a divisor of the chunk, so no piece straddles two chunks.
_PIECE = 1 << 15
_BLOCK = 1024
_GATHER_BLOCK = 1024
_failed: list[str] = []


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        from nccl_back.model import _hash_kernels
    except Exception as e:  # missing, or a broken install: the torch path is exact too
        _log.info("fused hashes unavailable; torch path", reason=f"{type(e).__name__}: {e}")
        return None
    return _hash_kernels


def _interpreted(kernels: ModuleType) -> bool:
    return type(kernels.gather).__name__ == "InterpretedFunction"


def usable(device: torch.device) -> bool:
    """Whether the fused kernels hash tensors on ``device`` now. On a GPU, not before
    they are compiled: the first call starts that in the background (see
    :func:`prepare`) and answers False until it is done."""
    if _failed or device.type not in ("cuda", "cpu"):
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    kernels = _kernels()
    # Compiled kernels take device addresses; interpreted ones, host addresses.
    if kernels is None or _interpreted(kernels) != (device.type == "cpu"):
        return False
    return device.type == "cpu" or prepare(device).is_set()


#: Per GPU, set once every kernel variant is compiled (Triton compiles at first launch,
#: seconds on a cold cache: a load never waits for it, the torch path hashes meanwhile).
_compiled: dict[torch.device, threading.Event] = {}
_compiled_lock = threading.Lock()


def prepare(device: torch.device) -> threading.Event:
    """Compile the kernels for ``device`` (a GPU) in the background, once: call it when
    a load starts, so that they are ready by the time its weights are checked. The
    event is set when they are (or when compiling failed: then :func:`usable` is False)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
    with _compiled_lock:
        done = _compiled.get(device)
        if done is None:
            done = _compiled[device] = threading.Event()
            threading.Thread(target=_compile, args=(device, done), daemon=True,
                             name="nccl-back-hash-kernels").start()
    return done


def _compile(device: torch.device, done: threading.Event) -> None:
    """Launch every variant once on a few words, on a stream of its own."""
    start = time.monotonic()
    try:
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            probe = {"w8": torch.zeros(8, dtype=torch.int64, device=device),
                     "w4": torch.zeros(8, dtype=torch.int32, device=device)}
            weights = torch.ones(1 << 10, dtype=torch.int64, device=device)
            for word in (8, 4):
                chunk_sums(["w8" if word == 8 else "w4"], probe, word, weights, compiling=True)
            for width, dtype in ((1, torch.int8), (2, torch.int16), (4, torch.int32), (8, torch.int64)):
                t = torch.zeros(4, dtype=dtype, device=device)
                _gather(device, dtype, integrity._WORD_DTYPE[width],
                        np.array([t.data_ptr()], dtype=np.int64))
            torch.cuda.current_stream(device).synchronize()
        _log.info("fused hash kernels compiled", device=str(device),
                  seconds=round(time.monotonic() - start, 2))
    except Exception as e:
        _give_up(e)
    finally:
        done.set()


def _give_up(e: Exception) -> None:
    _failed.append(f"{type(e).__name__}: {e}")
    _log.warning("fused hash launch failed; the torch path hashes from now on",
                 reason=_failed[0])


def _readable(t: torch.Tensor, word: int) -> bool:
    nbytes = t.numel() * t.element_size()
    return t.is_contiguous() and nbytes % word == 0 and t.data_ptr() % word == 0


def chunk_sums(names: list[str], tensors: Mapping[str, torch.Tensor], word: int,
               weights: torch.Tensor, *, compiling: bool = False
               ) -> tuple[dict[str, list[int]], list[str]]:
    """``integrity._chunk_sums`` of every named tensor (one device) it can read as
    ``word``-byte words (8: plain; 4: keyed, ``weights`` the key's), as unsigned
    ints, in one launch; and the names left for the torch path. ``compiling``: a
    failure raises (:func:`_compile` records it)."""
    picked = [n for n in names if _readable(tensors[n], word)]
    taken = set(picked)
    rest = [n for n in names if n not in taken]
    if not picked:
        return {}, rest
    device = tensors[picked[0]].device
    words = np.array([tensors[n].numel() * tensors[n].element_size() // word for n in picked],
                     dtype=np.int64)
    base = np.array([tensors[n].data_ptr() for n in picked], dtype=np.int64)
    pieces = -(-words // _PIECE)
    chunks = -(-words // integrity._CHUNK_WORDS)
    owner = np.repeat(np.arange(len(picked)), pieces)
    start = (np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * _PIECE
    table = np.stack([base[owner] + start * word, np.minimum(_PIECE, words[owner] - start),
                      start % integrity._CHUNK_WORDS])
    out: dict[str, list[int]] = {n: [] for n in picked}
    if table.shape[1]:
        try:
            args = torch.from_numpy(table).to(device)
            partial = torch.empty(table.shape[1], dtype=torch.int64, device=device)
            with _on(device):
                _kernels().weighted_sums[(table.shape[1],)](  # type: ignore[union-attr]
                    args[0], args[1], args[2], weights, partial, WORD=word, KEYED=word == 4,
                    MUL=integrity._WEIGHT_MUL, BLOCK=_BLOCK)
            sums = partial.cpu().numpy().view(np.uint64)
        except Exception as e:
            if compiling:
                raise
            _give_up(e)
            return {}, names
        # Pieces are in chunk order; a chunk's pieces are added (wrapping) into its sum.
        chunk_of = (np.repeat(np.cumsum(chunks) - chunks, pieces)
                    + start // integrity._CHUNK_WORDS)
        firsts = np.flatnonzero(np.r_[True, chunk_of[1:] != chunk_of[:-1]])
        per_chunk = np.add.reduceat(sums, firsts).tolist()
        out.update(zip(picked, integrity.cut(per_chunk, chunks.tolist()), strict=True))
    return out, rest


def sampled(tensors: Mapping[str, torch.Tensor], samples: int,
            key: bytes | None) -> tuple[dict[str, bytes], list[str]]:
    """``integrity``'s sampled payloads of the contiguous tensors on a device this
    module hashes; and the names left for the torch path."""
    # Per (device, dtype): names, base addresses, word indices; numpy once per group.
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[str], list[int], list[np.ndarray]]] = (
        defaultdict(lambda: ([], [], [])))
    rest: list[str] = []
    payloads: dict[str, bytes] = {}
    fused: dict[torch.device, bool] = {}
    mine: list[str] = []
    for name, t in tensors.items():
        on = fused.get(t.device)
        if on is None:
            on = fused[t.device] = usable(t.device)
        (mine if on and t.is_contiguous() else rest).append(name)
    picks = integrity.sample_picks_of([(n, tensors[n].numel()) for n in mine], samples, key)
    for name, pick in zip(mine, picks, strict=True):
        words, dtype, per = integrity._as_words(tensors[name])
        index = integrity._word_index(pick, per)
        if index.size == 0:
            payloads[name] = b""
            continue
        names, bases, indices = groups[(words.device, dtype)]
        names.append(name)
        bases.append(words.data_ptr())
        indices.append(index)
    for (device, dtype), (names, bases, indices) in groups.items():
        counts = np.array([len(i) for i in indices])
        word = integrity._WORD_DTYPE[dtype.itemsize]
        addresses = np.repeat(np.array(bases, dtype=np.int64), counts) + np.concatenate(indices) * word.itemsize
        try:
            got = _gather(device, dtype, word, addresses)
        except Exception as e:
            _give_up(e)
            return {}, list(tensors)
        step = len(got) // len(addresses)  # bytes per normalised sample
        payloads.update(zip(names, integrity.cut(got, [c * step for c in counts.tolist()]),
                            strict=True))
    return payloads, rest


def _gather(device: torch.device, dtype: torch.dtype, word: torch.dtype,
            addresses: np.ndarray) -> bytes:
    """The normalised samples of element dtype ``dtype`` read as ``word`` at
    ``addresses``, as bytes."""
    where = torch.from_numpy(addresses).to(device)
    words = torch.empty(where.numel(), dtype=word, device=device)
    with _on(device):
        _kernels().gather[(-(-where.numel() // _GATHER_BLOCK),)](  # type: ignore[union-attr]
            where, words, where.numel(), WIDTH=words.element_size(), BLOCK=_GATHER_BLOCK)
    return integrity._normalise(words, dtype).cpu().numpy().tobytes()


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launches on ``device``'s GPU: Triton launches on the current one, and the
    addresses are ``device``'s (a process may drive several GPUs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
