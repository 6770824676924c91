"""The ``nccl-back`` command line: one ``cmd_<name>(args) -> int`` per subcommand,
registered in :func:`build_parser`. Expected failures print one line on stderr and exit
non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

# Only light modules at the top: `--help`, `fingerprint` and `status` must not pay for
# torch (seconds). Each command imports what it needs (see tests/test_cli_speed.py).
from nccl_back.config import RETIRED, Settings
from nccl_back.errors import ConfigError, NcclBackError

if TYPE_CHECKING:
    import torch

    from nccl_back.coord.registry import PeerStatus, Registry

PROG = "nccl-back"
_URI_HELP = "checkpoint directory, gs://bucket/prefix, s3://bucket/prefix or az://container/prefix"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem and where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand; each sets ``func`` to its ``cmd_`` function."""
    parser = _Parser(prog=PROG, description="Receive model weights from a live peer.")
    parser.add_argument(
        "--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR (default WARNING)"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("fingerprint", help="print a checkpoint's version and shard CRC32Cs")
    p.add_argument("uri", metavar="PATH_OR_URI", help=_URI_HELP)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--cache-dir", help="CRC32C cache directory (default: Settings.cache_dir)")
    p.set_defaults(func=cmd_fingerprint)

    p = sub.add_parser("load", help="load a checkpoint from storage into a flat skeleton")
    p.add_argument("uri", metavar="PATH_OR_URI", help=_URI_HELP)
    p.add_argument("--device", default="cpu", help="torch device for the tensors (default cpu)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--cache-dir", help="CRC32C cache directory (default: Settings.cache_dir)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bars (they are drawn only when stderr is a terminal)")
    p.set_defaults(func=cmd_load)

    _add_serve(sub)
    _add_check(sub)

    p = sub.add_parser("drain", help="drain the local sidecar and wait until it has (a Kubernetes"
                       " preStop hook)", description="POST /drain to the sidecar's health port on"
                       " 127.0.0.1 and wait until its in-flight transfers have finished; exit 1 if"
                       " that fails.")
    p.add_argument("--port", type=int, default=9400, help="the sidecar's --health-port (default 9400)")
    p.add_argument("--timeout", type=float, default=130.0, help="seconds to wait at most")
    p.add_argument("--token-file", help="file holding the sidecar's drain token")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("status", help="what Redis holds: versions, peers, claims, ground truth")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--redis-url", help="coordination store (default: NCCL_BACK_REDIS_URL)")
    p.add_argument("--namespace", help="key prefix (default: NCCL_BACK_NAMESPACE)")
    p.set_defaults(func=cmd_status)
    return parser


#: serve flags that become Settings fields when given (flags win over NCCL_BACK_*).
_SETTINGS_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("redis-url", str, "coordination store: redis://[:password@]host:port/db, rediss:// (TLS),"
     " redis+sentinel://h1:26379,h2:26379/SERVICE/db or redis+cluster://h1:6379,h2:6379"),
    ("namespace", str, "prefix of every Redis key"),
    ("transport", str, "auto, gloo or nccl"),
    ("verify", str, "integrity check after a peer load: sampled, full or none"),
    ("advertise-host", str, "address peers use to reach this worker"),
    ("transfer-timeout", float, "seconds one copy may take; the load's waits are carved from it"),
    ("handshake-timeout", float, "seconds a receiver waits in the handshake (a sender a tenth)"),
    ("redis-timeout", float, "socket timeout of every Redis call, seconds"),
    ("peer-ttl", float, "seconds an entry stays visible without a heartbeat"),
    ("max-concurrent-sends", int, "receivers served at once"),
    ("cache-dir", str, "CRC32C cache directory"),
)


