"""vLLM's compile caches travel with the weights (docs/compile-caches.md).

After an engine is ready (its worker's ``compile_or_warm_up_model`` returned), rank 0
publishes one artifact set (:mod:`nccl_back.caches.artifact_transfer`): the compile cache
directories vLLM used (``torch_compile_cache/<hash>``, ``torch_compile_cache/
torch_aot_compile/<hash>``) and ``modelinfos/*.json`` under ``VLLM_CACHE_ROOT``. A
starting engine fetches it right after its weights, before warm-up, and installs it
with vLLM's own names, never over a local unit. Where inductor alone compiles
(:func:`inductor_only`) its cache directory is the set (``set=inductor``); inductor's
precompiled C++ headers travel as a third set (``set=headers``), in the background.

The lookup key (:func:`cache_key`) is computed by vLLM's and torch's own code at the
weight load on both ends; vLLM's own key (which covers the traced code) still decides
each hit after the install, so a stale set can only be a miss, never a wrong hit.
Misses say why in the engine's log. vLLM has no post-warm-up hook for a model loader,
so :func:`after_warm_up` wraps ``parallel_config.worker_cls`` (once per class).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import vllm
from vllm.config import VllmConfig

from nccl_back.caches import artifact_transfer
from nccl_back.caches.artifact_transfer import CacheKey
from nccl_back.caches.compile_cache import (
    cache_units,
    fetch_headers,
    header_units,
    headers_dir,
    headers_key,
    inductor_cache_dir,
)
from nccl_back.config import ENV_PREFIX, SECRET_FILE_ENV, Settings

#: The cache directory vLLM names its compile caches under, relative to VLLM_CACHE_ROOT.
COMPILE_DIR = "torch_compile_cache"
#: vLLM's AOT compile keeps its artifacts in this directory of COMPILE_DIR.
AOT_DIR = "torch_aot_compile"
MODELINFOS = "modelinfos"


def cache_root() -> str:
    """vLLM's ``VLLM_CACHE_ROOT`` as vLLM reads it."""
    import vllm.envs as envs

    return str(envs.VLLM_CACHE_ROOT)


def why_not_shared(vllm_config: VllmConfig) -> str | None:
    """Why this engine's compile caches cannot travel, or None."""
    import vllm.envs as envs
    from vllm.compilation.compiler_interface import is_compile_cache_enabled
    from vllm.config.compilation import CompilationMode

    cc = vllm_config.compilation_config
    if cc.mode == CompilationMode.NONE:
        return "vLLM compiles nothing here (enforce_eager, or compilation mode NONE)"
    if not is_compile_cache_enabled(cc.inductor_compile_config):
        return "vLLM's compile cache is disabled (VLLM_DISABLE_COMPILE_CACHE or inductor config)"
    if cc.cache_dir and not os.path.realpath(cc.cache_dir).startswith(
            os.path.realpath(os.path.join(envs.VLLM_CACHE_ROOT, COMPILE_DIR)) + os.sep):
        return f"compilation_config.cache_dir={cc.cache_dir!r} is outside VLLM_CACHE_ROOT"
    return None


def cache_key(vllm_config: VllmConfig, scope: str) -> CacheKey:
    """The lookup key of this rank's compile caches, from vLLM's and torch's own hashes."""
    import vllm.envs as envs
    from vllm.compilation.backends import make_compiler
    from vllm.config.utils import hash_factors

    par = vllm_config.parallel_config
    factors = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "nccl_back": artifact_transfer.nccl_back_version(),
        "config_hash": vllm_config.compute_hash(),
        "env_hash": hash_factors(envs.compile_factors()),
        "compiler_hash": make_compiler(vllm_config.compilation_config).compute_hash(vllm_config),
        "rank": f"{par.rank}_{par.data_parallel_index}",
    }
    return CacheKey({k: str(v) for k, v in factors.items()}, scope)


