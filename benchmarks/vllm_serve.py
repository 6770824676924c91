"""Benchmark: time to the first answered HTTP request of ``vllm serve``, with compile
caches from a peer.

Real vLLM OpenAI-compatible servers (the CPU build; its API process and engine core),
each with its own ``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR``
(inductor's precompiled headers live there), compiling (no ``--enforce-eager``), a fleet secret set, one
after the other on one Llama-shaped checkpoint (``--model-mb``;
``nccl_back.dev.example.write_example_model``). For each: seconds from the process launch
to ``GET /health`` answering 200, and to the first completion (``POST /v1/completions``,
a token-id prompt, one greedy token). Servers:

1. ``cold``: ``--load-format auto``, a fresh cache root;
2. ``warm_restart``: ``auto`` again on cold's cache root (its own caches);
3. ``peer_source``: ``nccl_back``, first of its key: storage, compiles, publishes its
   compile caches, model infos and inductor's precompiled headers, then stays up serving;
4. ``weights_from_peer``: ``nccl_back`` with compile caches off (it compiles itself);
5. ``weights_caches_from_peer``: ``nccl_back``, a fresh cache root: weights, model infos
   and compile caches from ``peer_source``.

Goal: weights and caches from a peer within 1.15x of the warm restart and at most 0.7x
of cold (launch to first completion). The phases of each start come from vLLM's log.

Run: ``PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_serve.py --model-mb 64``
(``VLLM_USE_AOT_COMPILE=0`` in the environment for vLLM's non-AOT compile path).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_start import ROOT, engine_env, marks

from nccl_back.dev.example import write_example_model
from nccl_back.dev.servers import LocalRedis

PROMPT = [1, 17, 42, 99, 7]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(name: str, model: Path, env: dict[str, str], work: Path, load_format: str,
          ) -> tuple[subprocess.Popen[bytes], int, Path, float]:
    """Launch vLLM's OpenAI server on a free loopback port; its log goes to ``work/name.log``."""
    port, log = free_port(), work / f"{name}.log"
    # vLLM's OpenAI server module (the CPU build's `vllm` command fails to import vllm).
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--load-format", load_format, "--dtype", "bfloat16", "--max-model-len", "128",
            "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as f:
        launched = time.time()
        proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=work,
                                start_new_session=True)
    return proc, port, log, launched


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except (urllib.error.URLError, OSError):
        return 0


