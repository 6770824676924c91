"""Diffusers pipelines: component skeletons from their configs, and the pipeline around
them (docs/diffusers.md).

A pipeline folder is one :class:`~nccl_back.model.identity.ModelSpec`; its weighted
components load as one *skeleton map*, ``{"unet": unet, "vqvae": vq}``, of which a
pipeline rank passes only the components it holds.

:func:`component_skeleton` builds a component (its class named by ``model_index.json``)
from its ``config.json`` (``from_config`` for diffusers models, the config class for
transformers models) under :func:`nccl_back.model.skeleton.build`: no weight
initialisation, no weight read. A constructor that loads weights eagerly loads them
into ``meta`` parameters, a copy PyTorch treats as a no-op, so only its file reads
remain (``factory=`` with the component's own skip-loading switch avoids those).

diffusers (and transformers, for transformers components) are imported only here and
only inside functions: ``pip install 'nccl-back[diffusers]'``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nccl_back.errors import ConfigError, SkeletonError
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import build

__all__ = ["assemble", "component_skeleton", "pipeline_skeletons", "require_diffusers"]


def require_diffusers() -> None:
    """:class:`ConfigError` unless the optional ``diffusers`` extra is installed."""
    try:
        import diffusers  # noqa: F401
    except ImportError as e:
        raise ConfigError("diffusers pipelines need diffusers: pip install 'nccl-back[diffusers]'") from e


def component_skeleton(
    spec: ModelSpec,
    name: str,
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype | None = None,
    factory: Callable[[], nn.Module] | None = None,
) -> nn.Module:
    """The skeleton of pipeline component ``name``: built from its config, one allocation.

    ``dtype`` casts floating-point tensors (the checkpoint's dtype; default: what the
    constructor makes, float32 for diffusers). ``factory`` replaces the construction
    from the config (see the module docstring). Raises :class:`SkeletonError` naming
    the component when it cannot be built.
    """
    if name not in spec.weighted_components:
        raise SkeletonError(
            f"pipeline component {name!r} has no weights to load"
            f" (components with weights: {list(spec.weighted_components)})"
        )
    # Resolved before building, so a bad model_index.json entry is its own ConfigError.
    make = factory or _from_config(spec, name)

    def construct() -> nn.Module:
        with warnings.catch_warnings():
            # An eager load_state_dict into meta parameters warns once per tensor that
            # the copy is a no-op: here that is the point.
            warnings.filterwarnings("ignore", message=r".*to a meta parameter .* is a no-op")
            module = make()
        if not isinstance(module, nn.Module):
            raise SkeletonError(f"built a {type(module).__name__}, not an nn.Module")
        # On meta parameters a cast costs nothing; buffers are cast for real.
        return module.to(dtype) if dtype is not None else module

    try:
        built = build(construct, device)
    except SkeletonError as e:
        raise SkeletonError(f"pipeline component {name!r}: {e}") from e
    if not isinstance(built, nn.Module):  # construct() returns a module; for mypy
        raise SkeletonError(f"pipeline component {name!r}: built a {type(built).__name__}")
    return built.eval()


def pipeline_skeletons(
    spec: ModelSpec,
    names: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype | None = None,
) -> dict[str, nn.Module]:
    """The skeleton map of ``names`` (default: every weighted component) for ``load``."""
    chosen = list(spec.weighted_components) if names is None else list(names)
    return {n: component_skeleton(spec, n, device, dtype=dtype) for n in chosen}


def assemble(spec: ModelSpec, modules: Mapping[str, nn.Module], **extra: Any) -> Any:
    """The diffusers pipeline of ``spec`` around loaded ``modules``.

    Weightless components with a config (schedulers) are built from it; anything else
    (a tokenizer, a component held by another rank) comes through ``extra``. Raises
    :class:`ConfigError` naming a component that is neither.
    """
    require_diffusers()
    import diffusers

    index = spec.config["model_index"]
    pipeline_cls = getattr(diffusers, str(index.get("_class_name")), None)
    if pipeline_cls is None:
        raise ConfigError(f"model_index.json names pipeline {index.get('_class_name')!r}, unknown to diffusers")
    kwargs: dict[str, Any] = {}
    for key, value in index.items():
        if key.startswith("_"):
            continue
        if key in modules:
            kwargs[key] = modules[key]
        elif key in extra:
            kwargs[key] = extra[key]
        elif key in spec.components and key not in spec.weighted_components:
            kwargs[key] = _weightless(spec, key)
        elif key in spec.components:
            raise ConfigError(f"pipeline component {key!r} was not given (pass it in modules)")
        elif isinstance(value, list):
            kwargs[key] = None  # [null, null]: an absent optional component
        else:
            kwargs[key] = value  # the pipeline's own arguments
    return pipeline_cls(**kwargs)


# -- construction -----------------------------------------------------------------------


#: Libraries whose classes model_index.json may name: the file comes from storage, and
#: importing whatever module it names would run code nobody chose.
_LIBRARIES = ("diffusers", "transformers")


def _component_class(spec: ModelSpec, name: str) -> Any:
    library, class_name = spec.component_class(name)
    if library not in _LIBRARIES:
        raise ConfigError(
            f"pipeline component {name!r}: class {library}.{class_name} is not from"
            f" {' or '.join(_LIBRARIES)}; build it yourself (factory=, or assemble(..., {name}=...))"
        )
    try:
        module = importlib.import_module(library)
    except ImportError as e:
        raise ConfigError(f"pipeline component {name!r}: cannot import {library!r} ({e})") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"pipeline component {name!r}: {library} has no class {class_name!r}")
    return cls


def _from_config(spec: ModelSpec, name: str) -> Callable[[], nn.Module]:
    """A factory building component ``name`` from its config.json."""
    cls = _component_class(spec, name)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise SkeletonError(f"pipeline component {name!r}: {cls!r} is not an nn.Module class")
    config = spec.component_config(name)
    if hasattr(cls, "from_config"):  # diffusers ModelMixin (ConfigMixin)
        return lambda: cls.from_config(config)
    config_cls = getattr(cls, "config_class", None)
    if config_cls is not None:  # transformers PreTrainedModel
        return lambda: cls(config_cls.from_dict(config))
    raise SkeletonError(
        f"pipeline component {name!r}: {cls.__name__} has neither from_config nor config_class;"
        " pass factory="
    )


def _weightless(spec: ModelSpec, name: str) -> Any:
    cls = _component_class(spec, name)
    configs = spec.config["components"].get(name, {})
    config = next((configs[f] for f in sorted(configs) if f.endswith("config.json")), None)
    if config is None or not hasattr(cls, "from_config"):
        raise ConfigError(
            f"pipeline component {name!r} ({cls.__name__}) cannot be built from a config;"
            " pass it to assemble()"
        )
    return cls.from_config(config)
