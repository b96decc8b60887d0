"""A checkpoint replaced by another process while it is read (a tag overwritten between reading
its manifest and its shard files, on a local disk and on an object store): ``load()`` and
``restore()`` find it again and read the new one, with a WARNING and ``RestoreReport.rereads``;
``restore(fallback=True)`` never moves the new checkpoint aside as damaged. Real damage is not
taken for a replacement: it raises at once. A listing (``latest()``) during another process's
commit or overwrite finds the old checkpoint or the new one, and names no damage."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import datastates
from datastates import CheckpointConfig, Checkpointer, CorruptCheckpointError
from datastates.format import codec as fmt
from datastates.restore import opened as opened_module
from datastates.storage import s3 as s3_module

from _faults_helpers import assert_bit_exact
from testkit import filled_tensors

# slow: another process commits while this one reads
pytestmark = pytest.mark.slow

SMALL = dict(host_cache_bytes=256 << 10, chunk_bytes=16 << 10)


def _state(value: float) -> dict:
    return {**filled_tensors(value, w=1000, b=10), "note": value}


def _warnings(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "datastates" and r.levelno == logging.WARNING and text in r.getMessage()
    ]


def _overwrite_on_read(
    monkeypatch, root, options, times: int = 1, where: str = "open", first: float = 10.0
):
    """At each of the first ``times`` reads of a shard file (``where``: when it is opened, or
    at its ranged GETs on an object store), another Checkpointer overwrites ``best`` with the
    next value from ``first``; returns that Checkpointer and the values written."""
    written = []
    other = Checkpointer(root, CheckpointConfig(**SMALL), storage_options=options)

    def overwrite():
        if len(written) < times:
            written.append(first + len(written))
            other.save(_state(written[-1]), tag="best", overwrite=True).wait(60)

    if where == "open":
        real = opened_module.ShardFiles._check_size

        def check_size(self, file_id):
            overwrite()
            return real(self, file_id)

        monkeypatch.setattr(opened_module.ShardFiles, "_check_size", check_size)
    else:
        real = s3_module.S3ReadFile.read_into

        def read_into(self, views, offset):
            overwrite()
            return real(self, views, offset)

        monkeypatch.setattr(s3_module.S3ReadFile, "read_into", read_into)
    return other, written


def _check_rereads(ck, monkeypatch, root, options, caplog, where):
    ck.save(_state(1.0), tag="best").wait(60)
    other, written = _overwrite_on_read(monkeypatch, root, options, times=1, where=where)
    with other:
        caplog.clear()
        assert ck.load(tag="best")["note"] == 10.0
        assert len(_warnings(caplog, "was replaced or deleted by another process")) == 1
        monkeypatch.undo()
        again, more = _overwrite_on_read(monkeypatch, root, options, where=where, first=20.0)
        with again:
            live = _state(0.0)
            report = ck.restore(live, tag="best")
        assert len(report.rereads) == 1 and report.rereads[0].startswith("best: ")
        assert torch.equal(live["w"], torch.full((1000,), 20.0)) and live["note"] == 20.0
    assert written == [10.0] and more == [20.0]


def test_a_tag_overwritten_while_read_is_read_again(tmp_path, monkeypatch, caplog):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        _check_rereads(ck, monkeypatch, tmp_path, None, caplog, "open")


def test_an_object_store_tag_overwritten_while_read_is_read_again(
    s3_root, s3_storage_options, monkeypatch, caplog
):
    """The old data directory is deleted by the overwrite: the ranged GET of an opened shard
    file finds no object (CheckpointNotFoundError, not a bare FileNotFoundError)."""
    with Checkpointer(s3_root, CheckpointConfig(**SMALL), storage_options=s3_storage_options) as ck:
        _check_rereads(ck, monkeypatch, s3_root, s3_storage_options, caplog, "get")


def test_rereads_are_bounded(tmp_path, monkeypatch, caplog):
    """Replaced at every read: three reads again, then the error."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.save(_state(1.0), tag="best").wait(60)
        other, written = _overwrite_on_read(monkeypatch, tmp_path, None, times=10)
        with other:
            caplog.clear()
            with pytest.raises((CorruptCheckpointError, datastates.CheckpointNotFoundError)):
                ck.restore(_state(0.0), tag="best")
        assert len(written) >= 4  # (a read may open its file more than once)
        assert len(_warnings(caplog, "was replaced or deleted by another process")) == 3


