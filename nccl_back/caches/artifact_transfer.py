"""Publishing and fetching artifact sets (compile caches) through the weight path.

A set (:mod:`nccl_back.model.artifact_sets`) travels exactly as weights do: its bytes are
one ``uint8`` tensor of a one-rank "model" whose version is content-addressed
(:func:`artifact_spec`), so holders are published, found, claimed, handshaken and sent
by the same code (:class:`~nccl_back.load.service.WeightService`), with the same send
slots, budgets and fallback to the next holder. What differs:

* the lookup: a :class:`CacheKey` of what the engine knows before it compiles (named
  factors, e.g. vLLM's config and compiler hashes); the manifest is read from
  ``ns:art:{lookup}`` (:mod:`nccl_back.coord.artifact_records`);
* verification: the set's keyed digest over every byte, checked by
  :func:`~nccl_back.model.artifact_sets.install` before anything is written;
* no storage path: a set nobody holds is a miss with its reason, and the engine
  compiles itself;
* a secret is required: sets hold code the engine runs (shared libraries).

A receiver that installed a set serves it on (fan-out) until its process exits.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from nccl_back import _clock
from nccl_back.config import MAX_ARTIFACT_BYTES, Settings
from nccl_back.coord.artifact_records import ArtifactSetRecord
from nccl_back.errors import ArtifactError, NcclBackError, UntrustedPathError
from nccl_back.load.service import WeightService
from nccl_back.log import get_logger
from nccl_back.model import artifact_sets
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import Model

log = get_logger(__name__)

_warned = threading.Event()
#: Services of this process serving sets, closed (withdrawn) at exit.
_SERVING: list[WeightService] = []
_lock = threading.Lock()


@dataclass(frozen=True)
class CacheKey:
    """What an engine knows about its compile before compiling: named factors (versions,
    the engine's own hashes of its config, environment and compiler), and the model they
    belong to (``scope``: the weights' version, hex), which only explains misses."""

    factors: Mapping[str, str]
    scope: str

    @property
    def lookup(self) -> str:
        """The key a set is published and found under: a digest of every factor."""
        text = json.dumps(dict(self.factors), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class FetchResult:
    """One fetch's outcome: installed (or kept) units, or why not."""

    ok: bool
    reason: str = ""
    installed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    peer: str | None = None


def nccl_back_version() -> str:
    """The installed nccl-back's version (part of every cache key)."""
    try:
        return importlib.metadata.version("nccl-back")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def warn_no_secret() -> None:
    """Say once per process that caches are skipped without a secret."""
    if _warned.is_set():
        return
    _warned.set()
    log.warning("compile_caches_skipped", message="NCCL_BACK_SECRET is not set: compile"
                " caches hold code the engine runs, so they are neither published nor"
                " received from peers without a fleet secret (weights still are)")


def artifact_spec(lookup: str, digest: str) -> ModelSpec:
    """The identity a set travels as: content-addressed, one rank, no shards."""
    return ModelSpec({"artifact_set": {"lookup": lookup, "digest": digest}})


def _transfer_settings(s: Settings) -> Settings:
    # Sets are CPU bytes (gloo whatever the weights use), checked by their own digest
    # (no ground truth), and have no storage path: a failed transfer is a miss.
    return s.replace(transport="gloo", verify="none", strict=True).capped(
        single_flight_wait=2.0, single_flight_max_wait=2.0)


def _holder(nbytes: int, data: torch.Tensor | None = None) -> Model:
    model = nn.Module()
    model.register_buffer("data", data if data is not None else torch.empty(nbytes, dtype=torch.uint8))
    return model


def _no_storage(model: Model, spec: ModelSpec, settings: Settings) -> object:
    raise ArtifactError("no live peer holds the set (it has no storage copy)")


def _keep(service: WeightService) -> None:
    with _lock:
        if not _SERVING:
            atexit.register(close_all)
        _SERVING.append(service)


def close_all() -> None:
    """Withdraw every set this process serves."""
    with _lock:
        services = list(_SERVING)
        _SERVING.clear()
    for s in services:
        s.close()


def _miss_reason(service: WeightService, key: CacheKey) -> str:
    index = service.registry.get_artifact_index(key.scope)
    if index is None:
        return "no peer has published compile caches for this model"
    if index.lookup == key.lookup:
        return "the set's manifest for this key is gone (expired or rejected)"
    differ = sorted(k for k in {*index.factors, *key.factors}
                    if index.factors.get(k) != key.factors.get(k))
    shown = ", ".join(f"{k} (theirs {index.factors.get(k, '-')!s:.16}, ours"
                      f" {key.factors.get(k, '-')!s:.16})" for k in differ[:4])
    return f"the newest set for this model was published with other compile factors: {shown}"


def fetch(settings: Settings, key: CacheKey, root: str, *, engine: str = "library",
          serve: bool = True) -> FetchResult:
    """Receive the set published under ``key`` from a live holder and install it under
    ``root``, then (``serve``) serve it on; never raises for a miss (the reason is in
    the result)."""
    start = _clock.perf()
    if settings.secret is None:
        warn_no_secret()
        return FetchResult(False, "no fleet secret (NCCL_BACK_SECRET): caches are skipped")
    secret = settings.key("artifacts")
    assert secret is not None
    s = _transfer_settings(settings)
    service = WeightService(s, storage_loader=_no_storage, engine=f"{engine}-caches")  # type: ignore[arg-type]
    served = False
    try:
        record = service.registry.get_artifact_set(key.lookup)
        if record is None:
            return FetchResult(False, f"no set for key {key.lookup[:12]}: {_miss_reason(service, key)}")
        man = record.manifest
        spec = artifact_spec(key.lookup, man.digest)
        if spec.version != record.version:
            return FetchResult(False, f"the set for key {key.lookup[:12]} names version"
                           f" {record.version[:12]}, its content is {spec.version[:12]}")
        if not service.registry.find_peers(spec.version, 0, 1):
            return FetchResult(False, f"no live peer holds the set for key {key.lookup[:12]}")
        artifact_sets.check_destination(root)  # install would refuse it; and what is "here" is not ours
        local = [u for u in man.units if os.path.lexists(os.path.join(root, u))]
        if local and len(local) == len(man.units):  # nothing to receive (a local cache wins)
            return FetchResult(False, f"every unit of the set for key {key.lookup[:12]} is"
                           " already here", kept=local)
        model = _holder(man.nbytes)
        result = service.load(model, spec)
        data: torch.Tensor = model.data  # type: ignore[assignment,union-attr]
        done = artifact_sets.install(root, man, memoryview(data.numpy()), secret)  # type: ignore[arg-type]
        if serve:  # other new engines of the fleet receive it from here too
            _keep(service)
            served = True
        return FetchResult(True, installed=done.installed, kept=done.kept, bytes=man.nbytes,
                       seconds=_clock.perf() - start, peer=result.peer_id)
    except UntrustedPathError as e:
        log.warning("artifact_install_refused", root=root, key=key.lookup[:12], reason=str(e))
        return FetchResult(False, f"not installed: {e}"[:500])
    except NcclBackError as e:
        return FetchResult(False, f"{type(e).__name__}: {e}"[:500])
    except OSError as e:
        return FetchResult(False, f"installing under {root}: {e}"[:500])
    finally:
        if not served:
            service.close()


def publish(settings: Settings, key: CacheKey, root: str, units: Sequence[str], *,
            engine: str = "library") -> str:
    """Serve the set of ``units`` (paths under ``root``) under ``key`` until exit.

    Returns what happened, for the engine's log; never raises.
    """
    if settings.secret is None:
        warn_no_secret()
        return "not published: no fleet secret"
    secret = settings.key("artifacts")
    assert secret is not None
    refused: list[str] = []
    try:
        man, data = artifact_sets.collect(root, units, secret, MAX_ARTIFACT_BYTES,
                                      refused=refused)
    except UntrustedPathError as e:
        log.warning("artifact_set_refused", root=root, key=key.lookup[:12], reason=str(e))
        return f"not published: {e}"
    except ArtifactError as e:
        return f"not published: {e}"
    left_out = (f"; left out {len(refused)} unit(s) another user could have written:"
                f" {'; '.join(refused[:3])}" if refused else "")
    if man.nbytes == 0:
        return f"not published: nothing under {root} for {list(units)[:3]}{left_out}"
    spec = artifact_spec(key.lookup, man.digest)
    service = WeightService(_transfer_settings(settings), engine=f"{engine}-caches")
    try:
        info = service.serve(_holder(man.nbytes, torch.frombuffer(data, dtype=torch.uint8)), spec)
        service.registry.put_artifact_set(ArtifactSetRecord(key.lookup, spec.version, man),
                                          key.scope, dict(key.factors))
    except NcclBackError as e:
        service.close()
        return f"not published: {e}"
    _keep(service)
    return (f"published {len(man.files)} files, {man.nbytes / 1e6:.1f} MB under key"
            f" {key.lookup[:12]} as {info.peer_id}{left_out}")
