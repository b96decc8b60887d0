"""The validating parsers of the small JSON records that live beside checkpoints: a preemption's
stop plan (from another rank, through the coordination store), a data loader's position (from a
checkpoint, or from a caller), the keeper's mark of a checked memory checkpoint and a memory
directory's record of ranks (both from files of the memory directory).

Built from the field checks of ``checks.py``, as ``validate.py``'s parsers of the checkpoint's
records are: exact JSON types (a bool is not an int), ranges, and every violation raised as
``CorruptCheckpointError`` naming where the bytes came from and the field's JSON path, with what
was expected and what was found -- except the data position, a caller's argument as much as a
stored value, whose violations are ``ConfigError`` (the error ``load_state_dict`` gives a wrong
argument). Nothing else escapes.

Pure: no I/O. The records' writers and users are ``preemption.py``, ``data.py`` and
``memory/marks.py`` / ``memory/nodes.py``.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ConfigError
from .checks import _At, _bool, _dict, _get, _int, _list, _show, _str

#: The largest world size and rank a record may name (as a manifest's ``world_size``).
MAX_WORLD = 1 << 24


def _fields(obj: dict, expected: tuple[str, ...], at: _At) -> None:
    """``obj`` has exactly the fields ``expected``."""
    if obj.keys() != set(expected):
        raise at.bad(f"expected the fields {sorted(expected)}, found {sorted(map(str, obj))}")


def _decode(raw: bytes, at: _At) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise at.bad(f"expected JSON, found {raw[:80]!r}") from None


# ---------------------------------------------------------------- preemption's stop plan

_PLAN_FIELDS = ("rank", "signum", "step")


def parse_stop_plan(raw: bytes, where: str) -> tuple[int, int, int]:
    """(step, signum, rank) of the stop plan ``raw`` a rank wrote: a JSON object of exactly
    these non-negative ints, ``signum`` a signal number of this platform."""
    at = _At(where)
    obj = _dict(_decode(raw, at), at)
    _fields(obj, _PLAN_FIELDS, at)
    step = _int(obj["step"], at / "step", 0, (1 << 63) - 1)
    signum = _int(obj["signum"], at / "signum", 1, 1 << 16)
    if signum not in signal.valid_signals():
        raise (at / "signum").bad(f"expected a signal number of this platform, found {signum}")
    rank = _int(obj["rank"], at / "rank", 0, MAX_WORLD)
    return step, signum, rank


# ---------------------------------------------------------------- a data loader's position

#: The fields of a saved position (``ElasticSampler.state_dict()``), identical on every rank.
POSITION_FIELDS = ("seed", "shuffle", "epoch", "consumed", "dataset_len")
#: seed and epoch stay below this, so seed + epoch fits ``torch.Generator.manual_seed``.
MAX_SEED = 2**63


class _ArgumentAt(_At):
    """A place in a caller's argument: its violations are ConfigError."""

    __slots__ = ()

    def __truediv__(self, part) -> "_ArgumentAt":
        return _ArgumentAt(self.file, self, part)

    def bad(self, what: str) -> ConfigError:
        return ConfigError(f"{self.file}: {self.path or 'top level'}: {what}")


def parse_position(state: Any, where: str) -> dict[str, Any]:
    """``state`` checked as one ``ElasticSampler.state_dict()`` writes (any Mapping of exactly
    its fields), as a new dict; ConfigError naming ``where``, the field, what was expected and
    what was found otherwise."""
    at = _ArgumentAt(where)
    if isinstance(state, Mapping) and type(state) is not dict:
        state = dict(state)
    obj = _dict(state, at)
    _fields(obj, POSITION_FIELDS, at)
    out = {
        "seed": _int(obj["seed"], at / "seed", 0, MAX_SEED - 1),
        "shuffle": _bool(obj["shuffle"], at / "shuffle"),
        "epoch": _int(obj["epoch"], at / "epoch", 0, MAX_SEED - 1),
        "consumed": 0,
        "dataset_len": _int(obj["dataset_len"], at / "dataset_len", 0, (1 << 63) - 1),
    }
    consumed = obj["consumed"]
    if type(consumed) is int and not 0 <= consumed <= out["dataset_len"]:
        raise (at / "consumed").bad(
            f"expected at most the dataset's length "
            f"{out['dataset_len']} (and at least 0), found {consumed}"
        )
    out["consumed"] = _int(consumed, at / "consumed", 0, out["dataset_len"])
    return out


