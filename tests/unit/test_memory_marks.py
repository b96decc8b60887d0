"""The keeper's marks (datastates/memory/marks.py): a memory checkpoint checked after its last
write is read back without checksums; any change to it, or any doubt about the mark, and it is
checked again."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import datastates
from datastates.directory import TierCheckpointer, TierPolicy
from datastates.memory import marks

STATE = {"w": torch.arange(70_000, dtype=torch.float32), "n": torch.arange(5)}


@pytest.fixture
def memdir(tmp_path):
    """A memory directory's layout: ``ckpt/`` holds steps 1 and 2."""
    with datastates.Checkpointer(
        tmp_path / "ckpt", datastates.CheckpointConfig(chunk_bytes=64 << 10)
    ) as ck:
        for step in (1, 2):
            ck.save(STATE, step=step).wait()
        infos = ck.list()
    return str(tmp_path), infos


def _shard(info) -> str:
    return next(os.path.join(info.path, n) for n in os.listdir(info.path) if n.endswith(".dsf"))


def test_the_newest_is_checked_and_marked(memdir):
    root, (one, two) = memdir
    assert not marks.holds(root, two)
    assert marks.verify_newest(root, os.path.join(root, "ckpt")).name == two.name
    assert marks.holds(root, two) and not marks.holds(root, one)
    assert os.listdir(os.path.join(root, marks.MARKS)) == [two.name]
    mark = json.loads(open(os.path.join(root, marks.MARKS, two.name)).read())
    assert sorted(mark["files"]) == sorted(n for n in os.listdir(two.path) if n.endswith(".dsf"))


def test_a_write_after_the_check_voids_the_mark_even_with_its_mtime_set_back(memdir):
    root, (_, two) = memdir
    marks.verify_newest(root, os.path.join(root, "ckpt"))
    path = _shard(two)
    st = os.stat(path)
    with open(path, "r+b") as f:  # the same byte written back: only the times change
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(byte)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert not marks.holds(root, two)  # its change time moved


def test_a_changed_manifest_voids_the_mark(memdir):
    root, (_, two) = memdir
    marks.verify_newest(root, os.path.join(root, "ckpt"))
    manifest = os.path.join(two.path, "manifest.json")
    data = open(manifest, "rb").read()
    with open(manifest, "wb") as f:
        f.write(data + b" ")
    assert not marks.holds(root, two)


@pytest.mark.parametrize(
    "mark", [b"", b"{", b"[]", b'{"name": "x", "manifest": 1, "files": {}}', b"nul\0", "link"]
)
def test_a_mark_that_is_not_one_holds_nothing(memdir, mark):
    root, (_, two) = memdir
    marks.verify_newest(root, os.path.join(root, "ckpt"))
    path = os.path.join(root, marks.MARKS, two.name)
    if mark == "link":  # a link to a genuine mark is not one either
        os.replace(path, path + ".real")
        os.symlink(path + ".real", path)
    else:
        with open(path, "wb") as f:
            f.write(mark)
    assert not marks.holds(root, two)


def test_a_mark_copied_to_another_checkpoint_holds_nothing(memdir):
    root, (one, two) = memdir
    marks.verify_newest(root, os.path.join(root, "ckpt"))
    os.link(os.path.join(root, marks.MARKS, two.name), os.path.join(root, marks.MARKS, one.name))
    assert not marks.holds(root, one)


def test_a_damaged_newest_is_not_marked(memdir, caplog):
    root, (_, two) = memdir
    path = _shard(two)
    with open(path, "r+b") as f:
        f.seek(8192)
        byte = f.read(1)
        f.seek(8192)
        f.write(bytes([byte[0] ^ 1]))
    with caplog.at_level(logging.WARNING, logger="datastates"):
        assert marks.verify_newest(root, os.path.join(root, "ckpt")) is None
    assert "does not verify" in caplog.text and two.name in caplog.text
    assert not os.path.exists(os.path.join(root, marks.MARKS, two.name))


def test_marks_of_checkpoints_that_are_gone_are_removed(memdir):
    root, (one, two) = memdir
    marks.verify_newest(root, os.path.join(root, "ckpt"))
    with datastates.Checkpointer(os.path.join(root, "ckpt")) as ck:
        ck.delete(step=2)
        ck.save(STATE, step=3).wait()
        three = ck.latest()
    assert marks.verify_newest(root, os.path.join(root, "ckpt")).name == three.name
    assert os.listdir(os.path.join(root, marks.MARKS)) == [three.name]


def test_a_prechecked_restore_reads_without_checksums_and_says_so(memdir):
    """The policy the memory tier gives its TierCheckpointer: a candidate whose mark holds is
    read with verify off, and the report says so; without it, the same restore checks."""
    root, (_, two) = memdir
    marks.verify_newest(root, os.path.join(root, "ckpt"))
    prechecked = TierPolicy(optimistic=True, prechecked=lambda info: marks.holds(root, info))
    live = {k: torch.zeros_like(v) for k, v in STATE.items()}
    with TierCheckpointer(os.path.join(root, "ckpt"), policy=prechecked) as ck:
        report = ck.restore(live, fallback=True)
        assert report.prechecked and report.step == 2
        assert all(torch.equal(live[k], STATE[k]) for k in STATE)
    with TierCheckpointer(os.path.join(root, "ckpt"), policy=TierPolicy(optimistic=True)) as ck:
        report = ck.restore(live, fallback=True)
        assert not report.prechecked and report.step == 2


def test_a_newest_that_storage_has_passed_is_not_checked(memdir, tmp_path):
    """Storage holds a newer step than memory's newest: a restore of the latest reads storage,
    so the keeper does not spend the check (and marks nothing)."""
    root, (_, two) = memdir
    with datastates.Checkpointer(tmp_path / "storage") as ck:
        ck.save(STATE, step=3).wait()
    assert marks.verify_newest(root, os.path.join(root, "ckpt"), str(tmp_path / "storage")) is None
    assert not marks.holds(root, two)
    with datastates.Checkpointer(tmp_path / "older") as ck:
        ck.save(STATE, step=2).wait()  # a tie: memory is read, so it is checked
    assert (
        marks.verify_newest(root, os.path.join(root, "ckpt"), str(tmp_path / "older")).name
        == two.name
    )


def test_a_planted_marks_link_is_refused(memdir, tmp_path):
    """``verified`` as a link to another directory: nothing is written or removed there."""
    root, (_, two) = memdir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep-me").write_text("x")
    os.symlink(elsewhere, os.path.join(root, marks.MARKS))
    assert marks.verify_newest(root, os.path.join(root, "ckpt")).name == two.name
    assert not marks.holds(root, two)  # not marked: its restore checksums
    assert os.listdir(elsewhere) == ["keep-me"]
