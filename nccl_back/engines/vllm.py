"""vLLM adapter: the ``nccl_back`` load format.

Installing nccl-back registers it through vLLM's ``vllm.general_plugins`` entry point
(:func:`register`, which vLLM calls in every process it starts), so this works with
nothing but an install::

    NCCL_BACK_REDIS_URL=redis://... vllm serve /models/llama --load-format nccl_back

Settings come from ``NCCL_BACK_*`` and ``--model-loader-extra-config`` (JSON; its
keys are :class:`~nccl_back.config.Settings` fields and win over the environment). An
unknown key or a bad value raises :class:`ConfigError` when vLLM builds the loader,
before any weight is read.

**What travels.** vLLM's model is built exactly as for ``--load-format auto``
(``create_model``: vLLM's own module on the target device, no checkpoint read), and
its tensors are filled either from a peer engine or by vLLM's ``DefaultModelLoader``
(then the engine's hashes become the ground truth). What moves between engines is
the module as vLLM's checkpoint load leaves it, in the engine's own layout: fused
(``qkv_proj``, ``gate_up_proj``), sharded by tensor-parallel rank, in the engine's
dtype. Afterwards vLLM's ``process_weights_after_loading`` runs on both paths, as
after any load. Why not its output: on the CPU build that step packs every linear
weight into a oneDNN handle and leaves a zero-size parameter behind, so the final
state is not a set of tensors that can be sent. A sender keeps the loaded tensors
alive (on CUDA, unquantized, processing leaves them in place: no extra memory); if
processing rewrote one in place, the sender detects it and stops serving.

**Identity.** The version is the checkpoint's content identity plus everything that
changes these tensors (:func:`engine_layout`): vLLM version, architecture, dtype,
quantization, tensor-parallel size and rank, pipeline size and rank, expert
parallelism, KV-cache dtype, revision and ``hf_overrides``. Engines with different
layouts never exchange weights.

**Ranks.** Each vLLM worker process is one rank; consensus, election and fallback run
over the engine's world group (gloo ``cpu_group``): every rank loads from a peer, or
every rank loads from storage. After its load an engine serves its weights in the
background while it answers requests, and leaves the registry when it exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import vllm
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_world_group,
)
from vllm.model_executor.model_loader import (
    BaseModelLoader,
    DefaultModelLoader,
    register_model_loader,
)

from nccl_back.config import ENV_PREFIX, Settings
from nccl_back.errors import ConfigError, NcclBackError, WeightLoadError
from nccl_back.load.service import WeightService
from nccl_back.model import integrity
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import Model, named_tensors
from nccl_back.result import LoadResult

__all__ = ["LOAD_FORMAT", "NcclBackModelLoader", "engine_layout", "register", "settings_from"]

LOAD_FORMAT = "nccl_back"
#: What travels (part of the identity): the module as vLLM's checkpoint load leaves it.
STAGE = "loaded"

# A child of vLLM's logger, so the outcome shows in vLLM's own output; nothing here
# configures logging.
log = logging.getLogger("vllm.nccl_back")


class _ToEngineLog(logging.Handler):
    """Hands the library's own warnings and errors (``nccl_back.*``: ``no_secret``,
    ``record_rejected``, ``publish_failed`` ...) to vLLM's logger, so they appear where
    the engine's own do, at their level; below WARNING they stay with the application's
    logging configuration, as for any embedding."""

    def emit(self, record: logging.LogRecord) -> None:
        if log.isEnabledFor(record.levelno):
            log.handle(record)


def _route_library_logs() -> None:
    """Install :class:`_ToEngineLog` once per process (vLLM calls ``register`` in each)."""
    root = logging.getLogger("nccl_back")
    if not any(isinstance(h, _ToEngineLog) for h in root.handlers):
        root.addHandler(_ToEngineLog(logging.WARNING))

#: Services of this process, kept open (serving) until the process exits.
_SERVICES: list[WeightService] = []


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``nccl_back`` load format.

    vLLM calls it in every process it starts; registering twice is harmless.
    """
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not NcclBackModelLoader:
        register_model_loader(LOAD_FORMAT)(NcclBackModelLoader)
    _route_library_logs()


