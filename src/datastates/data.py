"""A data position that survives a change of data-parallel size.

A checkpoint saved on W ranks may be resumed on W' ranks. A per-rank loader position ("rank 3 is
at batch 17") has no meaning on another world size, so the position kept here is global: the
epoch's order of the whole dataset and how many of its samples all ranks together consumed. Every
rank saves the same state, so a restore at another world size needs no ``rank_policy``.

``ElasticSampler`` turns that position into this rank's indices; ``ElasticLoader`` wraps a
``torch.utils.data.DataLoader`` over the sampler and advances the position as batches reach the
caller, which only the consumer side can know (a DataLoader draws indices ahead of the loop to
prefetch). docs/data.md describes the order, the end of an epoch and the lockstep assumption.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from .errors import ConfigError, StateMismatchError
from .format.small_records import MAX_SEED, POSITION_FIELDS, parse_position

#: The keys of a saved state, identical on every rank.
STATE_KEYS = POSITION_FIELDS
#: DataLoader arguments the loader sets itself: the order is the sampler's alone, and the
#: generator the DataLoader draws its workers' base seed from is the loader's own.
_OWNED_ARGS = ("sampler", "batch_sampler", "shuffle", "generator")


class ElasticSampler(Sampler[int]):
    """This rank's share of an epoch's order, resumable at any world size.

    The order of epoch ``e`` is ``torch.randperm(len(dataset))`` drawn from a ``torch.Generator``
    seeded with ``seed + e`` (``range(len(dataset))`` without ``shuffle``). Of the samples not
    consumed yet, ``remaining = order[consumed:]``, rank r of W takes ``remaining[r::W]``, so once
    every rank took k of them the consumed samples are exactly ``order[:consumed + k * W]``. From
    ``consumed == 0`` this is the sequence ``torch.utils.data.DistributedSampler`` yields for the
    same seed, epoch and ``drop_last``.

    When ``len(remaining)`` does not divide by W: with ``drop_last`` the last
    ``len(remaining) % W`` samples are dropped from this epoch; without it, ``remaining`` is
    padded up to the next multiple of W with samples repeated from the start of the epoch's order
    (cyclically if the dataset is smaller than W). Padded samples are the only repeats of an
    epoch; they are never counted in ``consumed``.

    The sampler does not count what it yields: ``ElasticLoader`` calls :meth:`advance` as batches
    reach the caller. Used with a plain DataLoader, call :meth:`advance` yourself after each
    batch; otherwise ``state_dict()`` records the start of the pass. Runs in the main process
    (a DataLoader never iterates its sampler in a worker).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        self.dataset_len = _length(dataset)
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.seed = _seed_like("seed", seed, "ElasticSampler")
        self.shuffle = _flag("shuffle", shuffle, "ElasticSampler")
        self.drop_last = _flag("drop_last", drop_last, "ElasticSampler")
        self._epoch, self._consumed = 0, 0

    @property
    def epoch(self) -> int:
        """The epoch whose order is being consumed."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of this epoch's order consumed by all ranks together (padding excluded)."""
        return self._consumed

    def __len__(self) -> int:
        """How many indices a pass started now yields on this rank (the same on every rank)."""
        remaining, world = self.dataset_len - self._consumed, self.num_replicas
        return remaining // world if self.drop_last else -(-remaining // world)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices of the rest of the epoch, as of the moment of the call."""
        order = _order(self.dataset_len, self.seed, self._epoch, self.shuffle)
        total = len(self) * self.num_replicas
        rest = order[self._consumed :]
        if total > rest.numel():
            rest = torch.cat([rest, _padding(order, total - rest.numel())])
        return iter(rest[self.rank : total : self.num_replicas].tolist())

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start, as ``DistributedSampler.set_epoch``. Setting the
        current epoch again keeps the position, so calling it with the epoch a restore brought
        back continues that epoch where it stopped."""
        epoch = _seed_like("epoch", epoch, "ElasticSampler.set_epoch")
        if epoch != self._epoch:
            self._epoch, self._consumed = epoch, 0

    def advance(self, samples: int) -> None:
        """Record that every rank consumed ``samples`` more of its indices: ``consumed`` grows by
        ``samples * num_replicas``, capped at the dataset's length (what is past it was padding).
        Call it between passes or for the pass in progress; it does not change that pass."""
        if not _is_int(samples) or samples < 0:
            raise ConfigError(
                f"ElasticSampler.advance: expected a non-negative int of samples, found {samples!r}"
            )
        self._consumed = min(self.dataset_len, self._consumed + samples * self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        """The global position: identical on every rank of a lockstep loop. Plain ints and
        bools, a new dict each call."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "dataset_len": self.dataset_len,
        }

    def check_state_dict(self, state: Any, where: str = "ElasticSampler") -> dict[str, Any]:
        """The checks of :meth:`load_state_dict`, changing nothing; returns the parsed state.
        ``Checkpointer.restore`` calls it (through ``StatefulProvider.check``) before any live
        state is modified, so a refused position fails the restore with the model untouched."""
        parsed = parse_state(state, where)
        if parsed["dataset_len"] != self.dataset_len:
            raise StateMismatchError(
                f"{where}: the state was saved over a dataset of "
                f"{parsed['dataset_len']} samples, expected the live "
                f"dataset's {self.dataset_len}"
            )
        return parsed

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position, at this sampler's world size and rank: the saved
        seed and shuffle replace the live ones (the epoch in progress keeps its order);
        ``drop_last`` stays the live one. Checked in full before anything changes: ConfigError
        for a state that is not one :meth:`state_dict` writes (keys, types, ranges),
        StateMismatchError when it was saved over a dataset of another length."""
        parsed = self.check_state_dict(state, "ElasticSampler.load_state_dict")
        self.seed, self.shuffle = parsed["seed"], parsed["shuffle"]
        self._epoch, self._consumed = parsed["epoch"], parsed["consumed"]


class ElasticLoader:
    """A ``torch.utils.data.DataLoader`` over an ``ElasticSampler`` that counts what it hands
    over: a batch counts as consumed when it is yielded to the caller, whatever the workers
    prefetched, so ``state_dict()`` taken in the loop body after a batch resumes at the next one.

    Lockstep data parallelism is assumed: every rank yields the same number of batches per step
    (each rank gets the same number of indices per pass), so each rank counts ``len(batch) * W``
    and all ranks hold the same state. The per-rank ``batch_size`` may differ on resume (keep
    ``batch_size * W`` for the same global batch): the position is in samples.

    Epochs: a pass that runs to its end moves to the next epoch from its start; ``set_epoch``
    moves there explicitly. A pass left early (``break``) keeps its position: the next pass
    continues after the last batch yielded. A state saved after the last batch of an epoch but
    before the loop ended resumes into an empty pass, which then moves to the next epoch (at the
    same world size; at another one with ``drop_last=True``, the tail the saving run dropped
    may come first, as not yet seen). One
    pass at a time: starting a pass, ``set_epoch`` and ``load_state_dict`` end any pass in
    progress (its iterator stops). Used from the training thread of each rank.

    Randomness: the loader draws nothing from the global torch generator, so a restored
    ``RNGState`` continues the stream of the run that saved it (dropout draws the same masks).
    A DataLoader draws its workers' base seed from a generator at the start of every pass; the
    loader gives it its own, seeded with ``seed + epoch`` at each pass.

    ``dataloader_kwargs`` go to the DataLoader (``num_workers``, ``collate_fn``,
    ``pin_memory``, ``prefetch_factor``...), except ``sampler``, ``batch_sampler``,
    ``shuffle`` and ``generator``, which the loader sets itself, and ``in_order=False``, under
    which the batches yielded would not be a prefix of the order (ConfigError for each).
    ``drop_last`` is the sampler's; a pass's last batch may be smaller than ``batch_size``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        **dataloader_kwargs: Any,
    ):
        _check_loader_args(dataloader_kwargs)
        if not _is_int(batch_size) or batch_size < 1:
            raise ConfigError(
                f"ElasticLoader: expected a positive int batch_size, found {batch_size!r}"
            )
        self.batch_size = batch_size
        self.sampler = ElasticSampler(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
        )
        self._generator = torch.Generator()  # the workers' base seed: never the global one
        self._loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            generator=self._generator,
            **dataloader_kwargs,
        )
        self._active: weakref.ref | None = None  # the pass in progress

    @property
    def epoch(self) -> int:
        """The epoch being consumed (the sampler's)."""
        return self.sampler.epoch

    def __len__(self) -> int:
        """How many batches a pass started now yields on this rank."""
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        """One pass over the rest of the epoch: this rank's batches, each counted as it is
        yielded. Ends the pass in progress, if any."""
        self._end_pass()
        batches = self._run()
        self._active = weakref.ref(batches)  # a pass left early still frees its workers
        return batches

    def _run(self) -> Iterator[Any]:
        left = len(self.sampler)  # read with the indices the DataLoader draws just below
        self._generator.manual_seed(self.sampler.seed + self.sampler.epoch)
        for batch in self._loader:
            taken = min(self.batch_size, left)
            left -= taken
            self.sampler.advance(taken)
            yield batch
        self.sampler.set_epoch(self.sampler.epoch + 1)

    def _end_pass(self) -> None:
        batches = self._active() if self._active is not None else None
        if batches is not None:
            batches.close()  # it stops at its yield: the batch handed over stays the last

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`ElasticSampler.set_epoch`; ends a pass in progress."""
        self.sampler.set_epoch(epoch)
        self._end_pass()

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: the global position after the last batch yielded."""
        return self.sampler.state_dict()

    def check_state_dict(self, state: Any) -> dict[str, Any]:
        """As :meth:`ElasticSampler.check_state_dict`."""
        return self.sampler.check_state_dict(state, "ElasticLoader")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """As :meth:`ElasticSampler.load_state_dict` (same checks, nothing changes on a
        refusal); ends a pass in progress. The next pass yields exactly the rest of the saved
        epoch, shared among this loader's world size."""
        self.sampler.load_state_dict(state)
        self._end_pass()


