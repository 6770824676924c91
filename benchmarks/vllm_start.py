"""Benchmark: vLLM engine start with ``--load-format nccl_back`` from a live peer vs ``auto``.

One run, one Llama-shaped checkpoint (``--model-mb``, default 1024 MiB, bf16, 24 layers,
4 shards; ``nccl_back.dev.example.write_example_model``), real vLLM engines (the CPU build),
one at a time, each a separate process (``tests/vllm/engine.py``):

1. ``auto_cold``: ``--load-format auto`` with the checkpoint's pages evicted from the
   page cache first (``/proc/sys/vm/drop_caches`` when writable, and
   ``posix_fadvise(DONTNEED)`` on every shard in any case; ``fincore`` reports what
   stayed cached);
2. ``auto_warm``: ``auto`` again, the checkpoint now in the page cache;
3. ``peer_source``: ``nccl_back``, first engine: vLLM's default loader (storage), then
   it serves;
4. ``peer``: ``nccl_back`` while ``peer_source`` runs: receives from it.

For each engine: the **load phase** (filling the weights: vLLM's own ``Loading weights
took`` for ``auto``, the nccl_back load line for ``nccl_back``), the **whole start**
(``LLM(...)`` constructed, and to the first generated token) and vLLM's other start-up
phases from its log. Ratios: auto cold / peer and auto warm / peer, for the load phase
and the whole start.

Run: ``.venv-vllm/bin/python benchmarks/vllm_start.py`` (``bash scripts/bootstrap_vllm.sh`` first)

``--caches``: engines that compile (no ``enforce_eager``), each with its own
``VLLM_CACHE_ROOT``, a fleet secret set; time from the process launch to the first
generated token (``LLM(...)`` then one greedy token: the harness has no HTTP server,
so this stands for the first answered request) for ``cold`` (``auto``, storage, a fresh
cache root), ``warm_restart`` (``auto`` again on cold's cache root: its own caches),
``weights_from_peer`` (``nccl_back`` with ``compile_caches`` off: it compiles itself)
and ``weights_caches_from_peer`` (a fresh cache root: weights and caches from the
``peer_source`` engine, which is held serving meanwhile). Goal: weights and caches
within 1.15x of the warm restart and at most 0.7x of cold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nccl_back.dev.example import write_example_model
from nccl_back.dev.servers import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tests" / "vllm" / "engine.py"

_PHASES = {
    "init_model": r"Initializing model took ([\d.]+) seconds",
    "auto_load_weights": r"Loading weights took ([\d.]+) seconds",
    "nccl_back_load": r"nccl_back: loaded version \w+ from \w+.*? in ([\d.]+) s",
    "init_engine": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}


def engine_env(redis_url: str, work: Path, **extra: str) -> dict[str, str]:
    """Every benchmark engine's environment: this tree, real Redis, a fresh namespace,
    loopback addresses, the CRC cache under ``work``; ``extra`` on top."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
        "NCCL_BACK_REDIS_URL": redis_url, "NCCL_BACK_NAMESPACE": f"bench{os.getpid()}",
        "NCCL_BACK_ADVERTISE_HOST": "127.0.0.1",
        "NCCL_BACK_CACHE_DIR": str(work / "crc-cache"), **extra,
    })
    return env


def evict(paths: list[Path]) -> str:
    """Drop the checkpoint from the page cache; say how."""
    how = []
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        how.append("drop_caches")
    except OSError as e:
        how.append(f"drop_caches refused ({e.strerror})")
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how.append("posix_fadvise(DONTNEED) per shard")
    return ", ".join(how)


def cached(paths: list[Path]) -> str:
    """``fincore``'s view of how much of the checkpoint is in the page cache."""
    if shutil.which("fincore") is None:
        return "fincore unavailable"
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=False).stdout
    total = sum(int(x) for x in out.split() if x.isdigit())
    return f"{total / 2**20:.0f} MiB cached"


def run_engine(name: str, model: Path, env: dict[str, str], workdir: Path, load_format: str,
               hold: bool = False, serve_every: float = 3.0, extra: list[str] | None = None,
               ) -> tuple[subprocess.Popen[bytes], Path, Path, Path]:
    out, log, release = (workdir / f"{name}.json", workdir / f"{name}.log",
                         workdir / f"{name}.release")
    args = [sys.executable, str(ENGINE), "--model", str(model), "--load-format", load_format,
            "--out", str(out), *(extra or [])]
    if hold:
        args += ["--hold", str(release), "--serve-every", str(serve_every)]
    with open(log, "wb") as f:
        launched = time.time()
        proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=workdir)
    (workdir / f"{name}.launched").write_text(repr(launched))
    return proc, out, log, release


