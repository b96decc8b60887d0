"""Fallback resume on the real S3-compatible server: a damaged newest checkpoint is skipped,
moved aside by rank 0 (``ManifestPublisher.quarantine``) and reported, the older one restored
bit-exact; the move takes the damaged objects out of the listing and removes nothing else.
The local-disk counterpart is tests/faults/test_fallback.py."""

from __future__ import annotations

import logging

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer, CorruptCheckpointError
from datastates.format import codec as fmt
from datastates.restore.reader import Reader

from server import storage_options
from testkit import step_state

# slow: damaged checkpoints on a real object store, moved aside and copied back
pytestmark = pytest.mark.slow

SMALL = dict(chunk_bytes=64 << 10, host_cache_bytes=1 << 20)


def key_of(url: str) -> str:
    return url.split("/", 3)[3]


def _blank() -> dict:
    return {"w": torch.zeros(3000), "b": torch.zeros(7), "meta": {"step": -1, "name": ""}}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["meta"] == b["meta"]


def objects(server, url: str) -> dict[str, str]:
    """Every object under ``url``: its key relative to ``url`` → its ETag."""
    pages = (
        server.client()
        .get_paginator("list_objects_v2")
        .paginate(Bucket=server.bucket, Prefix=key_of(url) + "/")
    )
    start = len(key_of(url)) + 1
    return {o["Key"][start:]: o["ETag"] for p in pages for o in p.get("Contents", [])}


def get(server, url: str, rel: str) -> bytes:
    return (
        server.client().get_object(Bucket=server.bucket, Key=f"{key_of(url)}/{rel}")["Body"].read()
    )


def flip(server, url: str, rel: str, offset: int) -> None:
    """Flip bits of one byte of the object ``url/rel`` (an object is replaced whole)."""
    data = bytearray(get(server, url, rel))
    data[offset] ^= 0x5A
    server.client().put_object(Bucket=server.bucket, Key=f"{key_of(url)}/{rel}", Body=bytes(data))