def inductor_only(vllm_config: VllmConfig) -> bool:
    """Whether vLLM hands its graph to inductor itself (``DYNAMO_TRACE_ONCE`` without AOT
    compile): then its whole compile is in inductor's cache directory, which travels."""
    import vllm.envs as envs
    from vllm.config.compilation import CompilationMode

    return bool(vllm_config.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE
                and not envs.VLLM_USE_AOT_COMPILE)


def units(vllm_config: VllmConfig, root: str) -> list[str]:
    """What travels after a compile: the cache directories vLLM's config names as used."""
    out: list[str] = []
    cc = vllm_config.compilation_config
    for used in (cc.cache_dir, cc.local_cache_dir):
        if not used:
            continue
        rel = os.path.relpath(os.path.realpath(used), os.path.realpath(root)).split(os.sep)
        if len(rel) < 2 or rel[0] != COMPILE_DIR:
            continue
        unit = "/".join(rel[:3] if rel[1] == AOT_DIR else rel[:2])
        if len(unit.split("/")) >= 2 + (rel[1] == AOT_DIR) and unit not in out:
            out.append(unit)
    return out


def _modelinfos(root: str) -> list[str]:
    infos = os.path.join(root, MODELINFOS)
    if not os.path.isdir(infos):
        return []
    return [f"{MODELINFOS}/{n}" for n in sorted(os.listdir(infos)) if n.endswith(".json")]


def modelinfos_key() -> CacheKey:
    """The key of vLLM's model infos: vLLM checks each file against its model code's
    hash, so any engine of this vLLM version may provide them."""
    factors = {"set": MODELINFOS, "vllm": vllm.__version__, "nccl_back": artifact_transfer.nccl_back_version()}
    return CacheKey(factors, hashlib.sha256(f"{MODELINFOS}-{vllm.__version__}".encode())
                    .hexdigest()[:32])


_early = threading.Event()
#: What :func:`early_modelinfos` did here (None: did not try); its log line may not show,
#: as vLLM configures the front end's logging after plugins load.
early_outcome: str | None = None


def early_modelinfos(log: logging.Logger) -> None:
    """At plugin load, before vLLM's configuration inspects the model in a subprocess:
    fetch model infos from a peer into an empty ``VLLM_CACHE_ROOT/modelinfos`` (once per
    process, only with ``NCCL_BACK_REDIS_URL`` and a secret in the environment)."""
    if _early.is_set():
        return
    _early.set()
    if not os.environ.get(f"{ENV_PREFIX}REDIS_URL") or not (
            os.environ.get(f"{ENV_PREFIX}SECRET") or os.environ.get(SECRET_FILE_ENV)):
        return
    try:
        root = cache_root()
        if _modelinfos(root):
            return
        settings = Settings.from_env()
    except Exception as e:  # a bad setting is reported where the loader is built
        log.debug("nccl_back: no early model infos (%r)", e)
        return
    if not settings.compile_caches:
        return
    global early_outcome
    try:
        got = artifact_transfer.fetch(settings, modelinfos_key(), root, engine="vllm-modelinfos", serve=False)
    except Exception as e:  # never breaks vLLM's start
        got = artifact_transfer.FetchResult(False, repr(e)[:500])
    early_outcome = f"from peer {got.peer}: {got.installed}" if got.ok else f"missed: {got.reason}"
    if got.ok:
        log.info("nccl_back: model infos from peer %s in %.3f s: %s", got.peer, got.seconds,
                 got.installed)
    else:
        log.debug("nccl_back: no model infos from peers (%s)", got.reason)


_READY: list[Callable[[], None]] = []
_WRAPPED: set[type] = set()


