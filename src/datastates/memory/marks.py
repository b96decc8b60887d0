"""Memory checkpoints the keeper has checked: a restart reads them without checking them again.

When the last trainer leaves (it died, or detached), the keeper checks every byte of the newest
memory checkpoint (``verify_checkpoint``: headers, indexes, every checksum, the zero padding)
while the trainer restarts, and records that it did in a *mark*, ``<memdir>/verified/<name>``:
the SHA-256 of the checkpoint's manifest and, for each of its shard files, the size, inode,
modification and change times (ns), taken before the check and found the same after it. A
restore from memory whose checkpoint has a mark matching the files as they are now reads them
without checksumming every byte a second time. No mark, a mark that does not parse or does not
match: the restore checks every checksum as it reads, as without marks.

What a mark relies on: a committed checkpoint is never written again (only removed: the
trainer's retention, and the trainer has left when the keeper checks), so its files keep the
bytes checked. A write after the check, by anything, gives the file a new change time, which no
``utime`` can set back, and the mark no longer holds. The times are those of a write's start in
clock ticks, so a write already under way when the check began and still running would not
show: none can be, by the rule above.

The memory directory is the user's own, with no access for anyone else (``place.py``), so only
the user's processes can write to the files or to the marks. Marks of checkpoints that are gone
are removed when the next mark is written; the memory directory goes with the keeper.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat

from ..commit.catalog import Catalog
from ..errors import CorruptCheckpointError, DatastatesError
from ..format import codec as fmt
from ..format.records import CheckpointInfo
from ..format.small_records import Mark, parse_mark
from ..providers import ProviderRegistry
from ..restore.reader import Reader
from ..restore.verify import verify_checkpoint
from ..storage import LOCAL
from ..storage.store import read_regular
from . import place

log = logging.getLogger("datastates")

MARKS = "verified"
_MAX_MARK = 1 << 20  # a mark names a few files; anything larger is not one


def _order(info: CheckpointInfo) -> int:
    return -1 if info.step is None else info.step


def _identity(path: str) -> list[int] | None:
    """Size, inode, mtime and ctime (ns) of the regular file ``path`` (None: not one)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _manifest_digest(ckpt: str) -> str:
    return hashlib.sha256(
        read_regular(os.path.join(ckpt, fmt.MANIFEST), fmt.MAX_MANIFEST_BYTES)
    ).hexdigest()


def record(memdir: str, info: CheckpointInfo, digest: str, identities: dict) -> None:
    """Write the mark of ``info``, a checkpoint of ``memdir`` checked just now: ``digest`` and
    ``identities`` (file name -> :func:`_identity`) as they were taken *before* the check
    (:func:`verify_newest` marks only when they are the same after it). Remove the marks of
    checkpoints that are gone."""
    marks = os.path.join(memdir, MARKS)
    place.ensure_private_dir(marks)  # a real directory of this user's, never a link
    tmp = os.path.join(marks, f".{info.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(Mark(info.name, digest, identities).to_json(), f)
    os.replace(tmp, os.path.join(marks, info.name))
    parent = os.path.dirname(info.path)
    for name in os.listdir(marks):
        if (
            name != info.name
            and not name.startswith(".")
            and not os.path.isdir(os.path.join(parent, name))
        ):
            try:
                os.unlink(os.path.join(marks, name))
            except OSError:
                pass


def holds(memdir: str, info: CheckpointInfo) -> bool:
    """Whether ``info`` (a checkpoint of ``memdir``) has a mark that matches its manifest and
    every shard file as they are now. Any doubt is False."""
    path = os.path.join(memdir, MARKS, info.name)
    try:
        mark = parse_mark(read_regular(path, _MAX_MARK), path)
        if mark.name != info.name or mark.manifest != _manifest_digest(info.path):
            return False
        return all(
            _identity(os.path.join(info.path, name)) == list(identity)
            for name, identity in mark.files.items()
        )
    except (OSError, CorruptCheckpointError):  # the mark, or the manifest, does not read
        return False


def verify_newest(
    memdir: str, ckpt_root: str, storage_root: str | None = None
) -> CheckpointInfo | None:
    """Check every byte of the newest committed checkpoint of ``ckpt_root`` unless its mark
    holds, and mark it; return it (None: there is none, or ``storage_root`` holds a newer step,
    which a restore of the latest reads instead). A damaged one is logged, not marked (the
    restore finds the damage itself and passes over it)."""
    newest = Catalog(ckpt_root, LOCAL).scan() if os.path.isdir(ckpt_root) else []
    if not newest:
        return None
    info = newest[-1]
    if storage_root is not None and os.path.isdir(storage_root):
        stored = [_order(i) for i in Catalog(storage_root, LOCAL).scan()]
        if stored and max(stored) > _order(info):
            return None
    if holds(memdir, info):
        return info
    try:
        digest = _manifest_digest(info.path)  # before the manifest is parsed and the files read
        files = [n for n in os.listdir(info.path) if n != fmt.MANIFEST]
        before = {name: _identity(os.path.join(info.path, name)) for name in files}
        with Reader(
            info.path,
            registry=ProviderRegistry.default(),
            verify=True,
            store=LOCAL,
            world_size=info.world_size,
            rank_policy="rank0",
        ) as reader:
            names = [ref.name for ref in reader.manifest.files]
            verify_checkpoint(reader.checkpoint)
    except (OSError, DatastatesError) as exc:
        log.warning("keeper: the memory checkpoint %s does not verify: %s", info.name, exc)
        return None
    identities = {name: before.get(name) for name in names}
    after = {name: _identity(os.path.join(info.path, name)) for name in names}
    # Marked only if nothing visibly changed during the check.
    if (
        None not in identities.values()
        and after == identities
        and _manifest_digest(info.path) == digest
    ):
        try:
            record(memdir, info, digest, identities)
        except (OSError, DatastatesError) as exc:  # its restore checksums, as without marks
            log.warning("keeper: could not mark %s as checked: %s", info.name, exc)
    return info
