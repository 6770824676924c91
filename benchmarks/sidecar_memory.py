"""The memory a CPU ``nccl-back serve`` sidecar holds, as the kernel counts it.

Run: ``.venv/bin/python benchmarks/sidecar_memory.py [--mib 392] [--tensors 24]``

Writes a float32 checkpoint of ``--mib`` MiB, starts a real ``redis-server``, then two
real ``nccl-back serve`` processes with a hand-off socket: the first loads from
storage, the second from the first (a peer). Once each prints its ready line its
``/proc/<pid>/status`` is read; so is that of an idle interpreter that made the same
imports. Printed per sidecar: RssAnon and RssShmem (MiB), and
(RssAnon + RssShmem - the idle interpreter's) / the model's bytes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from nccl_back.dev.servers import LocalRedis, free_port

#: What ``nccl-back serve`` imports before it loads, for the idle interpreter.
IDLE = (
    "import sys, torch, nccl_back.cli, nccl_back.sidecar.serve;"
    " print('idle', flush=True); sys.stdin.read()"
)


def write_model(directory: Path, mib: int, tensors: int) -> int:
    """A float32 checkpoint of ``tensors`` tensors, ``mib`` MiB in all; its bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    per = mib * (1 << 20) // tensors // 4
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i:03d}.weight": torch.randn(per, generator=gen) for i in range(tensors)}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text('{"model_type": "bench"}')
    return sum(t.numel() * 4 for t in state.values())


def status_kib(pid: int) -> dict[str, int]:
    """The ``kB`` fields of ``/proc/<pid>/status``."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0])
    return out


def held_kib(pid: int) -> int:
    s = status_kib(pid)
    return s["RssAnon"] + s["RssShmem"]


def wait_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"process exited: {proc.stderr.read() if proc.stderr else ''}")
        if line.startswith(prefix):
            return line.strip()
    raise SystemExit(f"no {prefix!r} line within {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=392)
    ap.add_argument("--tensors", type=int, default=24)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nb-mem-"))
    nbytes = write_model(tmp / "ckpt", args.mib, args.tensors)
    redis = LocalRedis().start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}
    env.update(NCCL_BACK_REDIS_URL=redis.url, NCCL_BACK_NAMESPACE="m" + uuid.uuid4().hex[:8],
               NCCL_BACK_ADVERTISE_HOST="127.0.0.1",
               NCCL_BACK_CACHE_DIR=str(tmp / "cache"), NCCL_BACK_PEER_TTL="5")
    procs: list[subprocess.Popen[str]] = []
    try:
        idle = subprocess.Popen([sys.executable, "-c", IDLE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(idle)
        wait_line(idle, "idle", 120)
        base = held_kib(idle.pid)
        print(f"model {nbytes / 2**20:.0f} MiB; idle interpreter RssAnon+RssShmem"
              f" {base / 1024:.0f} MiB")
        for i, expect in enumerate(("storage", "peer")):
            proc = subprocess.Popen(
                [sys.executable, "-m", "nccl_back.cli", "serve", "--model", str(tmp / "ckpt"),
                 "--socket", str(tmp / f"s{i}" / "handoff.sock"),
                 "--health-port", str(free_port())],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            procs.append(proc)
            line = wait_line(proc, "ready ", 300)
            assert f"source={expect}" in line, line
            time.sleep(1.0)  # let post-ready work (heartbeat, publish) settle
            s = status_kib(proc.pid)
            ratio = (s["RssAnon"] + s["RssShmem"] - base) * 1024 / nbytes
            print(f"{expect:8s} RssAnon {s['RssAnon'] / 1024:7.0f} MiB  RssShmem"
                  f" {s['RssShmem'] / 1024:7.0f} MiB  RssFile {s['RssFile'] / 1024:6.0f} MiB"
                  f"  ratio {ratio:.2f}x")
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
        redis.stop()


if __name__ == "__main__":
    main()
