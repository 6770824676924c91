"""The ``nccl-back`` command line.

Each subcommand is one ``cmd_<name>(args) -> int`` function, registered in
:func:`build_parser` with ``set_defaults(func=...)``; to add one, add a subparser
there and a ``cmd_`` function here. Expected failures (bad input, missing files,
storage errors) print one line on stderr and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from . import log
from .checkpoint import flat_skeleton
from .config import Settings
from .errors import ConfigError, NcclBackError
from .identity import ModelSpec
from .loader import load_from_storage

PROG = "nccl-back"


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
    p.add_argument("uri", metavar="PATH_OR_URI", help="checkpoint directory or gs://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--cache-dir", help="CRC32C cache directory (default: Settings.cache_dir)")
    p.set_defaults(func=cmd_fingerprint)

    p = sub.add_parser("load", help="load a checkpoint from storage into a flat skeleton")
    p.add_argument("uri", metavar="PATH_OR_URI", help="checkpoint directory or gs://bucket/prefix")
    p.add_argument("--device", default="cpu", help="torch device for the tensors (default cpu)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--cache-dir", help="CRC32C cache directory (default: Settings.cache_dir)")
    p.set_defaults(func=cmd_load)
    return parser


def cmd_fingerprint(args: argparse.Namespace) -> int:
    """Print the version and every shard's CRC32C."""
    spec = ModelSpec.from_dir(args.uri, cache_dir=_cache_dir(args))
    if args.json:
        shards = [{"uri": s.uri, "crc32c": s.crc32c, "size": s.size} for s in spec.shards]
        print(json.dumps({"version": spec.version, "shards": shards}, indent=2))
    else:
        print(f"version {spec.version}")
        for s in spec.shards:
            print(f"{s.crc32c}  {s.size:>14}  {s.uri}")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    """Load into a skeleton built from the headers; print version, bytes, seconds, GB/s."""
    device = _device(args.device)
    settings = Settings.from_env()
    spec = ModelSpec.from_dir(args.uri, cache_dir=_cache_dir(args))
    skeleton = flat_skeleton(spec, device=device)
    result = load_from_storage(skeleton, spec, progress=_ProgressBar(), settings=settings)
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


class _ProgressBar:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, done: int, total: int, rate: float) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        end = "\n" if done >= total else ""
        sys.stderr.write(
            f"\r[{bar:<30}] {frac:6.1%} {done / 1e9:.2f}/{total / 1e9:.2f} GB {rate / 1e9:.2f} GB/s{end}"
        )
        sys.stderr.flush()


def _cache_dir(args: argparse.Namespace) -> str:
    return args.cache_dir or Settings.from_env().cache_dir


def _device(name: str) -> torch.device:
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
