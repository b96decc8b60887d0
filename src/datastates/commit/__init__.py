"""The commit round: ranks agree, rank 0 reviews the rank reports into a manifest, the checkpoint
is published atomically, then cataloged and retained.

The names below are the public surface for code outside the core: the publishers (atomic
visibility on each kind of store) and the catalog of a root's committed checkpoints."""

from .catalog import Catalog, CheckpointInfo, DamagedCheckpoint
from .publish import ManifestPublisher, Publisher, RenamePublisher, publisher_for

__all__ = [
    "Catalog",
    "CheckpointInfo",
    "DamagedCheckpoint",
    "ManifestPublisher",
    "Publisher",
    "RenamePublisher",
    "publisher_for",
]