# ---------------------------------------------------------------- the keeper's marks


class Mark(NamedTuple):
    """The keeper's record that it checked the memory checkpoint ``name`` (memory/marks.py):
    the SHA-256 of its manifest (64 hex digits) and, per shard file, its size, inode,
    modification and change times (ns) as they were during the check."""

    name: str
    manifest: str
    files: dict[str, tuple[int, int, int, int]]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "manifest": self.manifest,
            "files": {name: list(identity) for name, identity in self.files.items()},
        }


_MARK_FIELDS = ("name", "manifest", "files")
_HEX = frozenset("0123456789abcdef")


def parse_mark(raw: bytes, where: str) -> Mark:
    """The mark ``raw`` read from a file: a JSON object of a name, a 64-hex-digit digest and a
    non-empty object of plain file names (no path) to four non-negative integers."""
    at = _At(where)
    obj = _dict(_decode(raw, at), at)
    _fields(obj, _MARK_FIELDS, at)
    name = _str(obj["name"], at / "name")
    digest = _str(obj["manifest"], at / "manifest")
    if len(digest) != 64 or not _HEX.issuperset(digest):
        raise (at / "manifest").bad(f"expected 64 hex digits (a SHA-256), found {_show(digest)}")
    files = _dict(obj["files"], at / "files")
    if not files:
        raise (at / "files").bad("expected at least one file, found none")
    out = {}
    for file, identity in files.items():
        fat = at / "files" / file
        if "/" in file or "\0" in file or file in ("", ".", ".."):
            raise fat.bad(f"expected a file name without a path, found {_show(file)}")
        values = _list(identity, fat)
        if len(values) != 4:
            raise fat.bad(f"expected [size, inode, mtime_ns, ctime_ns], found {len(values)} values")
        size, inode, mtime, ctime = (
            _int(v, fat / i, 0, (1 << 64) - 1) for i, v in enumerate(values)
        )
        out[file] = (size, inode, mtime, ctime)
    return Mark(name, digest, out)


# ---------------------------------------------------------------- a memory directory's ranks


@dataclass(frozen=True)
class NodeRanks:
    """Which ranks of a job of ``world_size`` ranks one memory directory holds the shards of
    (in group order: local rank ``i`` is ``ranks[i]``); memory/nodes.py."""

    world_size: int
    ranks: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """Every rank of the job: the checkpoints are the job's (one node)."""
        return self.ranks == tuple(range(self.world_size))

    def describe(self) -> str:
        return f"ranks {list(self.ranks)} of {self.world_size}"

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "ranks": list(self.ranks)}


def parse_node_ranks(raw: bytes, where: str) -> NodeRanks:
    """The record of ranks ``raw`` read from a file: a JSON object of a positive
    ``world_size`` and a non-empty list of distinct ``ranks`` below it."""
    at = _At(where)
    obj = _dict(_decode(raw, at), at)
    _fields(obj, ("world_size", "ranks"), at)
    world = _int(_get(obj, "world_size", at), at / "world_size", 1, MAX_WORLD)
    values = _list(obj["ranks"], at / "ranks")
    if not values:
        raise (at / "ranks").bad("expected at least one rank, found none")
    ranks = tuple(_int(r, at / "ranks" / i, 0, world - 1) for i, r in enumerate(values))
    if len(set(ranks)) != len(ranks):
        raise (at / "ranks").bad(f"expected distinct ranks, found {list(ranks)}")
    return NodeRanks(world, ranks)
