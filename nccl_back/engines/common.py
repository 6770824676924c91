"""What every engine adapter needs, and the :class:`EngineAdapter` protocol.

An adapter's module (``nccl_back.engines.{name}``, the only one importing the engine)
implements :class:`EngineAdapter`, registers it (:func:`register_engine`) and hooks into
the engine's plug-in point (vLLM: ``--load-format nccl_back``). The hook builds the model
as the engine does, calls :func:`load_weights` with the adapter (:func:`engine_adapter`),
the settings (:func:`settings_from`) and the model, and after the engine's
post-processing calls :meth:`EngineLoad.check_served_state`. An engine whose every rank
is described (:meth:`EngineAdapter.describe`) shares one version with other parallel
layouts of the same content and reshards from them (:mod:`nccl_back.load.reshard`).
Everything else lives here; this module never imports an engine.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import importlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from torch import nn

from nccl_back import _clock
from nccl_back.config import ENV_PREFIX, Settings, retired_error
from nccl_back.coord import consensus
from nccl_back.errors import (
    ConfigError,
    LayoutMismatchError,
    NcclBackError,
    WeightLoadError,
    fallback_reason,
)
from nccl_back.load.service import WeightService
from nccl_back.model.checkpoint import buffer_module, model_headers
from nccl_back.model.identity import ModelSpec
from nccl_back.model.layout import TensorLayout
from nccl_back.model.loader import StorageLoader
from nccl_back.model.sharding import Sharding, sharding
from nccl_back.model.skeleton import Model, named_tensors
from nccl_back.model.storage import Storage
from nccl_back.result import LoadResult

#: The load format's name in every engine (``--load-format nccl_back``).
LOAD_FORMAT = "nccl_back"
#: What travels (part of the identity): the module as the engine's checkpoint load
#: leaves it, before the engine's post-processing.
STAGE = "loaded"


class EngineAdapter(Protocol):
    """One engine's side of a load (see the module docstring)."""

    name: str
    """Registry key, part of the identity and of the worker's label (``vllm``)."""
    title: str
    """How messages name the engine (``vLLM``)."""
    version: str
    log: logging.Logger
    """The engine's logger: the load's outcome goes there."""

    def checkpoint_dir(self) -> str:
        """The checkpoint folder the engine loads (must be local: the identity reads it)."""
        ...

    def layout(self) -> dict[str, Any]:
        """The engine's own identity fields (dtype, quantization, parallel sizes...): what
        besides the checkpoint changes the tensors this rank loads (:func:`jsonable` values)."""
        ...

    def default_load(self, model: nn.Module) -> None:
        """Fill ``model`` with the engine's own loader (the storage path)."""
        ...

    def group(self) -> Any:
        """The ``torch.distributed`` group of the engine's ranks (a CPU/gloo group)."""
        ...

    parallel_fields: tuple[str, ...]
    """The :meth:`layout` fields a description replaces (they then leave the identity)."""

    def describe(self, model: nn.Module,
                 checkpoint: Sequence[str]) -> Mapping[str, TensorLayout | None]:
        """Each tensor ``model`` serves as pieces of the named ``checkpoint`` tensors (None:
        an engine-made constant); :class:`~nccl_back.model.layout.LayoutError` if it cannot."""
        ...


A = TypeVar("A", bound=type)

_ENGINES: dict[str, Callable[..., EngineAdapter]] = {}


def register_engine(name: str) -> Callable[[A], A]:
    """Class decorator: register an :class:`EngineAdapter` implementation as ``name``."""

    def add(cls: A) -> A:
        _ENGINES[name] = cls
        return cls

    return add


def engine_adapter(name: str) -> Callable[..., EngineAdapter]:
    """The adapter class registered as ``name``, importing ``nccl_back.engines.{name}``
    (and so the engine) on first use."""
    if name not in _ENGINES:
        if not name.isidentifier():
            raise ConfigError(f"engine {name!r}: not an adapter name")
        try:
            importlib.import_module(f"nccl_back.engines.{name}")
        except ModuleNotFoundError as e:
            raise ConfigError(f"engine {name!r}: no adapter, or its engine is not installed ({e})") from e
    if name not in _ENGINES:
        raise ConfigError(f"engine {name!r}: nccl_back.engines.{name} registers no adapter")
    return _ENGINES[name]


# -- settings and identity ---------------------------------------------------------------


