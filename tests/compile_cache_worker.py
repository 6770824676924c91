"""A torch.compile user for the compile_cache tests: compiles a small function inside
``nccl_back.compile_cache``, prints one JSON line (fetched?, why, inductor's FX-graph
cache hits and misses), then with ``hold`` serves until its stdin closes.

``python tests/compile_cache_worker.py CONFIG_JSON`` (``settings``, ``name``, ``hold``);
``TORCHINDUCTOR_CACHE_DIR`` chooses its cache directory.
"""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

import nccl_back
from nccl_back.config import Settings


def f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x * 2 + 1) @ x.T


def main() -> int:
    cfg = json.loads(sys.argv[1])
    compiled = torch.compile(f)
    with nccl_back.compile_cache(cfg["name"], Settings(**cfg["settings"])) as got:
        out = compiled(torch.ones(8, 8))
    print(json.dumps({"ok": got.ok, "reason": got.reason, "sum": float(out.sum()),
                      "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}), flush=True)
    if cfg.get("hold"):
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
