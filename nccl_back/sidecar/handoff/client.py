"""The hand-off's consuming half: :func:`attach` fills a skeleton from the local sidecar.

Modes. ``copy``: the consumer copies into its own tensors and drops the mapping.
``zero_copy``: its tensors become views of the arena (no second host copy); they stay
valid after the sidecar dies and the segment is unlinked, as a mapping keeps a tmpfs
file's pages alive (tests/test_handoff.py). On GPU the sidecar must outlive a zero-copy
consumer: CUDA IPC memory belongs to the exporting process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

import torch

from nccl_back import _clock, bounded_json
from nccl_back.errors import AttachError, ConfigError, SkeletonError
from nccl_back.load.verifier import Verifier
from nccl_back.log import get_logger
from nccl_back.model.skeleton import Manifest, Model, manifest, model_device, named_tensors
from nccl_back.result import LoadResult
from nccl_back.sidecar.handoff import arena, cuda
from nccl_back.sidecar.handoff.perms import peer_uid, private_dir
from nccl_back.sidecar.handoff.protocol import (
    MAX_ARENA,
    MAX_REPLY,
    MODES,
    PROTOCOL,
    AttachMode,
    recv_line,
    send_line,
)

_log = get_logger("nccl_back.sidecar.handoff")


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

    Before any byte is sent, the socket's directory must be its owner's alone and the
    listener must run as ``expected_uid`` (default: this process's). The sidecar must
    serve the same ``version`` and manifest, else :class:`AttachError` names the
    difference before anything is mapped (as for any failure to reach or map it).
    ``timeout`` bounds the exchange; with ``verify`` the layer hashes are recomputed
    (:class:`WeightVerificationError` on a mismatch).
    """
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r}: choose 'copy' or 'zero_copy'")
    if timeout <= 0:
        raise ConfigError(f"timeout={timeout!r}: must be a positive number of seconds")
    uid = os.geteuid() if expected_uid is None else expected_uid
    log = _log.bind(endpoint=endpoint, version=version, mode=mode)
    started = _clock.perf()
    mine = manifest(model)
    reply = _request(
        endpoint,
        {"protocol": PROTOCOL, "version": version, "manifest_digest": mine.digest, "mode": mode},
        timeout,
        uid,
    )
    if not reply.get("ok"):
        raise AttachError(_refusal_message(endpoint, version, mine, reply))
    timings = {"request": _clock.perf() - started}
    mark = _clock.perf()
    try:
        tensor = _open_arena(reply, populate=mode == "copy", owner=uid)
        views = arena.views(tensor, mine, arena.checked_layout(reply["layout"], mine, tensor.numel()))
    except (KeyError, TypeError, ValueError) as e:
        raise AttachError(f"malformed reply from sidecar at {endpoint}: {e!r}") from e
    timings["map"] = _clock.perf() - mark
    mark = _clock.perf()
    if mode == "copy":
        _copy_into(model, views)
    else:
        _zero_copy(model, views, mine.aliases)
    del views, tensor  # in copy mode this unmaps the segment
    timings["copy"] = _clock.perf() - mark
    if verify:
        mark = _clock.perf()
        expected, hash_mode = reply.get("hashes"), reply.get("hash_mode")
        if not isinstance(expected, dict) or hash_mode not in ("sampled", "full"):
            raise AttachError(f"sidecar at {endpoint} sent no usable layer hashes")
        # Unkeyed: a local consumer holds no fleet secret (the socket's checks vouch
        # for the sidecar; the hashes catch a misplaced or torn copy).
        Verifier(hash_mode, None).check_layers(model, expected)
        timings["verify"] = _clock.perf() - mark
    seconds = _clock.perf() - started
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


def _request(
    endpoint: str, request: dict[str, Any], timeout: float, expected_uid: int
) -> dict[str, Any]:
    deadline = _clock.monotonic() + timeout
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
            send_line(conn, request, deadline)
            reply = bounded_json.loads(recv_line(conn, deadline, MAX_REPLY), max_bytes=MAX_REPLY)
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
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_ARENA:
        raise ValueError(f"arena size {size!r} is not a positive byte count")
    if reply["kind"] == "shm":
        name = reply["segment"]
        if not isinstance(name, str) or not arena.SHM_NAME.fullmatch(name):
            raise ValueError(f"segment name {name!r} is not one a hand-off server creates")
        try:
            return arena.map_segment(name, size, writable=False, populate=populate, owner=owner)
        except OSError as e:
            raise AttachError(f"cannot map segment {name}: {e}") from e
    if reply["kind"] == "cuda_ipc":
        if not isinstance(reply["cuda"], dict):
            raise ValueError("cuda must be an object")
        return cuda.open_shared(reply["cuda"], size)
    raise ValueError(f"unknown arena kind {reply['kind']!r}")


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
    arena.repoint(arena.originals(model), views, aliases)
