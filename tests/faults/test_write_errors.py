"""Injected I/O failures (disk full, EIO, permission denied) in every stage of a save.

Each failure must reach the save's handle as ``CheckpointWriteError`` (an ``OSError``), leave the
previous checkpoint bit-exact and the directory without the failed checkpoint or its temporaries,
never hang or raise in the training loop, and leave the Checkpointer usable for the next save.
Failures are injected by wrapping the system calls the library makes (``os.pwrite`` through
``storage.pwrite_all``, ``os.fsync``, ``os.ftruncate``, ``os.open``, ``os.rename``...), keyed on
the file they touch so the rest of the process is unaffected.
"""

from __future__ import annotations

import copy
import errno
import gc
import os
import threading
import warnings

import pytest
import torch

import datastates
import datastates.storage.posix
from datastates import CheckpointWriteError
from datastates.storage.temporaries import name_key

from _faults_helpers import WAIT_S, assert_bit_exact, hidden_entries, visible_entries
from testkit import SMALL

STEP1, STEP2 = "step-0000000001", "step-0000000002"


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Faults:
    """Makes the n-th matching system call fail with an OSError (and every later one if
    ``sticky``). ``calls`` counts the matching calls seen."""

    def __init__(self, monkeypatch, root):
        self.mp, self.root = monkeypatch, os.path.realpath(root)
        self.lock = threading.Lock()
        self.calls = 0
        self.fired = 0

    def _should_fail(self, nth: int, sticky: bool) -> bool:
        with self.lock:
            self.calls += 1
            if self.calls == nth or (sticky and self.calls > nth):
                self.fired += 1
                return True
            return False

    def _inside(self, path: str, name_part: str) -> bool:
        return path.startswith(self.root) and name_part in os.path.basename(path)

    def writes(
        self,
        name_part: str,
        nth: int = 1,
        err: int = errno.ENOSPC,
        sticky=True,
        thread: str | None = None,
    ):
        """``pwrite_all`` on a file whose name contains ``name_part`` (data, index, manifest...),
        from threads whose name starts with ``thread`` if given."""
        real = datastates.storage.posix.pwrite_all

        def pwrite_all(fd, data, offset):
            if (
                self._inside(_fd_path(fd), name_part)
                and (thread is None or threading.current_thread().name.startswith(thread))
                and self._should_fail(nth, sticky)
            ):
                raise OSError(err, os.strerror(err))
            return real(fd, data, offset)

        self.mp.setattr(datastates.storage.posix, "pwrite_all", pwrite_all)

    def fd_call(self, name: str, name_part: str, nth: int = 1, err: int = errno.EIO):
        """``os.fsync`` / ``os.ftruncate`` on a file (or directory) matching ``name_part``."""
        real = getattr(os, name)

        def call(fd, *args):
            path = _fd_path(fd)
            match = (
                (path.rstrip("/") == self.root)
                if name_part == "<root>"
                else self._inside(path, name_part)
            )
            if match and self._should_fail(nth, False):
                raise OSError(err, os.strerror(err))
            return real(fd, *args)

        self.mp.setattr(os, name, call)

    def path_call(
        self, name: str, name_part: str, nth: int = 1, err: int = errno.EACCES, arg: int = 0
    ):
        """``os.open`` / ``os.rename`` / ``os.replace`` / ``os.mkdir`` whose ``arg``-th path
        argument matches ``name_part``."""
        real = getattr(os, name)

        def call(*args, **kwargs):
            path = os.fspath(args[arg])
            if self._inside(os.path.realpath(path), name_part) and self._should_fail(nth, False):
                raise OSError(err, os.strerror(err), path)
            return real(*args, **kwargs)

        self.mp.setattr(os, name, call)


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    extra = {"big": torch.randn(96, 1024), "ints": torch.arange(5000), "note": {("a", 1): "x"}}
    return model, opt, extra


def _train_step(model, opt) -> None:
    loss = model(torch.randn(16, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _state(model, opt, extra) -> dict:
    return {"model": model, "opt": opt, "extra": extra}


def _snapshot(model, opt, extra) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "extra": extra})


