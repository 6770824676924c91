"""A torch.compile user for the compile_cache tests: compiles a small function inside
``nccl_back.compile_cache``, prints one JSON line (fetched?, why, inductor's FX-graph
cache hits and misses), then with ``hold`` serves until its stdin closes.

``python tests/compile_cache_worker.py CONFIG_JSON`` (``settings``, ``name``, ``hold``);
``TORCHINDUCTOR_CACHE_DIR`` chooses its cache directory, ``TMPDIR`` where inductor's
precompiled headers are (and the cache directory, without it). The report also holds
both directories and the library's warnings.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
from torch._dynamo.utils import counters

import nccl_back
from nccl_back.caches.compile_cache import header_units, headers_dir, inductor_cache_dir
from nccl_back.config import Settings


class Noted(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x * 2 + 1) @ x.T


def main() -> int:
    cfg = json.loads(sys.argv[1])
    noted = Noted()
    logging.getLogger("nccl_back").addHandler(noted)
    compiled = torch.compile(f)
    with nccl_back.compile_cache(cfg["name"], Settings(**cfg["settings"])) as got:
        out = compiled(torch.ones(8, 8))
    # The precompiled headers the compile used, with their modes: gcc writes 0644, an
    # install from a peer 0600.
    headers = {u: oct(os.stat(os.path.join(headers_dir(), u)).st_mode & 0o777)
               for u in header_units()}
    print(json.dumps({"ok": got.ok, "reason": got.reason, "sum": float(out.sum()),
                      "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"],
                      "headers": headers, "cache_dir": inductor_cache_dir(),
                      "headers_dir": headers_dir(), "warnings": noted.lines}), flush=True)
    if cfg.get("hold"):
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