def first_request(proc: subprocess.Popen[bytes], port: int, log: Path, model: Path,
                  launched: float, timeout: float) -> dict[str, Any]:
    """Poll ``/health`` until 200, then one completion; seconds from the launch to each."""
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while _get(base + "/health", 2.0) != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise SystemExit(f"server failed (exit {proc.returncode}):\n{tail}")
        time.sleep(0.1)
    health = time.time() - launched
    body = json.dumps({"model": str(model), "prompt": PROMPT, "max_tokens": 1,
                       "temperature": 0.0, "return_token_ids": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=max(deadline - time.monotonic(), 1.0)) as r:
        answer = json.loads(r.read())
    first = time.time() - launched
    choice = answer["choices"][0]
    text = log.read_text(errors="replace")
    return {"launch_to_health_s": round(health, 2), "launch_to_first_completion_s": round(first, 2),
            "token_ids": choice.get("token_ids"), "marks": marks(log, launched),
            "caches": ("from_peer" if re.search(r"nccl_back: compile caches from peer \S+:", text)
                       else "missed" if "no compile caches from peers" in text else "n/a"),
            "headers": "from_peer" if "precompiled headers from peer" in text else "no"}


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server's session (vLLM shuts its engine core down), then kill."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-mb", type=float, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
    model = write_example_model(work / "model", args.model_mb)
    redis = LocalRedis().start()
    base = engine_env(redis.url, work, NCCL_BACK_SECRET="bench-fleet-secret-0123",
                      VLLM_CPU_OMP_THREADS_BIND="nobind")
    meta: dict[str, Any] = {"model_bytes": sum(s.stat().st_size for s in model.glob("*.safetensors")),
                            "aot_compile": os.environ.get("VLLM_USE_AOT_COMPILE", "default"),
                            "load_avg_start": os.getloadavg()[0]}
    results: dict[str, dict[str, Any]] = {}
    source: subprocess.Popen[bytes] | None = None

    def env(root: str, **extra: str) -> dict[str, str]:
        # Inductor's cache and its precompiled headers (under the temporary directory)
        # are the server's own too: shared ones would make "cold" warm.
        (work / f"{root}-tmp").mkdir(exist_ok=True)
        return dict(base, VLLM_CACHE_ROOT=str(work / root), TMPDIR=str(work / f"{root}-tmp"),
                    TORCHINDUCTOR_CACHE_DIR=str(work / f"{root}-inductor"), **extra)

    def one(name: str, load_format: str, root: str, keep: bool = False, **extra: str) -> None:
        nonlocal source
        proc, port, log, launched = serve(name, model, env(root, **extra), work, load_format)
        try:
            results[name] = first_request(proc, port, log, model, launched, args.timeout)
        finally:
            if keep:
                source = proc
            else:
                stop(proc)
        print(f"{name}: {results[name]['launch_to_health_s']:.1f} s to /health,"
              f" {results[name]['launch_to_first_completion_s']:.1f} s to the first completion"
              f" (caches {results[name]['caches']}, headers {results[name]['headers']});"
              f" {results[name]['marks']}", flush=True)

    try:
        one("cold", "auto", "root-cold")
        one("warm_restart", "auto", "root-cold")
        one("peer_source", "nccl_back", "root-src", keep=True)
        deadline = time.monotonic() + 120  # its sets are published just after it is ready
        for line in ("compile caches published", "precompiled headers published"):
            while line not in (work / "peer_source.log").read_text(errors="replace"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"peer_source: no '{line}' in its log")
                time.sleep(0.5)
        one("weights_from_peer", "nccl_back", "root-w", NCCL_BACK_COMPILE_CACHES="false")
        one("weights_caches_from_peer", "nccl_back", "root-wc")
        meta["load_avg_end"] = os.getloadavg()[0]
    finally:
        if source is not None:
            stop(source)
        redis.stop()
        (outdir / "vllm_serve_logs").mkdir(exist_ok=True)
        for f in work.glob("*.log"):
            shutil.copy(f, outdir / "vllm_serve_logs" / f.name)
        shutil.rmtree(work, ignore_errors=True)

    key = "launch_to_first_completion_s"
    tokens = {r["token_ids"] and tuple(r["token_ids"]) for r in results.values()}
    print(f"\n{meta['model_bytes'] / 2**20:.0f} MiB checkpoint; VLLM_USE_AOT_COMPILE="
          f"{meta['aot_compile']}; load average {meta['load_avg_start']:.1f} ->"
          f" {meta['load_avg_end']:.1f}; first tokens identical: {len(tokens) == 1}")
    print(f"{'server':<26}{'-> /health':>12}{'-> completion':>15}  caches  phases (s from launch)")
    for name, r in results.items():
        print(f"{name:<26}{r['launch_to_health_s']:>12.1f}{r[key]:>15.1f}  {r['caches']:<9}"
              f" {r['marks']}")
    wc = results["weights_caches_from_peer"][key]
    ratios = {"over_warm_restart": wc / results["warm_restart"][key],
              "over_cold": wc / results["cold"][key]}
    print(f"weights_caches_from_peer: {ratios['over_warm_restart']:.2f}x the warm restart,"
          f" {ratios['over_cold']:.2f}x cold")
    print(f"goal: <= 1.15x warm restart: {'PASS' if ratios['over_warm_restart'] <= 1.15 else 'MISS'};"
          f" <= 0.7x cold: {'PASS' if ratios['over_cold'] <= 0.7 else 'MISS'}")
    (outdir / "vllm_serve.json").write_text(
        json.dumps({"meta": meta, "results": results, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
