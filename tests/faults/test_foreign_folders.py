"""A folder of the checkpoint root that holds a ``manifest.json`` but bears no mark of datastates
(another program's folder) is no checkpoint: retention, ``delete()``, the listing and a save that
needs its name leave it and every file in it alone, with one WARNING naming it. A checkpoint
datastates wrote whose manifest is damaged keeps counting as damaged as long as one mark is
left: the manifest's beginning, its sealing checksum field, or rank 0's shard file."""

from __future__ import annotations

import logging
import os
import time as _time

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer
from datastates.commit import publish
from datastates.commit.catalog import written_by_datastates
from datastates.errors import CheckpointExistsError, CheckpointNotFoundError
from datastates.format import codec as fmt

# slow: many object-store round trips
pytestmark = pytest.mark.slow

SMALL = dict(host_cache_bytes=256 << 10, chunk_bytes=16 << 10)

#: manifest.json bodies other programs write (a web app's manifest, a note, an empty file,
#: JSON that merely mentions the field datastates seals with)
FOREIGN = {
    "webapp": b'{"name": "my pwa", "icons": []}',
    "notes": b"hello",
    "empty": b"",
    "mentions": b'{"manifest_crc32": "00000000", "files": ["a.bin"]}',
}


def _plant(root, name: str, manifest: bytes | None, *, fifo: bool = False) -> None:
    folder = root / name
    folder.mkdir()
    (folder / "precious.bin").write_bytes(b"user data " + name.encode())
    path = folder / fmt.MANIFEST
    if fifo:
        os.mkfifo(path)
    else:
        path.write_bytes(manifest)
    old = os.stat(folder / "precious.bin").st_mtime - 3600  # older than every checkpoint
    os.utime(folder / "precious.bin", (old, old))
    if not fifo:
        os.utime(path, (old, old))


def _untouched(root, name: str) -> bool:
    return (root / name / "precious.bin").read_bytes() == b"user data " + name.encode()


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "datastates" and r.levelno == logging.WARNING
    ]


def test_retention_and_the_listing_leave_foreign_folders_alone(tmp_path, caplog):
    for name, body in FOREIGN.items():
        _plant(tmp_path, name, body)
    _plant(tmp_path, "pipe", None, fifo=True)
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=1, **SMALL)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
        assert [i.step for i in ckpt.list()] == [3]
        assert ckpt.damaged() == []
    for name in [*FOREIGN, "pipe"]:
        assert _untouched(tmp_path, name), name
    named = [w for w in _warnings(caplog) if "bears no mark of datastates" in w]
    assert sorted(w.split(" ", 1)[0] for w in named) == sorted(
        str(tmp_path / name) for name in [*FOREIGN, "pipe"]
    )  # once each per process


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_delete_refuses_a_foreign_folder(tmp_path, name):
    _plant(tmp_path, name, FOREIGN[name])
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        ckpt.save({"x": torch.ones(4)}, step=1).wait(60)
        with pytest.raises(
            CheckpointNotFoundError,
            match=f"{name} is not a checkpoint: its "
            "manifest.json is not one datastates wrote .*nothing was removed",
        ):
            ckpt.delete(tag=name)
        assert [i.step for i in ckpt.list()] == [1]
    assert _untouched(tmp_path, name)


def test_a_save_never_replaces_a_foreign_folder_of_its_name(tmp_path):
    _plant(tmp_path, fmt.step_name(2), FOREIGN["webapp"])
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        for overwrite in (False, True):
            with pytest.raises(
                CheckpointExistsError,
                match="step-0000000002 exists and is not "
                "a checkpoint .it holds no manifest.json datastates wrote",
            ):
                ckpt.save({"x": torch.ones(4)}, step=2, overwrite=overwrite).wait(60)
        assert ckpt.list() == []
    assert _untouched(tmp_path, fmt.step_name(2))


def _damage(path, how: str) -> None:
    raw = path.read_bytes()
    if how == "middle":
        raw = raw[: len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0x10]) + raw[len(raw) // 2 + 1 :]
    elif how == "beginning":
        raw = b"\0" * 40 + raw[40:]
    elif how == "truncated":
        raw = raw[: len(raw) // 3]
    elif how == "emptied":
        raw = b""
    path.write_bytes(raw)


@pytest.mark.parametrize("how", ["middle", "beginning", "truncated", "emptied"])
def test_a_damaged_checkpoint_datastates_wrote_still_counts_as_damaged(tmp_path, how):
    """One mark left is enough: the beginning (a truncated manifest), the sealing field (a
    manifest whose beginning is overwritten), rank 0's shard file (an emptied manifest)."""
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    folder = tmp_path / fmt.step_name(1)
    _damage(folder / fmt.MANIFEST, how)
    assert written_by_datastates(str(folder))
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        assert [d.name for d in ckpt.damaged()] == [fmt.step_name(1)]
        ckpt.delete(step=1)
    assert not folder.exists()


def test_without_any_mark_left_a_damaged_checkpoint_is_left_alone(tmp_path, caplog):
    """Emptied manifest and no rank 0 shard file: nothing tells it from another program's
    folder, so it is named in a WARNING and kept, never deleted."""
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    folder = tmp_path / fmt.step_name(1)
    (folder / fmt.MANIFEST).write_bytes(b"")
    os.remove(folder / fmt.shard_file_name(0))
    assert not written_by_datastates(str(folder))
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=1, **SMALL)) as ckpt:
        assert ckpt.damaged() == []
        ckpt.save({"x": torch.ones(4)}, step=3).wait(60)
        with pytest.raises(CheckpointNotFoundError, match="is not a checkpoint"):
            ckpt.delete(step=1)
    assert sorted(os.listdir(folder)) == [fmt.MANIFEST]
    assert any(
        w.startswith(f"{folder} is not a checkpoint and is left alone") for w in _warnings(caplog)
    )