def test_real_damage_is_not_read_again(tmp_path, caplog):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.save(_state(1.0), tag="best").wait(60)
        path = tmp_path / "best" / fmt.shard_file_name(0)
        with open(path, "r+b") as f:
            f.seek(fmt.HEADER_BYTES)
            byte = f.read(1)
            f.seek(fmt.HEADER_BYTES)
            f.write(bytes([byte[0] ^ 0xFF]))
        caplog.clear()
        with pytest.raises(CorruptCheckpointError):
            ck.load(tag="best")
        assert _warnings(caplog, "replaced") == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_fallback_restore_never_moves_aside_a_checkpoint_replaced_while_read(
    where, tmp_path, monkeypatch, caplog, request
):
    """The newest checkpoint (``best``) is overwritten while a fallback restore reads it: the
    restore falls back (``best`` in ``skipped``, moved nowhere) and the new ``best`` stays
    listed and intact."""
    if where == "s3":
        root, options = (
            request.getfixturevalue("s3_root"),
            request.getfixturevalue("s3_storage_options"),
        )
    else:
        root, options = tmp_path, None
    with Checkpointer(
        root, CheckpointConfig(keep_last=None, **SMALL), storage_options=options
    ) as ck:
        ck.save(_state(1.0), step=1).wait(60)
        ck.save(_state(2.0), tag="best").wait(60)
        other, written = _overwrite_on_read(
            monkeypatch, root, options, times=1, where="open" if where == "local" else "get"
        )
        with other:
            caplog.clear()
            report = ck.restore(_state(0.0), fallback=True)
        monkeypatch.undo()
        assert [(s.name, s.quarantined) for s in report.skipped] == [("best", None)]
        assert report.name in (fmt.step_name(1), "best")
        assert len(_warnings(caplog, "what is there now is not moved aside")) == (
            report.name != "best"
        )
        assert sorted(i.name for i in ck.list()) == ["best", fmt.step_name(1)]
        assert ck.load(tag="best")["note"] == written[0] == 10.0
        if where == "local":
            assert not [n for n in os.listdir(root) if n.startswith(".damaged.")]


def test_several_ranks_never_read_again_on_their_own(tmp_path, monkeypatch, caplog):
    """Two ranks restore ``best`` while another process overwrites it during the first shard
    read: the rank that meets the new files raises (a rank re-reading alone could restore
    another commit than its peers); none reads again."""
    from thread_ranks import in_thread_ranks

    small = CheckpointConfig(**SMALL)
    saved = in_thread_ranks(
        str(tmp_path),
        2,
        lambda ck, r: ck.save(_state(1.0), tag="best", replicated=["w", "b", "note"]).wait(60),
        config=small,
    )
    assert not [e for e in saved.values() if isinstance(e, BaseException)], saved
    other, written = _overwrite_on_read(monkeypatch, tmp_path, None)
    with other:
        caplog.clear()
        out = in_thread_ranks(
            str(tmp_path), 2, lambda ck, r: ck.restore(_state(0.0), tag="best"), config=small
        )
    assert written == [10.0]
    failed = [r for r, got in out.items() if isinstance(got, BaseException)]
    assert failed and all(
        isinstance(out[r], (CorruptCheckpointError, datastates.CheckpointNotFoundError))
        for r in failed
    ), out
    assert all(got.rereads == [] for got in out.values() if not isinstance(got, BaseException))
    assert _warnings(caplog, "finding and reading it again") == []


def test_a_reader_between_the_two_renames_of_an_overwrite_finds_the_old_checkpoint(
    tmp_path, monkeypatch
):
    """Where the file system cannot exchange two directories (NFS, FUSE: here a C library
    without ``renameat2``), an overwrite renames the old checkpoint to ``.old.``, then the new one
    into place. A reader on another thread, with its own Checkpointer, that opens the root
    between the two renames finds the old checkpoint -- as the latest, by step, by tag --
    bit-exact; once the second rename is done, the new one."""
    from datastates.storage import posix

    monkeypatch.setattr(posix, "_renameat2", None)
    moved_aside, resume = threading.Event(), threading.Event()
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):  # the overwrite pauses between its two renames
        real_rename(src, dst, *args, **kwargs)
        if os.path.basename(dst).startswith(".old.") and not moved_aside.is_set():
            moved_aside.set()
            assert resume.wait(60)

    config = CheckpointConfig(**SMALL)
    with Checkpointer(tmp_path, config) as writer, Checkpointer(tmp_path, config) as reader:
        writer.save(_state(3.0), tag="best", step=0).wait(60)  # older than step 1
        writer.save(_state(1.0), step=1).wait(60)
        monkeypatch.setattr(os, "rename", rename)
        handle = writer.save(_state(2.0), step=1, overwrite=True)
        try:
            assert moved_aside.wait(60)
            assert not (tmp_path / fmt.step_name(1)).exists()  # between the two renames
            with Checkpointer(tmp_path, config) as opened:  # opening the root puts nothing back
                assert opened.latest().name == fmt.step_name(1)
                assert_bit_exact(opened.load(), _state(1.0))
            assert [i.name for i in reader.list()] == ["best", fmt.step_name(1)]
            assert_bit_exact(reader.load(step=1), _state(1.0))
            live = _state(0.0)
            assert reader.restore(live).name == fmt.step_name(1)
            assert_bit_exact(live, _state(1.0))
        finally:
            resume.set()
        handle.wait(60)
        monkeypatch.undo()
        assert_bit_exact(reader.load(step=1), _state(2.0))
        assert_bit_exact(reader.load(), _state(2.0))
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".old.", ".tmp.", ".trash."))]


