"""The health port's connections: one thread, one epoll, a bounded table, deadlines.

:class:`Loop` accepts, reads, parses (:mod:`nccl_back.sidecar.http`), hands each
request to its handler, writes the reply and closes; it never blocks on a client, so
no flood of idle or dripping clients can make a kubelet probe (1 s timeout) miss:

- *The accept queue never stays full* (a dropped SYN is retransmitted after 1 s, past
  the probe's timeout): :data:`LISTENERS` sockets share the port with :data:`BACKLOG`
  each; ``TCP_DEFER_ACCEPT`` keeps silent clients in the SYN queue; each turn serves
  readable connections first, then accepts until the queues are empty (for
  :data:`ACCEPT_BUDGET` at most); an accept costs one read and one registration.
- *A bounded table that makes room instead of refusing*: beyond ``max_connections`` a
  new connection evicts the oldest one still sending its request, after a last read (a
  probe whose request arrived is answered). Eviction is a plain close, not a reset: the
  flooder's end stays open, holding its port, so it slows itself down (a reset made the
  same flood 3-4 times faster, and probes failed).
- *A deadline on the whole request*: ``timeout`` seconds from accept to the reply's last
  byte, then a best-effort ``408``. A slow handler (the drain) runs on its own thread,
  exempt, then gets a fresh deadline for the reply.
- *Out of descriptors* (``EMFILE``): evict the oldest unfinished connection, else give
  up a spare descriptor to accept and close the next client, so the queue drains.

The limit is the GIL shared with the rest of the sidecar: beside a thread busy in
Python code each system call waits for it (about 3 ms per accepted connection instead
of 25 µs), so a flood above a few hundred connections a second outgrows the queues.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeAlias

from nccl_back import _clock
from nccl_back.log import get_logger
from nccl_back.sidecar.http import (
    MAX_HEAD_BYTES,
    TEXT,
    BadRequest,
    Request,
    parse_request,
    response,
)
from nccl_back.timing import DEFER_SECONDS

#: Listen backlog asked for; Linux caps it at ``net.core.somaxconn`` (4096 since 5.4).
BACKLOG = 4096
#: Listening sockets on the one port, each with its own accept queue (``SO_REUSEPORT``).
LISTENERS = 4
#: Seconds a turn may spend accepting before it serves the readable connections again.
ACCEPT_BUDGET = 0.02
#: A reply's bytes, or a slow callable (run off the loop) that returns them.
Answer: TypeAlias = "bytes | Callable[[], bytes]"
Handler: TypeAlias = "Callable[[str, Request], Answer]"
# Longest sleep of the loop with nothing to do (deadlines and close() wake it sooner).
_IDLE_TICK = 0.5
_READ = select.EPOLLIN | select.EPOLLRDHUP
_WRITE = select.EPOLLOUT
_TROUBLE = select.EPOLLERR | select.EPOLLHUP
# Sockets stay blocking (no system call to change that per connection); every call on
# them passes this flag instead.
_NOWAIT = socket.MSG_DONTWAIT


@dataclass(eq=False, slots=True)
class _Conn:
    sock: socket.socket
    fd: int
    client: str
    deadline: float | None
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytes = b""
    sent: int = 0
    state: str = "reading"  # reading -> (slow ->) writing -> closed
    mask: int = 0  # epoll events registered for it; 0: not registered


class Loop:
    """Serves every connection of ``listeners`` (from :func:`bind`) with ``handler``
    until :attr:`stop` is set and :meth:`wake` called (see the module docstring)."""

    def __init__(
        self, listeners: list[socket.socket], handler: Handler, *, max_connections: int,
        timeout: float,
    ) -> None:
        self.listeners = {s.fileno(): s for s in listeners}
        self.handler = handler
        self.max_connections = max_connections
        self.timeout = timeout
        self.stop = threading.Event()
        self._ep = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Insertion order is accept order, so the first unfinished entry is the oldest
        # (an OrderedDict: a plain dict's first entry is slow to find after many removals).
        self._conns: OrderedDict[int, _Conn] = OrderedDict()
        self._spare: int | None = _open_spare()
        self._evicted: list[socket.socket] = []
        self._done: list[tuple[_Conn, bytes]] = []
        self._done_lock = threading.Lock()
        # A slow handler (the drain) may block for minutes: never on the loop.
        self._slow = ThreadPoolExecutor(1, thread_name_prefix="nccl-back-drain")
        for fd in self.listeners:
            self._ep.register(fd, select.EPOLLIN)
        self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
        self._log = get_logger("nccl_back.sidecar.health")

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the loop is awake anyway
            self._wake_w.send(b"x")

    def run(self) -> None:
        wake_fd = self._wake_r.fileno()
        try:
            while not self.stop.is_set():
                pending: list[socket.socket] = []
                for fd, events in self._ep.poll(self._next_timeout()):
                    if (listener := self.listeners.get(fd)) is not None:
                        pending.append(listener)
                    elif fd == wake_fd:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif (conn := self._conns.get(fd)) is not None:
                        self._guarded(conn, events)
                # After the readable ones: a burst of accepts may evict the oldest. New
                # descriptors appear only here, so no event above is for a reused one.
                if pending:
                    self._accept(pending)
                self._finish_slow()
                self._expire()
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._close_evicted()
            self._ep.close()
            for listener in self.listeners.values():
                listener.close()
            self._wake_r.close()
            self._wake_w.close()
            if self._spare is not None:
                os.close(self._spare)
            self._slow.shutdown(wait=False, cancel_futures=True)

    def _guarded(self, conn: _Conn, events: int) -> None:
        try:
            if conn.state == "reading" and events & (_READ | _TROUBLE):
                self._read(conn)
            elif conn.state == "writing" and events & (_WRITE | _TROUBLE):
                self._flush(conn)
        except Exception:  # one client's trouble never stops the loop
            self._log.exception("health_request_failed", client=conn.client)
            self._close(conn)

    def _next_timeout(self) -> float:
        deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None]
        if not deadlines:
            return _IDLE_TICK
        return min(max(min(deadlines) - _clock.monotonic(), 0.0), _IDLE_TICK)

    # -- accepting -----------------------------------------------------------------------

    def _accept(self, listeners: list[socket.socket]) -> None:
        """Accept from each of ``listeners`` in turn, 16 at a time, until every queue
        is empty or the turn's :data:`ACCEPT_BUDGET` is spent."""
        now = _clock.monotonic()
        deadline, stop_at = now + self.timeout, now + ACCEPT_BUDGET
        try:
            while listeners and _clock.monotonic() < stop_at:
                listeners = [s for s in listeners if self._accept_some(s, deadline)]
        finally:
            self._close_evicted()

    def _accept_some(self, listener: socket.socket, deadline: float) -> bool:
        """Up to 16 connections from ``listener``; False once its queue is empty."""
        for _ in range(16):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._out_of_descriptors(listener):
                    continue
                self._log.warning("health_accept_failed", error=str(e))
                return False
            if len(self._conns) >= self.max_connections and not self._make_room():
                _discard(sock)  # every slot waits on an authorized drain
                continue
            fd = sock.fileno()
            conn = _Conn(sock, fd, str(addr[0]), deadline)
            self._conns[fd] = conn
            # Accepted once data came (TCP_DEFER_ACCEPT): a probe's request is usually
            # here already, and is answered now, with no wait for the next turn.
            self._guarded(conn, _READ)
            if conn.state == "reading":
                self._set_mask(conn, _READ)
        return True

    def _make_room(self) -> bool:
        """Evict for one new connection (the oldest reading, after a last read that may
        answer it; else the oldest writing); False if every slot waits on a slow handler."""
        while len(self._conns) >= self.max_connections:
            victim = next((c for c in self._conns.values() if c.state == "reading"), None)
            if victim is None:
                victim = next((c for c in self._conns.values() if c.state == "writing"), None)
                if victim is None:
                    return False
                self._evict(victim)
                continue
            self._guarded(victim, _READ)
            if victim.state == "reading":
                self._evict(victim)
        return True

    def _evict(self, conn: _Conn) -> None:
        """Out of the table now; closed once the accept queue is empty (a close costs as
        much as an accept, and a full queue is what drops a probe), or at once when
        max_connections of them wait."""
        conn.state = "closed"
        self._conns.pop(conn.fd, None)
        self._evicted.append(conn.sock)
        if len(self._evicted) >= self.max_connections:
            self._close_evicted()

    def _close_evicted(self) -> None:
        evicted, self._evicted = self._evicted, []
        for sock in evicted:
            _discard(sock)

    def _out_of_descriptors(self, listener: socket.socket) -> bool:
        """EMFILE: free a descriptor by evicting, else accept and close one client with
        the spare. True if the next accept may succeed."""
        if self._evicted:
            self._close_evicted()
            return True
        victim = next((c for c in self._conns.values() if c.state == "reading"), None)
        if victim is not None:
            self._close(victim)
            return True
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            sock, _ = listener.accept()
            _discard(sock)
        except OSError:
            return False
        finally:
            self._spare = _open_spare()
        self._log.warning("health_out_of_descriptors", open=len(self._conns))
        return True

    # -- one request ---------------------------------------------------------------------

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(MAX_HEAD_BYTES, _NOWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""  # a broken connection ends as a closed one
        if not chunk:
            self._close(conn)
            return
        conn.inbox += chunk
        try:
            request = parse_request(bytes(conn.inbox))
        except BadRequest as e:
            self._send(conn, response(e.status, f"{e.reason}\n".encode(), TEXT, True))
            return
        if request is None:
            return
        answer = self.handler(conn.client, request)
        if isinstance(answer, bytes):
            self._send(conn, answer)
        else:
            self._start_slow(conn, answer)

    def _start_slow(self, conn: _Conn, work: Callable[[], bytes]) -> None:
        conn.state = "slow"
        conn.deadline = None  # the handler's own bound applies, not a client's
        self._set_mask(conn, 0)
        try:
            future = self._slow.submit(work)
        except RuntimeError:  # closing
            self._close(conn)
            return
        future.add_done_callback(lambda f: self._slow_done(conn, f))

    def _slow_done(self, conn: _Conn, future: Future[bytes]) -> None:
        # Runs on the slow handler's thread: hand the reply to the loop.
        if future.cancelled():
            reply = response(503, b"server closing\n", TEXT, True)
        elif (error := future.exception()) is not None:
            self._log.error("health_handler_failed", error=repr(error))
            reply = response(500, f"failed: {error}\n".encode(), TEXT, True)
        else:
            reply = future.result()
        with self._done_lock:
            self._done.append((conn, reply))
        self.wake()

    def _finish_slow(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
        for conn, reply in done:
            if conn.state == "slow":
                conn.deadline = _clock.monotonic() + self.timeout
                self._send(conn, reply)

    def _expire(self) -> None:
        now = _clock.monotonic()
        for conn in list(self._conns.values()):
            if conn.deadline is not None and now >= conn.deadline:
                self._log.debug("health_request_timed_out", client=conn.client, state=conn.state)
                if conn.state == "reading":
                    with contextlib.suppress(OSError):  # best effort: it is too slow anyway
                        conn.sock.send(response(408, b"request timed out\n", TEXT, True), _NOWAIT)
                self._close(conn)

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.state, conn.outbox, conn.sent = "writing", data, 0
        self._flush(conn)
        if conn.state == "writing":
            self._set_mask(conn, _WRITE)

    def _flush(self, conn: _Conn) -> None:
        try:
            conn.sent += conn.sock.send(memoryview(conn.outbox)[conn.sent :], _NOWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if conn.sent >= len(conn.outbox):
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
                # Unread input would make close() send a reset that can destroy the
                # reply in flight: discard what has already arrived.
                conn.sock.recv(1 << 16, _NOWAIT)
            self._close(conn)

    def _set_mask(self, conn: _Conn, mask: int) -> None:
        with contextlib.suppress(OSError):
            if mask == 0:
                if conn.mask:
                    self._ep.unregister(conn.fd)
            elif conn.mask:
                self._ep.modify(conn.fd, mask)
            else:
                self._ep.register(conn.fd, mask)
        conn.mask = mask

    def _close(self, conn: _Conn) -> None:
        if conn.state == "closed":
            return
        conn.state = "closed"
        # Closing the descriptor removes it from the epoll set: no unregister call.
        self._conns.pop(conn.fd, None)
        _discard(conn.sock)


def bind(host: str, port: int) -> list[socket.socket]:
    """:data:`LISTENERS` listening sockets sharing ``host:port`` (``SO_REUSEPORT``; port 0:
    a free one), set up for the loop: backlog, deferred accept, non-blocking.

    A port bound by anyone is ``EADDRINUSE``, as for one socket: it is first bound once
    without ``SO_REUSEPORT``. Only this user's sockets could join the group (the kernel's
    rule), so no other user's process can take a share of the probes.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    group: list[socket.socket] = []
    try:
        for _ in range(LISTENERS if hasattr(socket, "SO_REUSEPORT") else 1):
            s = socket.socket(family, socket.SOCK_STREAM)
            group.append(s)
            # A restarted sidecar rebinds its port at once, despite TIME_WAIT leftovers.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
            port = int(s.getsockname()[1])
            defer = getattr(socket, "TCP_DEFER_ACCEPT", None)  # Linux
            if defer is not None:
                s.setsockopt(socket.IPPROTO_TCP, defer, DEFER_SECONDS)
            s.listen(BACKLOG)
            s.setblocking(False)
    except BaseException:
        for s in group:
            s.close()
        raise
    return group


def _discard(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