def test_an_object_store_keeps_a_foreign_prefix(s3_server, s3_root, s3_storage_options):
    client = s3_server.client()
    prefix = s3_root.split("/", 3)[3]
    for name, body in FOREIGN.items():
        for leaf, data in ((fmt.MANIFEST, body), ("precious.bin", b"mine")):
            client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}/{leaf}", Body=data)
    with Checkpointer(
        s3_root, CheckpointConfig(keep_last=1, **SMALL), storage_options=s3_storage_options
    ) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
        assert ckpt.damaged() == []
        with pytest.raises(CheckpointNotFoundError, match="nothing was removed"):
            ckpt.delete(tag="webapp")
    for name in FOREIGN:
        got = client.get_object(Bucket=s3_server.bucket, Key=f"{prefix}/{name}/precious.bin")
        assert got["Body"].read() == b"mine"


def test_an_object_store_save_never_replaces_a_foreign_manifest(
    s3_server, s3_root, s3_storage_options
):
    client = s3_server.client()
    key = f"{s3_root.split('/', 3)[3]}/webapp/{fmt.MANIFEST}"
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=FOREIGN["webapp"])
    with Checkpointer(
        s3_root, CheckpointConfig(**SMALL), storage_options=s3_storage_options
    ) as ckpt:
        for overwrite in (False, True):
            with pytest.raises(
                CheckpointExistsError, match="webapp exists and is not a checkpoint"
            ):
                ckpt.save({"x": torch.ones(4)}, tag="webapp", overwrite=overwrite).wait(60)
        assert ckpt.list() == []
    body = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    assert body == FOREIGN["webapp"]


def _two_steps_on_s3(root: str, options: dict, step: int) -> str:
    """Steps 1 and 2 saved under ``root``; the key of step ``step``'s manifest."""
    with Checkpointer(
        root, CheckpointConfig(keep_last=None, **SMALL), storage_options=options
    ) as ckpt:
        for saved in (1, 2):
            ckpt.save({"x": torch.full((4,), float(saved))}, step=saved).wait(60)
    return f"{root.split('/', 3)[3]}/{fmt.step_name(step)}/{fmt.MANIFEST}"


def test_an_object_store_checkpoint_with_an_emptied_manifest_is_damaged(
    s3_server, s3_root, s3_storage_options
):
    """Its shard files lie in the checkpoint's data directory: that is the mark left."""
    client = s3_server.client()
    key = _two_steps_on_s3(s3_root, s3_storage_options, 1)
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"")
    with Checkpointer(
        s3_root, CheckpointConfig(**SMALL), storage_options=s3_storage_options
    ) as ckpt:
        assert [d.name for d in ckpt.damaged()] == [fmt.step_name(1)]
        ckpt.delete(step=1)
        assert [i.step for i in ckpt.list()] == [2]


# ---------------------------------------------------------------- a folder without its manifest


def test_a_newest_checkpoint_whose_manifest_was_deleted_is_named_not_skipped(tmp_path, caplog):
    """The newest checkpoint's manifest deleted by hand: ``latest()`` and ``restore()`` use the
    one before, name the folder in a WARNING and in the report (a resume must not go back a
    step without a word), and nothing lists, keeps in ``damaged()`` or deletes it. A folder of
    another program and an older manifest-less checkpoint are not named."""
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    os.remove(tmp_path / fmt.step_name(1) / fmt.MANIFEST)
    old = os.stat(tmp_path / fmt.step_name(2) / fmt.MANIFEST).st_mtime - 60
    os.utime(tmp_path / fmt.step_name(1), (old, old))  # older than the one used
    os.remove(tmp_path / fmt.step_name(3) / fmt.MANIFEST)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.txt").write_text("not a checkpoint")
    newest = fmt.step_name(3)
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=1, **SMALL)) as ckpt:
        caplog.clear()
        assert ckpt.latest().step == 2
        named = [w for w in _warnings(caplog) if "passed over" in w]
        assert (
            len(named) == 1
            and f"passed over the damaged checkpoint {newest}" in named[0]
            and f"no {fmt.MANIFEST}: its manifest was deleted" in named[0]
        ), named
        live = {"x": torch.zeros(4)}
        report = ckpt.restore(live)
        assert report.step == 2 and report.passed_over == [newest]
        assert torch.equal(live["x"], torch.full((4,), 2.0))
        assert [i.step for i in ckpt.list()] == [2] and ckpt.damaged() == []
        ckpt.save({"x": torch.full((4,), 4.0)}, step=4).wait(60)  # retention: keep_last=1
        assert [i.step for i in ckpt.list()] == [4]
    for step in (1, 3):
        assert (tmp_path / fmt.step_name(step) / fmt.shard_file_name(0)).is_file()
    assert (tmp_path / "logs" / "events.txt").read_text() == "not a checkpoint"


