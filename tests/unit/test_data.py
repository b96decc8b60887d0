"""The data position of datastates.data (docs/data.md): every sample id of an epoch is consumed
exactly once across a save and a resume at another data-parallel size, the only repeats being the
documented padding; the count is exact with prefetching workers; bad states are refused.

Data parallelism is simulated in one process: W loaders, rank 0..W-1, stepped in lockstep.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset

import datastates
from datastates import Checkpointer, ConfigError, ElasticLoader, ElasticSampler, StateMismatchError

N = 37  # prime: no world size below divides it
SEED = 11
GLOBAL_BATCH = 8


class Ids(torch.utils.data.Dataset):
    """Sample i is the id i."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def order(epoch=0, n=N, seed=SEED):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def loaders(world, batch_size, n=N, **kwargs):
    return [
        ElasticLoader(
            Ids(n), batch_size=batch_size, num_replicas=world, rank=r, seed=SEED, **kwargs
        )
        for r in range(world)
    ]


def take(iterators, steps):
    """``steps`` batches from each rank's iterator: the ids per rank."""
    return [[i for _ in range(steps) for i in next(it).tolist()] for it in iterators]


def finish(group):
    """A pass of each loader to its end: the ids per rank."""
    return [[i for batch in loader for i in batch.tolist()] for loader in group]


def save_and_restore(tmp_path, saved, group):
    """``saved`` saved with a Checkpointer, then restored into each loader of ``group``."""
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save({"loader": saved}, step=1).wait(60)
        for loader in group:
            ckpt.restore({"loader": loader})


def flat(per_rank):
    return [i for ids in per_rank for i in ids]


# ------------------------------------------------------------------ the order


@pytest.mark.parametrize("world", [1, 3, 4, 40])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_from_the_start_of_an_epoch_the_order_is_torchs_distributed_samplers(
    world, shuffle, drop_last
):
    for epoch in (0, 1):
        for rank in range(world):
            ours = ElasticSampler(
                Ids(),
                num_replicas=world,
                rank=rank,
                seed=SEED,
                shuffle=shuffle,
                drop_last=drop_last,
            )
            theirs = DistributedSampler(
                Ids(),
                num_replicas=world,
                rank=rank,
                seed=SEED,
                shuffle=shuffle,
                drop_last=drop_last,
            )
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_the_consumed_samples_are_the_first_of_the_order_and_the_state_is_global():
    group = loaders(4, 2)
    before = take([iter(loader) for loader in group], 3)
    assert sorted(flat(before)) == sorted(order()[:24])
    states = [loader.state_dict() for loader in group]
    assert (
        states
        == [{"seed": SEED, "shuffle": True, "epoch": 0, "consumed": 24, "dataset_len": N}] * 4
    )


# ------------------------------------------------------------------ resume at another size


