"""The file at a framework's checkpoint path (the layer under the DeepSpeed and Lightning
adapters): a hard link to the shard file of ``dir/.datastates/<name>/``, put in place only after
the commit, in one rename. No framework needed."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import datastates
from datastates.integrations._paths import PathCheckpoints

from integration_helpers import assert_same
from testkit import ONE_WRITER


def _state(v: float) -> dict:
    return {"v": torch.full((64,), v), "step": int(v), "size": torch.Size([2, 3])}


def _behind(target) -> str:
    """The checkpoint behind the path ``target``."""
    return os.path.join(os.path.dirname(target), ".datastates", os.path.basename(target))


def _shard(target) -> str:
    return os.path.join(_behind(target), "rank-00000.dsf")


def _hold_commits(monkeypatch) -> threading.Event:
    """Hold every save back in its commit thread (writing the shard's index) until the event
    returned is set."""
    import datastates.format.codec as codec

    gate, encode = threading.Event(), codec.encode_index_items

    def held(*args, **kwargs):
        gate.wait()
        return encode(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_index_items", held)
    return gate


def _fail_commits(monkeypatch) -> None:
    import datastates.format.codec as codec

    def fail(*args, **kwargs):
        raise KeyError("injected background failure")

    monkeypatch.setattr(codec, "encode_index_items", fail)


def test_the_link_is_made_after_the_commit_only(tmp_path, monkeypatch):
    target = tmp_path / "a.ckpt"
    paths = PathCheckpoints(ONE_WRITER)
    gate = _hold_commits(monkeypatch)
    try:
        paths.save(_state(1.0), target, snapshot=True)
        assert os.path.isfile(target) and os.path.getsize(target) == 0  # the placeholder
        assert not os.path.exists(_behind(target))  # nothing committed yet
    finally:
        gate.set()
    paths.wait()
    st, shard = os.stat(target), os.stat(_shard(target))
    assert (st.st_dev, st.st_ino) == (shard.st_dev, shard.st_ino) and st.st_nlink == 2
    assert_same(_state(1.0), torch.load(target, weights_only=True, mmap=True))
    assert_same(_state(1.0), paths.load(target))
    assert not [n for n in os.listdir(tmp_path) if ".link-" in n]
    paths.close()


def test_a_failed_commit_leaves_the_previous_file_or_none(tmp_path, monkeypatch):
    target = tmp_path / "a.ckpt"
    paths = PathCheckpoints(ONE_WRITER)
    _fail_commits(monkeypatch)
    paths.save(_state(1.0), target, snapshot=False)  # (the failure may come before a capture wait)
    with pytest.raises(KeyError, match="injected"):
        paths.wait()
    assert not os.path.lexists(target) and not paths.exists(target)  # placeholder removed
    monkeypatch.undo()
    paths.save(_state(2.0), target, snapshot=True)
    paths.wait()
    inode = os.stat(target).st_ino
    _fail_commits(monkeypatch)
    paths.save(_state(3.0), target, snapshot=False)  # (the failure may come before a capture wait)
    with pytest.raises(KeyError, match="injected"):
        paths.wait()
    assert os.stat(target).st_ino == inode
    assert_same(_state(2.0), torch.load(target, weights_only=True))
    assert_same(_state(2.0), paths.load(target))
    paths.close()


def test_an_overwrite_keeps_the_old_file_until_the_new_link_replaces_it(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(_state(1.0), target, snapshot=True)
    paths.wait()
    old_inode = os.stat(target).st_ino
    gate = _hold_commits(monkeypatch)
    try:
        paths.save(_state(2.0), target, snapshot=True)
        assert os.stat(target).st_ino == old_inode
        opened = torch.load(target, weights_only=True, mmap=True)  # a reader of the old file
        assert_same(_state(1.0), opened)
    finally:
        gate.set()
    paths.wait()
    new_inode = os.stat(target).st_ino
    assert new_inode != old_inode and new_inode == os.stat(_shard(target)).st_ino
    assert_same(_state(2.0), torch.load(target, weights_only=True))
    assert_same(_state(1.0), opened)  # the old inode lives on for the reader that has it
    paths.close()


def test_a_stock_file_stays_loadable_until_the_commit_replaces_it(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    plain = {"w": torch.arange(5.0)}
    torch.save(plain, target)
    inode = os.stat(target).st_ino
    paths = PathCheckpoints(ONE_WRITER)
    gate = _hold_commits(monkeypatch)
    try:
        paths.save(_state(1.0), target, snapshot=True)
        assert os.stat(target).st_ino == inode
        assert_same(plain, torch.load(target, weights_only=True))
    finally:
        gate.set()
    paths.wait()
    assert os.stat(target).st_ino == os.stat(_shard(target)).st_ino
    assert_same(_state(1.0), torch.load(target, weights_only=True))
    paths.close()


def test_remove_removes_the_file_and_the_checkpoint(tmp_path):
    target = tmp_path / "a.ckpt"
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(_state(1.0), target, snapshot=True)
    paths.wait()
    paths.remove(target)
    assert not os.path.lexists(target) and not os.path.exists(_behind(target))
    assert not paths.exists(target)
    with pytest.raises(datastates.CheckpointNotFoundError, match="a.ckpt"):
        paths.load(target)
    paths.close()
    assert os.listdir(tmp_path) == [".datastates"]  # the core's hint, if any, is in there


def test_a_checkpoint_directory_at_the_path_from_earlier_versions_still_loads(tmp_path):
    """Earlier versions wrote the checkpoint of ``dir/name`` as the directory ``dir/name/``."""
    target = tmp_path / "old.ckpt"
    with datastates.Checkpointer(
        tmp_path, ONE_WRITER, communicator=datastates.LocalCommunicator()
    ) as ckpt:
        ckpt.save({"v": torch.arange(8.0)}, 3, tag="old.ckpt").wait()
    assert os.path.isfile(target / "manifest.json")
    paths = PathCheckpoints(ONE_WRITER)
    assert paths.exists(target)
    assert_same({"v": torch.arange(8.0)}, paths.load(target))
    paths.save(_state(2.0), target, snapshot=True)  # replaced once the new one commits
    paths.wait()
    assert os.path.isfile(target) and os.stat(target).st_ino == os.stat(_shard(target)).st_ino
    assert_same(_state(2.0), paths.load(target))
    paths.close()
    assert sorted(os.listdir(tmp_path)) == [".datastates", "old.ckpt"]


def test_links_refused_warn_once_and_the_checkpoints_still_load(tmp_path, monkeypatch, caplog):
    """A file system without hard links (played by refusing os.link of shard files): no file
    at the path, one WARNING for the directory, and load() reads the checkpoint."""
    link = os.link

    def refuse(src, dst, *args, **kwargs):
        if os.fspath(src).endswith(".dsf"):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), src)
        return link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", refuse)
    torch.save({"w": torch.ones(2)}, tmp_path / "c.ckpt")  # another engine's, older
    paths = PathCheckpoints(ONE_WRITER)
    with caplog.at_level(logging.WARNING, logger="datastates.integrations"):
        for name, v in (("a.ckpt", 1.0), ("b.ckpt", 2.0), ("c.ckpt", 3.0)):
            paths.save(_state(v), tmp_path / name, snapshot=True)
        paths.wait()
    refused = [r for r in caplog.records if "refused a hard link" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING
    for name, v in (("a.ckpt", 1.0), ("b.ckpt", 2.0), ("c.ckpt", 3.0)):
        assert not os.path.lexists(tmp_path / name)
        assert paths.exists(tmp_path / name)
        assert_same(_state(v), paths.load(tmp_path / name))
    paths.remove(tmp_path / "a.ckpt")
    assert not paths.exists(tmp_path / "a.ckpt")
    assert not os.path.exists(_behind(tmp_path / "a.ckpt"))
    assert sorted(os.listdir(tmp_path)) == [".datastates"]  # no file at the paths
    paths.close()


def test_links_refused_deepspeed_finds_an_empty_file_and_loads_through_it(tmp_path, monkeypatch):
    """DeepSpeed's load_checkpoint globs the files it saved, then asks the engine to load each:
    without hard links the engine leaves an empty file at each path for it to find."""
    import glob

    from datastates.integrations.deepspeed import CheckpointEngine

    link = os.link

    def refuse(src, dst, *args, **kwargs):
        if os.fspath(src).endswith(".dsf"):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src)
        return link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", refuse)
    tag = tmp_path / "global_step1"
    state = {"module": {"w": torch.arange(6.0)}, "global_steps": 1}
    engine = CheckpointEngine({"host_cache_size": 0.002}, rank=0)
    engine.save(state, str(tag / "mp_rank_00_model_states.pt"))
    engine.wait(persist=True)
    found = glob.glob(str(tag / "mp_rank_*_model_states.pt"))
    assert found == [str(tag / "mp_rank_00_model_states.pt")]
    assert os.path.getsize(found[0]) == 0
    assert_same(state, engine.load(found[0]))
    engine.close()


def test_a_file_written_at_the_path_after_the_commit_is_what_loads(tmp_path):
    """Another engine saving to the path afterwards (Lightning's TorchCheckpointIO truncates
    the file it finds, here the shard's inode): the path's newer content is what load() reads."""
    target = tmp_path / "a.ckpt"
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(_state(1.0), target, snapshot=True)
    paths.wait()
    other = {"w": torch.arange(3.0)}
    with open(target, "wb") as f:
        torch.save(other, f)
    committed = os.stat(os.path.join(_behind(target), "manifest.json")).st_mtime_ns
    later = committed + 10**9  # a second after the commit, whatever the clock's granularity
    os.utime(target, ns=(later, later))
    assert_same(other, paths.load(target))
    paths.close()


def test_stale_link_temporaries_are_removed_by_repair(tmp_path):
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    from datastates.integrations._layout import HOST

    stale, ours = f".link-{HOST}-{dead}-0123abcd", f".link-{HOST}-{os.getpid()}-0123abcd"
    other = f".link-{'0' * 8 if HOST != '0' * 8 else '1' * 8}-{dead}-0123abcd"  # another node's
    for name in (stale, ours, other):
        open(tmp_path / name, "w").close()
    paths = PathCheckpoints(ONE_WRITER)
    paths.repair(tmp_path)
    assert not os.path.exists(tmp_path / stale)
    assert os.path.exists(tmp_path / ours)  # this process's own: never removed from under it
    assert os.path.exists(tmp_path / other)  # its process may be alive on its own node
    paths.close()


def test_a_listing_of_the_directory_shows_the_paths_and_the_hidden_folder_only(tmp_path):
    """Every file of the checkpoints' Checkpointer (the checkpoints, ``latest``, leases,
    temporaries) is in ``.datastates``; a name ending in ``.datastates`` is a path like any
    other; the hidden folder itself is refused as a path (a name starting with '.')."""
    paths = PathCheckpoints(ONE_WRITER)
    for name, v in (("a.ckpt", 1.0), ("x.datastates", 2.0), ("a.ckpt", 3.0)):
        paths.save(_state(v), tmp_path / name, snapshot=True)
    paths.wait()
    assert sorted(os.listdir(tmp_path)) == [".datastates", "a.ckpt", "x.datastates"]
    assert os.path.isfile(tmp_path / "x.datastates")
    assert_same(_state(2.0), torch.load(tmp_path / "x.datastates", weights_only=True))
    assert_same(_state(3.0), paths.load(tmp_path / "a.ckpt"))
    with pytest.raises(ValueError, match="must not"):
        paths.save(_state(1.0), tmp_path / ".datastates", snapshot=True)
    paths.close()
    assert sorted(os.listdir(tmp_path)) == [".datastates", "a.ckpt", "x.datastates"]


def test_nothing_is_created_before_the_first_save(tmp_path):
    paths = PathCheckpoints(ONE_WRITER)
    paths.repair(tmp_path)
    assert not paths.exists(tmp_path / "a.ckpt")
    assert paths.committed(tmp_path) == []
    paths.close()
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_superseded_by_a_symbolic_link_is_removed(tmp_path):
    """ModelCheckpoint(save_last="link") removes last.ckpt and links it to another path: the
    checkpoint behind the earlier real last.ckpt goes at the next save or removal."""
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(_state(1.0), tmp_path / "last.ckpt", snapshot=True)
    paths.save(_state(2.0), tmp_path / "a.ckpt", snapshot=True)
    paths.wait()
    os.remove(tmp_path / "last.ckpt")
    os.symlink("a.ckpt", tmp_path / "last.ckpt")
    assert_same(_state(2.0), torch.load(tmp_path / "last.ckpt", weights_only=True))
    paths.save(_state(3.0), tmp_path / "b.ckpt", snapshot=True)
    paths.wait()
    behind = os.listdir(tmp_path / ".datastates")
    assert sorted(n for n in behind if n[0] != "." and n != "latest") == ["a.ckpt", "b.ckpt"]
    assert os.path.islink(tmp_path / "last.ckpt")  # the link itself is Lightning's
    paths.close()


def test_a_symbolic_link_at_the_path_is_read_as_its_target_never_as_an_older_checkpoint(tmp_path):
    """last.ckpt saved for real, then made a link to a save still in flight (its placeholder
    empty) by save_last="link", then the process dies: the path has no checkpoint, not the
    one saved at last.ckpt before."""
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(_state(1.0), tmp_path / "last.ckpt", snapshot=True)
    paths.wait()
    open(tmp_path / "b.ckpt", "wb").close()  # the placeholder of a save that never committed
    os.remove(tmp_path / "last.ckpt")
    os.symlink("b.ckpt", tmp_path / "last.ckpt")
    assert paths.source(str(tmp_path / "last.ckpt")) == (None, "")
    assert not paths.exists(tmp_path / "last.ckpt")
    paths.save(_state(2.0), tmp_path / "b.ckpt", snapshot=True)
    paths.wait()
    assert_same(_state(2.0), paths.load(tmp_path / "last.ckpt"))
    paths.close()


def test_the_cli_given_the_file_reads_the_checkpoint_behind_it(tmp_path, capsys):
    from datastates.tools.cli import main

    target = tmp_path / "last.ckpt"
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(_state(1.0), target, snapshot=True)
    paths.wait()
    paths.close()
    assert main(["verify", str(target)]) == 0
    assert capsys.readouterr().out.startswith("last.ckpt: OK")
    assert main(["verify", str(tmp_path)]) == 0  # the folder: its checkpoints, behind the files
    assert capsys.readouterr().out.startswith("last.ckpt: OK")
    assert main(["list", str(tmp_path)]) == 0
    assert "last.ckpt" in capsys.readouterr().out
    out = tmp_path / "out.pt"
    assert main(["export", str(target), "--to", "torch", str(out)]) == 0
    assert_same(_state(1.0), torch.load(out, weights_only=True))
    os.remove(target)
    open(target, "wb").close()  # a file with no checkpoint behind it stays refused
    os.rename(_behind(target), tmp_path / "elsewhere")
    assert main(["verify", str(target)]) == 1
    assert "is a file" in capsys.readouterr().err


def test_the_cli_follows_no_link_from_a_file_to_a_checkpoint_elsewhere(tmp_path, capsys):
    """A handed folder whose ``.datastates`` is a symbolic link to a checkpoint elsewhere: the
    CLI given the file there does not read what the link points at."""
    from datastates.tools.cli import main

    paths = PathCheckpoints(ONE_WRITER)
    paths.save(_state(1.0), tmp_path / "real" / "last.ckpt", snapshot=True)
    paths.wait()
    paths.close()
    handed = tmp_path / "handed"
    handed.mkdir()
    open(handed / "last.ckpt", "wb").write(b"x")
    os.symlink(tmp_path / "real" / ".datastates", handed / ".datastates")
    assert main(["verify", str(handed / "last.ckpt")]) == 1
    assert "is a file" in capsys.readouterr().err
