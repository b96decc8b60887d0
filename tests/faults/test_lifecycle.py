"""Nothing hangs, nothing is swallowed: shutdown orders, dying threads, close() errors, leftovers.

Each test injects one failure into a library internal (by monkeypatching) or drives one lifecycle
order, and asserts on what reaches the caller (the exact error type and text) and on what is left
on disk. Every wait is bounded (``WAIT_S``), so a hang fails the test instead of the run.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings

import pytest
import torch

import datastates
import datastates.format.codec
import datastates.storage.posix
from datastates import (
    CheckpointerClosedError,
    CheckpointWriteError,
    DatastatesError,
    SerializationError,
)
from datastates.storage.posix import ShardWriter, remove_tree

from _faults_helpers import WAIT_S, hidden_entries, latest_temporaries, tmp_of, visible_entries
from datastates.storage.temporaries import name_key
from testkit import ROOMY, TWO_UNITS, random_tensors

STEP1, STEP2, STEP3 = "step-0000000001", "step-0000000002", "step-0000000003"


def _state(seed: int) -> dict:
    return {**random_tensors(seed, a=(64, 1024), b=4000), "note": f"seed {seed}"}


def _assert_loaded(ck, expected: dict, step: int) -> None:
    got = ck.load(step=step)
    assert got["note"] == expected["note"]
    for k in ("a", "b"):
        assert torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)), k


def _bounded(call) -> None:
    """Run ``call`` in a thread; fail (instead of hanging) if it does not return in WAIT_S."""
    errors = []

    def run():
        try:
            call()
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), f"{call} did not return within {WAIT_S} s (hang)"
    if errors:
        raise errors[0]


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


# ------------------------------------------------------------------ shutdown order


def test_owner_close_drains_a_sharers_queued_save(tmp_path):
    """The owner closes while a sharer's save of many units is queued behind a full cache: close
    waits for it (the stop signals queue behind its units), the save commits, the sharer then
    raises CheckpointerClosedError and closes at once."""
    owner = datastates.Checkpointer(tmp_path / "owner", TWO_UNITS)
    sharer = datastates.Checkpointer(tmp_path / "sharer", share=owner)
    state = _state(1)
    handle = sharer.save(state, step=1)
    _bounded(owner.close)
    assert handle.done()
    assert handle.wait(WAIT_S).name == STEP1
    with pytest.raises(CheckpointerClosedError, match="shares"):
        sharer.save(state, step=2)
    _bounded(sharer.close)
    with datastates.Checkpointer(tmp_path / "sharer") as again:
        _assert_loaded(again, state, 1)
        assert hidden_entries(again.directory) == []


def test_sharer_close_then_owner_close_with_saves_in_flight(tmp_path):
    owner = datastates.Checkpointer(tmp_path / "owner", TWO_UNITS)
    sharer = datastates.Checkpointer(tmp_path / "sharer", share=owner)
    s1, s2 = _state(1), _state(2)
    h_owner, h_sharer = owner.save(s1, step=1), sharer.save(s2, step=1)
    _bounded(sharer.close)
    assert h_sharer.done()
    _bounded(owner.close)
    assert h_owner.wait(WAIT_S).name == STEP1 and h_sharer.wait(WAIT_S).name == STEP1
    for root, expected in (("owner", s1), ("sharer", s2)):
        with datastates.Checkpointer(tmp_path / root) as again:
            _assert_loaded(again, expected, 1)


def test_use_after_close_raises_a_datastates_error(tmp_path):
    ck = datastates.Checkpointer(tmp_path, TWO_UNITS)
    ck.save(_state(1), step=1).wait(WAIT_S)
    ck.close()
    for call in (
        lambda: ck.save(_state(2), step=2),
        lambda: ck.load(),
        lambda: ck.restore(_state(3)),
        lambda: datastates.Checkpointer(tmp_path / "x", share=ck),
    ):
        with pytest.raises(CheckpointerClosedError) as info:
            call()
        assert isinstance(info.value, DatastatesError) and isinstance(info.value, RuntimeError)
        assert os.fspath(tmp_path) in str(info.value)


# ------------------------------------------------------------------ thread loops never die


def test_writer_thread_failure_fails_the_job_and_the_threads_live_on(tmp_path, monkeypatch):
    """A checksum that raises in a writer thread fails that save with the error (no hang); the
    writer threads survive and the next save commits."""
    real = datastates.format.codec.crc32

    def crc32(data, value=0):
        if threading.current_thread().name.startswith("datastates-writer"):
            raise RuntimeError("injected checksum failure")
        return real(data, value)

    with datastates.Checkpointer(tmp_path, ROOMY) as ck:
        monkeypatch.setattr(datastates.format.codec, "crc32", crc32)
        handle = ck.save(_state(1), step=1)
        with pytest.raises(RuntimeError, match="injected checksum failure"):
            handle.wait(WAIT_S)
        monkeypatch.undo()
        assert ck.list() == [] and hidden_entries(ck.directory) == []
        state = _state(2)
        ck.save(state, step=2).wait(WAIT_S)  # both writer threads still serve
        ck.save(_state(3), step=3).wait(WAIT_S)
        _assert_loaded(ck, state, 2)


def test_commit_thread_failure_fails_the_job_and_the_thread_lives_on(tmp_path, monkeypatch):
    """An unexpected exception while the commit thread finishes a file fails that save only."""
    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        monkeypatch.setattr(
            datastates.format.codec,
            "encode_index_items",
            lambda *a: (_ for _ in ()).throw(KeyError("injected index failure")),
        )
        with pytest.raises(KeyError, match="injected index failure"):
            ck.save(_state(1), step=1).wait(WAIT_S)
        monkeypatch.undo()
        state = _state(2)
        ck.save(state, step=2).wait(WAIT_S)
        _assert_loaded(ck, state, 2)
        assert [i.name for i in ck.list()] == [STEP2]


def test_wait_with_a_timeout_raises_timeouterror_and_the_save_still_commits(tmp_path, monkeypatch):
    """``wait(timeout)`` and ``wait_snapshot(timeout)`` on a save held up in its writer raise
    TimeoutError naming the checkpoint; the save commits once the writer goes on."""
    real, gate = datastates.format.codec.crc32, threading.Event()

    def crc32(data, value=0):
        if threading.current_thread().name.startswith("datastates-writer"):
            gate.wait(WAIT_S)
        return real(data, value)

    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        monkeypatch.setattr(datastates.format.codec, "crc32", crc32)
        state = _state(1)
        handle = ck.save(state, step=1)
        with pytest.raises(TimeoutError, match="'step-0000000001' not committed after"):
            handle.wait(timeout=0.01)
        gate.set()
        assert handle.wait(WAIT_S).name == "step-0000000001"
        handle.wait_snapshot(timeout=0.01)  # complete: returns at once
        _assert_loaded(ck, state, 1)


# ------------------------------------------------------------------ storage primitives


def test_direct_io_fallback_keeps_the_direct_descriptor_open(tmp_path, monkeypatch):
    """EINVAL from an O_DIRECT write switches to buffered writes without closing the O_DIRECT
    descriptor, which another writer thread may be using at that moment."""
    path = os.fspath(tmp_path / "f.dsf")
    writer = ShardWriter(path, "auto")
    if writer.direct_fd < 0:
        writer.close()
        pytest.skip("this file system refuses O_DIRECT")
    direct = writer.direct_fd
    real = datastates.storage.posix.pwrite_all

    def pwrite_all(fd, data, offset):
        if fd == direct:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, offset)

    monkeypatch.setattr(datastates.storage.posix, "pwrite_all", pwrite_all)
    buf = torch.zeros(8192 + 4096, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 4096
    block = buf[start : start + 8192]
    block[:5000] = 7
    view = datastates.storage.posix.buffer_of(block)
    writer.write(view[:5000], 0, view)
    assert os.fstat(direct).st_ino == os.stat(path).st_ino, "the O_DIRECT descriptor was closed"
    writer.write(view[:5000], 8192, view)  # later writes go through the buffered descriptor
    monkeypatch.undo()
    writer.finish(False, 8192 + 5000)
    writer.close()
    with open(path, "rb") as f:
        data = f.read()
    assert data == bytes([7]) * 5000 + bytes(8192 - 5000) + bytes([7]) * 5000


def _failing_unlink(monkeypatch, name_part: str):
    real = os.unlink

    def unlink(path, *args, dir_fd=None, **kwargs):
        full = os.fspath(path)
        if dir_fd is not None:
            full = os.path.join(_fd_path(dir_fd), full)
            kwargs["dir_fd"] = dir_fd
        if name_part in full:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), full)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def test_remove_tree_raises_naming_what_it_could_not_remove(tmp_path, monkeypatch):
    root = tmp_path / "tree"
    (root / "sub").mkdir(parents=True)
    for name in ("a.bin", "stuck.bin", "sub/c.bin"):
        (root / name).write_bytes(b"x")
    _failing_unlink(monkeypatch, "stuck")
    with pytest.raises(OSError) as info:
        remove_tree(os.fspath(root))
    assert info.value.errno == errno.EACCES and "stuck.bin" in str(info.value)
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["stuck.bin"]  # everything else was removed
    remove_tree(os.fspath(root))
    assert not root.exists()
    remove_tree(os.fspath(root))  # a missing tree is not an error


def test_retention_failure_warns_naming_the_path_and_is_retried(tmp_path, monkeypatch):
    """keep_last=1: the old checkpoint is renamed away but its files cannot be deleted. The new
    save commits, a RuntimeWarning names the leftover, and the next retention removes it."""
    with datastates.Checkpointer(tmp_path, TWO_UNITS.replace(keep_last=1)) as ck:
        ck.save(_state(1), step=1).wait(WAIT_S)
        _failing_unlink(monkeypatch, ".trash.")
        state = _state(2)
        with pytest.warns(RuntimeWarning, match=r"retention.*'step-0000000001'.*\.trash\."):
            ck.save(state, step=2).wait(WAIT_S)
        monkeypatch.undo()
        assert [i.name for i in ck.list()] == [STEP2]
        assert [n for n in hidden_entries(ck.directory) if n.startswith(".trash.")]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.save(_state(3), step=3).wait(WAIT_S)
        assert [i.name for i in ck.list()] == [STEP3]
        assert hidden_entries(ck.directory) == []


def test_close_error_of_the_shard_file_fails_the_save(tmp_path, monkeypatch):
    """NFS reports deferred write errors at close(): the save fails with that error, nothing is
    committed, nothing is left behind, and the next save commits."""
    real = os.close
    fired = []

    def close(fd):
        path = _fd_path(fd)
        real(fd)
        if path.endswith(".dsf") and threading.current_thread().name == "datastates-commit":
            fired.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    with datastates.Checkpointer(tmp_path, TWO_UNITS.replace(io_mode="buffered")) as ck:
        monkeypatch.setattr(os, "close", close)
        handle = ck.save(_state(1), step=1)
        with pytest.raises(CheckpointWriteError) as info:
            handle.wait(WAIT_S)
        monkeypatch.undo()
        assert len(fired) == 1 and info.value.errno == errno.EIO
        assert f"closing {fired[0]}" in str(info.value)
        assert ck.list() == [] and hidden_entries(ck.directory) == []
        state = _state(2)
        ck.save(state, step=2).wait(WAIT_S)
        _assert_loaded(ck, state, 2)


# ------------------------------------------------------------------ temporaries


def test_latest_update_failure_leaves_no_temporary(tmp_path, monkeypatch):
    """The checkpoint commits, writing the new ``latest`` hits ENOSPC: a warning, the save
    succeeds, and no ``latest.tmp.*`` is left."""
    real = datastates.storage.posix.pwrite_all

    def pwrite_all(fd, data, offset):
        if os.path.basename(_fd_path(fd)).startswith("latest.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        ck.save(_state(1), step=1).wait(WAIT_S)
        monkeypatch.setattr(datastates.storage.posix, "pwrite_all", pwrite_all)
        with pytest.warns(RuntimeWarning, match="latest"):
            assert ck.save(_state(2), step=2).wait(WAIT_S).name == STEP2
        monkeypatch.undo()
        assert latest_temporaries(ck.directory) == []
        assert visible_entries(ck.directory) == [STEP1, STEP2]


def test_failed_rename_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """The rename of the temporary directory into place fails: the save fails, and neither this
    Checkpointer nor a second one in the same (live) process finds a ``.tmp.*`` left."""
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if tmp_of(os.path.basename(os.fspath(src)), STEP2):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(src))
        return real(src, dst, *args, **kwargs)

    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        ck.save(_state(1), step=1).wait(WAIT_S)
        monkeypatch.setattr(os, "rename", rename)
        with pytest.raises(CheckpointWriteError):
            ck.save(_state(2), step=2).wait(WAIT_S)
        monkeypatch.undo()
        assert hidden_entries(ck.directory) == []
    with datastates.Checkpointer(tmp_path, TWO_UNITS) as second:
        assert hidden_entries(second.directory) == []
        assert [i.name for i in second.list()] == [STEP1]


def test_undeletable_temporary_of_a_failed_save_is_removed_later(tmp_path, monkeypatch):
    """The rename fails and so does the removal of the temporary directory (a transient
    permission or I/O problem): a warning names it, and the next save of the same process removes
    it (temporaries of a live process are not touched by other Checkpointers)."""
    real_rename, real_rmdir = os.rename, os.rmdir

    def rename(src, dst, *args, **kwargs):
        if tmp_of(os.path.basename(os.fspath(src)), STEP2):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(src))
        return real_rename(src, dst, *args, **kwargs)

    def rmdir(path, *args, **kwargs):
        if tmp_of(os.path.basename(os.fspath(path)), STEP2):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_rmdir(path, *args, **kwargs)

    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        ck.save(_state(1), step=1).wait(WAIT_S)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "rmdir", rmdir)
        with pytest.warns(
            RuntimeWarning,
            match=rf"\.tmp\.[0-9a-f]{{16}}-\d+\.{name_key(STEP2)}.*could not be removed",
        ):
            with pytest.raises(CheckpointWriteError):
                ck.save(_state(2), step=2).wait(WAIT_S)
        assert [n for n in hidden_entries(ck.directory) if tmp_of(n, STEP2)]
        monkeypatch.undo()
        ck.save(_state(3), step=3).wait(WAIT_S)
        assert hidden_entries(ck.directory) == []
        assert [i.name for i in ck.list()] == [STEP1, STEP3]


@pytest.mark.parametrize("exchange", ["fails", "unsupported"])
def test_failed_rename_of_a_replacement_keeps_the_old_checkpoint(tmp_path, monkeypatch, exchange):
    """overwrite=True and the exchange of the two directories fails (nothing changes), or the
    file system cannot exchange them and the rename of the new directory fails: the replaced
    checkpoint stays, or is put back at once (not left as ``.old.*`` until some later
    Checkpointer opens the directory)."""
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if tmp_of(os.path.basename(os.fspath(src)), STEP1):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(src))
        return real(src, dst, *args, **kwargs)

    def exchanged(a, b):
        if exchange == "unsupported":
            return False
        raise OSError(errno.EIO, os.strerror(errno.EIO), a)

    old = _state(1)
    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        ck.save(old, step=1).wait(WAIT_S)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(datastates.storage.posix, "exchange", exchanged)
        with pytest.raises(CheckpointWriteError):
            ck.save(_state(2), step=1, overwrite=True).wait(WAIT_S)
        monkeypatch.undo()
        assert hidden_entries(ck.directory) == []
        _assert_loaded(ck, old, 1)


def test_an_overwrite_never_leaves_the_name_without_a_checkpoint(tmp_path, monkeypatch):
    """Between any two renames of an overwrite (the exchange counts as one), ``root/<name>``
    holds a complete checkpoint, the old one or the new one: a reader of the name never finds
    it missing. With the exchange unavailable (two renames), the name is missing in between:
    the check below sees that, so it can fail."""
    seen = []
    name = os.path.join(tmp_path, "best")

    def watched(real):
        def call(*args, **kwargs):
            done = real(*args, **kwargs)
            try:
                seen.append(datastates.commit.catalog.examine(name)[0].name)
            except AttributeError:  # examine found nothing there
                seen.append(None)
            return done

        return call

    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        ck.save(_state(1), tag="best").wait(WAIT_S)
        for exchange in (datastates.storage.posix.exchange, lambda a, b: False):
            monkeypatch.setattr(os, "rename", watched(os.rename))
            monkeypatch.setattr(datastates.storage.posix, "exchange", watched(exchange))
            ck.save(_state(2), tag="best", overwrite=True).wait(WAIT_S)
            monkeypatch.undo()
            if exchange is not datastates.storage.posix.exchange:
                assert None in seen  # two renames: the name was missing in between
            else:
                assert seen and None not in seen, seen
            seen.clear()
        got = ck.load(tag="best")
        assert got["note"] == _state(2)["note"] and torch.equal(got["a"], _state(2)["a"])


# ------------------------------------------------------------------ fail inside save()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_dtype_fails_inside_save_naming_the_key(tmp_path):
    with datastates.Checkpointer(tmp_path, TWO_UNITS) as ck:
        with pytest.raises(SerializationError) as info:
            ck.save(
                {"ok": torch.ones(3), "inner": {"z": torch.zeros(3, dtype=torch.complex32)}}, step=1
            )
        assert "'inner/z'" in str(info.value) and "complex32" in str(info.value)
        assert isinstance(info.value, TypeError)
        assert ck.storage._pending == [] and os.listdir(ck.directory) == []
        ck.save({"ok": torch.ones(3)}, step=1).wait(WAIT_S)
