"""The hand-off's serving half: :class:`HandoffServer` answers consumers on this host.

At ``start()`` it packs the model into its arena (unless the model was built in one,
:func:`.arena.host`), binds the socket 0600 in a private directory and answers each
request line from a small thread pool: a refusal, or the arena, its layout and the
layer hashes. ``close()`` unlinks the segment: its memory is freed with the last
mapping. A dead server's stale socket is replaced by the next server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nccl_back import _clock, bounded_json
from nccl_back.errors import AttachError, ConfigError
from nccl_back.load.verifier import Verifier
from nccl_back.log import get_logger
from nccl_back.model.integrity import HashMode
from nccl_back.model.skeleton import Model
from nccl_back.sidecar.handoff import arena, cuda
from nccl_back.sidecar.handoff.perms import UMASK_LOCK, peer_uid, private_dir
from nccl_back.sidecar.handoff.protocol import (
    MAX_REQUEST,
    MODES,
    PROTOCOL,
    recv_line,
    refusal,
    send_line,
)
from nccl_back.timing import HANDOFF_ACCEPT_POLL as _ACCEPT_POLL

_HANDLER_THREADS = 8
#: Connections being served or waiting for a handler at most; more are closed at once.
_MAX_PENDING = 64

_log = get_logger("nccl_back.sidecar.handoff")


class HandoffServer:
    """Serves a loaded model to consumers on this host over the Unix socket ``socket_path``.

    ``hashes``: the ground-truth layer hashes (``hash_mode``); omitted, they are computed
    at ``start()`` and guard only the hand-off. ``io_timeout`` bounds each socket call of
    a request. ``hosted``: the arena ``model`` was built in, served without a copy while
    the model lies in it, owned (and unlinked) by the server from here on.
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
        hosted: arena.Arena | None = None,
    ) -> None:
        self._hosted = hosted
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
        self._packed: arena.Arena | None = None  # what is served, from start() to close()
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
        shm = self._packed.shm if self._packed is not None else None
        return shm.name if shm is not None else None

    def start(self) -> HandoffServer:
        """Pack the model into the arena, bind the socket and serve in a background thread
        (:class:`AttachError` if that fails, or if started or closed before)."""
        if self._thread is not None or self._stop.is_set():
            raise AttachError(
                f"hand-off server at {self.socket_path} was already started or closed;"
                " create a new one"
            )
        try:
            self._packed = packed = self._pack()
            if self._hashes is None:
                self._hashes = Verifier(self.hash_mode, None).fingerprint(self.model)
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
            bytes=packed.manifest.nbytes,
            tensors=len(packed.layout),
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
        arena.release(self._packed)
        arena.release(self._hosted)
        self._packed = self._hosted = None

    def __enter__(self) -> HandoffServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pack(self) -> arena.Arena:
        hosted = self._hosted
        if hosted is not None and arena.holds(hosted, self.model):
            self._hosted = None  # unlinked as the served arena from here on
            return hosted
        if hosted is not None:
            # Something re-pointed the model's tensors: serve a fresh packed copy.
            self._log.warning("handoff_arena_repacked")
            arena.release(hosted)
            self._hosted = None
        return arena.pack(self.model)

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
            with UMASK_LOCK:
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
                pool.submit(self._handle, conn)
            except RuntimeError:  # the pool was shut down by close()
                self._slots.release()
                conn.close()
                return

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                deadline = _clock.monotonic() + self.io_timeout
                uid = peer_uid(conn)
                if uid not in (os.geteuid(), 0):
                    # The socket is 0600 in a private directory; refuse anyone else anyway.
                    self._log.warning("handoff_peer_refused", uid=uid)
                    return
                try:
                    request = bounded_json.loads(
                        recv_line(conn, deadline, MAX_REQUEST), max_bytes=MAX_REQUEST
                    )
                    reply = self._answer(request)
                    send_line(conn, reply, deadline)
                except (OSError, ValueError) as e:  # a consumer that went away or sent garbage
                    self._log.warning("handoff_request_failed", error=str(e))
                except Exception:
                    # A pool thread would swallow it silently: log it, keep serving others.
                    self._log.exception("handoff_request_crashed")
        finally:
            self._slots.release()

    def _answer(self, request: Any) -> dict[str, Any]:
        packed = self._packed
        if packed is None:
            return refusal("closed", "the server is closing")
        man = packed.manifest
        if not isinstance(request, dict) or request.get("protocol") != PROTOCOL:
            return refusal("protocol", f"expected a protocol {PROTOCOL} request object")
        if request.get("version") != self.version:
            self._log.info("handoff_refused", reason="version", theirs=request.get("version"))
            return refusal(
                "version",
                f"sidecar serves version {self.version!r}, consumer asked for"
                f" {request.get('version')!r}",
                version=self.version,
            )
        if request.get("manifest_digest") != man.digest:
            self._log.info("handoff_refused", reason="manifest")
            return refusal("manifest", "different tensors", manifest=man.to_json())
        mode = request.get("mode")
        if mode not in MODES:
            return refusal("mode", f"unknown mode {mode!r}")
        reply: dict[str, Any] = {
            "ok": True,
            "protocol": PROTOCOL,
            "version": self.version,
            "layout": packed.layout,
            "hashes": self._hashes,
            "hash_mode": self.hash_mode,
            "size": packed.tensor.numel(),
        }
        if packed.shm is not None:
            reply.update(kind="shm", segment=packed.shm.name)
        else:
            try:
                with self._share_lock:
                    reply.update(kind="cuda_ipc", cuda=cuda.share(packed.tensor))
            except RuntimeError as e:
                self._log.warning("handoff_export_failed", error=str(e))
                return refusal("export", f"cannot export a CUDA IPC handle: {e}")
        self._log.info("handoff_served", mode=mode)
        return reply


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True
