"""Skeletons and manifests.

A *skeleton* is a model whose tensors have the right shapes, dtypes and device but no
meaningful values yet: the containers that a storage load or a peer broadcast writes
into (NCCL allocates nothing). :func:`build` constructs one by running the model's own
constructor with weight initialisation switched off (:func:`no_init`), so
constructor-computed state such as a rotary ``inv_freq`` buffer is real while
parameters cost only their allocation.

A *manifest* is the ordered list of (name, shape, dtype) of every tensor that must be
transferred: the model's ``state_dict`` (persistent parameters and buffers), in sorted
name order, tied tensors listed once. Its digest lets two workers check, before any
data moves, that they would issue the same collectives in the same order.

A model is an ``nn.Module`` or a mapping of named sub-modules (a pipeline such as
``{"transformer": ..., "vae": ...}``); sub-module tensor names are prefixed with the
sub-module's name and a dot.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn

from nccl_back.errors import SkeletonError

Model: TypeAlias = "nn.Module | Mapping[str, nn.Module]"

#: In-place initialisers that :func:`no_init` turns into no-ops.
_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float16"`` -> ``torch.float16``; raises :class:`SkeletonError` for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SkeletonError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to transfer."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    """The ordered tensors of a model, and the names that alias (tie) to them."""

    entries: tuple[TensorEntry, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Tied names -> the canonical (listed) name they share storage with."""

    @property
    def digest(self) -> str:
        """MD5 hex of the canonical JSON of the entries: equal iff same names, shapes, dtypes."""
        payload = json.dumps(self.to_json()["entries"], separators=(",", ":"))
        return hashlib.md5(payload.encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def to_json(self) -> dict[str, Any]:
        return {
            "entries": [[e.name, list(e.shape), e.dtype] for e in self.entries],
            "aliases": dict(self.aliases),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        try:
            entries = tuple(
                TensorEntry(str(n), tuple(int(d) for d in s), str(t)) for n, s, t in data["entries"]
            )
            aliases = {str(k): str(v) for k, v in dict(data.get("aliases", {})).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise SkeletonError(f"malformed manifest JSON: {e}") from e
        return cls(entries, aliases)

    def diff(self, other: Manifest) -> str:
        """A short human-readable description of how ``other`` differs from this manifest."""
        mine = {e.name: e for e in self.entries}
        theirs = {e.name: e for e in other.entries}
        parts: list[str] = []
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        if missing:
            parts.append(f"missing {missing[:5]}")
        if extra:
            parts.append(f"unexpected {extra[:5]}")
        for name in sorted(set(mine) & set(theirs)):
            a, b = mine[name], theirs[name]
            if a != b:
                parts.append(f"{name}: {list(a.shape)} {a.dtype} vs {list(b.shape)} {b.dtype}")
                if len(parts) >= 8:
                    break
        return "; ".join(parts) or "identical"


def _iter_modules(model: Model) -> Iterator[tuple[str, nn.Module]]:
    if isinstance(model, nn.Module):
        yield "", model
    elif isinstance(model, Mapping):
        for key in sorted(model):
            sub = model[key]
            if not isinstance(sub, nn.Module):
                raise SkeletonError(
                    f"model[{key!r}] is a {type(sub).__name__}, expected an nn.Module"
                )
            if not key or "." in key:
                raise SkeletonError(f"sub-module name {key!r} must be non-empty and without '.'")
            yield key + ".", sub
    else:
        raise SkeletonError(
            f"model is a {type(model).__name__}; expected an nn.Module or a mapping of them"
        )


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def named_tensors(model: Model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to transfer, in sorted name order, and the aliases of tied ones.

    Returns ``(tensors, aliases)``: ``tensors`` maps each canonical name (the first, in
    sorted order, of the names sharing one storage) to the live tensor (``.data`` of a
    parameter, so in-place writes don't touch autograd); ``aliases`` maps every other
    name of a tied tensor to its canonical name.
    """
    everything: dict[str, torch.Tensor] = {}
    identity: dict[str, int] = {}
    for prefix, module in _iter_modules(model):
        for name, t in module.state_dict(keep_vars=True).items():
            # ``.data`` is a new object each time: tie meta tensors by the original's id.
            identity[prefix + name] = id(t)
            everything[prefix + name] = t.data if isinstance(t, nn.Parameter) else t
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(everything):
        t = everything[name]
        # A zero-element tensor holds no bytes, so its address says nothing (two empty
        # buffers of one shape share it): only the same object is the same tensor.
        key = (("id", identity[name]) if t.device.type == "meta" or t.numel() == 0
               else _storage_key(t))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t
    return tensors, aliases


def manifest(model: Model) -> Manifest:
    """The model's :class:`Manifest` (sorted names, tied tensors once)."""
    tensors, aliases = named_tensors(model)
    entries = tuple(
        TensorEntry(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()
    )
    return Manifest(entries, aliases)


def model_device(model: Model) -> torch.device:
    """The single device all of the model's tensors live on (``SkeletonError`` if several)."""
    tensors, _ = named_tensors(model)
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise SkeletonError(f"model spans several devices {sorted(map(str, devices))}; expected one")
    return devices.pop() if devices else torch.device("cpu")


class _ThreadPatch:
    """Attributes of shared objects (``nn.init``'s initialisers, ``nn.Module``'s
    ``register_parameter``) replaced while any thread is inside :meth:`active`, the
    replacements acting only in the threads that are. The attributes are process-wide:
    two blocks that each saved and restored "the original" could otherwise leave them
    replaced for good, in every thread (every later module made on ``meta``, or never
    initialised)."""

    def __init__(self, targets: Callable[[], dict[tuple[Any, str], Callable[..., Any]]]) -> None:
        self._targets = targets
        """``(owner, name) -> what the call does inside a block``, given the original."""
        self._lock = threading.Lock()
        self._users = 0
        self._local = threading.local()
        self._saved: dict[tuple[Any, str], Any] = {}

    def _inside(self) -> bool:
        return bool(getattr(self._local, "depth", 0))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                for (owner, name), inside in self._targets().items():
                    original = getattr(owner, name)
                    self._saved[(owner, name)] = original
                    setattr(owner, name, self._switch(original, inside))
            self._users += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for (owner, name), original in self._saved.items():
                        setattr(owner, name, original)
                    self._saved.clear()

    def _switch(self, original: Callable[..., Any], inside: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return inside(original, *args, **kwargs) if self._inside() else original(*args, **kwargs)
        return call


def _skip_init(original: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


_NO_INIT = _ThreadPatch(lambda: {(nn.init, f): _skip_init for f in _INIT_FUNCTIONS if hasattr(nn.init, f)})


def no_init() -> contextlib.AbstractContextManager[None]:
    """Within this block, this thread's ``torch.nn.init`` initialisers and
    ``reset_parameters`` do nothing (other threads' are untouched): parameters are
    containers to be filled, while buffers a constructor computes with ordinary tensor
    ops (``inv_freq``, masks), which no checkpoint carries, are computed as usual."""
    return _NO_INIT.active()


#: The one alignment, in bytes, of every layout nccl_back makes: tensors of a
#: consolidated skeleton, slots inside a broadcast bucket and the sidecar's hand-off
#: arena all start at multiples of it. One value, so a consolidated skeleton is already
#: laid out as its buckets travel and as the arena maps it (no repacking); 64 bytes
#: hold any dtype's alignment and a cache line.
ALIGN = 64


def flat_layout(man: Manifest) -> tuple[dict[str, int], int]:
    """Byte offset of each manifest entry in a consolidated buffer, and its total size."""
    offsets: dict[str, int] = {}
    end = 0
    for e in man.entries:
        start = -(-end // ALIGN) * ALIGN
        offsets[e.name] = start
        end = start + e.nbytes
    return offsets, end


def consolidate(model: Model) -> Model:
    """Re-home every tensor of a skeleton into views of one ``ALIGN``-ed allocation, in
    manifest order, so a transfer between two consolidated skeletons moves large
    contiguous ranges in place: close to one flat broadcast. Parameter values are *not*
    copied (a skeleton holds none yet), buffer values are; tied tensors stay tied;
    non-persistent buffers are left as they are. Parameters on the ``meta`` device
    (:func:`build` makes them so) get their first real storage here: the model is
    allocated once, never twice.
    """
    tensors, _ = named_tensors(model)
    devices = {t.device for t in tensors.values() if t.device.type != "meta"}
    if len(devices) > 1:
        raise SkeletonError(f"model spans several devices {sorted(map(str, devices))}; expected one")
    return _rehome(model, devices.pop() if devices else torch.device("cpu"))


def consolidate_into(model: Model, flat: torch.Tensor, *, keep_buffers: bool = True) -> Model:
    """:func:`consolidate` into ``flat``, a given uint8 tensor of at least
    :func:`flat_layout`'s total bytes (a shared-memory segment, say), so the skeleton
    is allocated where its bytes will live and never copied there afterwards.

    ``keep_buffers=False`` skips copying buffer values: for a skeleton whose buffers
    are all checkpoint tensors (one built from headers), so no value is worth a copy.
    Raises :class:`SkeletonError` if ``flat`` is too small or not a flat uint8 tensor.
    """
    _, total = flat_layout(manifest(model))
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise SkeletonError(f"consolidate_into needs a flat contiguous uint8 tensor, got {flat.dtype}")
    if flat.numel() < total:
        raise SkeletonError(f"consolidate_into: {flat.numel()} bytes given, the model needs {total}")
    return _rehome(model, flat.device, flat=flat, keep_buffers=keep_buffers)


def _rehome(model: Model, device: torch.device, *, flat: torch.Tensor | None = None,
            keep_buffers: bool = True) -> Model:
    man = manifest(model)
    if not man.entries:
        return model
    offsets, total = flat_layout(man)
    if flat is None:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    views: dict[str, torch.Tensor] = {}
    for e in man.entries:
        off = offsets[e.name]
        views[e.name] = flat[off : off + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)
    # A tied parameter is one object registered under several names: replace it once.
    replaced: dict[int, nn.Parameter] = {}
    for prefix, root in _iter_modules(model):
        for mod_name, mod in root.named_modules(remove_duplicate=False):
            base = prefix + (mod_name + "." if mod_name else "")
            for pname, param in mod._parameters.items():
                if param is None:
                    continue
                name = man.aliases.get(base + pname, base + pname)
                if name not in views:
                    continue
                if param.device.type != "meta":
                    param.data = views[name]
                    continue
                if id(param) not in replaced:
                    replaced[id(param)] = _parameter_like(param, views[name])
                mod._parameters[pname] = replaced[id(param)]
            for bname, buf in mod._buffers.items():
                if buf is not None and bname not in mod._non_persistent_buffers_set:
                    name = man.aliases.get(base + bname, base + bname)
                    if name in views and views[name] is not buf:
                        if keep_buffers and buf.device.type != "meta":
                            # Constructor-computed values (cheap to keep) stay valid.
                            views[name].copy_(buf)
                        mod._buffers[bname] = views[name]
    return model


def _parameter_like(like: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter like ``like`` (class, ``requires_grad``, attributes) holding ``data``.

    ``.data`` cannot be swapped between the meta device and a real one, so the parameter
    object is replaced; engines hang attributes (``weight_loader``) on theirs.
    """
    try:
        new = type(like)(data, requires_grad=like.requires_grad)
    except Exception:  # a subclass with its own constructor: a plain Parameter will do
        new = nn.Parameter(data, requires_grad=like.requires_grad)
    new.__dict__.update(like.__dict__)
    return new


def _on_meta(original: Callable[..., Any], module: nn.Module, name: str,
             param: nn.Parameter | None) -> None:
    original(module, name, param)
    if param is not None and param.device.type != "meta":
        module._parameters[name] = _parameter_like(param, param.data.to("meta"))


_PATCH = _ThreadPatch(lambda: {(nn.Module, "register_parameter"): _on_meta})


def params_on_meta() -> contextlib.AbstractContextManager[None]:
    """Within this block, every parameter this thread registers is moved to the ``meta``
    device (other threads' modules are left alone): constructors still run on the real
    device, so buffers they compute are real, and building costs at most one parameter
    of device memory until :func:`consolidate` allocates the whole model once."""
    return _PATCH.active()


def build(
    factory: Callable[[], Model], device: str | torch.device = "cpu", *, flat: bool = True
) -> Model:
    """Construct a skeleton: ``factory()`` on ``device`` with weight initialisation skipped.

    ``factory`` builds the model (or mapping of sub-modules) exactly as the worker
    would, minus any checkpoint loading (pass your own ``skip_checkpoint=True``-style
    flag inside it). With ``flat`` (the default) parameters are on ``meta`` while the
    factory runs (:func:`params_on_meta`) and then laid out in one allocation
    (:func:`consolidate`), so a model that fills most of a GPU can still be built.
    Raises :class:`SkeletonError` if the result has tensors on another device, or on
    ``meta`` after the layout.
    """
    dev = torch.device(device)
    meta = params_on_meta() if flat else contextlib.nullcontext()
    try:
        with no_init(), dev, meta:
            model = factory()
    except SkeletonError:
        raise
    except Exception as e:
        raise SkeletonError(f"skeleton factory {getattr(factory, '__name__', factory)!r} failed: {e}") from e
    if flat:
        tensors, _ = named_tensors(model)
        _check_devices(tensors, dev, allow_meta=True)
        if tensors:
            model = _rehome(model, dev if dev.index is not None or dev.type == "cpu"
                            else _real_device(tensors, dev))
    tensors, _ = named_tensors(model)
    _check_devices(tensors, dev, allow_meta=False)
    return model


def _real_device(tensors: Mapping[str, torch.Tensor], dev: torch.device) -> torch.device:
    """``cuda`` without an index: the index the factory's real tensors got, else current."""
    for t in tensors.values():
        if t.device.type == dev.type:
            return t.device
    return torch.device(dev.type, torch.cuda.current_device()) if dev.type == "cuda" else dev


def _check_devices(tensors: Mapping[str, torch.Tensor], dev: torch.device, *, allow_meta: bool) -> None:
    for name, t in tensors.items():
        if t.device.type == "meta":
            if allow_meta:
                continue
            raise SkeletonError(f"{name} is on the meta device; a skeleton needs real storage")
        if t.device != dev and not (dev.type == t.device.type and dev.index is None):
            raise SkeletonError(f"{name} is on {t.device}, expected {dev}")
