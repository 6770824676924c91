"""The storage path: every rank loads from storage unless every rank loaded from a
peer, hashes what it loaded, and publishes it (the hashes as ground truth).

An elected downloader streams its download to waiting workers' cohorts as the
checkpoint's tensors land (:meth:`nccl_back.transport.relay.Cohorts.open_stream`),
unless an engine's own loader fills the skeleton. One that gathers a cooperative
download announces its stream only once every file proved: nothing could be forwarded
before, and a stream-fed link's stall bound would run out while the members read
(the members and other waiters wait in the election meanwhile, the lease renewed).
The service runs these steps around the group's round (:func:`report`,
:func:`load_and_hash`, :func:`serve_stored`) and records what they give.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nccl_back import _clock
from nccl_back.config import Settings
from nccl_back.coord.consensus import gather
from nccl_back.errors import NcclBackError
from nccl_back.load.attempt import Attempt, NoHolder, Worker, reason_code
from nccl_back.load.cooperative import gather_parts
from nccl_back.load.publish import publish_stored
from nccl_back.load.vote import OK
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import StorageLoader, load_from_storage
from nccl_back.model.skeleton import Model
from nccl_back.result import LoadResult
from nccl_back.transport import relay


def load_checkpoint(model: Model, spec: ModelSpec, settings: Settings,
                    on_filled: Callable[[str], None] | None = None) -> LoadResult:
    """The default :data:`StorageLoader`: the checkpoint, tensor by tensor."""
    return load_from_storage(model, spec, settings=settings, on_filled=on_filled)


@dataclass
class StorageLoad:
    """What this rank's storage load gave: its bytes and the hashes it publishes."""

    bytes: int = 0
    hashes: dict[str, str] = field(default_factory=dict)
    received: int = 0
    """Bytes a cooperative download's members sent this rank."""
    stream: relay.Stream | None = None
    """The stream it feeds (ended by the caller, also when the load failed)."""


def report(worker: Worker, a: Attempt) -> None:
    """Count and log why every rank loads from storage (``a.reason``)."""
    reason = a.reason
    if reason is None:
        return
    code = reason_code(reason)
    worker.metrics.record_fallback(code)
    if a.elected and isinstance(reason, NoHolder):
        # Nothing went wrong: the first worker of a version must download it.
        a.log.info("first_of_version", reason=code, detail=str(reason))
    else:
        a.log.warning("fallback_to_storage", reason=code, detail=str(reason))


def failed(stored: StorageLoad, e: BaseException) -> None:
    """The group's storage load failed (``e``): the stream it fed ends with the reason."""
    if stored.stream is not None:
        stored.stream.end(False, f"the download failed: {e!r}"[:300])


def serve_stored(worker: Worker, a: Attempt, stored: StorageLoad) -> LoadResult:
    """After every rank loaded from storage: the result; the truth and the version
    published, the stream ended, the download's followers owed."""
    reason = a.reason
    code = reason_code(reason) if reason is not None else "other"
    stream = stored.stream
    seconds = _clock.perf() - a.start
    detail = f"{code}: {reason}" if reason is not None else None
    result = LoadResult(
        source="storage", version=a.spec.version, bytes=stored.bytes, seconds=seconds,
        fallback_reason=detail, verified=True, timings=a.timings,
        # A member whose stream failed read its share too.
        storage_bytes=stored.bytes + a.share_bytes, peer_bytes=stored.received,
    )
    worker.metrics.record_load("storage", stored.bytes, seconds)
    a.log.info("loaded", source="storage", seconds=round(seconds, 3), gbps=round(result.gbps, 3))
    publish_stored(worker, a, stored.hashes)
    if stream is not None:  # the truth is out: receivers of the stream can verify
        stream.end(True)
    if a.elected:
        _owe_followers(worker, a)
    # Every rank has published (or logged why not) before rank 0 lets go of the
    # download lease: waiters then find every rank's peer at once.
    gather(OK, a.group)
    return result


def _owe_followers(worker: Worker, a: Attempt) -> None:
    """The workers that waited for this elected worker's download (its download group)
    wait for it alone, and may ask for a while yet (as long as its stream lingers): owed
    a send, so a close meanwhile still serves them (:meth:`PeerServer.owe`)."""
    try:
        group = worker.registry.download_group(a.spec.version, a.world)
    except NcclBackError as e:  # they find another way: a download of their own
        a.log.info("download_group_unread", error=str(e))
        return
    worker.server.owe([w for w in group if w != worker.id],
                      worker.settings.cohort_window + relay.LINGER)


def _split(a: Attempt) -> tuple[int, int | None] | None:
    """``(members, part held)`` of the cooperative download this elected worker gathers:
    the roster it named, or, taking over as a former member whose share it read (the
    first elected worker died), that split again with its own part held; None: a
    whole download."""
    if a.roster is not None and len(a.roster) > 1:
        return len(a.roster), None
    if a.member is not None and a.share_bytes > 0:
        return a.member[1], a.member[0]
    return None


def load_and_hash(worker: Worker, a: Attempt, loader: StorageLoader, stored: StorageLoad) -> None:
    """Fill this rank's tensors from storage (an elected worker gathers its cooperative
    download's parts and streams), then hash them: into ``stored``."""
    s = worker.settings
    t = _clock.perf()
    # An engine's own loader may rewrite tensors after loading them, and reports no
    # per-tensor fills: only the checkpoint's loader streams.
    streams = a.elected and loader is load_checkpoint
    split = _split(a) if streams else None
    if split is not None:
        got = gather_parts(worker, a, *split)
        a.log.info("download_gathered", members=split[0], held=split[1],
                   read_for=list(got.read_for), bytes=got.bytes, received=got.received)
        stored.received, nbytes = got.received, got.bytes
    if streams:
        stored.stream = worker.cohorts.open_stream(a.replica(), a.log)
    if split is None:
        on_filled = stored.stream.filled if stored.stream is not None else None
        result = (load_checkpoint(a.model, a.spec, s, on_filled=on_filled) if streams
                  else loader(a.model, a.spec, s))
        nbytes = result.bytes
        a.timings.update({f"storage.{k}": v for k, v in result.timings.items()})
    if stored.stream is not None:
        stored.stream.loaded()
    a.timings["storage"] = _clock.perf() - t
    t = _clock.perf()
    hashes = worker.verifier.layer_truth(a.model)
    a.timings["hash"] = _clock.perf() - t
    stored.bytes, stored.hashes = nbytes, hashes