def after_warm_up(vllm_config: VllmConfig, callback: Callable[[], None]) -> None:
    """Call ``callback`` once, when this process's worker has compiled and warmed up."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = vllm_config.parallel_config.worker_cls
    worker = resolve_obj_by_qualname(cls) if isinstance(cls, str) else cls
    _READY.append(callback)
    if worker in _WRAPPED:
        return
    _WRAPPED.add(worker)
    original = worker.compile_or_warm_up_model

    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        while _READY:
            try:
                _READY.pop(0)()
            except Exception as e:  # publishing never breaks vLLM's start
                logging.getLogger("vllm.nccl_back").warning(
                    "nccl_back: compile caches not published (%r)", e)
        return out

    worker.compile_or_warm_up_model = compile_or_warm_up_model


def share(settings: Settings, vllm_config: VllmConfig, scope: str, log: logging.Logger,
          engine: str) -> None:
    """Fetch a peer's caches now (the weight load); after warm-up, publish this engine's
    own unless vLLM used the received ones. Never raises: the weights travel regardless."""
    try:
        _share(settings, vllm_config, scope, log, engine)
    except Exception as e:
        log.warning("nccl_back: compile caches not shared (%r)", e)


def _share(settings: Settings, vllm_config: VllmConfig, scope: str, log: logging.Logger,
           engine: str) -> None:
    if not settings.compile_caches or vllm_config.parallel_config.rank != 0:
        return
    why = why_not_shared(vllm_config)
    if why is None and settings.secret is None:
        artifact_transfer.warn_no_secret()
        why = "no fleet secret (NCCL_BACK_SECRET): compile caches are skipped"
    if why is not None:
        log.info("nccl_back: compile caches not shared: %s", why)
        return
    vllm_root = root = cache_root()
    try:
        key = cache_key(vllm_config, scope)
        inductor = inductor_only(vllm_config)
    except Exception as e:  # vLLM's internals moved: weights still travel
        log.warning("nccl_back: compile caches not shared: no lookup key (%r)", e)
        return
    if inductor:
        root, key = inductor_cache_dir(), CacheKey({**key.factors, "set": "inductor"}, key.scope)
    got = artifact_transfer.fetch(settings, key, root, engine=engine)
    if got.ok:
        log.info("nccl_back: compile caches from peer %s: %.1f MB in %.3f s, installed %s%s",
                 got.peer, got.bytes / 1e6, got.seconds, got.installed,
                 f", kept local {got.kept}" if got.kept else "")
    else:
        log.info("nccl_back: no compile caches from peers (%s); vLLM compiles, and this"
                 " engine publishes its caches when ready", got.reason)
    received = set(got.installed)
    # Inductor's precompiled headers for its C++ kernels (CPU), global to the machine:
    # in the background, while vLLM goes on to its profile run (inductor waits for them).
    def fetched(got: artifact_transfer.FetchResult) -> None:
        if got.ok:
            log.info("nccl_back: precompiled headers from peer %s: %.1f MB in %.3f s",
                     got.peer, got.bytes / 1e6, got.seconds)
        else:
            log.info("nccl_back: no precompiled headers from peers (%s)", got.reason)

    headers = fetch_headers(settings, key, engine=engine, on_done=fetched)

    def publish() -> None:
        found = cache_units(root) if inductor else units(vllm_config, root)
        own = not (found and any(u in received for u in found))  # else vLLM used the received set
        have = headers.result()  # artifact_wait after the fetch began at most
        used = [] if have.ok or have.kept else header_units()
        # In the background: collecting and hashing must not delay readiness.
        def run() -> None:
            try:
                if own:
                    what = artifact_transfer.publish(settings, key, root, found, engine=engine)
                    log.info("nccl_back: compile caches %s", what)
                    infos = artifact_transfer.publish(settings, modelinfos_key(), vllm_root,
                                                      _modelinfos(vllm_root), engine=engine)
                    log.info("nccl_back: model infos %s", infos)
                if used:
                    what = artifact_transfer.publish(settings, headers_key(key), headers_dir(),
                                                     used, engine=engine)
                    log.info("nccl_back: precompiled headers %s", what)
            except Exception as e:  # a publishing failure is a line in the log
                log.warning("nccl_back: compile caches not published (%r)", e)

        threading.Thread(target=run, daemon=True, name="nccl-back-publish-caches").start()

    after_warm_up(vllm_config, publish)
