"""Command line: ``datastates demo | list DIR | verify DIR [--step N | --tag T]``."""
from __future__ import annotations

import argparse
import sys
import time

from . import __version__
from . import commit as commit_mod
from .errors import DatastatesError
from .providers import ProviderRegistry
from .restore import Reader


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from .demo import main as demo_main
        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="datastates")
    parser.add_argument("--version", action="version", version=f"datastates {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a small GPT with checkpoints and print the measurements")
    p_list = sub.add_parser("list", help="list the committed checkpoints of a directory")
    p_list.add_argument("directory")
    p_verify = sub.add_parser("verify", help="re-read every byte of a checkpoint: manifest "
                              "checksum and fields, headers, indexes, every region's checksums, "
                              "zero padding")
    p_verify.add_argument("directory")
    p_verify.add_argument("--step", type=int)
    p_verify.add_argument("--tag")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            latest = commit_mod.latest(args.directory)
            for info in commit_mod.list_checkpoints(args.directory):
                mark = "*" if latest and info.name == latest.name else " "
                print(f"{mark} {info.name:<30} step={info.step} ranks={info.world_size} "
                      f"bytes={info.nbytes}")
            return 0
        info = commit_mod.resolve(args.directory, args.step, args.tag)
        t0 = time.perf_counter()
        # Objects are only checksummed here, never unpickled: verifying runs no code from the file.
        with Reader(info.path, registry=ProviderRegistry.default(), verify=True,
                    world_size=info.world_size, rank_policy="rank0") as reader:
            n = reader.verify_all()
        print(f"{info.name}: manifest and {info.world_size} shard file(s), {n} bytes verified "
              f"in {time.perf_counter() - t0:.2f} s, OK")
        return 0
    except DatastatesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
