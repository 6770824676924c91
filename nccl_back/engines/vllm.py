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

What every engine needs (the load's flow, the identity, the served state, the outcome
in the engine's log) is :mod:`nccl_back.engines.common`'s; this module is what is vLLM's.

**Identity.** The version is the checkpoint's content identity plus everything that
changes these tensors (:func:`engine_layout`): vLLM version, architecture, dtype,
quantization, tensor-parallel size and rank, pipeline size and rank, expert
parallelism, KV-cache dtype, revision and ``hf_overrides``. When every rank's
parameters are described as pieces of the checkpoint (:mod:`.vllm_layout`: the layers
of dense decoder models) the tensor-parallel size and rank leave the version: engines
of other TP sizes then share it and reshard from each other when no engine of their
own layout serves (docs/layouts.md); otherwise they stay in it and engines of
different layouts never exchange weights.

**Ranks.** Each vLLM worker process is one rank; consensus, election and fallback run
over the engine's world group (gloo ``cpu_group``): every rank loads from a peer, or
every rank loads from storage. After its load an engine serves its weights in the
background while it answers requests, and leaves the registry as soon as vLLM starts
shutting the worker down.

**Compile caches** travel too, with a fleet secret (:mod:`.vllm_cache`): fetched right
after the weights, before vLLM's warm-up compile; published once the engine is ready.
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
from nccl_back.load.service import WeightService
from nccl_back.model.layout import TensorLayout
from nccl_back.result import LoadResult

__all__ = ["LOAD_FORMAT", "NcclBackModelLoader", "engine_layout", "engine_spec", "loaded_state",
           "register", "settings_from"]

#: This adapter's name in the engine registry, the identity and the worker's label.
ENGINE = "vllm"

# A child of vLLM's logger, so the outcome shows in vLLM's own output; nothing here
# configures logging.
log = logging.getLogger("vllm.nccl_back")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``nccl_back`` load format.

    vLLM calls it in every process it starts; registering twice is harmless.
    """
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not NcclBackModelLoader:
        register_model_loader(LOAD_FORMAT)(NcclBackModelLoader)
    common.route_library_logs(log)
    # Before vLLM's configuration inspects the model (a subprocess when they are absent).
    vllm_cache.early_modelinfos(log)


def _layout_fields(vllm_config: VllmConfig, model_config: ModelConfig) -> dict[str, Any]:
    pp = get_pp_group()
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


def engine_layout(vllm_config: VllmConfig, model_config: ModelConfig) -> dict[str, Any]:
    """Everything besides the checkpoint that changes the tensors this rank loads."""
    return common.engine_layout(ENGINE, vllm.__version__, _layout_fields(vllm_config, model_config))


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
        return _layout_fields(self.vllm_config, self.model_config)

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

    @property
    def service(self) -> WeightService | None:
        return self._loaded.service if self._loaded is not None else None

    @property
    def result(self) -> LoadResult | None:
        return self._loaded.result if self._loaded is not None else None

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

    vLLM's executor gives a worker a grace period (5 s) from the start of its shutdown,
    then kills it. The worker's own teardown (message queues, the worker, the distributed
    state) runs first, about a second on a quiet machine and past the grace on a loaded
    one, and ``atexit``, where the service withdraws and closes, only after it: a worker
    killed before then stays listed until its entry's TTL, and a receiver may spend a
    handshake timeout on it. So the withdrawal also runs first thing in the worker's
    shutdown (the service still closes at exit). Under another executor (no
    ``WorkerProc``), exit alone withdraws.
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
