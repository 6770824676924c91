"""The ``nccl-back serve`` sidecar: load a model (peer first, storage as fallback), serve
it to peers and to local consumers until stopped, then drain.

Lifecycle, and what ``/readyz`` answers in each state::

    starting   503  health server bound: liveness answers during the (long) load
    loading    503  spec, skeleton, WeightService.load (a peer, else storage)
    ready      200  loaded, verified, published; hand-off socket open; ready line printed
    draining   503  SIGTERM/SIGINT or POST /drain: withdrawn from Redis (no new
                    transfers); in-flight sends get up to ``drain_timeout`` to finish
    closed          service, hand-off and health server closed; on a signal, exit 0

A signal that arrives during the load drains at once and waits for the load at most
``drain_timeout``. Whatever is still running then (a load, a send) is *abandoned*:
:attr:`Sidecar.abandoned` tells the process to exit without joining it, which closes
the sockets, so a receiver's transfer fails fast and it falls back to storage.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn, TextIO

import torch

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.registry import truth_for_mode
from nccl_back.errors import ConfigError, NcclBackError, RegistryError
from nccl_back.files import write_atomic
from nccl_back.load.service import WeightService
from nccl_back.log import get_logger
from nccl_back.metrics import Metrics
from nccl_back.model.checkpoint import flat_skeleton
from nccl_back.model.identity import ModelSpec
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import Model, build, manifest
from nccl_back.model.storage import forms, parse_uri
from nccl_back.result import LoadResult
from nccl_back.sidecar.drain import write_token_file
from nccl_back.sidecar.handoff import HandoffServer, arena
from nccl_back.sidecar.health import HealthServer
from nccl_back.timing import SIDECAR_STOP_POLL as _POLL

_log = get_logger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """What ``nccl-back serve`` was asked to do (beyond :class:`Settings`)."""

    model_uri: str
    """Checkpoint directory or storage URI (``gs://``, ``s3://``, ``az://``)."""
    device: torch.device
    factory: Callable[[], Model] | None = None
    """Builds the skeleton (under :func:`skeleton.build`); None: a flat one from the headers."""
    diffusers: bool = False
    """Build each component of a diffusers pipeline folder with diffusers
    (:func:`nccl_back.model.pipeline.pipeline_skeletons`); without it a pipeline folder
    gets a flat skeleton (one child per component) from the headers."""
    socket_path: str | None = None
    """Unix socket of the local hand-off server; None: no hand-off."""
    health_host: str = "127.0.0.1"
    health_port: int = 0
    drain_timeout: float | None = None
    """Bound on in-flight sends (and a running load) when draining; None: transfer_timeout."""
    ready_file: str | None = None
    """Written atomically (JSON) once ready, removed when draining starts."""
    drain_token_file: str | None = None
    """Where a fresh drain token is written (0600, private directory) at start; ``POST
    /drain`` then needs it. None: loopback clients drain without one."""


def resolve_factory(spec: str) -> Callable[[], Any]:
    """``"module:function"`` -> the callable (the current directory importable, as for
    ``python -m``); :class:`ConfigError` naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--factory {spec!r}: expected module:function (e.g. mypkg.models:build)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any error while importing user code is a bad --factory
        raise ConfigError(f"--factory {spec!r}: cannot import module {module_name!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--factory {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--factory {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def require_transformers() -> None:
    """:class:`ConfigError` unless the optional ``hf`` extra is installed."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError("--hf needs transformers: pip install 'nccl-back[hf]'") from e


def hf_factory(config: dict[str, Any]) -> Callable[[], Model]:
    """A factory for the Hugging Face causal LM that ``config`` (config.json) describes."""
    require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError("--hf: config.json has no model_type; it is not a transformers checkpoint")
    try:
        hf_config = AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--hf: transformers cannot read this config.json: {e}") from e
    # The checkpoint's dtype, or the skeleton would not match what is loaded into it.
    dtype = getattr(hf_config, "torch_dtype", None)
    return lambda: AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)


def check_local_model(uri: str) -> None:
    """A local ``--model`` must be an existing directory (remote ones are checked on use)."""
    loc = parse_uri(uri)
    if loc.is_local and not os.path.isdir(loc.path):
        raise ConfigError(
            f"--model {uri!r}: no such directory; give the checkpoint ({forms()})"
            " holding config.json and *.safetensors"
        )


