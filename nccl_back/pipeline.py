"""Diffusers pipelines: component skeletons from their configs, and the pipeline around them.

A diffusers pipeline folder (``model_index.json`` and one folder per component) is one
:class:`~nccl_back.identity.ModelSpec`; its weighted components load as one *skeleton
map*, ``{"unet": unet, "vqvae": vq}``, through :meth:`WeightService.load` (all of a
rank's components in one peer transfer, or each from its own files). A pipeline rank
passes only the components it holds.

:func:`component_skeleton` builds a component without running its weight
initialisation and without reading its weights: the component's class (from
``model_index.json``) is constructed from its ``config.json`` (``from_config`` for
diffusers models, the config class for transformers models) while every
``nn.Parameter`` is moved to the ``meta`` device as it is registered, so parameters
cost nothing and initialisers run on ``meta`` (free). Buffers are computed by the
constructor as usual, on the CPU, so constructor state that no checkpoint carries
(non-persistent buffers) is real. Then the parameters and persistent buffers get one
allocation on the target device, laid out as :func:`nccl_back.skeleton.consolidate`
lays out a skeleton (sorted names, ``FLAT_ALIGN``-ed), which makes transfers between
consolidated skeletons near one flat broadcast.

Constructors that load weights eagerly (a component that calls ``from_pretrained``
or ``load_state_dict`` on a sub-model in its ``__init__``) run under the same rule: the
parameters they fill are on ``meta``, so what they load is dropped without an
allocation (PyTorch treats a copy into a meta parameter as a no-op), and the real
values arrive with the transfer or the storage load like any other tensor. Only their
file reads would remain: pass ``factory=`` to build such a component with its own
skip-loading switch, under the same meta-parameter rule.

diffusers (and transformers, for transformers components) are imported only here and
only inside functions: ``pip install 'nccl-back[diffusers]'``.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .errors import ConfigError, SkeletonError
from .identity import ModelSpec
from .skeleton import Manifest, TensorEntry, dtype_from_name, dtype_name, flat_layout

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
    build = factory or (lambda: _from_config(spec, name))
    try:
        with _parameters_on_meta(), warnings.catch_warnings():
            # An eager load_state_dict into meta parameters warns once per tensor that
            # the copy is a no-op: here that is the point.
            warnings.filterwarnings("ignore", message=r".*to a meta parameter .* is a no-op")
            module = build()
    except (SkeletonError, ConfigError):
        raise
    except Exception as e:
        raise SkeletonError(f"pipeline component {name!r}: building its skeleton failed: {e}") from e
    if not isinstance(module, nn.Module):
        raise SkeletonError(f"pipeline component {name!r}: built a {type(module).__name__}, not an nn.Module")
    _materialise(module, torch.device(device), dtype, name)
    return module.eval()


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


def _component_class(spec: ModelSpec, name: str) -> Any:
    library, class_name = spec.component_class(name)
    try:
        module = importlib.import_module(library)
    except ImportError as e:
        raise ConfigError(f"pipeline component {name!r}: cannot import {library!r} ({e})") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"pipeline component {name!r}: {library} has no class {class_name!r}")
    return cls


def _from_config(spec: ModelSpec, name: str) -> nn.Module:
    cls = _component_class(spec, name)
    config = spec.component_config(name)
    if hasattr(cls, "from_config"):  # diffusers ModelMixin (ConfigMixin)
        return cls.from_config(config)
    config_cls = getattr(cls, "config_class", None)
    if config_cls is not None:  # transformers PreTrainedModel
        return cls(config_cls.from_dict(config))
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


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile moves to ``meta``; buffers stay real.

    Patches ``nn.Module.register_parameter`` for the duration (process-wide: build
    skeletons from one thread at a time).
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = moved

    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _materialise(module: nn.Module, device: torch.device, dtype: torch.dtype | None, name: str) -> None:
    """Give parameters and persistent buffers one allocation on ``device``, in manifest order."""
    state = module.state_dict(keep_vars=True)
    canonical: dict[int, str] = {}  # id of a tensor object -> its first (sorted) name: ties
    entries = []
    for key in sorted(state):
        t = state[key]
        if id(t) in canonical:
            continue
        canonical[id(t)] = key
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        entries.append(TensorEntry(key, tuple(t.shape), dtype_name(cast)))
    man = Manifest(tuple(entries))
    offsets, total = flat_layout(man)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    views = {
        e.name: flat[offsets[e.name] : offsets[e.name] + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)
        for e in man.entries
    }
    replaced: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for mod in module.modules():
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in canonical:
                    raise SkeletonError(f"pipeline component {name!r}: parameter {pname!r} is not in its state_dict")
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(views[canonical[id(p)]], requires_grad=p.requires_grad)
                mod._parameters[pname] = replaced[id(p)]
            for bname, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) in canonical:
                    view = views[canonical[id(b)]]
                    if b.device.type != "meta":
                        view.copy_(b)  # constructor-computed; the load overwrites it anyway
                    mod._buffers[bname] = view
                elif b.device.type == "meta":
                    raise SkeletonError(
                        f"pipeline component {name!r}: non-persistent buffer {bname!r} is on meta;"
                        " build it with factory="
                    )
                else:
                    mod._buffers[bname] = b.to(device)