def _outcome(result: LoadResult) -> tuple[str, int]:
    """The summary's tail and level: a peer load, or the first engine of a version (no
    live peer held it: nothing went wrong, it downloads and serves the next ones), is
    INFO; any other storage load is a fallback that an operator should see (WARNING)."""
    why = result.fallback_reason
    if result.source == "peer" or why is None:
        return "", logging.INFO
    if why.startswith("no_peer:"):
        return (f"; first engine of this version, it will serve the next ones ({why})",
                logging.INFO)
    return f"; fallback: {why}", logging.WARNING


def settings_from(extra: Any) -> Settings:
    """Settings from ``NCCL_BACK_*`` with ``model_loader_extra_config`` on top.

    Keys are :class:`Settings` field names; values are JSON scalars, parsed like the
    environment variables. Raises :class:`ConfigError` naming the key for an unknown
    key, a non-scalar or a bad value.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"model_loader_extra_config for load format {LOAD_FORMAT!r} must be a JSON object,"
            f" got {type(extra).__name__}"
        )
    fields = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(extra) - fields)
    if unknown:
        raise ConfigError(
            f"model_loader_extra_config: unknown key(s) {unknown} for load format"
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
                f"model_loader_extra_config[{key!r}]={value!r}: expected a string, number or boolean"
            )
    try:
        # The extra values alone, through the same parser and checks as the environment.
        parsed = Settings.from_env(environ=text)
        return Settings.from_env(**{k: getattr(parsed, k) for k in extra})
    except ConfigError as e:
        raise ConfigError(f"model_loader_extra_config: {e}") from e


def engine_layout(vllm_config: VllmConfig, model_config: ModelConfig) -> dict[str, Any]:
    """Everything besides the checkpoint that changes the tensors this rank loads."""
    pp = get_pp_group()
    load_device = vllm_config.load_config.device or vllm_config.device_config.device
    overrides = json.loads(json.dumps(model_config.hf_overrides, sort_keys=True, default=repr))
    return {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "stage": STAGE,
        "device": torch.device(load_device).type,
        "architectures": list(model_config.architectures or []),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "quantization": model_config.quantization,
        "tp_size": get_tensor_model_parallel_world_size(),
        "tp_rank": get_tensor_model_parallel_rank(),
        "pp_size": pp.world_size,
        "pp_rank": pp.rank_in_group,
        "expert_parallel": bool(vllm_config.parallel_config.enable_expert_parallel),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "revision": model_config.revision,
        "hf_overrides": overrides,
    }


def engine_spec(checkpoint: ModelSpec, layout: Mapping[str, Any]) -> ModelSpec:
    """The checkpoint's identity extended by the engine layout (same shards)."""
    return ModelSpec({"checkpoint": dict(checkpoint.config), "engine": dict(layout)},
                     checkpoint.shards)


def loaded_state(model: nn.Module) -> nn.Module:
    """A module holding ``model``'s persistent tensors under the same names.

    It keeps the tensors as vLLM's checkpoint load leaves them, whatever
    ``process_weights_after_loading`` later does to ``model``'s attributes, so the
    weight service receives into and serves exactly that state.
    """
    tensors, aliases = named_tensors(model)
    root = nn.Module()
    for name, t in [*tensors.items(), *((a, tensors[c]) for a, c in aliases.items())]:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_buffer(leaf, t)
    return root


def _rebind(state: nn.Module, model: nn.Module) -> None:
    """Make ``state`` hold what ``model`` holds after a load that replaced tensors."""
    held, _ = named_tensors(state)
    now, aliases = named_tensors(model)
    for name, t in held.items():
        src = now.get(name, now.get(aliases.get(name, ""), None))
        if src is None or src.data_ptr() == t.data_ptr():
            continue
        if src.shape != t.shape or src.dtype != t.dtype:
            raise WeightLoadError(
                f"vLLM's loader replaced {name} with {list(src.shape)} {src.dtype},"
                f" built as {list(t.shape)} {t.dtype}"
            )
        t.copy_(src)