def settings_from(extra: Any, *, source: str = "model_loader_extra_config") -> Settings:
    """Settings from ``NCCL_BACK_*`` with the engine's extra config ``extra`` (field names
    to JSON scalars, parsed like the variables) on top; a :class:`ConfigError` names
    ``source`` and the key."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"{source} for load format {LOAD_FORMAT!r} must be a JSON object,"
            f" got {type(extra).__name__}"
        )
    retired_error(extra, f"{source}[{{name!r}}]")
    fields = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(extra) - fields)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {unknown} for load format"
            f" {LOAD_FORMAT!r}; valid keys: {', '.join(sorted(fields))}"
        )
    text: dict[str, str] = {}
    for key, value in extra.items():
        if isinstance(value, bool):
            text[ENV_PREFIX + key.upper()] = "true" if value else "false"
        elif isinstance(value, (int, float, str)):
            text[ENV_PREFIX + key.upper()] = str(value)
        else:
            raise ConfigError(
                f"{source}[{key!r}]={value!r}: expected a string, number or boolean"
            )
    try:
        # The extra values alone, through the same parser and checks as the environment.
        parsed = Settings.from_env(environ=text)
        return Settings.from_env(**{k: getattr(parsed, k) for k in extra})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON (keys sorted, anything else by its ``repr``): engine
    configs hold objects whose identity must not depend on their type."""
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def engine_layout(engine: str, version: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The layout identity: the engine, its version, what travels, and its ``fields``."""
    return {"engine": engine, f"{engine}_version": version, "stage": STAGE, **fields}


def engine_spec(checkpoint: ModelSpec, layout: Mapping[str, Any]) -> ModelSpec:
    """The checkpoint's identity extended by the engine layout (same shards)."""
    return ModelSpec({"checkpoint": dict(checkpoint.config), "engine": dict(layout)},
                     checkpoint.shards)


def checkpoint_spec(adapter: EngineAdapter, settings: Settings) -> ModelSpec:
    """The content identity of ``adapter``'s checkpoint; :class:`ConfigError` unless it
    is a local folder."""
    path = adapter.checkpoint_dir()
    if not os.path.isdir(path):
        raise ConfigError(
            f"model {path!r} is not a local directory; the content identity needs the"
            " checkpoint files (download it first)"
        )
    return ModelSpec.from_dir(path, cache_dir=settings.cache_dir)


def adapter_spec(adapter: EngineAdapter, checkpoint: ModelSpec, *, described: bool) -> ModelSpec:
    """The identity of what ``adapter``'s rank loads; when ``described``, without the
    fields the description replaces, so engines of other parallel layouts share it."""
    fields = adapter.layout()
    if described:
        fields = {k: v for k, v in fields.items() if k not in adapter.parallel_fields}
        fields["layout"] = "described"
    return engine_spec(checkpoint, engine_layout(adapter.name, adapter.version, fields))


def engine_sharding(adapter: EngineAdapter, settings: Settings, model: nn.Module,
                    state: nn.Module, checkpoint: ModelSpec) -> Sharding | None:
    """This rank's :class:`Sharding` when every rank's layout is described, else None
    (logged once per rank with the reason, ``layout_mismatch``): all ranks reshard, or
    none does, so they share one identity."""
    why: BaseException | None = None
    found: Sharding | None = None
    try:
        names = sorted(n for h in model_headers(Storage(settings), checkpoint) for n in h.tensors)
        described = adapter.describe(model, names)
        found = sharding(state, checkpoint, {n: t for n, t in described.items() if t is not None},
                         settings, own={n for n, t in described.items() if t is None})
    except Exception as e:  # an adapter that fails to describe must not fail the load
        why = e
    if consensus.agree(found is not None, adapter.group()):
        return found
    error = LayoutMismatchError(str(why) if why is not None else "another rank's layout"
                                " cannot be described")
    adapter.log.info("nccl_back: this engine does not reshard (%s: %s); it loads from peers"
                     " of its own parallel layout or from storage", fallback_reason(error), error)
    return None


# -- the served state --------------------------------------------------------------------


def loaded_state(model: nn.Module) -> nn.Module:
    """A module holding ``model``'s persistent tensors under the same names, as the
    checkpoint load leaves them whatever post-processing later does to ``model``."""
    tensors, aliases = named_tensors(model)
    return buffer_module([*tensors.items(), *((a, tensors[c]) for a, c in aliases.items())])


def rebind(state: nn.Module, model: nn.Module, title: str) -> None:
    """Make ``state`` hold what ``model`` holds after a load that replaced tensors."""
    held, _ = named_tensors(state)
    now, aliases = named_tensors(model)
    for name, t in held.items():
        src = now.get(name, now.get(aliases.get(name, ""), None))
        if src is None or src.data_ptr() == t.data_ptr():
            continue
        if src.shape != t.shape or src.dtype != t.dtype:
            raise WeightLoadError(
                f"{title}'s loader replaced {name} with {list(src.shape)} {src.dtype},"
                f" built as {list(t.shape)} {t.dtype}"
            )
        t.copy_(src)


@dataclasses.dataclass
class EngineLoad:
    """A finished peer-or-storage load: the service now serving ``state``."""

    service: WeightService
    result: LoadResult
    state: nn.Module
    truth: dict[str, str] | None
    """The Verifier's fingerprint of ``state`` right after the load (None: no check)."""

    def check_served_state(self, log: logging.Logger, post_processing: str) -> None:
        """Stop serving if ``post_processing`` (the engine's step after the load) rewrote
        a served tensor in place."""
        if self.truth is None:
            return
        after = self.service.verifier.fingerprint(self.state, "sampled")  # cheap: a rewrite shows
        changed = sorted(k for k in self.truth if after.get(k) != self.truth[k])
        if changed:
            log.error("nccl_back: %s rewrote loaded tensors in place (%s); this engine"
                      " serves no other engine", post_processing, changed[:5])
            self.service.withdraw()


#: Services of this process, kept open (serving) until the process exits.
_SERVICES: list[WeightService] = []


def _close_at_exit(service: WeightService) -> None:
    service.close()
    # Without this, the interpreter's own final collection ran past vLLM's 5 s shutdown
    # grace and the worker was killed; this one takes about 0.6 s.
    gc.collect()


def withdraw_all() -> int:
    """Withdraw every service this process serves (an engine's shutdown has begun; they
    still close at exit). How many were serving."""
    for service in _SERVICES:
        with contextlib.suppress(Exception):  # shutting down: nothing left to tell
            service.withdraw()
    return len(_SERVICES)


def _storage_loader(adapter: EngineAdapter, model: nn.Module) -> StorageLoader:
    def load(state: Model, spec: ModelSpec, settings: Settings) -> LoadResult:
        # The engine's own loader, as without nccl_back: its name mapping, fusing,
        # sharding and its check that every parameter was filled.
        start = _clock.perf()
        adapter.default_load(model)
        if not isinstance(state, nn.Module):
            raise WeightLoadError("the loaded state must be a module")
        rebind(state, model, adapter.title)
        seconds = _clock.perf() - start
        nbytes = sum(t.nbytes for t in named_tensors(state)[0].values())
        return LoadResult("storage", spec.version, nbytes, seconds,
                          timings={f"{adapter.name}_default_loader": seconds}, storage_bytes=nbytes)

    return load


def load_weights(adapter: EngineAdapter, settings: Settings, model: nn.Module) -> EngineLoad | None:
    """Fill ``model`` (as the engine built it) from a peer, or from storage through the
    engine's loader; None when nccl_back cannot take part (the engine's loader ran)."""
    log = adapter.log
    started = _clock.perf()
    try:
        checkpoint = checkpoint_spec(adapter, settings)
    except NcclBackError as e:
        log.warning("nccl_back: no peer loading (%s); using %s's default loader", e, adapter.title)
        adapter.default_load(model)
        return None
    state = loaded_state(model)
    meta = [n for n, t in named_tensors(state)[0].items() if t.device.type == "meta"]
    if meta:
        # Online quantization builds on the meta device and fills layer by layer.
        log.warning("nccl_back: %d tensors on the meta device (e.g. %s); using %s's"
                    " default loader", len(meta), meta[0], adapter.title)
        adapter.default_load(model)
        return None
    sharded = engine_sharding(adapter, settings, model, state, checkpoint)
    spec = adapter_spec(adapter, checkpoint, described=sharded is not None)
    identity_s = _clock.perf() - started
    service = WeightService(settings, storage_loader=_storage_loader(adapter, model),
                            engine=f"{adapter.name}-{adapter.version}")
    try:
        result = service.load(state, spec, adapter.group(), sharding=sharded)
    except BaseException:
        service.close()
        raise
    truth = None
    if settings.verify != "none" and service.peers:
        truth = service.verifier.fingerprint(state, "sampled")
    # Serve until the process exits, then withdraw from the registry and close.
    _SERVICES.append(service)
    atexit.register(_close_at_exit, service)
    log_outcome(log, result, identity_s)
    return EngineLoad(service, result, state, truth)


# -- logs --------------------------------------------------------------------------------


def log_outcome(log: logging.Logger, result: LoadResult, identity_s: float) -> None:
    """One line in the engine's log: where the weights came from, how fast, each phase;
    INFO for a peer load or a version's first engine (no peer held it yet), WARNING for
    any other storage load (a fallback)."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in {"identity": identity_s,
                                                   **result.timings}.items())
    why, reason, level = result.fallback_reason, "", logging.INFO
    if result.source != "peer" and why is not None:
        if why.startswith("no_peer:"):
            reason = f"; first engine of this version, it will serve the next ones ({why})"
        else:
            reason, level = f"; fallback: {why}", logging.WARNING
    log.log(level, "nccl_back: loaded version %s from %s%s: %.1f MB in %.3f s (%.2f GB/s)"
            " [%s]%s", result.version[:12], result.source,
            f" {result.peer_id}" if result.peer_id else "", result.bytes / 1e6,
            result.seconds, result.gbps, phases, reason)


class ToEngineLog(logging.Handler):
    """Hands the library's warnings and errors to the engine's logger, so they appear
    where the engine's own do; lower levels stay with the application's configuration."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__(logging.WARNING)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if self.target.isEnabledFor(record.levelno):
            self.target.handle(record)


def route_library_logs(target: logging.Logger) -> None:
    """Install :class:`ToEngineLog` to ``target`` once per process (hooks run repeatedly)."""
    root = logging.getLogger("nccl_back")
    if not any(isinstance(h, ToEngineLog) and h.target is target for h in root.handlers):
        root.addHandler(ToEngineLog(target))
