"""Benchmark: vLLM engines resharding between TP=1 and TP=2 vs a same-layout peer load.

One run, one Llama-shaped checkpoint (``--model-mb``, bf16;
``nccl_back.dev.example.write_example_model``), real vLLM engines (the CPU build), one at a
time, each a separate process (``tests/vllm/engine.py``):

1. ``h1`` (TP=1): the first engine, vLLM's default loader (storage); it serves.
2. ``r2`` (TP=2): reshards from ``h1`` (each rank its half of the sharded tensors).
3. ``s2`` (TP=2): a same-layout peer load from ``r2``, rank for rank.
4. ``h1`` leaves; ``r1`` (TP=1): reshards from both ranks of ``r2``.
5. ``s1`` (TP=1): a same-layout peer load from ``r1``.

From each rank's nccl_back load line: bytes received and the load phase (the load's
``seconds``: discovery to verified bytes). Ratios, in this one run: bytes a resharding
rank moved over its own shards (what the same-layout load of that layout moves; goal
<= 1.1x), and its load phase over the same-layout load's (goal <= 1.5x).

Run: ``.venv-vllm/bin/python benchmarks/vllm_reshard.py`` (``bash scripts/bootstrap_vllm.sh`` first)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_start import engine_env  # benchmarks/vllm_start.py: the same engines' environment

from nccl_back.dev.example import write_example_model
from nccl_back.dev.servers import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tests" / "vllm" / "engine.py"
_LINE = re.compile(r"nccl_back: loaded version \w+ from (?P<source>\w+)(?: (?P<peers>\S+))?:"
                   r" (?P<mb>[\d.]+) MB in (?P<s>[\d.]+) s .*?\[(?P<phases>.*?)\]")


class Run:
    def __init__(self, name: str, model: Path, env: dict[str, str], work: Path, tp: int,
                 hold: bool) -> None:
        self.name, self.work = name, work
        self.out, self.log, self.release = (work / f"{name}.json", work / f"{name}.log",
                                            work / f"{name}.release")
        args = [sys.executable, str(ENGINE), "--model", str(model), "--out", str(self.out),
                "--tp", str(tp), "--serve-every", "0"]
        if hold:
            args += ["--hold", str(self.release)]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=work)

    def wait(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.out.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
                raise SystemExit(f"{self.name} failed (exit {self.proc.returncode}):\n{tail}")
            time.sleep(0.2)
        ranks = [{"source": m["source"], "peers": m["peers"], "bytes": float(m["mb"]) * 1e6,
                  "load_s": float(m["s"]),
                  "phases": {k: float(v) for k, v in (p.rsplit(" ", 1) for p in m["phases"].split(", "))}}
                 for m in _LINE.finditer(self.log.read_text(errors="replace"))]
        return {"ranks": ranks, "bytes_per_rank": max(r["bytes"] for r in ranks),
                "load_s": max(r["load_s"] for r in ranks),
                "sources": sorted({r["source"] for r in ranks})}

    def stop(self) -> None:
        self.release.touch()
        self.proc.wait(180)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-mb", type=float, default=256)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--max-concurrent-sends", type=int, default=1,
                   help="each engine's send slots (1, the default: a TP=1 holder serves the two"
                        " ranks of a TP=2 receiver one after the other)")
    args = p.parse_args(argv)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-reshard-"))
    model = write_example_model(work / "model", args.model_mb)
    size = sum(s.stat().st_size for s in model.glob("*.safetensors"))
    redis = LocalRedis().start()
    env = engine_env(redis.url, work, VLLM_CPU_OMP_THREADS_BIND="nobind",
                     NCCL_BACK_MAX_CONCURRENT_SENDS=str(args.max_concurrent_sends))
    res: dict[str, dict[str, Any]] = {}
    load_avg = [os.getloadavg()[0]]
    try:
        h1 = Run("h1", model, env, work, 1, hold=True)
        res["h1"] = h1.wait(args.timeout)
        r2 = Run("r2", model, env, work, 2, hold=True)
        res["r2"] = r2.wait(args.timeout)
        s2 = Run("s2", model, env, work, 2, hold=False)
        res["s2"] = s2.wait(args.timeout)
        s2.proc.wait(180)
        h1.stop()
        r1 = Run("r1", model, env, work, 1, hold=True)
        res["r1"] = r1.wait(args.timeout)
        s1 = Run("s1", model, env, work, 1, hold=False)
        res["s1"] = s1.wait(args.timeout)
        s1.proc.wait(180)
        r1.stop()
        r2.stop()
        load_avg.append(os.getloadavg()[0])
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    for name in ("r2", "s2", "r1", "s1"):
        if res[name]["sources"] != ["peer"]:
            raise SystemExit(f"{name} did not load from peers: {res[name]['ranks']}")
    ratios = {
        "tp1_to_tp2_bytes_over_own_shard": res["r2"]["bytes_per_rank"] / res["s2"]["bytes_per_rank"],
        "tp1_to_tp2_load_over_same_layout": res["r2"]["load_s"] / res["s2"]["load_s"],
        "tp2_to_tp1_bytes_over_own_shard": res["r1"]["bytes_per_rank"] / res["s1"]["bytes_per_rank"],
        "tp2_to_tp1_load_over_same_layout": res["r1"]["load_s"] / res["s1"]["load_s"],
    }
    print(f"{size / 2**20:.0f} MiB checkpoint; {args.max_concurrent_sends} send slot(s) per engine;"
          f" load average {load_avg[0]:.1f} -> {load_avg[-1]:.1f}")
    print(f"{'engine':<8}{'TP':>4}{'MB/rank':>10}{'load s':>9}  phases of the slowest rank")
    for name, r in res.items():
        slow = max(r["ranks"], key=lambda x: x["load_s"])
        print(f"{name:<8}{len(r['ranks']):>4}{r['bytes_per_rank'] / 1e6:>10.1f}{r['load_s']:>9.3f}"
              f"  {slow['phases']}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    ok_bytes = max(ratios["tp1_to_tp2_bytes_over_own_shard"], ratios["tp2_to_tp1_bytes_over_own_shard"]) <= 1.1
    ok_time = max(ratios["tp1_to_tp2_load_over_same_layout"], ratios["tp2_to_tp1_load_over_same_layout"]) <= 1.5
    print(f"goal: bytes <= 1.1x own shards: {'PASS' if ok_bytes else 'MISS'}; load phase <= 1.5x"
          f" a same-layout peer load: {'PASS' if ok_time else 'MISS'}")
    (outdir / "vllm_reshard.json").write_text(json.dumps(
        {"model_bytes": size, "load_avg": load_avg, "max_concurrent_sends": args.max_concurrent_sends, "results": res, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