class NcclBackModelLoader(BaseModelLoader):
    """``--load-format nccl_back``: weights from a live peer engine, vLLM's default
    loader as the storage path."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        # Validated here, when vLLM builds the loader: before any weight is read.
        self.settings = settings_from(load_config.model_loader_extra_config)
        self._default = DefaultModelLoader(
            dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})
        )
        self._vllm_config: VllmConfig | None = None
        self._state: nn.Module | None = None
        self._truth: dict[str, str] | None = None
        self.service: WeightService | None = None
        self.result: LoadResult | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        self._default.download_model(model_config)

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> nn.Module:
        """vLLM's own build / load / ``process_weights_after_loading``, then a check that
        processing left the served tensors as they were loaded."""
        self._vllm_config = vllm_config
        model = super().load_model(vllm_config=vllm_config, model_config=model_config,
                                   prefix=prefix)
        self._check_served_state()
        return model

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Fill ``model`` (as ``create_model`` built it) from a peer, or from storage."""
        vllm_config = self._vllm_config
        if vllm_config is None:
            from vllm.config import get_current_vllm_config

            vllm_config = get_current_vllm_config()
        started = time.perf_counter()
        try:
            spec = self._spec(vllm_config, model_config)
        except NcclBackError as e:
            log.warning("nccl_back: no peer loading (%s); using vLLM's default loader", e)
            self._default.load_weights(model, model_config)
            return
        identity_s = time.perf_counter() - started
        state = loaded_state(model)
        meta = [n for n, t in named_tensors(state)[0].items() if t.device.type == "meta"]
        if meta:
            # Online quantization builds on the meta device and fills layer by layer.
            log.warning("nccl_back: %d tensors on the meta device (e.g. %s); using vLLM's"
                        " default loader", len(meta), meta[0])
            self._default.load_weights(model, model_config)
            return
        service = WeightService(self.settings, storage_loader=self._storage_loader(model, model_config),
                                engine=f"vllm-{vllm.__version__}")
        try:
            result = service.load(state, spec, get_world_group().cpu_group)
        except BaseException:
            service.close()
            raise
        self.service, self.result, self._state = service, result, state
        if self.settings.verify != "none" and service.peers:
            self._truth = integrity.layer_hashes(state, mode="sampled")
        _SERVICES.append(service)
        atexit.register(service.close)
        phases = ", ".join(f"{k} {v:.3f}" for k, v in {"identity": identity_s,
                                                       **result.timings}.items())
        reason, level = _outcome(result)
        log.log(level, "nccl_back: loaded version %s from %s%s: %.1f MB in %.3f s (%.2f GB/s)"
                " [%s]%s", result.version[:12], result.source,
                f" {result.peer_id}" if result.peer_id else "", result.bytes / 1e6,
                result.seconds, result.gbps, phases, reason)

    def _spec(self, vllm_config: VllmConfig, model_config: ModelConfig) -> ModelSpec:
        path = model_config.model
        if not os.path.isdir(path):
            raise ConfigError(
                f"model {path!r} is not a local directory; the content identity needs the"
                " checkpoint files (download it first)"
            )
        checkpoint = ModelSpec.from_dir(path, cache_dir=self.settings.cache_dir)
        return engine_spec(checkpoint, engine_layout(vllm_config, model_config))

    def _storage_loader(
        self, model: nn.Module, model_config: ModelConfig
    ) -> Callable[[Model, ModelSpec, Settings], LoadResult]:
        def load(state: Model, spec: ModelSpec, settings: Settings) -> LoadResult:
            # vLLM's DefaultModelLoader, as --load-format auto: its name mapping,
            # fusing, sharding and its check that every parameter was filled.
            start = time.perf_counter()
            self._default.load_weights(model, model_config)
            if not isinstance(state, nn.Module):
                raise WeightLoadError("the loaded state must be a module")
            _rebind(state, model)
            seconds = time.perf_counter() - start
            nbytes = sum(t.nbytes for t in named_tensors(state)[0].values())
            return LoadResult("storage", spec.version, nbytes, seconds,
                              timings={"vllm_default_loader": seconds})

        return load

    def _check_served_state(self) -> None:
        """Stop serving if ``process_weights_after_loading`` rewrote a served tensor."""
        if self.service is None or self._state is None or self._truth is None:
            return
        after = integrity.layer_hashes(self._state, mode="sampled")
        changed = sorted(k for k in self._truth if after.get(k) != self._truth[k])
        if changed:
            log.error("nccl_back: vLLM's process_weights_after_loading rewrote loaded tensors"
                      " in place (%s); this engine serves no other engine", changed[:5])
            self.service.withdraw()
