"""A root holding more checkpoints than ``_STAMP_LISTING`` (64) on the real S3-compatible server:
past that many names, ``S3Store.file_stamps`` takes the manifests' ETags from one listing of every
key under the root instead of a HEAD per checkpoint. The catalog built on it must list, order and
restore exactly as below the threshold, and see another writer's replacements and deletions."""

from __future__ import annotations

import uuid

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer
from datastates.format import codec as fmt
from datastates.storage import s3

from server import delete_prefix, storage_options

# slow: more checkpoints than the listing threshold, saved and listed
pytestmark = pytest.mark.slow

COUNT = s3._STAMP_LISTING + 2  # past the threshold, whatever it is
SMALL = dict(chunk_bytes=64 << 10, host_cache_bytes=1 << 20)


def key_of(url: str) -> str:
    return url.split("/", 3)[3]


def state(step: int, version: int = 0) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + version)
    return {
        "w": torch.randn(16, generator=g),
        "i": torch.arange(5) * step,
        "meta": {"step": step, "version": version},
    }


def blank() -> dict:
    return {
        "w": torch.zeros(16),
        "i": torch.zeros(5, dtype=torch.int64),
        "meta": {"step": -1, "version": -1},
    }


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["i"], b["i"]) and a["meta"] == b["meta"]


def requests(ckpt: Checkpointer) -> list[tuple[str, dict]]:
    """Every request ``ckpt``'s client builds from now on: (operation, parameters)."""
    calls: list[tuple[str, dict]] = []
    ckpt.store.client.meta.events.register(
        "before-parameter-build.s3.*",
        lambda model, params, **_: calls.append((model.name, dict(params))),
    )
    return calls


def stamps_both_ways(store, root: str, monkeypatch) -> tuple[dict, dict]:
    """``file_stamps(root, manifest.json)`` by a HEAD per name, then by one full listing."""
    monkeypatch.setattr(s3, "_STAMP_LISTING", 1 << 30)
    by_heads = store.file_stamps(root, fmt.MANIFEST)
    monkeypatch.setattr(s3, "_STAMP_LISTING", 0)
    by_listing = store.file_stamps(root, fmt.MANIFEST)
    monkeypatch.undo()
    return by_heads, by_listing


@pytest.fixture(scope="module")
def built(s3_server):
    """A root holding ``COUNT`` checkpoints, steps 1..COUNT committed in that order (seq = step),
    built once for the module; a test that adds or changes checkpoints puts them back. Each
    commit's scan takes the listing way from the first (below the threshold, a HEAD per
    checkpoint at every commit would make the build quadratic in requests)."""
    prefix = f"many-{uuid.uuid4().hex[:12]}"
    root = f"s3://{s3_server.bucket}/{prefix}"
    with (
        pytest.MonkeyPatch.context() as patch,
        Checkpointer(
            root, CheckpointConfig(**SMALL), storage_options=storage_options(s3_server)
        ) as ckpt,
    ):
        patch.setattr(s3, "_STAMP_LISTING", 0)
        for step in range(1, COUNT + 1):
            ckpt.save(state(step), step=step).wait(60)
    yield root
    delete_prefix(s3_server, prefix)


@pytest.fixture()
def many(built, s3_server):
    """A Checkpointer on the built root."""
    with Checkpointer(
        built, CheckpointConfig(**SMALL), storage_options=storage_options(s3_server)
    ) as ckpt:
        yield ckpt


def test_past_the_threshold_one_listing_stamps_every_checkpoint(
    many, built, s3_server, monkeypatch
):
    """A scan past the threshold costs listings only (no HEAD, no manifest read again: the
    stamps are the ETags the commits' PUTs returned); list(), latest() and restores are those of
    every checkpoint committed, bit-exact; the stamps both ways are the same."""
    names = [fmt.step_name(s) for s in range(1, COUNT + 1)]
    assert [(i.name, i.seq) for i in many.list()] == [(n, s) for s, n in enumerate(names, 1)]
    calls = requests(many)  # a scan of a catalog that has read every manifest once
    assert many.latest().step == COUNT
    assert not [p for op, p in calls if op in ("HeadObject", "GetObject")], calls
    assert any(op == "ListObjectsV2" and "Delimiter" not in p for op, p in calls), calls
    live = blank()
    assert many.restore(live).step == COUNT and same(live, state(COUNT))
    assert same(many.load(step=33), state(33))
    by_heads, by_listing = stamps_both_ways(many.store, built, monkeypatch)
    assert sorted(by_heads) == names and by_listing == by_heads
    head = s3_server.client().head_object(
        Bucket=s3_server.bucket, Key=f"{key_of(built)}/{names[40]}/{fmt.MANIFEST}"
    )
    assert by_listing[names[40]] == head["ETag"]


