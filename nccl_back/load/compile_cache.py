"""``compile_cache``: a ``torch.compile`` user's inductor cache, shared with the fleet.

One call around the first run of a compiled program::

    import nccl_back

    compiled = torch.compile(model)
    with nccl_back.compile_cache("llama-8b-bf16-max-autotune") as got:
        compiled(example)            # compiles: from a peer's kernels if one published them
    print(got.ok, got.reason)        # whether the cache came from a peer, or why not

On entry the set published under this key is fetched into inductor's cache directory
(``TORCHINDUCTOR_CACHE_DIR``, else torch's default) from a live peer, and with it the
precompiled headers its C++ kernels were built with (into torch's default cache
directory, where inductor looks for them: ~150 MB each, seconds of compiler time to
rebuild); on a clean exit after a miss, this process publishes its own cache directory
(and the headers it used, if none came) and serves them until it exits. The key is ``name`` (what you compile, and how), torch's version and torch's own
inductor key (``torch._inductor.codecache.torch_key``: its code and system); torch's
FX-graph cache keys still decide each hit after the install, so a stale set is only a
miss. Everything else is :mod:`nccl_back.load.artifacts`'s: the fleet secret required,
the keyed digest checked before any write, nothing written over a local cache (a
top-level entry of the cache directory that exists locally is kept as it is: give
each program its own ``TORCHINDUCTOR_CACHE_DIR`` to share all of it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nccl_back.config import Settings
from nccl_back.load import artifacts
from nccl_back.load.artifacts import CacheKey, Fetched
from nccl_back.model.artifacts import TMP_PREFIX


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
#: Clear while a headers fetch runs: inductor waits for it before it looks for a header.
_FETCHED = threading.Event()
_FETCHED.set()
#: Longest inductor waits for a headers fetch before it builds the header itself (the
#: fetch's own deadlines end it well before: a stalled transfer at ``stall_timeout``).
HEADERS_WAIT = 60.0


def headers_dir() -> str:
    """Where inductor keeps its precompiled headers (torch's default cache directory,
    not ``TORCHINDUCTOR_CACHE_DIR``: they are global to the machine)."""
    from torch._inductor import codecache

    return str(codecache._HEADER_DIR)


def record_headers() -> None:
    """From now on, note every precompiled header inductor builds or finds in this
    process (once per process). Torch names each header file by the hash of its compile
    command, preprocessed content and compiler, so the names used are known only from
    inductor itself: its ``_precompile_header`` returns the header's path (the
    precompiled ``.gch`` next to it), and is wrapped here to note it."""
    global _RECORDING
    if _RECORDING:
        return
    from torch._inductor import codecache

    original = codecache._precompile_header

    def noted(*args: Any, **kwargs: Any) -> str:
        _FETCHED.wait(HEADERS_WAIT)  # never build a header that is on its way
        path = str(original(*args, **kwargs))
        _HEADERS.add(os.path.basename(path))
        return path

    noted.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    codecache._precompile_header = noted  # type: ignore[assignment]
    _RECORDING = True


def header_units() -> list[str]:
    """The precompiled headers this process used (:func:`record_headers`), as units of
    :func:`headers_dir`: each header and its ``.gch``, where both exist."""
    root = headers_dir()
    return sorted(u for h in _HEADERS for u in (h, h + ".gch")
                  if all(os.path.isfile(os.path.join(root, x)) for x in (h, h + ".gch")))


def fetch_headers(settings: Settings, key: CacheKey, *, engine: str = "library",
                  on_done: Callable[[Fetched], None] | None = None) -> Callable[[], Fetched]:
    """Fetch the precompiled headers that go with ``key`` in the background, so writing
    them (~150 MB) overlaps the engine's other start-up work; inductor's
    ``_precompile_header``, as :func:`record_headers` wraps it, waits for the fetch.
    Returns a call that waits for the outcome (``on_done`` gets it too)."""
    record_headers()
    out: list[Fetched] = []
    _FETCHED.clear()

    def run() -> None:
        try:
            got = artifacts.fetch(settings, headers_key(key), headers_dir(), engine=engine)
        except Exception as e:  # fetch reports its own failures; this is a last guard
            got = Fetched(False, repr(e))
        out.append(got)
        _FETCHED.set()
        if on_done is not None:
            on_done(got)

    threading.Thread(target=run, daemon=True, name="nccl-back-fetch-headers").start()

    def result() -> Fetched:
        _FETCHED.wait()
        return out[0]

    return result


def headers_key(key: CacheKey) -> CacheKey:
    """The key of the precompiled headers that go with the compile cache of ``key``."""
    return CacheKey({**key.factors, "set": "headers"}, key.scope)


def inductor_key(name: str) -> CacheKey:
    """The lookup key of ``name``'s inductor cache, from torch's own keys."""
    from torch._inductor.codecache import torch_key

    factors = {"name": name, "torch": torch.__version__, "nccl_back": artifacts.nccl_back_version(),
               "inductor_key": torch_key().hex()[:32]}
    return CacheKey(factors, hashlib.sha256(name.encode()).hexdigest()[:32])


@contextlib.contextmanager
def compile_cache(name: str, settings: Settings | None = None, *,
                  cache_dir: str | None = None) -> Iterator[Fetched]:
    """Fetch ``name``'s inductor cache before the block; publish this one's after it if
    none came (see the module docstring). Never raises for a miss."""
    s = settings if settings is not None else Settings.from_env()
    root = cache_dir or inductor_cache_dir()
    key = inductor_key(name)
    headers = fetch_headers(s, key)
    got = artifacts.fetch(s, key, root)
    yield got
    if s.secret is None:
        return
    if not got.ok:
        got.reason = f"{got.reason}; {artifacts.publish(s, key, root, cache_units(root))}"
    if not (headers().ok or headers().kept) and header_units():
        artifacts.publish(s, headers_key(key), headers_dir(), header_units())
