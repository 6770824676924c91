"""How long the metadata commands take, end to end, as a user runs them.

Run: ``.venv/bin/python benchmarks/cli_speed.py [--repeat 7]``

Times fresh processes of the installed console script: ``nccl-back --help``,
``fingerprint`` of a small local checkpoint (CRC32C cache warm, as on a restart) and
``status`` against a real redis-server holding one published peer. The baselines, in
the same run: a bare ``python -c pass`` (interpreter start-up, the floor) and
``python -c "import torch"`` (what each command paid before the imports were made
lazy). Prints median and best per command, and each median as a ratio to the torch
import; also whether torch was imported (from ``python -X importtime``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nccl_back.config import Settings
from nccl_back.coord.registry import PeerInfo, Registry
from nccl_back.dev.servers import LocalRedis
from nccl_back.model.identity import ModelSpec

EXE = str(Path(sys.executable).parent / "nccl-back")
GOAL_S = 0.5


def _time(argv: list[str], repeat: int) -> list[float]:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runs.append(time.perf_counter() - t)
    return runs


def _imports_torch(argv: list[str]) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "nccl_back.cli", *argv],
                          capture_output=True, text=True, check=True)
    return any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    import torch

    from nccl_back.dev.example import write_example_model

    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis:
        ckpt = Path(tmp) / "ckpt"
        write_example_model(ckpt, 8)
        cache = str(Path(tmp) / "cache")
        spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache)  # warm the CRC32C cache
        reg = Registry(Settings(redis_url=redis.url, namespace="bench"))
        reg.publish_peer(PeerInfo("p1", spec.version, 0, 1, "d", "gloo", "127.0.0.1:1"))
        commands = {
            "--help": ["--help"],
            "fingerprint": ["fingerprint", str(ckpt), "--cache-dir", cache],
            "status": ["status", "--redis-url", redis.url, "--namespace", "bench"],
        }
        baselines = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        }
        rows: dict[str, list[float]] = {}
        for name, argv in baselines.items():
            rows[name] = _time(argv, args.repeat)
        for name, argv in commands.items():
            rows[f"nccl-back {name}"] = _time([EXE, *argv], args.repeat)
        torch_median = statistics.median(rows["python -c 'import torch'"])
        print(f"torch {torch.__version__}, {args.repeat} runs each, goal < {GOAL_S} s")
        print(f"{'command':<28} {'median s':>9} {'best s':>7} {'/torch':>7}  imports torch")
        for name, runs in rows.items():
            med = statistics.median(runs)
            torch_used = ""
            if name.startswith("nccl-back "):
                torch_used = "yes" if _imports_torch(commands[name.split(" ", 1)[1]]) else "no"
            print(f"{name:<28} {med:9.3f} {min(runs):7.3f} {med / torch_median:7.2f}  {torch_used}")


if __name__ == "__main__":
    main()