def _assert_restores(ck, reference, step=None) -> None:
    """Restore into a differently initialized copy and compare bit-exactly with ``reference``."""
    model, opt, extra = make_training(seed=123)
    ck.restore(_state(model, opt, extra), step=step)
    assert_bit_exact(model.state_dict(), reference["model"], "model")
    assert_bit_exact(opt.state_dict(), reference["opt"], "opt")
    for k in ("big", "ints"):
        assert_bit_exact(extra[k], reference["extra"][k], k)


# name -> (installer, expected errno). Every one fails before the checkpoint becomes visible.
BEFORE_COMMIT = {
    "first-data-write-enospc": (lambda f: f.writes(".dsf", 1), errno.ENOSPC),
    "later-data-write-enospc": (lambda f: f.writes(".dsf", 5, thread=None), errno.ENOSPC),
    "data-write-eio-once": (lambda f: f.writes(".dsf", 3, errno.EIO, sticky=False), errno.EIO),
    "object-blob-write": (lambda f: f.writes(".dsf", 1, thread="datastates-commit"), errno.ENOSPC),
    "index-write": (lambda f: f.writes(".dsf", 2, thread="datastates-commit"), errno.ENOSPC),
    "header-write": (lambda f: f.writes(".dsf", 3, thread="datastates-commit"), errno.ENOSPC),
    "shard-ftruncate": (lambda f: f.fd_call("ftruncate", ".dsf", err=errno.ENOSPC), errno.ENOSPC),
    "shard-fsync": (lambda f: f.fd_call("fsync", ".dsf"), errno.EIO),
    "manifest-write": (lambda f: f.writes("manifest.json.tmp", 1), errno.ENOSPC),
    "manifest-fsync": (lambda f: f.fd_call("fsync", "manifest.json.tmp"), errno.EIO),
    "manifest-rename": (lambda f: f.path_call("replace", "manifest.json.tmp"), errno.EACCES),
    "directory-rename": (
        lambda f: f.path_call("rename", "." + name_key("step-0000000002")),
        errno.EACCES,
    ),
    "shard-open-eacces": (lambda f: f.path_call("open", ".dsf"), errno.EACCES),
    "tmp-mkdir-eacces": (
        lambda f: f.path_call("mkdir", "." + name_key("step-0000000002")),
        errno.EACCES,
    ),
}


# Failures raised as the raw OSError instead of CheckpointWriteError (see the report).
def _before_commit_params():
    for name in BEFORE_COMMIT:
        yield pytest.param(name, id=name)


@pytest.fixture
def ck(tmp_path, small_config):
    with datastates.Checkpointer(tmp_path / "ck", small_config) as ck:
        yield ck


def _save_reference(ck):
    model, opt, extra = make_training()
    ck.save(_state(model, opt, extra), step=1).wait(WAIT_S)
    return (model, opt, extra), _snapshot(model, opt, extra)


def _check_failed_save(ck, monkeypatch, install, expected_errno) -> None:
    (model, opt, extra), reference = _save_reference(ck)
    faults = Faults(monkeypatch, ck.directory)
    install(faults)
    handle = ck.save(_state(model, opt, extra), step=2)
    _train_step(model, opt)  # the guarded optimizer step neither hangs nor raises
    with pytest.raises(CheckpointWriteError) as info:
        handle.wait(WAIT_S)
    monkeypatch.undo()
    assert faults.fired >= 1
    assert isinstance(info.value, OSError)
    assert handle.done() and handle.exception() is info.value
    assert os.strerror(expected_errno) in str(info.value), "the original OSError is lost"
    # Nothing of the failed save is left or visible; the previous checkpoint is intact.
    assert [i.name for i in ck.list()] == [STEP1]
    assert ck.latest().name == STEP1
    assert visible_entries(ck.directory) == [STEP1]
    assert hidden_entries(ck.directory) == []
    _assert_restores(ck, reference)
    # The Checkpointer still works: the same step saves and restores.
    model2, opt2, extra2 = make_training(seed=7)
    ck.save(_state(model2, opt2, extra2), step=2).wait(WAIT_S)
    assert [i.name for i in ck.list()] == [STEP1, STEP2]
    _assert_restores(ck, _snapshot(model2, opt2, extra2), step=2)


@pytest.mark.parametrize("name", list(_before_commit_params()))
def test_failure_before_commit_surfaces_on_handle(ck, monkeypatch, name):
    install, expected_errno = BEFORE_COMMIT[name]
    _check_failed_save(ck, monkeypatch, install, expected_errno)