class _Retired(argparse.Action):
    """A retired settings flag: one line naming what replaces it, exit 2."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: setting retired; {RETIRED[self.dest]}")


def _add_settings_flags(p: argparse.ArgumentParser) -> None:
    for flag, type_, help_ in _SETTINGS_FLAGS:
        p.add_argument(f"--{flag}", type=type_, help=help_)
    for name in RETIRED:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, action=_Retired, help=argparse.SUPPRESS)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags given on the command line, as ``Settings`` field values."""
    names = (f.replace("-", "_") for f, _, _ in _SETTINGS_FLAGS)
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _add_health_flags(p: argparse.ArgumentParser, of: str, port_note: str) -> None:
    p.add_argument("--health-host", default="127.0.0.1", help=f"interface of {of} (default 127.0.0.1)")
    p.add_argument("--health-port", type=int, default=9400,
                   help=f"port of the health server (default 9400{port_note})")


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="sidecar: load a model (peer first) and serve it until SIGTERM",
                       description="Load a model (from a live peer, storage as fallback), serve it"
                       " to peers and local consumers, answer health probes; SIGTERM drains and"
                       " exits 0. Settings come from NCCL_BACK_* variables; flags win.")
    p.add_argument("--model", required=True, metavar="PATH_OR_URI", help=_URI_HELP)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--factory", metavar="MODULE:FUNCTION",
                     help="callable returning the nn.Module skeleton (default: a flat skeleton"
                     " from the safetensors headers); the current directory is importable")
    how.add_argument("--hf", action="store_true",
                     help="build a transformers causal LM from config.json (extra 'hf')")
    how.add_argument("--diffusers", action="store_true",
                     help="a diffusers pipeline folder (model_index.json): build each component"
                     " with diffusers (extra 'diffusers'); without it a pipeline folder is"
                     " detected and served from flat skeletons built from the headers")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket of the local hand-off server")
    _add_health_flags(p, "/healthz /readyz /metrics /drain", "; 0: any free port")
    p.add_argument("--drain-timeout", type=float, metavar="SECONDS",
                   help="bound on in-flight transfers when draining (default: transfer timeout)")
    p.add_argument("--ready-file", metavar="PATH",
                   help="written atomically (JSON) when ready, removed when draining")
    p.add_argument("--drain-token-file", metavar="PATH",
                   help="write a random token there (0600, private directory); POST /drain"
                   " then needs it (nccl-back drain --token-file PATH)")
    p.add_argument("--strict", action="store_true", default=None,
                   help="fail instead of falling back to storage when a peer load fails")
    _add_settings_flags(p)
    p.add_argument("--log-json", action="store_true", help="log events as JSON lines on stderr")
    p.add_argument("--log-level", dest="serve_log_level", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.set_defaults(func=cmd_serve)


def _add_check(sub: Any) -> None:
    from nccl_back.check import NAMES

    p = sub.add_parser("check", help="preflight: can this worker reach Redis, bind its ports, read"
                       " its model?", description="Run every check a worker needs before a rollout,"
                       " with the settings `serve` would use (NCCL_BACK_* variables; flags win);"
                       f" one line per check, exit 1 if any fails. Checks: {', '.join(NAMES)}.")
    p.add_argument("--model", metavar="PATH_OR_URI", help=_URI_HELP + " to read (storage check)")
    _add_health_flags(p, "the health server, as for serve", "")
    p.add_argument("--skip", default="", metavar="NAME[,NAME]",
                   help="checks to leave out (e.g. transports: answers without importing torch)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    _add_settings_flags(p)
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    """Print one line per preflight check (or JSON); 1 if any failed."""
    from nccl_back import check

    overrides = _overrides(args)
    target = check.Target(args.model, args.health_host, args.health_port)
    skip = frozenset(n.strip() for n in args.skip.split(",") if n.strip())
    results = check.run_checks(os.environ, overrides, target, skip)
    if args.json:
        print(json.dumps(check.as_json(results), indent=2))
    else:
        for c in results:
            print(c.line())
    return 1 if check.failed(results) else 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain the local sidecar; returns once it has drained."""
    from nccl_back.sidecar.drain import read_token_file, request_drain

    try:
        token = read_token_file(args.token_file) if args.token_file else None
        request_drain(args.port, args.timeout, token=token)
    except NcclBackError as e:
        # Exits rather than returning 1, as the preStop command always has: a caller
        # running it in-process (tests, a wrapper script) sees the failure as an exit.
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from e
    return 0


def cmd_fingerprint(args: argparse.Namespace) -> int:
    """Print the version, a pipeline's components, and every shard's CRC32C (headers
    validated: only files a load would accept get a version)."""
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.safetensors_format import validate_headers
    from nccl_back.model.storage import Storage

    storage = Storage(Settings.from_env())
    spec = ModelSpec.from_dir(args.uri, cache_dir=_cache_dir(args), storage=storage)
    validate_headers(storage, spec.shards)
    components = [
        {"name": c, "class": ".".join(spec.component_class(c)),
         "files": len(spec.component_shards(c)),
         "bytes": sum(s.size for s in spec.component_shards(c))}
        for c in spec.components
    ]
    if args.json:
        shards = [{"uri": s.uri, "crc32c": s.crc32c, "size": s.size} for s in spec.shards]
        out: dict[str, Any] = {"version": spec.version, "shards": shards}
        if components:
            out["components"] = components
        print(json.dumps(out, indent=2))
    else:
        print(f"version {spec.version}")
        for c in components:
            weights = f"{c['files']} weight file(s), {c['bytes']} bytes" if c["files"] else "config only"
            print(f"component {c['name']}  {c['class']}  {weights}")
        for s in spec.shards:
            print(f"{s.crc32c}  {s.size:>14}  {s.uri}")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    """Load into a skeleton built from the headers; print version, bytes, seconds, GB/s."""
    from nccl_back.model.checkpoint import flat_skeleton
    from nccl_back.model.identity import ModelSpec
    from nccl_back.model.loader import load_from_storage
    from nccl_back.model.storage import parse_uri

    device = _device(args.device)
    settings = Settings.from_env()
    spec = ModelSpec.from_dir(args.uri, cache_dir=_cache_dir(args), settings=settings)
    skeleton = flat_skeleton(spec, device=device, settings=settings)
    remote = sum(s.size for s in spec.shards if not parse_uri(s.uri).is_local)
    download = _Bar("download", remote, args.quiet) if remote else None
    load = _Bar("load", None, args.quiet)
    try:
        result = load_from_storage(
            skeleton, spec, progress=load, settings=settings,
            on_download=download.add if download else None,
        )
    finally:
        if download:
            download.close()
        load.close()
    summary = {
        "version": result.version,
        "bytes": result.bytes,
        "seconds": round(result.seconds, 4),
        "gbps": round(result.gbps, 3),
        "timings": {k: round(v, 4) for k, v in result.timings.items()},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"version {result.version}")
        print(f"bytes   {result.bytes}")
        print(f"seconds {result.seconds:.3f}")
        print(f"GB/s    {result.gbps:.2f}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate everything up front, then run the sidecar until SIGTERM/SIGINT."""
    from nccl_back import log
    from nccl_back.model.identity import ModelSpec
    from nccl_back.sidecar import serve

    log.configure(level=args.serve_log_level or "INFO", json=args.log_json)
    overrides = _overrides(args)
    if args.strict is not None:
        overrides["strict"] = True
    settings = Settings.from_env(**overrides)
    device = _device(args.device)
    factory = serve.resolve_factory(args.factory) if args.factory else None
    if args.hf:
        serve.require_transformers()
    if args.diffusers:
        from nccl_back.model import pipeline

        pipeline.require_diffusers()
    serve.check_local_model(args.model)
    if args.drain_timeout is not None and args.drain_timeout <= 0:
        raise ConfigError(f"--drain-timeout {args.drain_timeout!r}: must be a positive number of seconds")
    if args.hf:
        spec_config = dict(ModelSpec.from_dir(args.model, cache_dir=settings.cache_dir).config)
        factory = serve.hf_factory(spec_config)
    options = serve.ServeOptions(
        model_uri=args.model,
        device=device,
        factory=factory,
        diffusers=args.diffusers,
        socket_path=args.socket,
        health_host=args.health_host,
        health_port=args.health_port,
        drain_timeout=args.drain_timeout,
        ready_file=args.ready_file,
        drain_token_file=args.drain_token_file,
    )
    sidecar = serve.Sidecar(settings, options).start()
    with serve.stop_on_signals(sidecar):
        code = sidecar.run()
    if sidecar.abandoned:
        # A load or send outlived the drain bound; joining it could take as long again.
        # Exiting closes its sockets, so the receiver fails fast and falls back.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_status(args: argparse.Namespace) -> int:
    """Print every version and peer the registry holds (table, or JSON with --json)."""
    from nccl_back.coord.registry import Registry

    overrides = {k: v for k in ("redis_url", "namespace") if (v := getattr(args, k)) is not None}
    settings = Settings.from_env(**overrides)
    registry = Registry(settings)
    try:
        listing = registry.list_all()
        report = _status_report(registry, listing)
    finally:
        registry.close()
    if args.json:
        print(json.dumps({"namespace": settings.namespace, "versions": report}, indent=2))
        return 0
    if not report:
        print(f"no peers in namespace {settings.namespace!r}")
        return 0
    header = ("VERSION", "MODEL", "RANK", "WORKER", "ENGINE", "PEER", "AGE", "SENDS", "SOURCE",
              "TRUTH", "ADDRESS")
    rows = [header]
    for version, entry in report.items():
        for p in entry["peers"]:
            rows.append((
                version[:12],
                p["model"] or "-",
                f"{p['rank']}/{p['world_size']}",
                f"{p['host']}:{p['pid']}" if p["host"] else "-",
                p["engine"] or "-",
                p["peer_id"],
                f"{p['age']:.0f}s",
                f"{'busy' if p['busy'] else 'free'} {p['active_claims']}/{p['max_sends']}",
                p["source"],
                "yes" if p["ground_truth"] else "no",
                f"{p['transport']} {p['address']}",
            ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


#: ``PeerInfo`` fields that open each peer's row of ``status`` (in this order).
_STATUS_INFO = ("peer_id", "model", "host", "pid", "engine", "rank", "world_size")


def _status_report(registry: Registry, listing: dict[str, list[PeerStatus]]) -> dict[str, Any]:
    from nccl_back.model.scheme import SCHEME

    report: dict[str, Any] = {}
    for version, peers in listing.items():
        truth: dict[tuple[int, int], bool] = {}
        rows = []
        for st in peers:
            key = (st.info.rank, st.info.world_size)
            if key not in truth:
                truth[key] = registry.has_ground_truth(version, *key, SCHEME)
            info = {k: getattr(st.info, k) for k in _STATUS_INFO}
            rows.append({**info, "age": round(st.age, 3), "ttl": round(st.ttl, 3),
                         "active_claims": st.active_claims, "max_sends": st.info.max_sends,
                         "busy": st.busy, "source": st.info.source,
                         "transport": st.info.transport, "address": st.info.address,
                         "ground_truth": truth[key]})
        report[version] = {
            "peers": rows,
            "ground_truth": {f"{r}/{w}": v for (r, w), v in sorted(truth.items())},
        }
    return report


class _Bar:
    """A tqdm progress bar of bytes on stderr (only on a terminal, never with --quiet):
    the loader's ``progress(done, total, rate)``, or :meth:`add` from download threads."""

    def __init__(self, desc: str, total: int | None, quiet: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
            file=sys.stderr, mininterval=0.1, dynamic_ncols=True,
            disable=quiet or not sys.stderr.isatty(),
        )
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int, rate: float) -> None:
        with self._lock:
            if self._bar.total != total:
                self._bar.total = total
            self._bar.update(done - self._bar.n)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._bar.update(nbytes)

    def close(self) -> None:
        self._bar.close()


def _cache_dir(args: argparse.Namespace) -> str:
    return args.cache_dir or Settings.from_env().cache_dir


def _device(name: str) -> torch.device:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r}: not a torch device; use cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name!r}: CUDA is not available here; use --device cpu")
    return device


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nccl-back`` console script; returns the exit status."""
    args: Any = build_parser().parse_args(argv)
    try:
        from nccl_back import log

        log.configure(level=args.log_level)
        return int(args.func(args))
    except NcclBackError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