def shard_of(found: dict[str, str], name: str) -> str:
    (shard,) = [k for k in found if k.startswith(f"{name}/.data.") and k.endswith(".dsf")]
    return shard


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_older_one_restored(
    s3_server, s3_root, caplog
):
    """A flipped byte in the newest checkpoint's shard object: the step before is restored
    bit-exact; the report and a WARNING name the newest as skipped and where it went; its
    manifest and damaged shard, byte for byte, are under the quarantine prefix (and read as the
    damaged checkpoint they are), it is no longer listed, nothing else under the root moved or
    changed; the step is saved again without overwrite=True, and a later cleanup of stale data
    leaves the quarantine alone."""
    options = storage_options(s3_server)
    newest = fmt.step_name(3)
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=options) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step_state(step), step=step).wait(60)
        before = objects(s3_server, s3_root)
        shard = shard_of(before, newest)
        manifest = get(s3_server, s3_root, f"{newest}/{fmt.MANIFEST}")
        flip(s3_server, s3_root, shard, 4096 + 17)  # inside the first tensor's bytes
        damaged = objects(s3_server, s3_root)
        live = _blank()
        with caplog.at_level(logging.WARNING, logger="datastates"):
            report = ckpt.restore(live, fallback=True)

        assert report.step == 2 and _same(live, step_state(2))
        assert ckpt.storage._publisher.wait_moves(
            120
        )  # the shard files follow on a thread of their own
        assert [s.name for s in report.skipped] == [newest] and report.passed_over == []
        skipped = report.skipped[0]
        assert skipped.reason.startswith("rank 0:") and "checksum mismatch" in skipped.reason
        assert skipped.quarantined.startswith(f"{s3_root}/.damaged.{newest}.")
        assert any(
            newest in r.getMessage() and skipped.quarantined in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING
        )
        aside = skipped.quarantined[len(s3_root) + 1 :]
        data_dir = shard.split("/")[1]

        # the damaged checkpoint, whole and as it was found, under the quarantine prefix ...
        after = objects(s3_server, s3_root)
        moved = {
            f"{newest}/{fmt.MANIFEST}": f"{aside}/{fmt.MANIFEST}",
            shard: f"{aside}/{data_dir}/{fmt.shard_file_name(0)}",
        }
        assert {k for k in after if k.startswith(aside + "/")} == set(moved.values()) | {
            f"{aside}/reason.txt"
        }
        assert get(s3_server, s3_root, f"{aside}/{fmt.MANIFEST}") == manifest
        assert get(s3_server, s3_root, f"{aside}/reason.txt") == skipped.reason.encode()
        assert after[moved[shard]] == damaged[shard]  # the damaged bytes, kept
        with Reader(skipped.quarantined, registry=ckpt.registry, store=ckpt.store) as reader:
            with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
                reader.verify_all()
        # ... gone from the checkpoint, and nothing else under the root moved or changed
        assert {k: e for k, e in after.items() if not k.startswith(aside + "/")} == {
            k: e for k, e in damaged.items() if k not in moved
        }
        assert [i.step for i in ckpt.list()] == [1, 2] and ckpt.latest().step == 2
        assert ckpt.damaged() == []

        # the resume loop saves the step again, without overwrite=True
        ckpt.save(step_state(3), step=3).wait(60)
        live = _blank()
        report = ckpt.restore(live, fallback=True)
        assert report.step == 3 and report.skipped == [] and _same(live, step_state(3))

    # a later Checkpointer, its cleanup of stale data included, lists what the first one did
    # and leaves the quarantine as it was
    quarantined = {
        k: e for k, e in objects(s3_server, s3_root).items() if k.startswith(aside + "/")
    }
    with Checkpointer(
        s3_root, CheckpointConfig(stale_tmp_age_s=1e-6, **SMALL), storage_options=options
    ) as ckpt:
        assert [i.step for i in ckpt.list()] == [1, 2, 3] and ckpt.damaged() == []
        assert _same(ckpt.load(fallback=True), step_state(3))
    assert {
        k: e for k, e in objects(s3_server, s3_root).items() if k.startswith(aside + "/")
    } == quarantined


def test_a_missing_shard_is_moved_aside_with_what_is_left(s3_server, s3_root):
    """The damage is a shard object that is gone: the checkpoint is skipped and moved aside
    all the same (its manifest and reason), the older one restored."""
    options = storage_options(s3_server)
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=options) as ckpt:
        for step in (1, 2):
            ckpt.save(step_state(step), step=step).wait(60)
        before = objects(s3_server, s3_root)
        shard = shard_of(before, fmt.step_name(2))
        s3_server.client().delete_object(Bucket=s3_server.bucket, Key=f"{key_of(s3_root)}/{shard}")
        live = _blank()
        report = ckpt.restore(live, fallback=True)
        assert report.step == 1 and _same(live, step_state(1))
        assert ckpt.storage._publisher.wait_moves(120)
        (skipped,) = report.skipped
        assert skipped.name == fmt.step_name(2) and "CheckpointNotFoundError" in skipped.reason
        aside = skipped.quarantined[len(s3_root) + 1 :]
        after = objects(s3_server, s3_root)
        assert {k for k in after if k.startswith(aside + "/")} == {
            f"{aside}/{fmt.MANIFEST}",
            f"{aside}/reason.txt",
        }
        manifest = f"{fmt.step_name(2)}/{fmt.MANIFEST}"
        assert {k: e for k, e in after.items() if not k.startswith(aside + "/")} == {
            k: e for k, e in before.items() if k not in (shard, manifest)
        }
        assert [i.step for i in ckpt.list()] == [1]