class Sidecar:
    """One ``serve`` process: health server, weight service, hand-off server, drain;
    ``out`` receives the one ready line."""

    def __init__(
        self,
        settings: Settings,
        options: ServeOptions,
        *,
        metrics: Metrics | None = None,
        service: WeightService | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.metrics = metrics if metrics is not None else Metrics()
        self.service = service if service is not None else WeightService(
            settings, metrics=self.metrics, engine="sidecar")
        self._drain_token = secrets.token_urlsafe(32) if options.drain_token_file else None
        self.health = HealthServer(
            self.metrics,
            options.health_host,
            options.health_port,
            on_drain=self._drain,
            drain_token=self._drain_token,
        )
        self.handoff: HandoffServer | None = None
        self._hosted: arena.Arena | None = None
        self.result: LoadResult | None = None
        self.abandoned = False
        """True when a load or send outlived the drain bound: exit without joining it."""
        self.stop_signal: str | None = None
        """Name of the signal that stopped :meth:`run` (set by :func:`stop_on_signals`)."""
        self._out = out if out is not None else sys.stdout
        self._started = False
        self._draining = threading.Event()
        self._load_error: BaseException | None = None
        self._log = _log.bind(worker=self.service.worker_id)

    @property
    def drain_timeout(self) -> float:
        t = self.options.drain_timeout
        return self.settings.transfer_timeout if t is None else t

    @property
    def health_url(self) -> str:
        host = self.options.health_host
        # A wildcard bind is reachable on loopback; print an address a script can use.
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        return f"http://{shown}:{self.health.port}"

    def start(self) -> Sidecar:
        """Write the drain token file and bind the health port."""
        if self.options.drain_token_file is not None:
            try:
                write_token_file(self.options.drain_token_file, self._drain_token)
            except OSError as e:
                raise ConfigError(
                    f"cannot write the drain token to {self.options.drain_token_file}: {e}"
                ) from e
        self.health.start()
        self._started = True
        return self

    def load(self) -> LoadResult:
        """Build the skeleton, load (peer first), open the hand-off socket, become ready."""
        opts = self.options
        spec = ModelSpec.from_dir(opts.model_uri, settings=self.settings)
        log = self._log.bind(version=spec.version[:12])
        log.info("skeleton_building", device=str(opts.device), factory=opts.factory is not None)
        if opts.factory is not None:
            model = build(opts.factory, opts.device)
        elif opts.diffusers:
            if not spec.components:
                raise ConfigError(f"--diffusers: {opts.model_uri} has no model_index.json")
            from nccl_back.model.pipeline import pipeline_skeletons

            model = pipeline_skeletons(spec, device=opts.device)
        else:
            model = flat_skeleton(spec, opts.device, settings=self.settings)
        if opts.socket_path is not None and opts.device.type == "cpu":
            # In the hand-off's segment: loaded once into shared memory, served to peers
            # from it, mapped by consumers. A flat skeleton has no other buffers to keep.
            self._hosted = arena.host(model, keep_buffers=opts.factory is not None or opts.diffusers)
        result = self.service.load(model, spec)
        if opts.socket_path is not None:
            server = HandoffServer(model, spec.version, opts.socket_path,
                                   hashes=self._ground_truth(spec, model), hosted=self._hosted)
            self._hosted = None  # the hand-off server's now, unlinked by its close()
            self.handoff = server.start()
        self.result = result
        if self._draining.is_set():
            # The service published at the end of the load, after the drain withdrew.
            self.service.withdraw()
            return result
        if not self.service.peers:
            # Ready means published (or waiting for the heartbeat to publish). Without a
            # rendezvous (the service logged why) it serves locally but is no source.
            log.error("not_published", source=result.source,
                      hint="see the service's publish_failed / ground_truth_* events")
            return result
        self.health.set_ready(True)
        self._announce(result)
        return result

    def drain(self) -> None:
        """Stop taking transfers and wait (bounded) for in-flight ones; don't exit."""
        self.health.drain()

    def close(self) -> None:
        """Release everything; skips waiting on sends when :attr:`abandoned`."""
        if self.handoff is not None:
            self.handoff.close()
        arena.release(self._hosted)  # the load failed or was abandoned before the hand-off
        self._hosted = None
        if not self.abandoned:
            self.service.close()
        self.health.close()

    def run(self, stop: threading.Event | None = None) -> int:
        """Start, load and serve until ``stop`` is set or a signal arrives
        (:func:`stop_on_signals`); drain, close, return 0. A failed load raises (closed)."""
        stop = stop if stop is not None else threading.Event()
        if not self._started:
            self.start()
        loader = threading.Thread(target=self._load_thread, name="nccl-back-load", daemon=True)
        loader.start()
        while loader.is_alive() and not self._stop_requested(stop):
            stop.wait(_POLL)
        if not loader.is_alive() and self._load_error is not None:
            self.close()
            _reraise(self._load_error)
        while not self._stop_requested(stop):
            stop.wait(_POLL)
        self._log.info("stopping", signal=self.stop_signal, loaded=self.result is not None)
        self.drain()
        if loader.is_alive():
            loader.join(self.drain_timeout)
            if loader.is_alive():
                self._log.warning("load_abandoned", bound=self.drain_timeout)
                self.abandoned = True
        if self._load_error is not None:
            self._log.warning("load_failed_while_stopping", error=str(self._load_error))
        self.close()
        self._log.info("stopped", abandoned=self.abandoned)
        return 0

    def _stop_requested(self, stop: threading.Event) -> bool:
        return stop.is_set() or self.stop_signal is not None

    # -- internals ----------------------------------------------------------------------

    def _load_thread(self) -> None:
        try:
            self.load()
        except BaseException as e:  # handed to run(), which re-raises it in the main thread
            self._load_error = e

    def _drain(self) -> None:
        """``HealthServer``'s ``on_drain``: runs once, from POST /drain or a signal."""
        self._draining.set()
        if self.options.ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.options.ready_file)
        self.service.withdraw()
        deadline = _clock.monotonic() + self.drain_timeout
        while self.service.active_sends and _clock.monotonic() < deadline:
            _clock.sleep(_POLL)
        left = self.service.active_sends
        if left:
            self._log.warning("drain_timeout", active_sends=left, bound=self.drain_timeout)
            # NCCL communicators stop at once; a gloo wait ends at its own deadline.
            self.service.abort_sends()
            self.abandoned = True
        self._log.info("sends_drained", active_sends=left)

    def _ground_truth(self, spec: ModelSpec, model: Model) -> dict[str, str] | None:
        """The storage load's sampled hashes for local consumers to check against; None
        (the hand-off hashes the model) without a match, or with a secret (keyed hashes)."""
        if self.settings.key("integrity") is not None:
            return None
        try:
            stored = self.service.registry.get_ground_truth(spec.version, 0, 1, manifest(model).digest,
                                                            SCHEME)
        except RegistryError as e:
            self._log.warning("ground_truth_unavailable", error=str(e))
            return None
        return truth_for_mode(stored, "sampled") if stored is not None else None

    def _announce(self, result: LoadResult) -> None:
        info: dict[str, Any] = {
            "version": result.version,
            "source": result.source,
            "seconds": round(result.seconds, 3),
            "health": self.health_url,
        }
        if result.peer_id is not None:
            info["peer"] = result.peer_id
        if self.options.socket_path is not None:
            info["socket"] = self.options.socket_path
        if self.options.ready_file is not None:
            write_atomic(self.options.ready_file, json.dumps(info, indent=2) + "\n")
        self._out.write("ready " + " ".join(f"{k}={v}" for k, v in info.items()) + "\n")
        self._out.flush()
        self._log.info("ready", **info, fallback=result.fallback_reason)


@contextlib.contextmanager
def stop_on_signals(sidecar: Sidecar) -> Iterator[None]:
    """Within this block SIGTERM and SIGINT stop ``sidecar.run`` (main thread only).

    The handler only assigns: taking a lock (``Event.set``, a logger's) where it
    interrupts the main thread could deadlock."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        sidecar.stop_signal = signal.Signals(signum).name

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _reraise(error: BaseException) -> NoReturn:
    """Re-raise a load error, as an NcclBackError if foreign (the CLI reports one line)."""
    if isinstance(error, (NcclBackError, KeyboardInterrupt, SystemExit)):
        raise error
    raise NcclBackError(f"load failed: {error!r}") from error
