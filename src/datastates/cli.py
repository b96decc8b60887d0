"""Command line: ``datastates demo | list | inspect | verify | export | import`` (also
``python -m datastates ...``).

Exit codes scripts can rely on: 0 success; 1 an error (damaged checkpoint, missing path, bad
input: the message says what and where); 2 wrong usage (argparse); 3 nothing to act on (the
folder holds no datastates checkpoint).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import __version__
from . import interchange, tools
from .errors import CheckpointNotFoundError, DatastatesError
from .providers import ProviderRegistry
from .restore import Reader

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_EMPTY = 0, 1, 2, 3

_WHERE = ("a checkpoint folder, or a folder of checkpoints (a Checkpointer's directory, an "
          "integration's output folder); s3://bucket/prefix for object storage")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="datastates", description="Inspect, verify, convert and demo datastates checkpoints.",
        epilog="exit codes: 0 ok, 1 error, 2 usage, 3 no checkpoint found. s3:// paths take the "
               "endpoint and credentials from the standard AWS variables (AWS_ENDPOINT_URL, "
               "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION)")
    parser.add_argument("--version", action="version", version=f"datastates {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("demo", help="train a small GPT with checkpoints and print the measurements")

    p = sub.add_parser("list", help="list the committed checkpoints of a folder")
    p.add_argument("path", help="a folder of checkpoints (or s3://bucket/prefix)")

    p = sub.add_parser("inspect", help="keys, dtypes, shapes, sizes, shards, step, metadata")
    _add_which(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")

    p = sub.add_parser("verify", help="re-read every byte of a checkpoint: manifest checksum and "
                                      "fields, headers, indexes, every region's checksums, zero "
                                      "padding")
    _add_which(p)
    p.add_argument("--all", action="store_true", help="verify every checkpoint of the folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("export", help="write a checkpoint as a torch.save or safetensors file, "
                                      "or an HF model folder")
    _add_which(p)
    p.add_argument("--to", required=True, choices=("torch", "safetensors", "hf"),
                   help="output format (hf: a folder from_pretrained loads)")
    p.add_argument("out", help="the file (folder for hf) to write, atomically")
    p.add_argument("--keys", nargs="+", metavar="KEY",
                   help="only these key prefixes (e.g. model); with one prefix, safetensors "
                        "names are relative to it")
    p.add_argument("--trusted", action="store_true",
                   help="allow unpickling any Python object stored in the checkpoint (torch only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("import", help="save a torch.save / safetensors file or a DCP folder as a "
                                      "datastates checkpoint")
    p.add_argument("src", help="the file (torch, safetensors) or folder (dcp) to read")
    p.add_argument("--from", dest="source", required=True, choices=("torch", "safetensors", "dcp"),
                   help="format of SRC")
    p.add_argument("dest", help="the folder of checkpoints to save into")
    p.add_argument("--step", type=int, help="step of the new checkpoint (default 0)")
    p.add_argument("--tag", help="name of the new checkpoint instead of step-<step>")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint of that name")
    return parser


def _add_which(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help=_WHERE)
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--tag", help="the checkpoint of this tag")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from .demo import main as demo_main
        return demo_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except CheckpointNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_EMPTY if "no datastates checkpoint" in str(exc) else EXIT_ERROR
    except DatastatesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _list(args) -> int:
    infos = tools.find(args.path, every=True)
    newest = infos[-1].name
    rows = [(" ", "name", "step", "saved (UTC)", "size", "ranks")]
    for info in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(info.created_unix))
        rows.append(("*" if info.name == newest else " ", info.name,
                     "-" if info.step is None else str(info.step), when,
                     tools.human_bytes(info.nbytes), str(info.world_size)))
    _table(rows)
    print(f"{len(infos)} checkpoint(s); * = newest committed (what restore() takes by default)")
    return EXIT_OK


def _inspect(args) -> int:
    # A folder of several checkpoints with no newest one (a DeepSpeed tag folder: one checkpoint
    # per file DeepSpeed names) shows each of them.
    paths = [args.path] if tools.is_single(args.path) or args.step is not None or args.tag \
        else [i.path for i in tools.find(args.path)]
    summaries = [tools.inspect(p, args.step, args.tag) for p in paths]
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=1))
    else:
        print("\n\n".join(tools.render_inspect(s) for s in summaries))
    return EXIT_OK


def _verify(args) -> int:
    infos = tools.find(args.path, args.step, args.tag, every=args.all)
    total, t0 = 0, time.perf_counter()
    # one bar in bytes over every checkpoint, moving inside each one as its files are checked
    bar = _progress(sum(i.nbytes for i in infos), "B", "verify", args.no_progress)
    for info in infos:
        start = time.perf_counter()
        # Objects are only checksummed here, never unpickled: verifying runs no code from the file.
        with Reader(info.path, registry=ProviderRegistry.default(), verify=True,
                    world_size=info.world_size, rank_policy="rank0") as reader:
            n = reader.verify_all(bar.update if bar is not None else None)
        total += n
        _write(bar, f"{info.name}: OK, manifest and {info.world_size} shard file(s), {n} bytes "
                    f"verified ({tools.human_bytes(n)}) in {time.perf_counter() - start:.2f} s")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    print(f"verified {len(infos)} checkpoint(s), {tools.human_bytes(total)} in {seconds:.2f} s "
          f"({total / max(seconds, 1e-9) / 1e9:.2f} GB/s): all OK")
    return EXIT_OK


def _export(args) -> int:
    bar = _progress(None, "B", args.out, args.no_progress)
    report = interchange.export(args.path, args.out, args.to, keys=args.keys, step=args.step,
                                tag=args.tag, trusted=args.trusted,
                                progress=bar.update if bar is not None else None)
    if bar is not None:
        bar.close()
    note = ""
    if report.skipped:
        note = f"; left out {len(report.skipped)} non-tensor value(s) (safetensors holds tensors)"
    if report.aliases:
        note += f"; {len(report.aliases)} tied name(s) stored once (metadata datastates.aliases)"
    print(f"wrote {report.path}: {report.tensors} tensors, {tools.human_bytes(report.nbytes)} in "
          f"{report.seconds:.2f} s{note}")
    return EXIT_OK


def _import(args) -> int:
    info = interchange.import_checkpoint(args.src, args.dest, source=args.source, step=args.step,
                                         tag=args.tag, overwrite=args.overwrite)
    print(f"committed {info.path}: {tools.human_bytes(info.nbytes)} from {args.src}")
    return EXIT_OK


_COMMANDS = {"list": _list, "inspect": _inspect, "verify": _verify, "export": _export,
             "import": _import}


def _table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _progress(total, unit: str, desc: str, disabled: bool):
    """A tqdm bar on stderr when tqdm is installed, stderr is a terminal and it is wanted."""
    if disabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, leave=False,
                file=sys.stderr)


def _write(bar, line: str) -> None:
    if bar is not None:
        bar.write(line)
    else:
        print(line)