def wait_result(proc: subprocess.Popen[bytes], out: Path, log: Path, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise SystemExit(f"engine failed (exit {proc.returncode}):\n{tail}")
        time.sleep(0.2)
    result = dict(json.loads(out.read_text()))
    text = log.read_text(errors="replace")
    for phase, pattern in _PHASES.items():
        m = re.search(pattern, text)
        if m:
            result[phase] = float(m.group(1))
    phases = re.search(r"nccl_back: loaded version .*? \[(.*?)\]", text)
    if phases:
        result["nccl_back_phases"] = {k: float(v) for k, v in
                                      (p.rsplit(" ", 1) for p in phases.group(1).split(", "))}
    src = re.search(r"nccl_back: loaded version \w+ from (\w+)", text)
    result["source"] = src.group(1) if src else "auto"
    result["load_s"] = result.get("nccl_back_load", result.get("auto_load_weights"))
    launched = out.with_suffix(".launched")
    if launched.exists() and "first_token_unix" in result:
        result["launch_to_first_token_s"] = result["first_token_unix"] - float(launched.read_text())
    caches = re.search(r"nccl_back: compile caches from peer \S+: ([\d.]+) MB in ([\d.]+) s", text)
    if caches:
        result["caches_mb"], result["caches_s"] = float(caches.group(1)), float(caches.group(2))
    result["caches"] = ("from_peer" if caches else "missed" if "no compile caches from peers"
                        in text else "n/a")
    return result


#: Markers of a start in vLLM's log (the first line matching each), for ``--caches``.
_MARKS = {
    "engine_core": r"Initializing a V1 LLM engine",
    "modelinfos": r"nccl_back: model infos from peer",
    "weights": r"nccl_back: loaded version|Loading weights took",
    "caches": r"nccl_back: (?:no )?compile caches",
    "headers": r"nccl_back: precompiled headers from peer",
    "warm_up": r"Warming up model for the compilation",
    "ready": r"init engine \(profile, create kv cache, warmup model\) took",
}
_STAMP = re.compile(r"^\(\S+ pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d) ")


def marks(log: Path, launched: float) -> dict[str, float]:
    """Seconds from the launch to each marker (vLLM stamps its lines to the second)."""
    year = time.localtime(launched).tm_year
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        for name, pattern in _MARKS.items():
            if name not in out and re.search(pattern, line):
                at = time.mktime(time.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S"))
                out[name] = round(at - launched, 1)
    return out


def caches_main(args: argparse.Namespace) -> int:
    """``--caches``: time to the first generated token, with and without compile caches."""
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-caches-"))
    model = write_example_model(work / "model", args.model_mb)
    redis = LocalRedis().start()
    base = engine_env(redis.url, work, NCCL_BACK_SECRET="bench-fleet-secret-0123")

    def env(root: str) -> dict[str, str]:
        # Inductor's cache too is the engine's own: a shared one would make "cold" warm.
        # Inductor's precompiled headers (under the temporary directory) as well.
        (work / f"{root}-tmp").mkdir(exist_ok=True)
        return dict(base, VLLM_CACHE_ROOT=str(work / root), TMPDIR=str(work / f"{root}-tmp"),
                    TORCHINDUCTOR_CACHE_DIR=str(work / f"{root}-inductor"))

    results: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {"model_bytes": sum(s.stat().st_size for s in model.glob("*.safetensors")),
                            "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}

    def one(name: str, load_format: str, root: str, extra: list[str] | None = None,
            more_env: dict[str, str] | None = None) -> None:
        proc, out, log, _ = run_engine(name, model, {**env(root), **(more_env or {})}, work,
                                       load_format, extra=["--compile", *(extra or [])])
        results[name] = wait_result(proc, out, log, args.timeout)
        proc.wait(120)
        results[name]["marks"] = marks(log, float(out.with_suffix(".launched").read_text()))
        print(f"{name}: {results[name]['launch_to_first_token_s']:.1f} s launch -> first token"
              f" (caches {results[name]['caches']}); {results[name]['marks']}", flush=True)

    try:
        one("cold", "auto", "root-cold")
        one("warm_restart", "auto", "root-cold")
        proc_a, out, log, release = run_engine("peer_source", model, env("root-src"), work,
                                               "nccl_back", hold=True, serve_every=0,
                                               extra=["--compile"])
        results["peer_source"] = wait_result(proc_a, out, log, args.timeout)
        deadline = time.monotonic() + 120  # its set is published just after it is ready
        while "compile caches published" not in log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise SystemExit("peer_source published no compile caches; see its log")
            time.sleep(0.5)
        # In the environment, not the loader's extra config: model infos are fetched when
        # the plugin loads, from the environment's settings.
        one("weights_from_peer", "nccl_back", "root-w",
            more_env={"NCCL_BACK_COMPILE_CACHES": "false"})
        one("weights_caches_from_peer", "nccl_back", "root-wc")
        release.touch()
        proc_a.wait(120)
        meta["load_avg_end"] = os.getloadavg()[0]
    finally:
        redis.stop()
        (outdir / "vllm_start_caches_logs").mkdir(exist_ok=True)
        for f in work.glob("*.log"):
            shutil.copy(f, outdir / "vllm_start_caches_logs" / f.name)
        shutil.rmtree(work, ignore_errors=True)
    cols = ("launch_to_first_token_s", "init_model", "load_s", "init_engine", "first_token_s")
    print(f"\n{meta['model_bytes'] / 2**20:.0f} MiB checkpoint; load average"
          f" {meta['load_avg_start']:.1f} -> {meta['load_avg_end']:.1f}")
    print(f"{'engine':<26}" + "".join(f"{c:>24}" for c in cols) + "  caches")
    for name, r in results.items():
        print(f"{name:<26}" + "".join(f"{r.get(c, float('nan')):>24.2f}" for c in cols)
              + f"  {r['caches']}")
    wc = results["weights_caches_from_peer"]["launch_to_first_token_s"]
    ratios = {"over_warm_restart": wc / results["warm_restart"]["launch_to_first_token_s"],
              "over_cold": wc / results["cold"]["launch_to_first_token_s"],
              "weights_only_over_cold": results["weights_from_peer"]["launch_to_first_token_s"]
              / results["cold"]["launch_to_first_token_s"]}
    for k, v in ratios.items():
        print(f"weights_caches_from_peer {k}: {v:.2f}x" if k != "weights_only_over_cold"
              else f"weights_from_peer over_cold: {v:.2f}x")
    print(f"goal: <= 1.15x warm restart: {'PASS' if ratios['over_warm_restart'] <= 1.15 else 'MISS'};"
          f" <= 0.7x cold: {'PASS' if ratios['over_cold'] <= 0.7 else 'MISS'}")
    (outdir / "vllm_start_caches.json").write_text(
        json.dumps({"meta": meta, "results": results, "ratios": ratios}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-mb", type=float, default=1024)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--serve-every", type=float, default=3.0,
                   help="peer_source answers a request every this many seconds while it serves"
                        " (0: none, to measure the transfer without the source's own inference)")
    p.add_argument("--caches", action="store_true",
                   help="compiling engines: cold / warm restart / weights from a peer / weights"
                        " and compile caches from a peer, launch to first token")
    args = p.parse_args(argv)
    if args.caches:
        return caches_main(args)

    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-start-"))
    model = write_example_model(work / "model", args.model_mb)
    shards = sorted(model.glob("*.safetensors"))
    size = sum(s.stat().st_size for s in shards)
    redis = LocalRedis().start()
    env = engine_env(redis.url, work)
    results: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {
        "model_bytes": size, "shards": len(shards), "cpus": os.cpu_count(),
        "python": platform.python_version(), "load_avg_start": os.getloadavg()[0],
        "serve_every": args.serve_every,
    }
    try:
        meta["eviction"] = evict(shards)
        meta["cached_before_auto_cold"] = cached(shards)
        for name in ("auto_cold", "auto_warm"):
            proc, out, log, _ = run_engine(name, model, env, work, "auto")
            results[name] = wait_result(proc, out, log, args.timeout)
            proc.wait(120)
            print(f"{name}: {results[name]['load_s']:.2f} s load, "
                  f"{results[name]['first_token_s']:.1f} s to first token", flush=True)
        proc_a, out, log, release = run_engine("peer_source", model, env, work, "nccl_back",
                                               hold=True, serve_every=args.serve_every)
        results["peer_source"] = wait_result(proc_a, out, log, args.timeout)
        proc, out, log, _ = run_engine("peer", model, env, work, "nccl_back")
        results["peer"] = wait_result(proc, out, log, args.timeout)
        proc.wait(120)
        release.touch()
        proc_a.wait(120)
        meta["load_avg_end"] = os.getloadavg()[0]
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)

    if results["peer"]["source"] != "peer":
        raise SystemExit("the peer engine did not load from its peer; see its log")
    cols = ("load_s", "init_model", "init_engine", "ready_s", "first_token_s")
    print(f"\n{size / 2**30:.2f} GiB checkpoint, {len(shards)} shards; cold: {meta['eviction']}"
          f" ({meta['cached_before_auto_cold']} before auto_cold); peer_source answers a request"
          f" every {args.serve_every:g} s; load average {meta['load_avg_start']:.1f} ->"
          f" {meta['load_avg_end']:.1f}")
    print(f"{'engine':<12}" + "".join(f"{c:>15}" for c in cols))
    for name, r in results.items():
        print(f"{name:<12}" + "".join(f"{r.get(c, float('nan')):>15.2f}" for c in cols))
    for name in ("peer_source", "peer"):
        print(f"{name} load phases (s): {results[name].get('nccl_back_phases')}")
    peer = results["peer"]
    ratios = {
        "load_cold_auto_over_peer": results["auto_cold"]["load_s"] / peer["load_s"],
        "load_warm_auto_over_peer": results["auto_warm"]["load_s"] / peer["load_s"],
        "start_cold_auto_over_peer": results["auto_cold"]["first_token_s"] / peer["first_token_s"],
        "start_warm_auto_over_peer": results["auto_warm"]["first_token_s"] / peer["first_token_s"],
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    goal = ratios["load_cold_auto_over_peer"] >= 3.0
    print(f"goal: load phase from a peer >= 3x faster than auto from a cold page cache:"
          f" {'PASS' if goal else 'MISS'} ({ratios['load_cold_auto_over_peer']:.2f}x)")
    (outdir / "vllm_start.json").write_text(
        json.dumps({"meta": meta, "results": results, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