#: Another process saves ``_state(2.0)`` as ``argv[2]`` (overwrite=True). With ``pause``, as a
#: file system that cannot exchange two directories, and it reads a line of its stdin before
#: it renames the old checkpoint to ``.old.``, then says ``moved`` and reads another line.
_WRITER = """
import os, sys, torch
from datastates import Checkpointer, CheckpointConfig
from datastates.storage import posix
root, tag, pause = sys.argv[1], sys.argv[2], sys.argv[3] == "pause"
if pause:
    posix._renameat2 = None
    real_rename = os.rename
    def rename(src, dst, *args, **kwargs):
        if not os.path.basename(dst).startswith(".old."):
            return real_rename(src, dst, *args, **kwargs)
        sys.stdin.readline()
        real_rename(src, dst, *args, **kwargs)
        print("moved", flush=True)
        sys.stdin.readline()
    os.rename = rename
state = {"w": torch.full((1000,), 2.0), "b": torch.full((10,), 2.0), "note": 2.0}
with Checkpointer(root, CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=16 << 10)) as ck:
    ck.save(state, tag=tag, overwrite=True).wait(60)
"""


def test_a_checkpoint_committed_by_another_process_during_latest_is_no_damage(
    tmp_path, monkeypatch, caplog
):
    """Another process commits ``new`` after ``latest()`` listed the root and before it looks
    for folders without a manifest: ``latest()`` returns the checkpoint its listing found and
    names no damage (it named ``new`` as holding shard files but no manifest.json); the next
    call returns ``new``. A folder that stays without a manifest is still named."""
    from datastates.commit.catalog import Catalog

    real = Catalog.passed_over

    def passed_over(self, used):
        subprocess.run(
            [sys.executable, "-c", _WRITER, self.root, "new", "-"], check=True, timeout=120
        )
        return real(self, used)

    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.save(_state(1.0), tag="old").wait(60)
        monkeypatch.setattr(Catalog, "passed_over", passed_over)
        caplog.clear()
        assert ck.latest().name == "old"
        monkeypatch.undo()
        assert _warnings(caplog, "passed over") == []
        assert ck.latest().name == "new"
        assert_bit_exact(ck.load(), _state(2.0))
        (tmp_path / "new" / fmt.MANIFEST).unlink()  # real damage: named
        assert ck.latest().name == "old"
        assert len(_warnings(caplog, "passed over the damaged checkpoint new")) == 1


def test_a_listing_that_meets_an_overwrite_between_its_two_renames_lists_again(
    tmp_path, monkeypatch, caplog
):
    """Another process overwrites ``best`` (the newest) by two renames, the first one just
    after ``latest()`` listed the root and before it looked at ``best``: the listing is done
    again, finds the old ``best`` at its ``.old.`` name and returns it (it returned the older
    ``step_1``, with no word); once the overwrite is done, the new one. No damage is named."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.save(_state(1.0), step=1).wait(60)
        ck.save(_state(3.0), tag="best").wait(60)
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, ck.directory, "best", "pause"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        real_listdir, armed = os.listdir, [True]

        def listdir(path="."):
            names = real_listdir(path)
            if armed and os.fspath(path) == ck.directory:
                armed.clear()  # the root is listed: the overwrite moves best aside now
                writer.stdin.write("go\n")
                writer.stdin.flush()
                assert writer.stdout.readline() == "moved\n"
            return names

        try:
            monkeypatch.setattr(os, "listdir", listdir)
            caplog.clear()
            found = ck.latest()
            monkeypatch.undo()
            assert not armed and not (tmp_path / "best").exists()  # between the two renames
            assert found.name == "best" and found.seq == ck.list()[-1].seq
            assert_bit_exact(ck.load(), _state(3.0))
        finally:
            monkeypatch.undo()
            writer.stdin.write("resume\n")
            writer.stdin.close()
        assert writer.wait(120) == 0
        assert ck.latest().name == "best"
        assert_bit_exact(ck.load(), _state(2.0))
        assert _warnings(caplog, "passed over") == []
