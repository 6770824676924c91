"""Local hand-off: a sidecar that holds loaded weights gives them to a process on the
same host, with no storage and no network (issue 4, item 2).

The sidecar runs a :class:`HandoffServer`; an inference process calls :func:`attach`
with its skeleton and the server's Unix socket path. The protocol is one JSON line each
way (never pickle)::

    consumer -> {"protocol": 1, "version", "manifest_digest", "mode"}
    server   -> {"ok": false, "reason": "version" | "manifest" | ..., "message", ...}
              | {"ok": true, "kind": "shm" | "cuda_ipc", ..., "layout", "hashes"}

The server refuses a different version or manifest before anything is mapped; the
consumer then raises :class:`AttachError` naming what differs (for a manifest, the
tensors, from the server's manifest sent with the refusal).

Where the bytes are. At ``start()`` the server packs every canonical tensor into one
*arena* (``skeleton.ALIGN``-ed offsets, the consolidated layout, a name -> offset map) and re-points its own
model's tensors into it, so the host (or GPU) holds one copy. After ``start()`` the
server's model must be treated as read-only and its tensors are contiguous.

- CPU: the arena is one POSIX shared-memory segment ``/dev/shm/nccl_back_<random>``,
  created by ``multiprocessing.shared_memory.SharedMemory`` (mode 0600, so consumer
  and sidecar run as the same user; registered with the sidecar's resource tracker,
  which unlinks it if the sidecar dies). Both sides map the file with their own
  ``mmap`` object handed to ``torch.frombuffer``, which keeps the mmap alive as long
  as any tensor uses it: a ``SharedMemory`` object would unmap on garbage collection
  under live tensors, and on Python < 3.13 attaching one registers the segment with
  the *consumer's* resource tracker, which unlinks it when the consumer exits. The
  consumer maps copy-on-write (``MAP_PRIVATE``): pages are shared until it writes,
  and its writes never reach the sidecar or other consumers.
- GPU: the arena is one CUDA allocation, exported per request as a CUDA IPC handle
  (``UntypedStorage._share_cuda_``, bytes as base64) and opened by the consumer with
  ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` (torch's own ref counting).
  Not available with ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF``.

Modes. ``copy``: the consumer copies each tensor into its own skeleton tensors and
drops the mapping; its tensors are its own, and killing the sidecar afterwards changes
nothing. ``zero_copy``: the consumer's tensors are re-pointed to views of the arena
(no copy, no second host copy). Observed on Linux (tests/test_handoff.py): after the
sidecar is SIGKILLed and the segment unlinked, a zero-copy consumer's tensors stay
valid and unchanged, because a mapping keeps a tmpfs file's pages alive until it is
unmapped. On GPU the sidecar must outlive a zero-copy consumer: CUDA IPC memory
belongs to the exporting process.

The segment lives in /dev/shm, so it counts against the container's memory and needs a
/dev/shm large enough for the model (containers get 64 MiB by default; mount a memory
``emptyDir`` there, shared by sidecar and consumer). Space is reserved at ``start()``,
so a too-small /dev/shm is an :class:`AttachError`, not a SIGBUS. If the sidecar dies,
its resource tracker unlinks the segment (observed: right after a SIGKILL, with a
"leaked shared_memory objects" warning) and the next server replaces the stale socket.

``close()`` stops the server, removes the socket and unlinks the segment: no new
consumer can map it, and its memory is freed when the last mapping (the server
model's, zero-copy consumers') goes away.

After mapping, the consumer recomputes :func:`nccl_back.model.integrity.layer_hashes` and
compares them with the hashes the server sent (:class:`WeightVerificationError`).

Local doors. The socket lives in a directory that nobody but its owner (or root) can
write: the server creates it 0700 when missing and refuses one that others can write
(a squatter there could replace the socket), and binds the socket 0600 under a
restrictive umask. :func:`attach` refuses such a directory too, then checks with
``SO_PEERCRED`` that the process listening on the socket runs as ``expected_uid``
(default: the consumer's own), so a socket someone else put there is never trusted;
the server likewise answers only its own user (or root). /dev/shm is writable by
everyone, so the consumer maps a segment only after checking the very descriptor it
maps (opened with ``O_NOFOLLOW``): a regular file, owned by the sidecar's uid, its own
or root, writable by nobody else, and at least as large as the reply says
(:func:`check_segment`); anything else is an :class:`AttachError` naming the problem.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn

from nccl_back import bounded_json
from nccl_back.errors import AttachError, ConfigError, SkeletonError
from nccl_back.log import get_logger
from nccl_back.model.integrity import HashMode, compare, layer_hashes
from nccl_back.model.skeleton import (
    ALIGN,
    Manifest,
    Model,
    dtype_from_name,
    flat_layout,
    manifest,
    model_device,
    named_tensors,
)
from nccl_back.result import LoadResult

AttachMode = Literal["copy", "zero_copy"]

# 2: arena offsets are skeleton.ALIGN (64) multiples, the consolidated layout.
PROTOCOL = 2
_SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"nccl_back_[0-9a-f]{16}")
#: Linux >= 5.14; Python < 3.13 lacks the constant. Maps all pages in one call, which
#: is ~25% faster than faulting 4 KiB pages one by one during a copy (measured).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MAX_REQUEST = 1 << 20
_MAX_REPLY = 256 << 20
#: Largest arena a reply may name (1 PiB): a bound on outside data, not a model limit.
_MAX_ARENA = 1 << 50
_ACCEPT_POLL = 0.1
_HANDLER_THREADS = 8
#: Connections being served or waiting for a handler at most; more are closed at once.
_MAX_PENDING = 64
#: ``struct ucred`` (pid, uid, gid) as ``SO_PEERCRED`` returns it on Linux.
_UCRED = struct.Struct("3i")
# os.umask is process-wide: one binder at a time, restored right after.
_UMASK_LOCK = threading.Lock()

_log = get_logger(__name__)


class HandoffServer:
    """Serves a loaded model to consumers on this host over the Unix socket ``socket_path``.

    ``hashes`` are the ground-truth layer hashes (from the storage load, computed with
    ``hash_mode``); when omitted they are computed from the model at ``start()``, which
    then only guards the hand-off itself. ``io_timeout`` bounds every socket operation
    of one consumer's request. Use as a context manager or call ``start()``/``close()``.
    """

    def __init__(
        self,
        model: Model,
        version: str,
        socket_path: str,
        hashes: Mapping[str, str] | None = None,
        *,
        hash_mode: HashMode = "sampled",
        io_timeout: float = 5.0,
    ) -> None:
        if not version:
            raise ConfigError("version must be a non-empty string")
        if io_timeout <= 0:
            raise ConfigError(f"io_timeout={io_timeout!r}: must be a positive number of seconds")
        if hash_mode not in ("sampled", "full"):
            raise ConfigError(f"hash_mode={hash_mode!r}: choose 'sampled' or 'full'")
        self.model = model
        self.version = version
        self.socket_path = socket_path
        self.hash_mode: HashMode = hash_mode
        self.io_timeout = io_timeout
        self._hashes = dict(hashes) if hashes is not None else None
        self._manifest: Manifest | None = None
        self._layout: list[tuple[str, int]] = []
        self._arena: torch.Tensor | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._listener: socket.socket | None = None
        self._socket_ino: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._share_lock = threading.Lock()
        # Bounds the pool's queue, which is unbounded: each entry holds a descriptor.
        self._slots = threading.BoundedSemaphore(_MAX_PENDING)
        self._log = _log.bind(socket=socket_path, version=version)

    @property
    def segment_name(self) -> str | None:
        """Name of the shared-memory segment under /dev/shm (CPU models, once started)."""
        return self._shm.name if self._shm is not None else None

    def start(self) -> HandoffServer:
        """Pack the model into the arena, bind the socket and serve in a background thread.

        Raises :class:`AttachError` if the segment or the socket cannot be made (the
        message says why), or if this server was already started or closed.
        """
        if self._thread is not None or self._stop.is_set():
            raise AttachError(
                f"hand-off server at {self.socket_path} was already started or closed;"
                " create a new one"
            )
        try:
            self._pack()
            if self._hashes is None:
                self._hashes = layer_hashes(self.model, self.hash_mode)
            self._listener = self._bind()
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(_HANDLER_THREADS, thread_name_prefix="handoff-conn")
        self._thread = threading.Thread(
            target=self._accept_loop, name="handoff-accept", daemon=True
        )
        self._thread.start()
        self._log.info(
            "handoff_serving",
            bytes=self._manifest.nbytes if self._manifest is not None else 0,
            tensors=len(self._layout),
            segment=self.segment_name,
        )
        return self

    def close(self) -> None:
        """Stop serving, remove the socket and unlink the segment. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.io_timeout + 1)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                # Only remove the path if it is still our socket, not a successor's.
                if os.lstat(self.socket_path).st_ino == self._socket_ino:
                    os.unlink(self.socket_path)
        if self._shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
            self._shm = None
        self._arena = None

    def __enter__(self) -> HandoffServer:
        return self if self._thread is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- arena -------------------------------------------------------------------------

    def _pack(self) -> None:
        tensors, _ = named_tensors(self.model)
        self._manifest = manifest(self.model)
        device = model_device(self.model)
        # The arena's layout is the consolidated skeleton's (same order, same ALIGN).
        offsets, end = flat_layout(self._manifest)
        self._layout.extend(offsets.items())
        total = max(end, 1)  # a segment cannot be empty
        if device.type == "cpu":
            arena = self._create_segment(total)
        elif device.type == "cuda":
            laid_out = _laid_out(tensors, offsets, total)
            if laid_out is not None:
                # A consolidated skeleton already is the arena: export it as it is,
                # no second copy of the model on the GPU.
                self._arena = laid_out
                return
            arena = torch.empty(total, dtype=torch.uint8, device=device)
        else:
            raise AttachError(f"cannot serve a model on {device}: only cpu and cuda")
        views = _views(arena, self._manifest, dict(self._layout))
        originals = _originals(self.model)
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(tensors[name])
        # Re-point every holder (tied names included) only after all copies, so the old
        # storage of each tensor is freed as soon as its last holder moves.
        _repoint(originals, views, self._manifest.aliases)
        self._arena = arena

    def _create_segment(self, size: int) -> torch.Tensor:
        name = f"nccl_back_{secrets.token_hex(8)}"
        try:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            # Python's own mapping is not used: see the module docstring.
            self._shm.close()
            return _map_segment(name, size, writable=True)
        except OSError as e:
            raise AttachError(
                f"cannot create a {size}-byte shared-memory segment in {_SHM_DIR}: {e}"
                " (a container's /dev/shm is 64 MiB unless a larger one is mounted)"
            ) from e

    # -- socket ------------------------------------------------------------------------

    def _bind(self) -> socket.socket:
        path = self.socket_path
        private_dir(os.path.dirname(os.path.abspath(path)), create=True)
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise AttachError(f"{path} exists and is not a socket; refusing to replace it")
            if _listening(path):
                raise AttachError(f"another hand-off server is already listening at {path}")
            os.unlink(path)  # left behind by a server that crashed
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _UMASK_LOCK:
                # Created 0600 from the start: a chmod after bind leaves a window.
                old = os.umask(0o177)
                try:
                    listener.bind(path)
                finally:
                    os.umask(old)
            os.chmod(path, 0o600)
            listener.listen(16)
            listener.settimeout(_ACCEPT_POLL)
        except OSError as e:
            listener.close()
            raise AttachError(f"cannot listen on {path}: {e}") from e
        self._socket_ino = os.lstat(path).st_ino
        return listener

    def _accept_loop(self) -> None:
        listener, pool = self._listener, self._pool
        if listener is None or pool is None:
            return
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._stop.is_set():
                    self._log.exception("handoff_accept_failed")
                return
            if not self._slots.acquire(blocking=False):
                self._log.warning("handoff_busy", pending=_MAX_PENDING)
                conn.close()
                continue
            try:
                pool.submit(self._handle_slot, conn)
            except RuntimeError:  # the pool was shut down by close()
                self._slots.release()
                conn.close()
                return

    def _handle_slot(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        finally:
            self._slots.release()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            deadline = time.monotonic() + self.io_timeout
            uid = peer_uid(conn)
            if uid not in (os.geteuid(), 0):
                # The socket is 0600 in a private directory; refuse anyone else anyway.
                self._log.warning("handoff_peer_refused", uid=uid)
                return
            try:
                request = bounded_json.loads(
                    _recv_line(conn, deadline, _MAX_REQUEST), max_bytes=_MAX_REQUEST
                )
                reply = self._answer(request)
                _send_line(conn, reply, deadline)
            except (OSError, ValueError) as e:  # a consumer that went away or sent garbage
                self._log.warning("handoff_request_failed", error=str(e))
            except Exception:
                # A pool thread would swallow it silently: log it, keep serving others.
                self._log.exception("handoff_request_crashed")

    def _answer(self, request: Any) -> dict[str, Any]:
        man = self._manifest
        if man is None or self._arena is None:
            return _refusal("closed", "the server is closing")
        if not isinstance(request, dict) or request.get("protocol") != PROTOCOL:
            return _refusal("protocol", f"expected a protocol {PROTOCOL} request object")
        if request.get("version") != self.version:
            self._log.info("handoff_refused", reason="version", theirs=request.get("version"))
            return _refusal(
                "version",
                f"sidecar serves version {self.version!r}, consumer asked for"
                f" {request.get('version')!r}",
                version=self.version,
            )
        if request.get("manifest_digest") != man.digest:
            self._log.info("handoff_refused", reason="manifest")
            return _refusal("manifest", "different tensors", manifest=man.to_json())
        mode = request.get("mode")
        if mode not in ("copy", "zero_copy"):
            return _refusal("mode", f"unknown mode {mode!r}")
        reply: dict[str, Any] = {
            "ok": True,
            "protocol": PROTOCOL,
            "version": self.version,
            "layout": self._layout,
            "hashes": self._hashes,
            "hash_mode": self.hash_mode,
            "size": self._arena.numel(),
        }
        if self._shm is not None:
            reply.update(kind="shm", segment=self._shm.name)
        else:
            try:
                reply.update(kind="cuda_ipc", cuda=self._share_cuda())
            except RuntimeError as e:
                self._log.warning("handoff_export_failed", error=str(e))
                return _refusal("export", f"cannot export a CUDA IPC handle: {e}")
        self._log.info("handoff_served", mode=mode)
        return reply

    def _share_cuda(self) -> dict[str, Any]:
        arena = self._arena
        if arena is None:
            raise AttachError("the server is closing")
        # A fresh export per consumer: each carries its own IPC ref counter, which that
        # consumer releases when it drops the mapping (torch's CUDA IPC protocol).
        with self._share_lock, torch.cuda.device(arena.device):
            (device, handle, size, offset, counter, counter_offset, event, sync) = (
                arena.untyped_storage()._share_cuda_()
            )
        return {
            "device": device,
            # The index means nothing in a container with another CUDA_VISIBLE_DEVICES:
            # the consumer finds the GPU by its UUID.
            "uuid": gpu_uuid(int(device)),
            "handle": _b64(handle),
            "storage_size": size,
            "storage_offset": offset,
            "tensor_offset": arena.storage_offset(),
            "ref_counter": _b64(counter),
            "ref_counter_offset": counter_offset,
            "event": _b64(event),
            "event_sync_required": bool(sync),
        }


def attach(
    model: Model,
    endpoint: str,
    mode: AttachMode = "copy",
    timeout: float = 10.0,
    *,
    version: str,
    verify: bool = True,
    expected_uid: int | None = None,
) -> LoadResult:
    """Fill ``model`` (a skeleton) from the sidecar listening at ``endpoint`` (a socket path).

    The socket's directory must be writable by its owner only, and the process
    listening must run as ``expected_uid`` (default: this process's effective uid),
    checked with ``SO_PEERCRED``; otherwise :class:`AttachError`, before any byte is
    sent.

    The sidecar must serve the same ``version`` and the same manifest (tensor names,
    shapes, dtypes) as the skeleton, or :class:`AttachError` names the difference
    before anything is mapped; any failure to reach the sidecar or map its memory is
    an :class:`AttachError` too. ``mode`` is ``"copy"``
    (the tensors stay the consumer's own) or ``"zero_copy"`` (they become views of the
    sidecar's memory; see the module docstring). ``timeout`` bounds the exchange with
    the sidecar. With ``verify`` the layer hashes are recomputed and compared with the
    sidecar's (:class:`WeightVerificationError` on a mismatch).
    """
    if mode not in ("copy", "zero_copy"):
        raise ConfigError(f"mode={mode!r}: choose 'copy' or 'zero_copy'")
    if timeout <= 0:
        raise ConfigError(f"timeout={timeout!r}: must be a positive number of seconds")
    uid = os.geteuid() if expected_uid is None else expected_uid
    log = _log.bind(endpoint=endpoint, version=version, mode=mode)
    started = time.perf_counter()
    mine = manifest(model)
    reply = _request(
        endpoint,
        {"protocol": PROTOCOL, "version": version, "manifest_digest": mine.digest, "mode": mode},
        timeout,
        uid,
    )
    if not reply.get("ok"):
        raise AttachError(_refusal_message(endpoint, version, mine, reply))
    timings = {"request": time.perf_counter() - started}
    mark = time.perf_counter()
    try:
        arena = _open_arena(reply, populate=mode == "copy", owner=uid)
        views = _views(arena, mine, _layout(reply, mine, arena.numel()))
    except (KeyError, TypeError, ValueError) as e:
        raise AttachError(f"malformed reply from sidecar at {endpoint}: {e!r}") from e
    timings["map"] = time.perf_counter() - mark
    mark = time.perf_counter()
    if mode == "copy":
        _copy_into(model, views)
    else:
        _zero_copy(model, views, mine.aliases)
    del views, arena  # in copy mode this unmaps the segment
    timings["copy"] = time.perf_counter() - mark
    if verify:
        mark = time.perf_counter()
        expected, hash_mode = reply.get("hashes"), reply.get("hash_mode")
        if not isinstance(expected, dict) or hash_mode not in ("sampled", "full"):
            raise AttachError(f"sidecar at {endpoint} sent no usable layer hashes")
        compare(expected, layer_hashes(model, hash_mode))
        timings["verify"] = time.perf_counter() - mark
    seconds = time.perf_counter() - started
    log.info("attached", bytes=mine.nbytes, seconds=round(seconds, 4), verified=verify)
    return LoadResult(
        source="local",
        version=version,
        bytes=mine.nbytes,
        seconds=seconds,
        peer_id=endpoint,
        verified=verify,
        timings=timings,
    )


# -- consumer helpers ----------------------------------------------------------------


def _request(
    endpoint: str, request: dict[str, Any], timeout: float, expected_uid: int
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    directory = os.path.dirname(os.path.abspath(endpoint))
    if os.path.isdir(directory):  # a missing one is reported as a missing socket below
        private_dir(directory, create=False, owner=expected_uid)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(endpoint)
            served_by = peer_uid(conn)
            if served_by != expected_uid:
                raise AttachError(
                    f"the socket at {endpoint} is served by uid {served_by}, expected uid"
                    f" {expected_uid}; refusing it (another user's socket?)"
                )
            _send_line(conn, request, deadline)
            reply = bounded_json.loads(_recv_line(conn, deadline, _MAX_REPLY), max_bytes=_MAX_REPLY)
    except FileNotFoundError as e:
        raise AttachError(f"no hand-off socket at {endpoint} (is the sidecar running?)") from e
    except ConnectionRefusedError as e:
        raise AttachError(f"nothing listening at {endpoint} (stale socket?)") from e
    except TimeoutError as e:
        raise AttachError(f"sidecar at {endpoint} did not answer within {timeout}s") from e
    except OSError as e:
        raise AttachError(f"hand-off with sidecar at {endpoint} failed: {e}") from e
    except ValueError as e:
        raise AttachError(f"malformed reply from sidecar at {endpoint}: {e}") from e
    if not isinstance(reply, dict):
        raise AttachError(f"malformed reply from sidecar at {endpoint}: not an object")
    return reply


def _refusal_message(endpoint: str, version: str, mine: Manifest, reply: dict[str, Any]) -> str:
    reason = reply.get("reason")
    if reason == "version":
        return (
            f"sidecar at {endpoint} serves version {reply.get('version')!r},"
            f" this model is version {version!r}"
        )
    if reason == "manifest":
        try:
            theirs = Manifest.from_json(reply["manifest"])
        except (KeyError, TypeError, ValueError, SkeletonError) as e:
            return f"sidecar at {endpoint} holds different tensors (unreadable manifest: {e})"
        return (
            f"sidecar at {endpoint} holds different tensors (this skeleton vs sidecar):"
            f" {mine.diff(theirs)}"
        )
    return f"sidecar at {endpoint} refused ({reason}): {reply.get('message')}"


def _open_arena(reply: dict[str, Any], *, populate: bool, owner: int) -> torch.Tensor:
    size = reply["size"]
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= _MAX_ARENA:
        raise ValueError(f"arena size {size!r} is not a positive byte count")
    if reply["kind"] == "shm":
        name = reply["segment"]
        if not isinstance(name, str) or not _SHM_NAME.fullmatch(name):
            raise ValueError(f"segment name {name!r} is not one a hand-off server creates")
        try:
            return _map_segment(name, size, writable=False, populate=populate, owner=owner)
        except OSError as e:
            raise AttachError(f"cannot map segment {name}: {e}") from e
    if reply["kind"] == "cuda_ipc":
        if not isinstance(reply["cuda"], dict):
            raise ValueError("cuda must be an object")
        return _open_cuda(reply["cuda"], size)
    raise ValueError(f"unknown arena kind {reply['kind']!r}")


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it (``GPU-...``)."""
    raw = str(torch.cuda.get_device_properties(index).uuid)
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def local_gpu_index(uuid: str, visible: list[str]) -> int:
    """This process's index of the GPU named ``uuid``; :class:`AttachError` if unseen."""
    if not uuid:
        raise AttachError("the sidecar did not name its GPU by UUID; upgrade the sidecar")
    if uuid not in visible:
        raise AttachError(
            f"the sidecar's weights are on GPU {uuid}, which this process cannot see"
            f" (visible: {', '.join(visible) or 'none'}); give the consumer that GPU"
            " (CUDA_VISIBLE_DEVICES / the device plugin) or attach with a CPU skeleton"
        )
    return visible.index(uuid)


def _open_cuda(info: dict[str, Any], size: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise AttachError("the sidecar shares CUDA memory but this process has no CUDA")
    visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    index = local_gpu_index(str(info.get("uuid", "")), visible)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            (size,),
            (1,),
            int(info["tensor_offset"]),
            torch.storage.TypedStorage,
            torch.uint8,
            index,
            _unb64(info["handle"]),
            int(info["storage_size"]),
            int(info["storage_offset"]),
            False,
            _unb64(info["ref_counter"]),
            int(info["ref_counter_offset"]),
            _unb64(info["event"]),
            bool(info["event_sync_required"]),
        )
    except RuntimeError as e:
        raise AttachError(f"cannot open the sidecar's CUDA IPC handle: {e}") from e


def _layout(reply: dict[str, Any], mine: Manifest, size: int) -> dict[str, int]:
    layout = {str(name): int(offset) for name, offset in reply["layout"]}
    if sorted(layout) != sorted(mine.names):
        raise ValueError("layout names differ from the manifest")
    for entry in mine.entries:
        offset = layout[entry.name]
        if offset < 0 or offset % ALIGN or offset + entry.nbytes > size:
            raise ValueError(f"offset {offset} of {entry.name} is outside the arena")
    return layout


def _copy_into(model: Model, views: Mapping[str, torch.Tensor]) -> None:
    tensors, _ = named_tensors(model)
    with torch.no_grad():
        for name, view in views.items():
            tensors[name].copy_(view)
    devices = {t.device for t in views.values()} | {t.device for t in tensors.values()}
    for device in devices:
        if device.type == "cuda":
            # The mapping is released right after: copies must be done reading it.
            torch.cuda.synchronize(device)


def _zero_copy(model: Model, views: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    device = model_device(model)
    for name, view in views.items():
        if view.device != device:
            raise AttachError(
                f"zero_copy needs the skeleton on the sidecar's device {view.device},"
                f" but {name} is on {device}; use mode='copy'"
            )
    _repoint(_originals(model), views, aliases)


# -- shared helpers ------------------------------------------------------------------


def private_dir(directory: str, *, create: bool, owner: int | None = None) -> None:
    """Make sure ``directory`` is one only ``owner`` (default: this process) or root can
    write: created 0700 when missing and ``create``; :class:`AttachError` when it is a
    link or not a directory, belongs to someone else, or its group or others may write.
    """
    uid = os.geteuid() if owner is None else owner
    if create and not os.path.lexists(directory):
        with _UMASK_LOCK:
            old = os.umask(0o077)
            try:
                os.makedirs(directory, mode=0o700, exist_ok=True)
            finally:
                os.umask(old)
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise AttachError(f"socket directory {directory}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise AttachError(f"socket directory {directory} is not a directory (a symlink?)")
    if st.st_uid not in (uid, 0):
        raise AttachError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not {uid} (or root);"
            " refusing it"
        )
    if st.st_mode & 0o022:
        raise AttachError(
            f"socket directory {directory} is writable by others (mode {st.st_mode & 0o7777:o});"
            " put the socket in a directory of its own (the server creates it 0700)"
        )


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(raw)[1])


def _laid_out(
    tensors: dict[str, torch.Tensor], offsets: dict[str, int], total: int
) -> torch.Tensor | None:
    """The one allocation holding every tensor at its arena offset, as uint8, or None."""
    if not tensors:
        return None
    first = next(iter(tensors.values()))
    storage = first.untyped_storage()
    base = first.data_ptr() - offsets[next(iter(tensors))]
    for name, t in tensors.items():
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() != base + offsets[name]):
            return None
    start = base - storage.data_ptr()
    if start < 0 or start + total > storage.nbytes():
        return None
    view = torch.empty(0, dtype=torch.uint8, device=first.device)
    return view.set_(storage, start, (total,), (1,))


def _map_segment(
    name: str, size: int, *, writable: bool, populate: bool = False, owner: int | None = None
) -> torch.Tensor:
    """The segment as a uint8 tensor that keeps its own mmap alive (see module docstring).

    ``populate`` maps every page up front (read-only, so no copy-on-write is triggered),
    for a caller about to read all of them. A consumer (not ``writable``) maps only a
    regular file of at least ``size`` bytes that belongs to ``owner`` (default: this
    process's user) or root and that neither group nor others may write
    (:func:`check_segment`); it opens without following links and checks the very file
    descriptor it maps, so the file cannot be swapped between check and map.
    """
    path = os.path.join(_SHM_DIR, name)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    # A consumer opens non-blocking: a FIFO put in the segment's place would block it.
    flags |= os.O_RDWR if writable else os.O_RDONLY | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AttachError(f"segment {name} is a symbolic link; refusing to map it") from e
        raise
    try:
        if writable:
            # Reserve the pages now: a write into a sparse tmpfs file that cannot grow
            # kills the process with SIGBUS, whereas this raises ENOSPC.
            os.posix_fallocate(fd, 0, size)
        else:
            check_segment(name, os.fstat(fd), size, os.geteuid() if owner is None else owner)
        actual = os.fstat(fd).st_size
        if actual < size:
            raise AttachError(f"segment {name} has {actual} bytes, expected {size}")
        # Copy-on-write for consumers: reads share the pages, writes stay private.
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if populate:
        with contextlib.suppress(OSError):  # older kernels: pages fault in on first read
            mapping.madvise(_MADV_POPULATE_READ)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def check_segment(name: str, st: os.stat_result, size: int, owner: int) -> None:
    """Refuse (:class:`AttachError` naming the problem) a segment that a consumer must
    not map: not a regular file, owned by another user than ``owner`` (the sidecar's),
    this process's or root, writable
    by group or others (anyone could rewrite the weights under the consumer after the
    hashes were checked), or smaller than ``size`` bytes (a read past the end of a
    mapping is SIGBUS)."""
    if not stat.S_ISREG(st.st_mode):
        raise AttachError(f"segment {name} is not a regular file; refusing to map it")
    if st.st_uid not in (owner, os.geteuid(), 0):
        raise AttachError(
            f"segment {name} belongs to uid {st.st_uid}, expected uid {owner} (or root);"
            " refusing to map it"
        )
    if st.st_mode & 0o022:
        raise AttachError(
            f"segment {name} is writable by group or others (mode {st.st_mode & 0o7777:o});"
            " refusing to map it"
        )
    if size < 1 or st.st_size < size:
        raise AttachError(f"segment {name} has {st.st_size} bytes, expected {size}")


def _views(
    arena: torch.Tensor, man: Manifest, layout: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    views: dict[str, torch.Tensor] = {}
    for entry in man.entries:
        start = layout[entry.name]
        raw = arena[start : start + entry.nbytes]
        views[entry.name] = raw.view(dtype_from_name(entry.dtype)).view(entry.shape)
    return views


def _originals(model: Model) -> dict[str, torch.Tensor]:
    """Every state-dict name -> the live Parameter or buffer object (not ``.data``)."""
    modules = (
        [("", model)] if isinstance(model, nn.Module) else [(k + ".", model[k]) for k in model]
    )
    return {
        prefix + name: t
        for prefix, module in modules
        for name, t in module.state_dict(keep_vars=True).items()
    }


def _repoint(
    originals: Mapping[str, torch.Tensor],
    views: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
) -> None:
    with torch.no_grad():
        for name, t in originals.items():
            view = views[aliases.get(name, name)]
            if isinstance(t, nn.Parameter):
                t.data = view
            else:
                t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


def _refusal(reason: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "protocol": PROTOCOL, "reason": reason, "message": message, **extra}


def _send_line(conn: socket.socket, obj: Any, deadline: float) -> None:
    conn.settimeout(_remaining(deadline))
    conn.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")


def _recv_line(conn: socket.socket, deadline: float, limit: int) -> bytes:
    buf = bytearray()
    while True:
        conn.settimeout(_remaining(deadline))
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("connection closed before a complete line")
        end = chunk.find(b"\n")
        if end >= 0:
            return bytes(buf + chunk[:end])
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"line longer than {limit} bytes")


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _b64(data: bytes | None) -> str | None:
    return base64.b64encode(data).decode() if data is not None else None


def _unb64(data: str | None) -> bytes | None:
    return base64.b64decode(data) if data is not None else None