def test_an_object_store_checkpoint_without_its_manifest_is_named(
    s3_server, s3_root, s3_storage_options, caplog
):
    """On an object store the folder's shard files lie in its data directory: found there."""
    client = s3_server.client()
    key = _two_steps_on_s3(s3_root, s3_storage_options, 2)
    client.delete_object(Bucket=s3_server.bucket, Key=key)
    with Checkpointer(
        s3_root, CheckpointConfig(**SMALL), storage_options=s3_storage_options
    ) as ckpt:
        caplog.clear()
        report = ckpt.restore({"x": torch.zeros(4)})
        assert report.step == 1 and report.passed_over == [fmt.step_name(2)]
        assert any(
            f"passed over the damaged checkpoint {fmt.step_name(2)}" in w
            and "no manifest.json" in w
            for w in _warnings(caplog)
        )


# ---------------------------------------------------------------- object stores: what a save
# and the cleanup of stale data may touch


def test_an_object_store_save_never_writes_into_a_foreign_folder(
    s3_server, s3_root, s3_storage_options
):
    """A prefix holding another program's objects but no manifest is no checkpoint: a save of
    its name is refused, and nothing of the save is left in it (retention would otherwise
    delete the program's files with the checkpoint)."""
    client, prefix = s3_server.client(), s3_root.split("/", 3)[3]
    client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/notes/readme.txt", Body=b"mine")
    with Checkpointer(
        s3_root, CheckpointConfig(keep_last=1, **SMALL), storage_options=s3_storage_options
    ) as ckpt:
        with pytest.raises(CheckpointExistsError, match="notes exists and is not a checkpoint"):
            ckpt.save({"x": torch.ones(4)}, tag="notes").wait(60)
        ckpt.save({"x": torch.ones(4)}, step=1).wait(60)
        ckpt.save({"x": torch.ones(4)}, step=2).wait(60)
        assert [i.name for i in ckpt.list()] == [fmt.step_name(2)]
    keys = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/notes/").get(
            "Contents", []
        )
    ]
    assert keys == [f"{prefix}/notes/readme.txt"]


def test_the_cleanup_of_stale_data_removes_only_what_a_save_writes(
    s3_server, s3_root, s3_storage_options, monkeypatch
):
    """Opening a Checkpointer removes stale data directories and aborts stale uploads of dead
    saves (all made an hour old for it), and nothing else: not a folder merely named
    ``.data.*``, not a data directory holding another program's file, not another program's
    multipart upload."""

    class _AnHourLater:
        monotonic = staticmethod(_time.monotonic)

        @staticmethod
        def time():
            return _time.time() + 3600

    monkeypatch.setattr(publish, "time", _AnHourLater)
    client, prefix, bucket = s3_server.client(), s3_root.split("/", 3)[3], s3_server.bucket
    dead = f"{prefix}/{fmt.step_name(9)}/.data.0123456789abcdef-7/{fmt.shard_file_name(0)}"
    theirs = [
        f"{prefix}/datasets/.data.cache/shard-0.bin",
        f"{prefix}/datasets/.data.0123456789abcdef-5/notes.txt",
        f"{prefix}/{fmt.step_name(8)}/.data.0123456789abcdef-6/notes.txt",
    ]
    for key in [dead] + theirs:
        client.put_object(Bucket=bucket, Key=key, Body=b"x")
    uploads = {
        key: client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        for key in (
            f"{prefix}/logs/big.log",
            dead + ".other",
            f"{prefix}/x/.data.0123456789abcdef-7/{fmt.shard_file_name(3)}",
        )
    }
    with Checkpointer(
        s3_root, CheckpointConfig(stale_tmp_age_s=60.0, **SMALL), storage_options=s3_storage_options
    ):
        pass
    left = {
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    }
    assert dead not in left and set(theirs) <= left
    pending = {
        u["Key"]
        for u in client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get(
            "Uploads", []
        )
    }
    assert pending == {f"{prefix}/logs/big.log", dead + ".other"}
    for key, upload in uploads.items():
        if key in pending:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