@pytest.mark.parametrize("name", ["shard-open-eacces", "directory-rename"])
def test_failure_is_an_oserror_with_its_errno_kept(ck, monkeypatch, name):
    """Failures outside the data path (opening the shard, the commit rename) are OSErrors that
    keep the original errno and text."""
    install, expected_errno = BEFORE_COMMIT[name]
    _save_reference(ck)
    faults = Faults(monkeypatch, ck.directory)
    install(faults)
    model, opt, extra = make_training(seed=3)
    with pytest.raises(OSError) as info:
        ck.save(_state(model, opt, extra), step=2).wait(WAIT_S)
    monkeypatch.undo()
    assert os.strerror(expected_errno) in str(info.value)
    assert info.value.errno == expected_errno
    assert [i.name for i in ck.list()] == [STEP1]
    assert hidden_entries(ck.directory) == []


@pytest.mark.parametrize("thread", ["datastates-writer", "datastates-commit"])
def test_disk_full_is_recognizable_by_errno(ck, monkeypatch, thread):
    """``except OSError as e: if e.errno == errno.ENOSPC`` is how callers detect a full disk,
    whether a tensor unit (writer thread) or the index (commit thread) hit it."""
    _save_reference(ck)
    Faults(monkeypatch, ck.directory).writes(".dsf", 1, thread=thread)
    model, opt, extra = make_training(seed=3)
    with pytest.raises(CheckpointWriteError) as info:
        ck.save(_state(model, opt, extra), step=2).wait(WAIT_S)
    assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize(
    "name",
    [
        "root-fsync-after-rename",
        "latest-write",
    ],
)
def test_failure_after_rename_is_consistent(ck, monkeypatch, name):
    """A handle that raises must mean the checkpoint is not there. A failure after the directory
    was renamed into place (the checkpoint is committed) is a RuntimeWarning naming it, not a
    failed save; the checkpoint is listed and complete."""
    (model, opt, extra), reference = _save_reference(ck)
    faults = Faults(monkeypatch, ck.directory)
    if name == "root-fsync-after-rename":
        faults.fd_call("fsync", "<root>", nth=1)  # publish: fsync_dir(root) after the rename
    else:
        faults.writes("latest.tmp", 1)
    expected = _snapshot(model, opt, extra)
    with pytest.warns(RuntimeWarning, match="step-0000000002.*committed"):
        info = ck.save(_state(model, opt, extra), step=2).wait(WAIT_S)
    monkeypatch.undo()
    assert faults.fired == 1
    assert info.name == STEP2
    assert [i.name for i in ck.list()] == [STEP1, STEP2]
    assert hidden_entries(ck.directory) == []
    _assert_restores(ck, expected, step=2)
    _assert_restores(ck, reference, step=1)


def test_retention_failure_keeps_new_checkpoint(tmp_path, monkeypatch):
    """keep_last=1: deleting the old checkpoint fails (EACCES on its rename to .trash). The new
    checkpoint is committed and complete, the save succeeds with a RuntimeWarning, the old one is
    intact (not half deleted) and goes at the next save."""
    cfg = SMALL.replace(keep_last=1)
    with datastates.Checkpointer(tmp_path, cfg) as ck:
        (model, opt, extra), reference = _save_reference(ck)
        faults = Faults(monkeypatch, ck.directory)
        faults.path_call("rename", STEP1)
        model2, opt2, extra2 = make_training(seed=5)
        with pytest.warns(RuntimeWarning, match="step-0000000002.*committed"):
            ck.save(_state(model2, opt2, extra2), step=2).wait(WAIT_S)
        monkeypatch.undo()
        assert faults.fired == 1
        assert [i.name for i in ck.list()] == [STEP1, STEP2]
        assert ck.latest().name == STEP2
        _assert_restores(ck, _snapshot(model2, opt2, extra2), step=2)
        _assert_restores(ck, reference, step=1)
        assert hidden_entries(ck.directory) == []
        ck.save(_state(model2, opt2, extra2), step=3).wait(WAIT_S)
        assert [i.name for i in ck.list()] == ["step-0000000003"]