def test_a_move_that_fails_before_the_manifest_goes_leaves_the_checkpoint_as_it_was(
    s3_server, s3_root
):
    """The write of the quarantine's manifest fails: the older checkpoint is restored all the
    same, the damaged one is reported as not moved and stays as it was (listed, its objects
    unchanged, nothing copied), nothing is left of the quarantine; the next fallback restore
    moves it, its shard file included."""
    from botocore.exceptions import ConnectionClosedError

    options = {**storage_options(s3_server), "max_attempts": 1}
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=options) as ckpt:
        for step in (1, 2):
            ckpt.save(step_state(step), step=step).wait(60)
        shard = shard_of(objects(s3_server, s3_root), fmt.step_name(2))
        flip(s3_server, s3_root, shard, 4096 + 17)
        damaged = objects(s3_server, s3_root)
        copied = []

        def fail_the_manifest_aside(request, **_):
            if ".damaged." in request.url and request.url.endswith(fmt.MANIFEST):
                raise ConnectionClosedError(endpoint_url=request.url)

        ckpt.store.client.meta.events.register(
            "after-call.s3.CopyObject", lambda **_: copied.append(True)
        )
        ckpt.store.client.meta.events.register("before-send.s3.PutObject", fail_the_manifest_aside)
        live = _blank()
        report = ckpt.restore(live, fallback=True)
        assert report.step == 1 and _same(live, step_state(1))
        assert ckpt.storage._publisher.wait_moves(120) and copied == []  # nothing copied: not moved
        assert [(s.name, s.quarantined) for s in report.skipped] == [(fmt.step_name(2), None)]
        assert objects(s3_server, s3_root) == damaged
        assert [i.step for i in ckpt.list()] == [1, 2]
        ckpt.store.client.meta.events.unregister(
            "before-send.s3.PutObject", fail_the_manifest_aside
        )
        report = ckpt.restore(_blank(), fallback=True)
        assert report.step == 1 and report.skipped[0].quarantined is not None
        assert ckpt.storage._publisher.wait_moves(120) and copied == [True]  # the shard file, now
        assert [i.step for i in ckpt.list()] == [1]


def test_a_copy_is_made_by_the_server_whole_or_by_parts(s3_server, s3_root, monkeypatch):
    """``S3Store.copy``, how the quarantine moves shard files: one CopyObject, or above
    ``MAX_COPY`` a multipart upload of UploadPartCopy ranges (both lowered here so that 12 MiB
    goes in three parts); no byte is read or written by this process, the copy is byte-exact. A
    missing source is FileNotFoundError and creates nothing; a part that fails aborts the
    upload, nothing is created and no upload is left."""
    from botocore.exceptions import ConnectionClosedError

    from datastates.storage import open_store, s3

    from server import list_multipart_uploads

    store = open_store(s3_root, {**storage_options(s3_server), "max_attempts": 1})
    data = (
        torch.randint(
            0, 256, ((12 << 20) + 3,), generator=torch.Generator().manual_seed(5), dtype=torch.uint8
        )
        .numpy()
        .tobytes()
    )
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{key_of(s3_root)}/src", Body=data)
    calls: list[str] = []
    store.client.meta.events.register(
        "before-parameter-build.s3.*", lambda model, **_: calls.append(model.name)
    )
    store.copy(f"{s3_root}/src", f"{s3_root}/whole")
    assert calls == ["HeadObject", "CopyObject"] and get(s3_server, s3_root, "whole") == data
    monkeypatch.setattr(s3, "MAX_COPY", 0)
    monkeypatch.setattr(s3, "_COPY_PART", s3.MIN_PART)
    calls.clear()
    store.copy(f"{s3_root}/src", f"{s3_root}/parts")
    assert calls == [
        "HeadObject",
        "CreateMultipartUpload",
        *["UploadPartCopy"] * 3,
        "CompleteMultipartUpload",
    ]
    assert get(s3_server, s3_root, "parts") == data
    with pytest.raises(FileNotFoundError, match="missing"):
        store.copy(f"{s3_root}/missing", f"{s3_root}/never")

    def drop_the_second(request, **_):
        if calls.count("UploadPartCopy") == 2:
            raise ConnectionClosedError(endpoint_url=request.url)

    store.client.meta.events.register("before-send.s3.UploadPartCopy", drop_the_second)
    calls.clear()
    with pytest.raises(OSError, match="UploadPartCopy"):
        store.copy(f"{s3_root}/src", f"{s3_root}/broken")
    assert calls[-1] == "AbortMultipartUpload"
    assert sorted(objects(s3_server, s3_root)) == ["parts", "src", "whole"]
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []


def test_a_store_that_cannot_copy_moves_the_record_and_leaves_the_data(s3_server, s3_root, caplog):
    """A store without ``copy`` (the base Store's NotImplementedError, as a user's own object
    store may be): the fallback restore is the same, the quarantine holds the manifest and the
    reason, the shard file stays where it was (for the cleanup of stale data), a WARNING says
    so."""
    options = storage_options(s3_server)
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=options) as ckpt:
        for step in (1, 2):
            ckpt.save(step_state(step), step=step).wait(60)
        shard = shard_of(objects(s3_server, s3_root), fmt.step_name(2))
        flip(s3_server, s3_root, shard, 4096 + 17)
        damaged = objects(s3_server, s3_root)

        def cannot(src, dst):
            raise NotImplementedError

        ckpt.store.copy = cannot
        live = _blank()
        with caplog.at_level(logging.WARNING, logger="datastates"):
            report = ckpt.restore(live, fallback=True)
            assert ckpt.storage._publisher.wait_moves(120)
        assert report.step == 1 and _same(live, step_state(1))
        aside = report.skipped[0].quarantined[len(s3_root) + 1 :]
        after = objects(s3_server, s3_root)
        assert {k for k in after if k.startswith(aside + "/")} == {
            f"{aside}/{fmt.MANIFEST}",
            f"{aside}/reason.txt",
        }
        assert after[shard] == damaged[shard]
        assert any("cannot copy" in r.getMessage() for r in caplog.records)


def test_close_waits_for_the_quarantine_s_shard_files_to_move(s3_server, s3_root):
    """The copies of a quarantined checkpoint's shard files are held back until something waits
    for them: ``close()`` does, so once it returns the damaged shard is under the quarantine and
    gone from its old key (without that wait the copy would still be held when close returned)."""
    import threading

    options = storage_options(s3_server)
    ckpt = Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=options)
    for step in (1, 2):
        ckpt.save(step_state(step), step=step).wait(60)
    shard = shard_of(objects(s3_server, s3_root), fmt.step_name(2))
    flip(s3_server, s3_root, shard, 4096 + 5)
    damaged = objects(s3_server, s3_root)[shard]
    gate = threading.Event()
    store, publisher = ckpt.storage._publisher.store, ckpt.storage._publisher
    real_copy, real_wait = store.copy, publisher.wait_moves

    def held_copy(src, dst):  # a copy starts only once someone waits for the moves
        assert gate.wait(120), "nothing waited for the quarantine's copies"
        return real_copy(src, dst)

    def waiting(timeout_s=None):
        gate.set()
        return real_wait(timeout_s)

    store.copy, publisher.wait_moves = held_copy, waiting
    report = ckpt.restore(_blank(), fallback=True)
    assert report.step == 1 and [s.name for s in report.skipped] == [fmt.step_name(2)]
    assert not gate.is_set() and shard in objects(s3_server, s3_root)  # the copy is held
    ckpt.close()
    aside = report.skipped[0].quarantined[len(s3_root) + 1 :]
    after = objects(s3_server, s3_root)
    moved = f"{aside}/{shard.split('/')[1]}/{fmt.shard_file_name(0)}"
    assert shard not in after and after[moved] == damaged


