"""The on-disk model (docs/format.md): the bytes of shard files and manifests (``codec``), reading
and writing them as checked files (``files``), the typed records of the format and of the commit
round with their JSON forms (``records``), their validating parsers (``validate``, built on the
field checks of ``checks``, with one-function parsers of the ordinary per-tensor entries in
``plain``), the one walker of saved state trees (``tree``), the CRC-32
(``checksum``), and Python objects as byte blobs (``serialization``).

The names below are the public surface that code outside the core (the integrations, tools of
other projects) uses; inside the core each module imports the submodule it needs."""

from .codec import (
    CHECKPOINT_FORMAT,
    DATA_ALIGN,
    HEADER_BYTES,
    LATEST,
    MAGIC,
    MANIFEST,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    SHARD_FORMAT,
    UNIT_ALIGN,
    VERSION,
    ShardHeader,
    align_up,
    check_name,
    crc32,
    dtype_from_name,
    dtype_name,
    encode_index,
    encode_json,
    pack_header,
    read_header,
    seal_manifest,
    shard_file_name,
    step_name,
)
from .files import (
    encode_manifest,
    encode_manifest_checked,
    manifest_record_bytes,
    parse_index_bytes,
    parse_manifest_bytes,
    read_index,
    read_manifest,
)
from .records import (
    CheckpointInfo,
    FileRef,
    Manifest,
    ObjectEntry,
    RankReport,
    ShardIndex,
    ShardRef,
    TensorEntry,
    Verdict,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "DATA_ALIGN",
    "HEADER_BYTES",
    "LATEST",
    "MAGIC",
    "MANIFEST",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "SHARD_FORMAT",
    "UNIT_ALIGN",
    "VERSION",
    "ShardHeader",
    "align_up",
    "check_name",
    "crc32",
    "dtype_from_name",
    "dtype_name",
    "encode_index",
    "encode_json",
    "pack_header",
    "read_header",
    "seal_manifest",
    "shard_file_name",
    "step_name",
    "encode_manifest",
    "encode_manifest_checked",
    "manifest_record_bytes",
    "parse_index_bytes",
    "parse_manifest_bytes",
    "read_index",
    "read_manifest",
    "CheckpointInfo",
    "FileRef",
    "Manifest",
    "ObjectEntry",
    "RankReport",
    "ShardIndex",
    "ShardRef",
    "TensorEntry",
    "Verdict",
]
