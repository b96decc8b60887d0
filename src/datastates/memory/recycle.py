"""The memory root's store: shard files are recycled, as the two slots of an A/B buffer are.

On a tmpfs, a new file costs a page allocation (and its zeroing) per page written, and removing
one frees them again: for a checkpoint at every step that is more work than the copy itself.
Here, when a checkpoint of the memory root is removed (retention, a delete), each of its shard
files ``rank-RRRRR.dsf`` is moved to ``<memdir>/spare/`` instead (replacing an older spare of
that name); the next save of that rank renames the spare into its temporary directory and writes
over it (:class:`~datastates.storage.posix.ReusedShardWriter`, which zeroes what the save does
not write). Host memory then holds the committed checkpoints, the one being written, and one
spare per rank at most, which the next save consumes: with ``keep_last=1``, two copies of the
state, as two slots would. ``spare/`` is outside the checkpoint root, so it is never listed, and
it goes with the memory directory.
"""
from __future__ import annotations

import os
import stat

from ..format import codec as fmt
from ..storage import LocalStore
from ..storage.posix import ReusedShardWriter, ShardWriter

SPARE = "spare"


class RecyclingStore(LocalStore):
    """A local store whose removed shard files become the next save's (module docstring)."""

    def __init__(self, spare_dir: str):
        self.spare_dir = spare_dir

    def remove_tree(self, path: str) -> None:
        try:
            names = os.listdir(path)
        except OSError:
            names = []
        for name in names:
            if not _is_shard_name(name):
                continue
            source = os.path.join(path, name)
            try:
                if not stat.S_ISREG(os.lstat(source).st_mode):
                    continue
                os.makedirs(self.spare_dir, mode=0o700, exist_ok=True)
                os.rename(source, os.path.join(self.spare_dir, name))
            except OSError:
                pass  # removed with the rest below
        super().remove_tree(path)

    def shard_writer(self, path: str, io_mode: str, layout) -> ShardWriter:
        try:
            os.rename(os.path.join(self.spare_dir, os.path.basename(path)), path)
        except OSError:
            return ShardWriter(path, io_mode)
        return ReusedShardWriter(path, io_mode)


def _is_shard_name(name: str) -> bool:
    return (name.startswith("rank-") and name.endswith(".dsf") and
            name == fmt.shard_file_name(int(name[5:-4])) if name[5:-4].isdigit() else False)