@pytest.mark.parametrize("new_world", [1, 2, 3, 4])
def test_a_resume_at_another_world_size_consumes_every_id_once_apart_from_padding(
    tmp_path, new_world
):
    group = loaders(4, 2)
    before = take([iter(loader) for loader in group], 3)
    resumed = loaders(new_world, max(1, GLOBAL_BATCH // new_world))
    save_and_restore(tmp_path, group[1], resumed)
    after = finish(resumed)
    remaining = N - 24
    pad = -(-remaining // new_world) * new_world - remaining
    assert Counter(flat(before) + flat(after)) == Counter(order() + order()[:pad])
    assert sorted(flat(after)) == sorted(order()[24:] + order()[:pad])
    assert len({len(ids) for ids in after}) == 1  # lockstep: every rank the same count
    assert [(loader.epoch, loader.sampler.consumed) for loader in resumed] == [(1, 0)] * new_world


@pytest.mark.parametrize("new_world", [1, 2, 3, 4])
def test_with_drop_last_a_resume_drops_only_the_tail_and_repeats_nothing(tmp_path, new_world):
    group = loaders(4, 2, drop_last=True)
    before = take([iter(loader) for loader in group], 3)
    resumed = loaders(new_world, 3, drop_last=True)
    save_and_restore(tmp_path, group[0], resumed)
    after = flat(finish(resumed))
    kept = 24 + (N - 24) // new_world * new_world
    assert sorted(flat(before) + after) == sorted(order()[:kept])
    assert len(set(flat(before) + after)) == kept


def test_at_the_same_world_size_the_continuation_is_the_uninterrupted_run_per_rank(tmp_path):
    uninterrupted = loaders(4, 2)
    whole = finish(uninterrupted)
    next_epoch = finish(uninterrupted)
    group = loaders(4, 2)
    before = take([iter(loader) for loader in group], 3)
    resumed = loaders(4, 2)
    save_and_restore(tmp_path, group[3], resumed)
    after = finish(resumed)
    assert [b + a for b, a in zip(before, after)] == whole
    assert finish(resumed) == next_epoch


def test_the_per_rank_batch_size_may_change_on_resume_keeping_the_global_batch(tmp_path):
    group = loaders(4, 2)
    before = take([iter(loader) for loader in group], 2)
    resumed = loaders(2, 4)
    save_and_restore(tmp_path, group[0], resumed)
    batches = [[b.tolist() for b in loader] for loader in resumed]
    rest = order()[16:]
    rest += order()[:1]  # 21 remaining samples padded to 22 for 2 ranks
    assert [len(b) for b in batches[0]] == [4, 4, 3]
    assert flat(batches[0]) == rest[0::2] and flat(batches[1]) == rest[1::2]
    assert sorted(flat(before) + flat(flat(batches))) == sorted(order() + order()[:1])


# ------------------------------------------------------------------ exact counting


@pytest.mark.parametrize("persistent", [False, True])
def test_the_count_is_exact_with_prefetching_workers(tmp_path, persistent):
    workers = dict(num_workers=2, prefetch_factor=2, persistent_workers=persistent)
    reference = finish(loaders(2, 3))
    group = loaders(2, 3, **workers)
    before = take([iter(loader) for loader in group], 2)  # the workers drew further ahead
    assert group[0].state_dict()["consumed"] == 2 * 3 * 2
    resumed = loaders(2, 3, **workers)
    save_and_restore(tmp_path, group[0], resumed)
    assert [b + a for b, a in zip(before, finish(resumed))] == reference


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_pass_draws_nothing_from_the_global_generator(num_workers):
    """A DataLoader draws its workers' base seed at each pass; the loader's own generator gives
    it, so the global stream (what RNGState saves and restores) is the same with or without a
    pass."""
    torch.manual_seed(11)
    before = torch.get_rng_state()
    loader = loaders(1, 5, num_workers=num_workers)[0]
    assert flat(finish([loader])) == order()
    assert torch.equal(torch.get_rng_state(), before)


def test_a_pass_left_early_continues_after_the_last_batch_yielded():
    loader = loaders(1, 5)[0]
    first = []
    for batch in loader:
        first += batch.tolist()
        if len(first) == 10:
            break
    assert loader.sampler.consumed == 10 and len(loader) == 6
    assert first + flat(finish([loader])) == order()


def test_a_new_pass_and_a_load_end_the_pass_in_progress():
    loader = loaders(1, 4)[0]
    old = iter(loader)
    next(old)
    again = iter(loader)
    with pytest.raises(StopIteration):
        next(old)
    assert next(again).tolist() == order()[4:8]
    state = loader.state_dict()
    loader.load_state_dict(state)
    with pytest.raises(StopIteration):
        next(again)
    assert loader.state_dict() == state == {**state, "consumed": 8}


def test_a_state_saved_after_the_last_batch_resumes_into_the_next_epoch(tmp_path):
    loader = loaders(2, 19)[0]
    batches = iter(loader)
    next(batches)  # the epoch's only batch: 19 of 37 per rank, one padded
    assert loader.state_dict()["consumed"] == N and loader.epoch == 0
    resumed = loaders(3, 4)
    save_and_restore(tmp_path, loader, resumed)
    assert finish(resumed) == [[]] * 3
    assert [loader.epoch for loader in resumed] == [1] * 3
    assert sorted(flat(finish(resumed))) == sorted(order(1) + order(1)[:2])


def test_set_epoch_keeps_the_position_of_the_current_epoch_and_resets_for_another():
    loader = loaders(1, 4)[0]
    take([iter(loader)], 2)
    loader.set_epoch(0)
    assert loader.sampler.consumed == 8
    loader.set_epoch(5)
    assert (loader.epoch, loader.sampler.consumed) == (5, 0)
    assert flat(finish([loader])) == order(5) and loader.epoch == 6


def test_the_sampler_alone_counts_what_advance_records():
    sampler = ElasticSampler(Ids(), num_replicas=2, rank=1, seed=SEED)
    sampler.advance(5)
    assert sampler.consumed == 10 and list(sampler) == order()[10:][1::2] + order()[:1]
    sampler.advance(100)
    assert sampler.consumed == N and list(sampler) == []


def test_without_a_process_group_the_loader_is_rank_0_of_1():
    sampler = ElasticLoader(Ids(), batch_size=4).sampler
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


# ------------------------------------------------------------------ refusals

GOOD = {"seed": SEED, "shuffle": True, "epoch": 2, "consumed": 5, "dataset_len": N}


@pytest.mark.parametrize(
    "state",
    [
        [1, 2],
        None,
        {k: v for k, v in GOOD.items() if k != "epoch"},
        {**GOOD, "rank": 0},
        {**GOOD, "consumed": True},
        {**GOOD, "consumed": N + 1},
        {**GOOD, "consumed": -1},
        {**GOOD, "epoch": 1.0},
        {**GOOD, "seed": -1},
        {**GOOD, "seed": 2**63},
        {**GOOD, "shuffle": 1},
        {**GOOD, "dataset_len": "37"},
        {**GOOD, "dataset_len": -1},
    ],
    ids=lambda s: repr(s)[:40],
)
def test_a_malformed_state_is_refused_with_nothing_changed(state):
    loader = loaders(2, 2)[0]
    take([iter(loader)], 1)
    live = loader.state_dict()
    with pytest.raises(ConfigError, match="ElasticSampler.load_state_dict"):
        loader.load_state_dict(state)
    assert loader.state_dict() == live


def test_a_state_of_another_dataset_length_is_a_state_mismatch(tmp_path):
    saved = loaders(2, 2)[0]
    take([iter(saved)], 1)
    live = loaders(2, 2, n=N + 1)[0]
    with pytest.raises(StateMismatchError, match="37 samples, expected the live dataset's 38"):
        save_and_restore(tmp_path, saved, [live])
    assert live.state_dict() == {**GOOD, "epoch": 0, "consumed": 0, "dataset_len": N + 1}


def test_a_good_state_loads_as_given():
    loader = loaders(3, 2)[2]
    loader.load_state_dict({**GOOD, "seed": 4, "shuffle": False})
    assert loader.state_dict() == {**GOOD, "seed": 4, "shuffle": False}
    assert flat(finish([loader])) == list(range(7, N, 3)) + [0]  # 32 left, padded by one


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_replicas=4, rank=4), r"rank in \[0, 4\), found 4"),
        (dict(num_replicas=0), "positive int num_replicas, found 0"),
        (dict(batch_size=0), "positive int batch_size, found 0"),
        (dict(batch_size=True), "positive int batch_size, found True"),
        (dict(seed=-1), r"'seed' expected an int in \[0, 2\*\*63\), found -1"),
        (dict(shuffle="yes"), "'shuffle' expected a bool, found 'yes'"),
        (dict(sampler=[0, 1]), "expected no sampler"),
        (dict(shuffle=True, batch_sampler=None), "expected no batch_sampler"),
        (dict(in_order=False), "in_order=False"),
        (dict(generator=torch.Generator()), "expected no generator"),
        (dict(dataset=Stream()), "IterableDataset Stream"),
        (dict(dataset=iter(range(3))), "without len()"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    kwargs = {"dataset": Ids(), "batch_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        ElasticLoader(kwargs.pop("dataset"), **kwargs)


def test_bad_epochs_and_advances_are_refused():
    sampler = ElasticSampler(Ids())
    for call, value in ((sampler.set_epoch, -1), (sampler.set_epoch, True), (sampler.advance, -2)):
        with pytest.raises(ConfigError, match="found"):
            call(value)
    assert (sampler.epoch, sampler.consumed) == (0, 0)


def test_the_names_are_exported():
    assert {"ElasticLoader", "ElasticSampler"} <= set(datastates.__all__)


# ------------------------------------------------------------------ torchdata


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchdatas_stateful_dataloader_round_trips_at_the_same_world_size(tmp_path, num_workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        return stateful.StatefulDataLoader(
            Ids(),
            batch_size=4,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(SEED),
        )

    loader = make()
    batches = iter(loader)
    before = [next(batches).tolist() for _ in range(3)]
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save({"loader": loader}, step=1).wait(60)
        rest = [b.tolist() for b in batches]
        resumed = make()
        ckpt.restore({"loader": resumed})
    assert [b.tolist() for b in resumed] == rest
    assert sorted(flat(before) + flat(rest)) == list(range(N))


def test_a_refused_position_fails_the_restore_before_the_model_changes(tmp_path):
    """StatefulProvider.check calls check_state_dict: the dataset-length mismatch is found while
    planning, so the model saved beside the loader is not restored either."""
    model = torch.nn.Linear(3, 2)
    saved = ElasticLoader(list(range(N)), batch_size=2, num_replicas=1, rank=0)
    with Checkpointer(str(tmp_path / "c")) as ckpt:
        ckpt.save({"model": model, "loader": saved}, step=1).wait()
        fresh = torch.nn.Linear(3, 2)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        other = ElasticLoader(list(range(N - 1)), batch_size=2, num_replicas=1, rank=0)
        with pytest.raises(datastates.StateMismatchError, match="loader.*saved over a dataset"):
            ckpt.restore({"model": fresh, "loader": other})
        assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
        assert other.state_dict()["consumed"] == 0
