"""The records of a restore plan: what matching a saved tree against the live state decided, and
what the reading and the report of a restore are made of.

A :class:`Plan` is built by ``matching.py`` (nothing live changed, nothing read but the saved
Python objects) and carried out by ``reader.Reader``: its :class:`Read` regions read into their
destination tensors (``reads.py``), its copies run, its :class:`Cast` tensors filled through
temporaries, then its plain values written back and its providers' ``load`` called. ``verify.py``
builds :class:`Read` regions too (without destinations) to check a checkpoint's pieces.

Pure records: no I/O, nothing of the open checkpoint; every module of ``restore/`` may import them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..format.records import TensorEntry
from ..providers import StateProvider


@dataclass
class RestoreReport:
    """What an in-place restore did. On a strict restore the lists other than ``restored`` are
    empty (a mismatch raises instead)."""

    name: str
    step: int | None
    restored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  #: in the live state, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  #: in the checkpoint, not in the live state
    #: shape, dtype, type or length differs, or a provider's check refused it (skipped)
    mismatched: list[str] = field(default_factory=list)
    nbytes: int = 0
    #: damaged checkpoints newer than this one that finding the latest passed over (by name)
    passed_over: list[str] = field(default_factory=list)
    #: restored into a live tensor of another floating-point dtype (``cast=True``), each as
    #: ``"model/w (float32 -> bfloat16)"``; these keys are in ``restored`` too
    cast: list[str] = field(default_factory=list)
    #: newer committed checkpoints a restore with ``fallback=True`` did not use, newest first
    #: (``SkippedCheckpoint``: name, reason, where it was quarantined)
    skipped: list = field(default_factory=list)
    #: bytes re-read and checked before live state was touched (``fallback=True``), and seconds
    verified_nbytes: int = 0
    verify_s: float = 0.0
    #: where it was read from: "storage" (the directory), or "memory" (the memory tier)
    tier: str = "storage"
    #: with a memory tier, why this restore read storage without asking memory (its keeper
    #: did not answer when the Checkpointer was constructed: stopped or hung), else None
    tier_fallback: str | None = None
    #: True: a memory checkpoint its keeper had checked byte by byte after the last write to it
    #: (datastates/memory/marks.py), copied without checksumming again
    prechecked: bool = False
    #: reads started again because another process replaced or deleted the checkpoint while
    #: it was read (a tag overwritten, the latest deleted by retention): each as
    #: ``"<name>: <the error it caused>"``; the checkpoint restored is the one found last
    rereads: list[str] = field(default_factory=list)


@dataclass
class Read:
    """A region of a shard file: ``nbytes`` at ``offset`` of file ``file``, read into ``dest``
    and checked against ``checksums`` (``reads.py``'s regions)."""

    file: int
    offset: int
    nbytes: int
    #: the CPU tensor receiving the bytes: flat uint8, or any plain contiguous one
    #: (``providers.tree.plain_cpu``); None for a region that is only checked (verify.py)
    dest: torch.Tensor | None
    checksums: Sequence[Sequence[int]]  # [[length, crc], ...] over [offset, offset + nbytes)
    key: str
    #: where these bytes start in the tensor's own bytes (a part of a larger region: see
    #: ``reads.split_at_pieces``); error messages count from the tensor's first byte
    base: int = 0


@dataclass
class Cast:
    """A live tensor (or the local box of a sharded one) restored from a saved tensor of another
    floating-point dtype: the bytes are read and checked as saved, into a temporary of the saved
    dtype (``temporary``), then copied into ``dest`` with ``dest.copy_`` (torch's rounding), so
    ``dest`` changes only once every byte of it was verified."""

    dest: torch.Tensor
    entry: TensorEntry
    key: str
    box_offset: tuple | None  #: where ``dest`` lies in the global tensor (None: the whole)
    nbytes: int  #: bytes read from the checkpoint

    def temporary(self) -> torch.Tensor:
        return torch.empty(self.dest.shape, dtype=self.entry.torch_dtype)


class Rebuild:
    """A provider's ``rebuild(state)``, done once, after the reads (:func:`resolve`)."""

    __slots__ = ("provider", "state", "done", "value")

    def __init__(self, provider: StateProvider, state: Any):
        self.provider, self.state = provider, state
        self.done: bool = False
        self.value: Any = None


def resolve(value: Any) -> Any:
    """``value`` with every :class:`Rebuild` in it done; containers are kept as they are unless
    something inside them was rebuilt."""
    if isinstance(value, Rebuild):
        if not value.done:
            value.value, value.done = value.provider.rebuild(resolve(value.state)), True
        return value.value
    if type(value) in (dict, OrderedDict):
        pairs = [(k, v, resolve(v)) for k, v in value.items()]
        if all(v is r for _, v, r in pairs):
            return value
        return type(value)((k, r) for k, _, r in pairs)
    if type(value) in (list, tuple):
        items = [(v, resolve(v)) for v in value]
        if all(v is r for v, r in items):
            return value
        return type(value)(r for _, r in items)
    return value


class Early(NamedTuple):
    """The tensors of a provider that checks tensor values (``validate_values``): read, copied
    and cast before every other read, then validated (a refusal raises before any other read)."""

    provider: StateProvider
    loaded: Any  #: its state as loaded (tensors filled by these reads)
    key: str
    reads: list[Read]
    copies: list[Callable[[], Any]]
    casts: list[Cast]


@dataclass
class Plan:
    """A restore decided, nothing read yet but the saved Python objects: what to read, copy,
    cast, set back and apply, and the report so far. Built by ``matching.py``; carried out by
    ``reader.Reader`` in the order of its fields."""

    report: RestoreReport
    #: providers checking tensor values: done first (:class:`Early`)
    early: list[Early] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    #: after the reads: copies finishing non-contiguous or non-CPU destinations
    post_copies: list[Callable[[], Any]] = field(default_factory=list)
    #: live tensors filled from a saved tensor of another floating-point dtype, after the
    #: reads, a bounded batch of temporaries at a time (``Reader``)
    casts: list[Cast] = field(default_factory=list)
    #: (container, key, value): plain values of the live dicts/lists, replaced after the reads
    #: (the key ``slice(None)``: a grown or shrunk list's whole contents)
    writebacks: list[tuple[Any, Any, Any]] = field(default_factory=list)
    #: (provider.load, live object, loaded state), called last
    finalizers: list[tuple[Callable[[Any, Any], Any], Any, Any]] = field(default_factory=list)
    #: providers' rebuilds waiting for the reads of their tensors (:meth:`resolve`)
    deferred: int = 0

    def nbytes(self) -> int:
        """Bytes the plan reads."""
        total = sum(r.nbytes for r in self.reads) + sum(c.nbytes for c in self.casts)
        for e in self.early:
            total += sum(r.nbytes for r in e.reads) + sum(c.nbytes for c in e.casts)
        return total

    def files(self) -> set[int]:
        """The shard files the plan reads from (a cast counts every file of its tensor)."""
        reads = self.reads + [r for e in self.early for r in e.reads]
        casts = self.casts + [c for e in self.early for c in e.casts]
        return {r.file for r in reads} | {s.file for c in casts for s in c.entry.shards}

    def resolve(self, value: Any) -> Any:
        """``value`` with every provider's rebuild done: run after the reads, so a provider
        rebuilding an object (a numpy Generator) from its state sees the bytes read, not the
        empty tensors planned."""
        return resolve(value) if self.deferred else value
