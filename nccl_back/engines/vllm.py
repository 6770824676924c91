"""vLLM adapter: the ``nccl_back`` load format (docs/vllm.md: use, settings, limits).

Registered through vLLM's ``vllm.general_plugins`` entry point (:func:`register`, called
in every process vLLM starts). Settings (``NCCL_BACK_*``, then
``--model-loader-extra-config``) are validated when vLLM builds the loader, before any
weight is read.

What travels is the module as vLLM's checkpoint load leaves it (fused, TP-sharded, in
the engine's dtype), filled from a peer or by vLLM's ``DefaultModelLoader``;
``process_weights_after_loading`` then runs on both paths. Not its output: on the CPU
build it packs linear weights into oneDNN handles that cannot be sent. A sender that
finds a loaded tensor rewritten in place stops serving.

The version adds everything that changes these tensors (:meth:`VllmAdapter.layout`); when
every rank is described as pieces of the checkpoint (:mod:`.vllm_layout`), the TP size
and rank leave it and engines of other TP sizes reshard from each other. Consensus,
election and fallback run over the engine's world group (gloo ``cpu_group``). Compile
caches travel too, with a fleet secret (:mod:`.vllm_cache`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
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

from nccl_back.engines import common, vllm_cache, vllm_layout
from nccl_back.engines.common import (
    LOAD_FORMAT,
    EngineLoad,
    engine_spec,
    loaded_state,
    settings_from,
)
from nccl_back.model.layout import TensorLayout

__all__ = ["LOAD_FORMAT", "NcclBackModelLoader", "engine_spec", "loaded_state", "register",
           "settings_from"]

#: This adapter's name in the engine registry, the identity and the worker's label.
ENGINE = "vllm"

# A child of vLLM's logger, so the outcome shows in vLLM's own output; nothing here
# configures logging.
log = logging.getLogger("vllm.nccl_back")


def register() -> None:
    """The ``vllm.general_plugins`` entry point (called in every vLLM process; idempotent)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not NcclBackModelLoader:
        register_model_loader(LOAD_FORMAT)(NcclBackModelLoader)
    common.route_library_logs(log)
    # Before vLLM's configuration inspects the model (a subprocess when they are absent).
    vllm_cache.early_modelinfos(log)


@common.register_engine(ENGINE)
@dataclasses.dataclass
class VllmAdapter:
    """One vLLM load (:class:`~nccl_back.engines.common.EngineAdapter`)."""

    vllm_config: VllmConfig
    model_config: ModelConfig
    default: DefaultModelLoader

    name = ENGINE
    title = "vLLM"
    version = vllm.__version__
    log = log

    def checkpoint_dir(self) -> str:
        return str(self.model_config.model)

    def layout(self) -> dict[str, Any]:
        """Everything besides the checkpoint that changes the tensors this rank loads."""
        vllm_config, model_config, pp = self.vllm_config, self.model_config, get_pp_group()
        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        return {
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
            "hf_overrides": common.jsonable(model_config.hf_overrides),
        }

    def default_load(self, model: nn.Module) -> None:
        self.default.load_weights(model, self.model_config)

    def group(self) -> Any:
        return get_world_group().cpu_group

    parallel_fields: tuple[str, ...] = ("tp_size", "tp_rank")

    def describe(self, model: nn.Module,
                 checkpoint: Sequence[str]) -> Mapping[str, TensorLayout | None]:
        return vllm_layout.describe_engine(model, self.vllm_config, checkpoint)


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
        self._loaded: EngineLoad | None = None

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
        if self._loaded is not None:
            self._loaded.check_served_state(log, "vLLM's process_weights_after_loading")
        return model

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Fill ``model`` (as ``create_model`` built it) from a peer, or from storage."""
        vllm_config = self._vllm_config
        if vllm_config is None:
            from vllm.config import get_current_vllm_config

            vllm_config = get_current_vllm_config()
        adapter = common.engine_adapter(VllmAdapter.name)(vllm_config, model_config, self._default)
        self._loaded = common.load_weights(adapter, self.settings, model)
        if self._loaded is not None:
            _withdraw_when_shutdown_starts()
            # Still before vLLM's profile run and warm-up compile: the caches arrive in time.
            vllm_cache.share(self.settings, vllm_config, self._loaded.result.version, log,
                             engine=f"{ENGINE}-{vllm.__version__}")


def _withdraw_when_shutdown_starts() -> None:
    """Leave the registry the moment vLLM starts shutting this worker process down.

    vLLM kills a worker 5 s into its shutdown, and its own teardown (before ``atexit``,
    where the service withdraws) can take longer on a loaded machine: a killed worker
    would stay listed until its TTL. Under another executor, exit alone withdraws.
    """
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:
        return
    original = WorkerProc.shutdown
    if getattr(original, "nccl_back_withdraws", False):
        return

    def shutdown(self: Any) -> None:
        if common.withdraw_all():
            log.info("nccl_back: withdrawn from the registry: vLLM is shutting this worker down")
        original(self)

    shutdown.nccl_back_withdraws = True  # type: ignore[attr-defined]
    WorkerProc.shutdown = shutdown