# save() reports earlier failed handles it still tracks, even ones the caller will wait for.
@pytest.mark.filterwarnings("ignore:datastates. an earlier checkpoint:RuntimeWarning")
def test_every_save_fails_then_recovers(ck, monkeypatch):
    """A full disk for several saves in a row: each handle fails, training continues, nothing
    accumulates; once space is back the next save commits."""
    (model, opt, extra), reference = _save_reference(ck)
    faults = Faults(monkeypatch, ck.directory)
    faults.writes(".dsf", 1)
    handles = []
    for step in (2, 3, 4):
        handles.append(ck.save(_state(model, opt, extra), step=step))
        _train_step(model, opt)
    for h in handles:
        with pytest.raises(CheckpointWriteError):
            h.wait(WAIT_S)
    monkeypatch.undo()
    assert [i.name for i in ck.list()] == [STEP1]
    assert hidden_entries(ck.directory) == []
    _assert_restores(ck, reference)
    after = _snapshot(model, opt, extra)
    ck.save(_state(model, opt, extra), step=5).wait(WAIT_S)
    _assert_restores(ck, after, step=5)


# ---------------------------------------------------------------- dropped handles


def _failing_save(ck, monkeypatch, step: int):
    model, opt, extra = make_training()
    Faults(monkeypatch, ck.directory).writes(".dsf", 1)
    return ck.save(_state(model, opt, extra), step=step)


def test_dropped_failed_handle_warns_at_close(tmp_path, monkeypatch, small_config):
    ck = datastates.Checkpointer(tmp_path, small_config)
    _failing_save(ck, monkeypatch, 1)  # the handle is dropped at once
    gc.collect()
    with pytest.warns(
        RuntimeWarning,
        match=r"step-0000000001.*ENOSPC|ENOSPC.*step-0000000001|"
        r"step-0000000001.*No space left",
    ):
        ck.close()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []  # nothing committed, no temporaries, no latest


def test_dropped_failed_handle_warns_at_next_save(tmp_path, monkeypatch, small_config):
    with datastates.Checkpointer(tmp_path, small_config) as ck:
        handle = _failing_save(ck, monkeypatch, 1)
        # Wait for the failure without looking at it (wait()/exception() would observe it).
        assert handle._job.finished.wait(WAIT_S)
        del handle
        gc.collect()
        monkeypatch.undo()
        model, opt, extra = make_training(seed=1)
        with pytest.warns(RuntimeWarning, match="step-0000000001"):
            ck.save(_state(model, opt, extra), step=2).wait(WAIT_S)
        assert [i.name for i in ck.list()] == [STEP2]


def test_observed_failure_does_not_warn(tmp_path, monkeypatch, small_config):
    """A failure the caller saw through wait() is not re-reported."""
    ck = datastates.Checkpointer(tmp_path, small_config)
    handle = _failing_save(ck, monkeypatch, 1)
    with pytest.raises(CheckpointWriteError):
        handle.wait(WAIT_S)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.close()
        del handle
        gc.collect()


# ---------------------------------------------------------------- real permissions


def _permissions_enforced(directory) -> bool:
    """False as root (or with CAP_DAC_OVERRIDE): a read-only directory stays writable."""
    probe = os.path.join(directory, ".probe")
    try:
        os.mkdir(probe)
    except PermissionError:
        return True
    os.rmdir(probe)
    return False


def test_read_only_directory(tmp_path, small_config):
    root = tmp_path / "ck"
    with datastates.Checkpointer(root, small_config) as ck:
        model, opt, extra = make_training()
        ck.save(_state(model, opt, extra), step=1).wait(WAIT_S)
        reference = _snapshot(model, opt, extra)
        os.chmod(root, 0o555)
        try:
            if not _permissions_enforced(root):
                # root ignores permissions; the EACCES cases above inject the same failure
                pytest.skip("permissions are not enforced for this user (root)")
            handle = ck.save(_state(model, opt, extra), step=2)
            _train_step(model, opt)
            with pytest.raises(CheckpointWriteError, match="Permission denied"):
                handle.wait(WAIT_S)
            assert [i.name for i in ck.list()] == [STEP1]
            _assert_restores(ck, reference)
        finally:
            os.chmod(root, 0o755)
        ck.save(_state(model, opt, extra), step=2).wait(WAIT_S)
        assert [i.name for i in ck.list()] == [STEP1, STEP2]