def test_what_is_no_checkpoint_is_left_out_both_ways(many, built, s3_server, monkeypatch):
    """Entries of the root that are no checkpoints give no stamp by either way: a dot-name (a
    quarantined checkpoint's record, say) even with a manifest.json in it, a name holding other
    files only, a manifest.json one level deeper, and a plain object beside the checkpoints."""
    client = s3_server.client()
    planted = [
        f"{key_of(built)}/{key}"
        for key in (
            f".damaged.{fmt.step_name(3)}.0badc0de/{fmt.MANIFEST}",
            "loose/rank-00000.dsf",
            f"nested/deeper/{fmt.MANIFEST}",
            "plain-object",
        )
    ]
    for key in planted:
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"{}")
    try:
        by_heads, by_listing = stamps_both_ways(many.store, built, monkeypatch)
        assert sorted(by_heads) == [fmt.step_name(s) for s in range(1, COUNT + 1)]
        assert by_listing == by_heads
        assert [i.step for i in many.list()] == list(range(1, COUNT + 1))
        assert many.damaged() == []
    finally:
        for key in planted:
            client.delete_object(Bucket=s3_server.bucket, Key=key)


def test_another_writers_replacement_and_deletion_are_seen(many, built, s3_server):
    """Between two scans past the threshold another writer replaces one checkpoint and deletes
    another: the next scan reads again the replaced one's manifest only (its ETag changed),
    orders it by its new commit number, drops the deleted one, and restores the replacement
    bit-exact as the latest."""
    a, b, c = COUNT + 1, COUNT + 2, COUNT + 3
    with Checkpointer(
        built, CheckpointConfig(**SMALL), storage_options=storage_options(s3_server)
    ) as other:
        try:
            for step in (a, b, c):
                other.save(state(step), step=step).wait(60)
            assert [i.step for i in many.list()][-4:] == [COUNT, a, b, c]  # the catalog, now
            assert other.save(state(a, version=1), step=a, overwrite=True).wait(60).seq == c + 1
            other.delete(step=b)
            calls = requests(many)
            listed = [(i.step, i.seq) for i in many.list()]
            assert listed == [(s, s) for s in range(1, COUNT + 1)] + [(c, c), (a, c + 1)]
            gets = [p["Key"].rsplit("/", 2)[-2] for op, p in calls if op == "GetObject"]
            assert gets == [fmt.step_name(a)]
            assert not [op for op, _ in calls if op == "HeadObject"]
            assert many.latest().step == a
            live = blank()
            assert many.restore(live).step == a and same(live, state(a, version=1))
            assert same(many.load(step=c), state(c))
            assert fmt.step_name(b) not in many.store.file_stamps(built, fmt.MANIFEST)
        finally:  # the built root as it was
            for step in (a, c):
                if other.store.isfile(f"{built}/{fmt.step_name(step)}/{fmt.MANIFEST}"):
                    other.delete(step=step)
    assert [(i.step, i.seq) for i in many.list()] == [(s, s) for s in range(1, COUNT + 1)]


def test_entries_of_many_keys_are_stamped_by_heads_not_by_listing_every_key(s3_server, s3_root):
    """Past the threshold, a listing of every key is cheaper only while each entry holds few
    keys (a key per rank's shard file): one page of the last entry's keys decides. Entries of
    ``_STAMP_KEYS`` keys or more (many ranks) are stamped by a HEAD each, and no listing goes
    through their keys; both ways give the same stamps."""
    from datastates.storage import open_store

    client = s3_server.client()
    names = [fmt.step_name(s) for s in range(1, COUNT + 1)]
    for name in names:
        client.put_object(
            Bucket=s3_server.bucket,
            Key=f"{key_of(s3_root)}/{name}/{fmt.MANIFEST}",
            Body=name.encode(),
        )
    store = open_store(s3_root, storage_options(s3_server))
    calls: list[tuple[str, dict]] = []
    store.client.meta.events.register(
        "before-parameter-build.s3.*",
        lambda model, params, **_: calls.append((model.name, dict(params))),
    )
    few = store.file_stamps(s3_root, fmt.MANIFEST)  # one key per entry: the full listing
    assert sorted(few) == names and not [op for op, _ in calls if op == "HeadObject"]
    for i in range(s3._STAMP_KEYS):  # the last entry now holds that many shard files more
        client.put_object(
            Bucket=s3_server.bucket,
            Key=f"{key_of(s3_root)}/{names[-1]}/.data.r/rank-{i:05d}.dsf",
            Body=b"",
        )
    calls.clear()
    many = store.file_stamps(s3_root, fmt.MANIFEST)
    assert many == few
    assert len([op for op, _ in calls if op == "HeadObject"]) == COUNT
    listings = [p for op, p in calls if op == "ListObjectsV2"]
    assert len(listings) == 2  # the names (with a delimiter), then one page of the last entry
    assert (
        listings[1]["Prefix"].endswith(f"/{names[-1]}/")
        and listings[1]["MaxKeys"] == s3._STAMP_KEYS
    )
