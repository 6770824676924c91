"""``compile_cache``: a ``torch.compile`` user's inductor cache, shared with the fleet
(usage, trust rules and bounds: docs/compile-caches.md).

On entry the set published under this key is fetched from a live peer into inductor's
cache directory (``TORCHINDUCTOR_CACHE_DIR``, else torch's default), with the
precompiled headers its C++ kernels were built with (into torch's default cache
directory, where inductor looks: ~150 MB each, seconds of compiler time to rebuild); on
a clean exit after a miss, this process publishes its own (and the headers it used, if
none came) and serves them until it exits. The key is ``name``, torch's version and
torch's inductor key (``torch_key``: its code and system); torch's FX-graph cache keys
still decide each hit, so a stale set is only a miss. Transfer, digest and what is
written: :mod:`.artifact_transfer`; which files are trusted: :mod:`nccl_back.model.trusted_tree`.

Every wait is bounded: inductor (before it looks for a header) and the block's end wait
for the background headers fetch at most ``artifact_wait`` after it began, in total;
past it the fetch is a miss ("timed out") and inductor builds its headers itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nccl_back import _clock
from nccl_back.caches import artifact_transfer
from nccl_back.caches.artifact_transfer import CacheKey, FetchResult
from nccl_back.config import Settings
from nccl_back.log import get_logger
from nccl_back.model.artifact_sets import TMP_PREFIX

log = get_logger(__name__)


def inductor_cache_dir() -> str:
    """Inductor's cache directory, as torch resolves it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def cache_units(root: str) -> list[str]:
    """What of inductor's cache directory travels: its top-level entries (not the
    temporary directories of an install in progress)."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if not n.startswith(TMP_PREFIX))


_HEADERS: set[str] = set()
_RECORDING = False
_lock = threading.Lock()
#: Header fetches in flight, by what they fetch (Redis, namespace, the set's lookup key):
#: one fetch per set however many callers ask, and inductor waits for every one.
_IN_FLIGHT: dict[tuple[str, str, str], Background] = {}


class Background:
    """One fetch running in the background: its outcome once done, and its deadline
    (``Settings.artifact_wait`` after it began), past which nobody waits for it."""

    def __init__(self, what: str, wait: float) -> None:
        self.what, self.wait = what, wait
        self.deadline = _clock.monotonic() + wait
        self._done = threading.Event()
        self._outcome: FetchResult | None = None
        self._callbacks: list[Callable[[FetchResult], None]] = []

    def wait_done(self) -> bool:
        """Wait for the fetch until its deadline at most; whether it is done."""
        return _clock.wait(self._done, self.deadline - _clock.monotonic())

    def result(self) -> FetchResult:
        """The fetch's outcome, waiting for it until its deadline at most: past it, a miss
        saying so (the fetch may still end later; it never installs over a local file)."""
        if not self.wait_done() or self._outcome is None:
            return FetchResult(False, f"{self.what}: timed out after {self.wait:g} s (artifact_wait)")
        return self._outcome

    def on_done(self, callback: Callable[[FetchResult], None]) -> None:
        """Call ``callback`` with the outcome when the fetch ends (now if it has)."""
        with _lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        self._call(callback)

    def finish(self, outcome: FetchResult) -> None:
        with _lock:
            self._outcome = outcome
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for c in callbacks:
            self._call(c)

    def _call(self, callback: Callable[[FetchResult], None]) -> None:
        assert self._outcome is not None
        try:
            callback(self._outcome)
        except Exception as e:  # a caller's callback never ends the fetch's thread
            log.warning("artifact_callback_failed", what=self.what, error=repr(e))


def headers_dir() -> str:
    """Where inductor keeps its precompiled headers (torch's default cache directory,
    not ``TORCHINDUCTOR_CACHE_DIR``: they are global to the machine)."""
    from torch._inductor import codecache

    return str(codecache._HEADER_DIR)


def wait_for_headers() -> None:
    """Wait until no headers fetch of this process is in flight, for each one until its
    deadline at most: inductor waits at most ``artifact_wait`` after a fetch began, in
    total, however many headers it looks for meanwhile."""
    with _lock:
        pending = list(_IN_FLIGHT.values())
    for job in pending:
        job.wait_done()


def record_headers() -> None:
    """From now on, note every precompiled header inductor builds or finds in this
    process (once per process). Torch names each header file by the hash of its compile
    command, preprocessed content and compiler, so the names used are known only from
    inductor itself: its ``_precompile_header`` returns the header's path (the
    precompiled ``.gch`` next to it), and is wrapped here to note it. Only the headers
    noted travel (:func:`header_units`), never the rest of the directory."""
    global _RECORDING
    with _lock:
        if _RECORDING:
            return
        _RECORDING = True
    from torch._inductor import codecache

    original = codecache._precompile_header

    def noted(*args: Any, **kwargs: Any) -> str:
        wait_for_headers()  # never build a header that is on its way
        path = str(original(*args, **kwargs))
        with _lock:
            _HEADERS.add(os.path.basename(path))
        return path

    noted.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    codecache._precompile_header = noted  # type: ignore[assignment]


def header_units() -> list[str]:
    """The precompiled headers this process used (:func:`record_headers`), as units of
    :func:`headers_dir`: each header and its ``.gch``, where both exist."""
    root = headers_dir()
    with _lock:
        used = set(_HEADERS)
    return sorted(u for h in used for u in (h, h + ".gch")
                  if all(os.path.isfile(os.path.join(root, x)) for x in (h, h + ".gch")))


def fetch_headers(settings: Settings, key: CacheKey, *, engine: str = "library",
                  on_done: Callable[[FetchResult], None] | None = None) -> Background:
    """Fetch the precompiled headers that go with ``key`` in the background, so writing
    them (~150 MB) overlaps the engine's other start-up work; inductor's
    ``_precompile_header``, as :func:`record_headers` wraps it, waits for the fetch
    (``artifact_wait`` at most). A fetch of the same set already in flight is joined.
    Returns the fetch (:meth:`Background.result`); ``on_done`` gets its outcome too."""
    record_headers()
    hkey = headers_key(key)
    what = (settings.redis_url, settings.namespace, hkey.lookup)
    with _lock:
        job = _IN_FLIGHT.get(what)
        started = job is None
        if job is None:
            job = _IN_FLIGHT[what] = Background("precompiled headers", settings.artifact_wait)
    if on_done is not None:
        job.on_done(on_done)
    if not started:
        return job
    # The transfer gives up when nobody waits for it any more.
    s = settings.capped(peer_budget=settings.artifact_wait)

    def run() -> None:
        try:
            got = artifact_transfer.fetch(s, hkey, headers_dir(), engine=engine)
        except Exception as e:  # fetch reports its own failures; this is a last guard
            got = FetchResult(False, repr(e)[:500])
        with _lock:
            _IN_FLIGHT.pop(what, None)
        job.finish(got)

    try:
        threading.Thread(target=run, daemon=True, name="nccl-back-fetch-headers").start()
    except RuntimeError as e:  # no thread (interpreter shutting down): a miss
        with _lock:
            _IN_FLIGHT.pop(what, None)
        job.finish(FetchResult(False, f"precompiled headers not fetched: {e}"))
    return job


def headers_key(key: CacheKey) -> CacheKey:
    """The key of the precompiled headers that go with the compile cache of ``key``."""
    return CacheKey({**key.factors, "set": "headers"}, key.scope)


def inductor_key(name: str) -> CacheKey:
    """The lookup key of ``name``'s inductor cache, from torch's own keys."""
    from torch._inductor.codecache import torch_key

    factors = {"name": name, "torch": torch.__version__, "nccl_back": artifact_transfer.nccl_back_version(),
               "inductor_key": torch_key().hex()[:32]}
    return CacheKey(factors, hashlib.sha256(name.encode()).hexdigest()[:32])


def _publish(got: FetchResult, s: Settings, root: str, key: CacheKey, headers: Background) -> None:
    """At a ``compile_cache`` block's clean end: publish what did not come from a peer."""
    try:
        if not got.ok:
            got.reason = f"{got.reason}; {artifact_transfer.publish(s, key, root, cache_units(root))}"
        have = headers.result()
        used = header_units()
        if have.ok or have.kept:
            published = f"from a peer ({have.installed or have.kept})"
        elif used:
            published = artifact_transfer.publish(s, headers_key(key), headers_dir(), used)
        else:
            published = f"none used ({have.reason})"
        log.info("compile_cache_done", key=key.lookup[:12], caches=got.reason or "from a peer",
                 headers=published)
    except Exception as e:  # publishing never breaks the program
        got.reason = f"{got.reason}; not published: {type(e).__name__}: {e}"[:500]
        log.warning("compile_cache_not_published", key=key.lookup[:12], error=repr(e)[:500])


@contextlib.contextmanager
def compile_cache(name: str, settings: Settings | None = None, *,
                  cache_dir: str | None = None) -> Iterator[FetchResult]:
    """Fetch ``name``'s inductor cache before the block; publish this one's after it if
    none came (see the module docstring). Never raises: a miss, a bad setting or a
    failure of its own is a result with its reason (the block's own exceptions pass)."""
    block = None
    try:
        s = settings if settings is not None else Settings.from_env()
        root = cache_dir or inductor_cache_dir()
        key = inductor_key(name)
        headers = fetch_headers(s, key)
        got = artifact_transfer.fetch(s, key, root)
        block = (s, root, key, headers)
    except Exception as e:  # a compile never fails for its cache
        log.warning("compile_cache_skipped", name=name, error=repr(e)[:500])
        got = FetchResult(False, f"compile caches skipped: {type(e).__name__}: {e}"[:500])
    yield got
    if block is not None and block[0].secret is not None:
        _publish(got, *block)
