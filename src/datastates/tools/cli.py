"""Command line: ``datastates list | inspect | verify | export | import | check-resume |
keeper`` (also ``python -m datastates ...``).

Exit codes scripts can rely on: 0 success; 1 an error (damaged checkpoint, missing path, bad
input: one line on stderr, starting with ``error:``, says what and where; no traceback); 2 wrong
usage (argparse); 3 nothing to act on (the folder holds no datastates checkpoint, or none of
the ``--step``/``--tag`` asked for; a path that does not exist is 1). A reader that closes the
pipe early (``inspect --json | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from tqdm import tqdm

from .._version import __version__
from . import export, describe
from ..errors import CheckpointNotFoundError, ConfigError, DatastatesError
from ..save.arguments import check_tag
from ..providers import ProviderRegistry
from ..restore.reader import Reader
from ..storage.store import is_url

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_EMPTY = 0, 1, 2, 3

_WHERE = (
    "a checkpoint folder, or a folder of checkpoints (a Checkpointer's directory, an "
    "integration's output folder); s3://bucket/prefix for object storage"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="datastates",
        description="Inspect, verify and convert datastates checkpoints.",
        epilog="exit codes: 0 ok, 1 error, 2 usage, 3 no checkpoint found (an empty folder, "
        "no such --step or --tag). s3:// paths take the "
        "endpoint and credentials from the standard AWS variables (AWS_ENDPOINT_URL, "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION)",
    )
    parser.add_argument("--version", action="version", version=f"datastates {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "list",
        help="list the committed checkpoints of a folder, and the damaged "
        "ones (marked !, with the reason; every manifest's checksum "
        "is checked, the newest's fields all: 'verify --all' checks "
        "every one whole)",
    )
    p.add_argument("path", help="a folder of checkpoints (or s3://bucket/prefix)")

    p = sub.add_parser("inspect", help="keys, dtypes, shapes, sizes, shards, step, metadata")
    _add_which(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    p.add_argument(
        "--keys",
        nargs="+",
        metavar="KEY",
        help="only the entries under these key prefixes (e.g. model optimizer)",
    )

    p = sub.add_parser(
        "verify",
        help="re-read every byte of a checkpoint: manifest checksum and "
        "fields, headers, indexes, every region's checksums, zero "
        "padding",
    )
    _add_which(p)
    p.add_argument(
        "--all",
        action="store_true",
        help="verify every checkpoint of the folder (each one, then a summary; exit "
        "1 if any is damaged or fails)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "export",
        help="write a checkpoint as a torch.save or safetensors file, or an HF model folder",
    )
    _add_which(p)
    p.add_argument(
        "--to",
        required=True,
        choices=("torch", "safetensors", "hf"),
        help="output format (hf: a folder from_pretrained loads)",
    )
    p.add_argument("out", help="the file (folder for hf) to write, atomically")
    p.add_argument(
        "--keys",
        nargs="+",
        metavar="KEY",
        help="only these key prefixes (e.g. model); with one prefix, safetensors "
        "names are relative to it",
    )
    p.add_argument(
        "--trusted",
        action="store_true",
        help="allow unpickling any Python object stored in the checkpoint (torch only)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "import",
        help="save a torch.save / safetensors file or a DCP folder as a datastates checkpoint",
    )
    p.add_argument("src", help="the file (torch, safetensors) or folder (dcp) to read")
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        choices=("torch", "safetensors", "dcp"),
        help="format of SRC",
    )
    p.add_argument("dest", help="the folder of checkpoints to save into")
    p.add_argument("--step", type=int, help="step of the new checkpoint (default 0)")
    p.add_argument("--tag", type=_name, help="name of the new checkpoint instead of step-<step>")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint of that name")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="allow unpickling: Python objects of a torch.save file, and a stock DCP "
        "folder (its metadata is a pickle); only for files you trust",
    )
    _add_check_resume(sub)
    _add_keeper(sub)
    return parser


def _add_keeper(sub) -> None:
    p = sub.add_parser(
        "keeper",
        help="run the memory tier's keeper of a job (docs/memory-tier.md)"
        "; --status, --persist or --stop talk to a running one",
    )
    p.add_argument("path", help="the job's checkpoint directory (the storage tier)")
    p.add_argument("--root", default=None, help="the shared-memory root (default /dev/shm)")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="end after this many seconds without a trainer (default 300)",
    )
    p.add_argument(
        "--no-persist",
        action="store_true",
        help="do not write the newest memory checkpoint to storage when the trainer "
        "dies, detaches or the keeper ends",
    )
    act = p.add_mutually_exclusive_group()
    act.add_argument("--status", action="store_true", help="print the running keeper's state")
    act.add_argument(
        "--persist",
        action="store_true",
        help="make the running keeper write the newest memory checkpoint to storage "
        "(refused while a trainer is attached: it saves with persist=True)",
    )
    act.add_argument(
        "--stop",
        action="store_true",
        help="make the running keeper persist, remove the memory and end",
    )
    p.add_argument("--options", help=argparse.SUPPRESS)  # a spawning trainer's MemoryTier
    p.add_argument("--storage-config", help=argparse.SUPPRESS)  # ... and its retention, fsync


def _keeper(args) -> int:
    from .keeper import run_command

    return run_command(args)


def _add_check_resume(sub) -> None:
    p = sub.add_parser(
        "check-resume",
        help="run a training loop uninterrupted and killed at "
        "given steps; report whether the resumed run is "
        "bit-identical (docs/resume-check.md; exit 1 if not)",
    )
    p.add_argument(
        "target",
        metavar="MODULE:FUNCTION",
        help="the loop, train_fn(run), importable from the current directory",
    )
    p.add_argument("--steps", type=int, required=True, help="steps each run trains")
    p.add_argument(
        "--kill-at",
        required=True,
        type=_steps,
        metavar="A,B,...",
        help="the steps at which the interrupted run is killed, e.g. 3,7",
    )
    p.add_argument("--workdir", help="keep the runs' checkpoints, fingerprints and output here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process (600)")


def _steps(text: str) -> list:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps such as 3,7, found {text!r}") from None


def _check_resume(args) -> int:
    from .resumecheck import check_resume

    report = check_resume(
        args.target, args.steps, args.kill_at, workdir=args.workdir, timeout_s=args.timeout
    )
    print(report)
    return EXIT_OK if report.ok else EXIT_ERROR


def _add_which(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help=_WHERE)
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    p.add_argument("--tag", type=_name, help="the checkpoint of this tag")


def _name(text: str) -> str:
    """A ``--tag``: a name ``save()`` accepts (``arguments.check_tag``), else argparse's usage
    error."""
    try:
        return check_tag(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        code = _COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader has all it wanted (`... | head`); stdout goes to /dev/null so that the
        # flush at exit does not fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK
    except _NothingFound as exc:
        _error(exc.cause)
        return EXIT_EMPTY
    except (DatastatesError, OSError) as exc:
        _error(exc)
        return EXIT_ERROR


class _NothingFound(Exception):
    """The folder given exists but holds no checkpoint to act on (exit code 3)."""

    def __init__(self, cause: CheckpointNotFoundError):
        super().__init__(str(cause))
        self.cause = cause


@contextlib.contextmanager
def _finding(path: str):
    """Around the selection of the checkpoint(s) ``path`` designates: not finding one in a
    folder that exists (an empty folder, another framework's files, no such step or tag) is
    _NothingFound; ``path`` itself missing, or a file, stays an error (exit code 1), as does a
    file missing inside a checkpoint found (read later, outside this block)."""
    try:
        yield
    except CheckpointNotFoundError as exc:
        if is_url(path) or os.path.isdir(path):
            raise _NothingFound(exc) from None
        raise


def _error(exc: BaseException) -> None:
    """One line on stderr: ``error: <message>`` (an OSError outside the library: its class)."""
    text = str(exc) if isinstance(exc, DatastatesError) else f"{type(exc).__name__}: {exc}"
    print(f"error: {' '.join(text.split())}", file=sys.stderr)


def _list(args) -> int:
    with _finding(args.path):
        found = describe.select(args.path, every=True)
    infos = found.checkpoints
    newest = infos[-1].name if infos else None
    metrics = any(info.metrics for info in infos)  # the column only when some have metrics
    rows = [
        (" ", "name", "step", "saved (UTC)", "size", "ranks") + (("metrics",) if metrics else ())
    ]
    for info in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(info.created_unix))
        rows.append(
            (
                "*" if info.name == newest else " ",
                info.name,
                "-" if info.step is None else str(info.step),
                when,
                describe.human_bytes(info.nbytes),
                str(info.world_size),
            )
            + ((describe.render_metrics(info.metrics) or "-",) if metrics else ())
        )
    for d in found.damaged:
        reason = f"DAMAGED: {' '.join(d.reason.split())}"
        rows.append(("!", d.name, "-", "-", "-") + (("-", reason) if metrics else (reason,)))
    _table(rows)
    note = f", {len(found.damaged)} damaged (!: never restored)" if found.damaged else ""
    print(
        f"{len(infos)} checkpoint(s){note}; * = newest committed (what restore() takes by default)"
    )
    return EXIT_OK


def _inspect(args) -> int:
    # Every checkpoint the path designates: a DeepSpeed tag folder is one per file.
    with _finding(args.path):
        infos = describe.find(args.path, args.step, args.tag)
    summaries = [describe.describe(i, keys=args.keys) for i in infos]
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=1))
    else:
        print("\n\n".join(describe.render_inspect(s) for s in summaries))
    return EXIT_OK


def _verify(args) -> int:
    with _finding(args.path):
        found = describe.select(args.path, args.step, args.tag, every=args.all)
    total, failed, t0 = 0, [], time.perf_counter()
    # one bar in bytes over every checkpoint, moving inside each one as its files are checked
    bar = _progress(sum(i.nbytes for i in found.checkpoints), "B", "verify", args.no_progress)
    for info in found.checkpoints:
        start = time.perf_counter()
        try:
            n = _verify_one(info, bar.update)
        except (DatastatesError, OSError) as exc:
            failed.append(info.name)
            _write(bar, f"error: {info.name}: FAILED: {' '.join(str(exc).split())}", sys.stderr)
            continue
        total += n
        _write(
            bar,
            f"{info.name}: OK, manifest and {info.world_size} shard file(s), {n} bytes "
            f"verified ({describe.human_bytes(n)}) in {time.perf_counter() - start:.2f} s",
        )
    for d in found.damaged:
        failed.append(d.name)
        _write(bar, f"error: {d.name}: DAMAGED: {' '.join(d.reason.split())}", sys.stderr)
    bar.close()
    seconds = time.perf_counter() - t0
    checked = len(found.checkpoints) + len(found.damaged)
    verdict = "all OK" if not failed else f"{len(failed)} failed ({', '.join(failed)})"
    print(
        f"verified {checked} checkpoint(s), {describe.human_bytes(total)} in {seconds:.2f} s "
        f"({total / max(seconds, 1e-9) / 1e9:.2f} GB/s): {verdict}"
    )
    return EXIT_ERROR if failed else EXIT_OK


def _verify_one(info, progress) -> int:
    """Re-read every byte of one checkpoint; the bytes checked."""
    if describe.is_dcp_info(info):
        from ..dcp.folders import verify_folder

        return verify_folder(info.path, progress)
    # Objects are only checksummed here, never unpickled: verifying runs no code from the file.
    with Reader(
        info.path,
        registry=ProviderRegistry.default(),
        verify=True,
        world_size=info.world_size,
        rank_policy="rank0",
    ) as reader:
        return reader.verify_all(progress)


def _export(args) -> int:
    with _finding(args.path):  # (an object-store path: export's own error)
        infos = [] if is_url(args.path) else describe.find(args.path, args.step, args.tag)
    # the one checkpoint found, found once; several (a DeepSpeed tag): export's own error
    path, step, tag = (
        (infos[0].path, None, None) if len(infos) == 1 else (args.path, args.step, args.tag)
    )
    with _progress(None, "B", args.out, args.no_progress) as bar:
        if not bar.disable:  # its total only for a bar drawn
            bar.reset(total=export.planned_bytes(path, args.to, keys=args.keys, step=step, tag=tag))
        report = export.export(
            path,
            args.out,
            args.to,
            keys=args.keys,
            step=step,
            tag=tag,
            trusted=args.trusted,
            progress=bar.update,
        )
    note = ""
    if report.skipped:
        note = f"; left out {len(report.skipped)} non-tensor value(s) (safetensors holds tensors)"
    if report.aliases:
        note += f"; {len(report.aliases)} tied name(s) stored once (metadata datastates.aliases)"
    if report.refused:
        note += "; not copied: " + ", ".join(f"{n} ({why})" for n, why in report.refused)
    print(
        f"wrote {report.path}: {report.tensors} tensors, {describe.human_bytes(report.nbytes)} in "
        f"{report.seconds:.2f} s{note}"
    )
    return EXIT_OK


def _import(args) -> int:
    info = export.import_checkpoint(
        args.src,
        args.dest,
        source=args.source,
        step=args.step,
        tag=args.tag,
        overwrite=args.overwrite,
        trusted=args.trusted,
    )
    print(f"committed {info.path}: {describe.human_bytes(info.nbytes)} from {args.src}")
    return EXIT_OK


_COMMANDS = {
    "list": _list,
    "inspect": _inspect,
    "verify": _verify,
    "export": _export,
    "import": _import,
    "check-resume": _check_resume,
    "keeper": _keeper,
}


def _table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _progress(total, unit: str, desc: str, disabled: bool) -> tqdm:
    """A progress bar on stderr, drawn when stderr is a terminal (tqdm decides) unless
    ``disabled`` (``--no-progress``); a bar not drawn takes its updates and draws nothing."""
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        desc=desc,
        leave=False,
        file=sys.stderr,
        disable=True if disabled else None,
    )


def _write(bar: tqdm, line: str, file=None) -> None:
    """``line`` on ``file`` (stdout) above the bar, which is drawn again below it."""
    bar.write(line, file=file or sys.stdout)