def test_a_damaged_split_checkpoint_is_moved_aside_with_its_parts(s3_server, s3_root, monkeypatch):
    """A split manifest (docs/format.md, "Split manifests"; forced by a threshold of one byte):
    the quarantine moves its part with its shard file, and reads back there as the damaged
    checkpoint it is; the older split checkpoint is restored bit-exact."""
    monkeypatch.setattr(fmt, "SPLIT_BYTES", 1)
    options = storage_options(s3_server)
    newest = fmt.step_name(2)
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=options) as ckpt:
        for step in (1, 2):
            ckpt.save(step_state(step), step=step).wait(60)
        before = objects(s3_server, s3_root)
        shard = shard_of(before, newest)
        data_dir = shard.split("/")[1]
        part = f"{newest}/{data_dir}/{fmt.part_name(0)}"
        assert part in before
        flip(s3_server, s3_root, shard, 4096 + 17)
        live = _blank()
        report = ckpt.restore(live, fallback=True)
        assert report.step == 1 and _same(live, step_state(1))
        assert ckpt.storage._publisher.wait_moves(120)
        aside = report.skipped[0].quarantined[len(s3_root) + 1 :]
        after = objects(s3_server, s3_root)
        assert {k for k in after if k.startswith(aside + "/")} == {
            f"{aside}/{fmt.MANIFEST}",
            f"{aside}/reason.txt",
            f"{aside}/{data_dir}/{fmt.shard_file_name(0)}",
            f"{aside}/{data_dir}/{fmt.part_name(0)}",
        }
        assert after[f"{aside}/{data_dir}/{fmt.part_name(0)}"] == before[part]
        with Reader(
            report.skipped[0].quarantined, registry=ckpt.registry, store=ckpt.store
        ) as reader:
            with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
                reader.verify_all()


def test_each_rank_restores_a_split_checkpoint_through_its_view(s3_server, s3_root, monkeypatch):
    """Two ranks (threads, one coordination store) save a split checkpoint on the server and
    restore it: each rank reads its view of the manifest (docs/format.md, "A rank's view"), its
    parts in ``data_dir``, and restores its own state bit-exact; each view is that rank's slice
    of the whole manifest, and the job's listing decodes no part."""
    from datastates.commit.catalog import Catalog
    from datastates.format import files, tree
    from thread_ranks import in_thread_ranks

    monkeypatch.setattr(fmt, "SPLIT_BYTES", 1)
    options = storage_options(s3_server)
    world = 2
    decoded, decode = [], files._Parts.decode

    def counting(self, i, raw, convert=None):
        decoded.append(i)
        return decode(self, i, raw, convert)

    monkeypatch.setattr(files._Parts, "decode", counting)

    def mine(rank: int, step: int) -> dict:
        return {"w": torch.full((1000 + rank,), float(10 * step + rank)), "rank": rank}

    def restored(ck, rank: int):
        ck.save(mine(rank, 1), step=1).wait(60)
        live = {"w": torch.zeros(1000 + rank), "rank": -1}
        report = ck.restore(live)
        return report.step, torch.equal(live["w"], mine(rank, 1)["w"]), live["rank"]

    results = in_thread_ranks(
        s3_root, world, restored, config=CheckpointConfig(**SMALL), storage_options=options
    )
    assert results == {r: (1, True, r) for r in range(world)}, results
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=options) as ckpt:
        store = ckpt.store
    path = store.join(s3_root, fmt.step_name(1))
    whole = files.read_manifest(path, store)
    assert whole.version == fmt.SPLIT_VERSION and whole.data_dir is not None
    for rank in range(world):
        view = files.read_manifest(path, store, view=lambda saved, r=rank: r)
        refs = {
            n["e"] for _, n in tree.leaves(whole.ranks[rank].tree) if n["t"] in tree.ENTRY_LEAVES
        }
        assert view.view == rank and view.ranks == (whole.ranks[rank],)
        assert view.entries == {e: whole.entries[e] for e in refs}
    decoded.clear()
    (info,) = Catalog(s3_root, store, world_size=world).scan()
    assert info.step == 1 and decoded == []
