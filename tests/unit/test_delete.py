"""``delete()`` removes checkpoints only: a committed (or damaged) checkpoint goes, anything else
under the root -- a data set folder, a file, a symbolic link, a directory whose manifest is a
link -- raises CheckpointNotFoundError and is left exactly as it was. Local disk and object store
alike."""

from __future__ import annotations

import os

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer
from datastates.format import codec as fmt
from datastates.errors import CheckpointNotFoundError

SMALL = dict(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)


def tree(path) -> dict[str, bytes]:
    """Every file under ``path`` (links not followed) with its bytes; links as their target."""
    out = {}
    for folder, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, path)
            out[rel] = (
                (b"-> " + os.readlink(full).encode())
                if os.path.islink(full)
                else open(full, "rb").read()
            )
    return out


@pytest.fixture
def root(tmp_path):
    """A root with one committed checkpoint (step 1) and things that are not checkpoints."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.save({"x": torch.arange(4.0)}, step=1).wait(60)
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "train.bin").write_bytes(b"\x01" * 100)
    (tmp_path / "notes").write_bytes(b"not a directory")
    os.symlink(tmp_path / fmt.step_name(1), tmp_path / "alias")
    (tmp_path / "fake").mkdir()
    os.symlink(tmp_path / fmt.step_name(1) / fmt.MANIFEST, tmp_path / "fake" / fmt.MANIFEST)
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.mkdir()
    (outside / fmt.MANIFEST).write_bytes((tmp_path / fmt.step_name(1) / fmt.MANIFEST).read_bytes())
    os.symlink(outside, tmp_path / "elsewhere")
    return tmp_path


@pytest.mark.parametrize(
    "tag, found",
    [
        ("dataset", "it holds no manifest.json (only a commit writes one)"),
        ("notes", "expected a directory, found a regular file"),
        ("alias", "expected a directory, found a symbolic link"),
        ("elsewhere", "expected a directory, found a symbolic link"),
        ("fake", "manifest.json is a symbolic link, expected a regular file"),
        ("absent", None),
    ],
)
def test_delete_refuses_what_is_not_a_checkpoint(root, tag, found):
    before = tree(root)
    outside = tree(str(root) + "-outside")
    with Checkpointer(root, CheckpointConfig(**SMALL)) as ck:
        with pytest.raises(CheckpointNotFoundError) as raised:
            ck.delete(tag=tag)
        assert [i.name for i in ck.list()] == [fmt.step_name(1)]
        assert torch.equal(ck.load()["x"], torch.arange(4.0))
    if found is None:
        assert str(raised.value) == f"no checkpoint 'absent' in {str(root)!r}"
    else:
        assert str(raised.value) == (
            f"{root / tag} is not a checkpoint: "
            f"{'' if tag != 'fake' else str(root / tag) + '/'}"
            f"{found}; nothing was removed"
        )
    assert tree(root) == before and tree(str(root) + "-outside") == outside


def test_delete_removes_a_committed_and_a_damaged_checkpoint(root):
    with Checkpointer(root, CheckpointConfig(**SMALL)) as ck:
        ck.save({"x": torch.ones(4)}, step=2).wait(60)
        manifest = root / fmt.step_name(2) / fmt.MANIFEST
        data = bytearray(manifest.read_bytes())
        data[10] ^= 1
        manifest.write_bytes(bytes(data))
        assert fmt.step_name(2) in [d.name for d in ck.damaged()]
        ck.delete(step=2)
        assert fmt.step_name(2) not in [d.name for d in ck.damaged()]
        ck.delete(step=1)
        assert ck.list() == []
    left = sorted(os.listdir(root))
    assert left == ["alias", "dataset", "elsewhere", "fake", "latest", "notes"]


def test_delete_on_an_object_store_refuses_a_prefix_without_manifest(
    s3_server, s3_root, s3_storage_options
):
    client, bucket = s3_server.client(), s3_server.bucket
    prefix = s3_root.split("/", 3)[3]
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=s3_storage_options) as ck:
        ck.save({"x": torch.arange(4.0)}, step=1).wait(60)
        client.put_object(Bucket=bucket, Key=f"{prefix}/dataset/train.bin", Body=b"\x01" * 100)
        with pytest.raises(
            CheckpointNotFoundError,
            match=rf"no checkpoint 'dataset' in .*: no {s3_root}/dataset/"
            r"manifest.json; nothing was removed",
        ):
            ck.delete(tag="dataset")
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/dataset/train.bin")["Body"].read()
        assert body == b"\x01" * 100
        ck.delete(step=1)
        assert ck.list() == []