def parse_state(state: Any, where: str) -> dict[str, Any]:
    """``state`` checked as one ``ElasticSampler.state_dict()`` writes, as a new dict; ConfigError
    naming ``where``, the key, what was expected and what was found otherwise
    (``format.small_records.parse_position``)."""
    return parse_position(state, where)


def _order(length: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(length)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator)


def _padding(order: torch.Tensor, count: int) -> torch.Tensor:
    return order.repeat(-(-count // order.numel()))[:count]


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    dist = torch.distributed
    joined = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if joined else 1
    if rank is None:
        rank = dist.get_rank() if joined else 0
    if not _is_int(num_replicas) or num_replicas < 1:
        raise ConfigError(
            f"ElasticSampler: expected a positive int num_replicas, found {num_replicas!r}"
        )
    if not _is_int(rank) or not 0 <= rank < num_replicas:
        raise ConfigError(f"ElasticSampler: expected a rank in [0, {num_replicas}), found {rank!r}")
    return num_replicas, rank


def _length(dataset: Any) -> int:
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            "ElasticSampler: expected an indexable dataset with a length, found "
            f"the IterableDataset {type(dataset).__name__}"
        )
    try:
        return len(dataset)
    except TypeError:
        raise ConfigError(
            f"ElasticSampler: expected a dataset with a length, found "
            f"{type(dataset).__name__} without len()"
        ) from None


def _check_loader_args(kwargs: dict[str, Any]) -> None:
    owned = sorted(set(kwargs) & set(_OWNED_ARGS))
    if owned:
        raise ConfigError(
            f"ElasticLoader: the order is the ElasticSampler's; expected no "
            f"{', '.join(owned)} among the DataLoader arguments"
        )
    if kwargs.get("in_order", True) is not True:
        raise ConfigError(
            "ElasticLoader: expected batches in order (in_order=True), found "
            f"in_order={kwargs['in_order']!r}: the count assumes it"
        )


def _seed_like(name: str, value: Any, where: str) -> int:
    if not _is_int(value) or not 0 <= value < MAX_SEED:
        raise ConfigError(f"{where}: {name!r} expected an int in [0, 2**63), found {value!r}")
    return value


def _flag(name: str, value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {name!r} expected a bool, found {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
