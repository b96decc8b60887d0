"""Path-addressed checkpoints (the layer under the DeepSpeed and Lightning adapters), and the
name DeepSpeed imports. No framework needed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import datastates
from datastates.integrations._paths import PathCheckpoints

from integration_helpers import assert_same, subprocess_env
from testkit import ONE_WRITER


def test_deepspeed_imports_our_engine():
    from datastates.integrations.deepspeed import CheckpointEngine

    assert datastates.CheckpointEngine is CheckpointEngine


@pytest.mark.slow
def test_core_imports_without_frameworks():
    code = textwrap.dedent("""
        import sys
        import datastates, datastates.integrations
        bad = [m for m in ("deepspeed", "lightning", "transformers", "accelerate")
               if m in sys.modules]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env())


def _state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {
        "module": m.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "size": torch.Size([2, 3]),
        "names": ("a", "b"),
    }


def test_save_load_equals_torch_load(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "ref.pt")
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(state, tmp_path / "x.ckpt", snapshot=True)
    paths.wait()
    assert os.path.isfile(tmp_path / ".datastates" / "x.ckpt" / "manifest.json")
    want = torch.load(tmp_path / "ref.pt", weights_only=False)
    assert_same(want, paths.load(tmp_path / "x.ckpt"))
    assert_same(want["module"], torch.load(tmp_path / "x.ckpt", weights_only=True)["module"])
    paths.close()


def test_snapshot_is_taken_at_save_time(tmp_path):
    t = torch.arange(300_000, dtype=torch.float32)  # larger than the host cache: backpressure
    want = t.clone()
    paths = PathCheckpoints(ONE_WRITER)
    paths.save({"t": t}, tmp_path / "a", snapshot=True)
    t.add_(1)  # the caller mutates right after save() returned
    paths.wait()
    assert torch.equal(paths.load(tmp_path / "a")["t"], want)
    paths.close()


def test_overwrite_and_remove(tmp_path):
    paths = PathCheckpoints(ONE_WRITER)
    for v in range(3):
        paths.save({"v": torch.full((4,), v)}, tmp_path / "last.ckpt", snapshot=True)
    assert paths.load(tmp_path / "last.ckpt")["v"].tolist() == [2, 2, 2, 2]
    paths.remove(tmp_path / "last.ckpt")
    assert not os.path.exists(tmp_path / "last.ckpt")
    assert not os.path.exists(tmp_path / ".datastates" / "last.ckpt")
    paths.close()
    assert os.listdir(tmp_path) == [".datastates"]
    assert [n for n in os.listdir(tmp_path / ".datastates") if n.startswith(".")] == []


def _fail_in_background(monkeypatch):
    """Make every save fail in the background (its commit thread, writing the shard's index)."""
    import datastates.format.codec as codec

    monkeypatch.setattr(
        codec,
        "encode_index_items",
        lambda *a: (_ for _ in ()).throw(KeyError("injected background failure")),
    )


def test_background_failure_raised_by_next_save(tmp_path, monkeypatch):
    paths = PathCheckpoints(ONE_WRITER)
    bad = {"t": torch.ones(16)}
    _fail_in_background(monkeypatch)
    paths.save(bad, tmp_path / "bad", snapshot=False)
    with pytest.raises(KeyError, match="injected"):
        paths.wait()
    assert not os.path.exists(tmp_path / "bad")  # nothing partial is visible
    handle = paths.save(bad, tmp_path / "bad", snapshot=False)
    with pytest.raises(KeyError, match="injected"):
        handle.wait()
    monkeypatch.undo()
    with pytest.raises(KeyError, match="injected"):  # the next save reports it
        paths.save({"t": torch.ones(2)}, tmp_path / "ok", snapshot=True)
    paths.close()


@pytest.mark.slow
def test_crash_never_exposes_a_partial_checkpoint(tmp_path):
    code = textwrap.dedent(f"""
        import os, torch, datastates
        from datastates.integrations._paths import PathCheckpoints
        cfg = datastates.CheckpointConfig(host_cache_bytes=1 << 22, chunk_bytes=1 << 20)
        p = PathCheckpoints(cfg)
        p.save({{"t": torch.ones(8 << 20)}}, {str(tmp_path / "x.pt")!r},
               snapshot=False)
        os._exit(0)  # die with the save in flight
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env())
    target = tmp_path / "x.pt"
    paths = PathCheckpoints(ONE_WRITER)
    if paths.exists(target):  # the commit won the race: then it must be complete
        assert torch.equal(paths.load(target)["t"], torch.ones(8 << 20))
        if os.path.getsize(target):  # and so is the link, if it was made
            assert torch.equal(torch.load(target, weights_only=True)["t"], torch.ones(8 << 20))
    else:  # the placeholder the save made: no checkpoint, and the next save takes the name
        assert os.path.getsize(target) == 0
        assert not paths.exists(target)
        paths.save({"t": torch.zeros(2)}, target, snapshot=True)
        paths.wait()
        assert torch.equal(paths.load(target)["t"], torch.zeros(2))
    paths.close()
    assert sorted(os.listdir(tmp_path)) == [".datastates", "x.pt"]
    behind = sorted(n for n in os.listdir(tmp_path / ".datastates") if not n.startswith("."))
    assert behind in (["x.pt"], ["latest", "x.pt"])


def test_optimizers_make_only_their_bytes_lazy(tmp_path):
    """The core's capture rule through the path API: a BatchNorm buffer changed right after
    save() is not in the checkpoint; the parameters are captured lazily behind the step."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = {"module": m.state_dict(), "optimizer": opt.state_dict()}
    want = {"module": type(state["module"])((k, v.clone()) for k, v in state["module"].items())}
    paths = PathCheckpoints(ONE_WRITER)
    handle = paths.save(state, tmp_path / "x.ckpt", snapshot=False, optimizers=[opt])
    assert 0 < handle.stats.lazy_nbytes
    m(torch.randn(4, 8)).sum().backward()  # changes the running statistics
    opt.step()  # guarded: waits for the capture
    paths.wait()
    assert_same(want["module"], paths.load(tmp_path / "x.ckpt")["module"])
    paths.close()


def test_deepspeed_refuses_a_memory_tier_and_says_why(tmp_path):
    from datastates.integrations.deepspeed import CheckpointEngine

    tier = datastates.MemoryTier(root=str(tmp_path))
    for value in ({"root": str(tmp_path)}, tier):
        with pytest.raises(datastates.ConfigError, match="load_checkpoint\\(\\) finds them"):
            CheckpointEngine({"memory_tier": value})
    assert os.listdir(tmp_path) == []


def test_a_framework_s_step_is_recorded(tmp_path):
    paths = PathCheckpoints(datastates.CheckpointConfig(host_cache_bytes=1 << 20))
    paths.save({"x": torch.ones(3)}, tmp_path / "a.ckpt", snapshot=True, step=7)
    paths.save({"x": torch.ones(3)}, tmp_path / "b.ckpt", snapshot=True)
    paths.close()
    with datastates.Checkpointer(tmp_path / ".datastates") as ckpt:
        assert sorted((i.name, i.step) for i in ckpt.list()) == [("a.ckpt", 7), ("b.ckpt", None)]


def interrupt_replacement(root, name: str) -> str:
    """Leave ``root/name`` as a crash between the core's two renames of an overwrite leaves it
    (on a file system without an atomic exchange): moved to ``.old.<name>.<token>.<uid>``, the
    owner of ``token`` dead (its lease file exists, nobody holds its lock). Returns that path."""
    token = "0123456789abcdef"
    open(os.path.join(root, f".owner.{token}"), "w").close()
    old = os.path.join(root, f".old.{name}.{token}.89abcdef")
    os.rename(os.path.join(root, name), old)
    return old


def test_interrupted_replacement_is_put_back_before_lookup(tmp_path):
    state = _state()
    paths = PathCheckpoints(ONE_WRITER)
    paths.save(state, tmp_path / "last.ckpt", snapshot=True)
    paths.close()
    old = interrupt_replacement(tmp_path / ".datastates", "last.ckpt")
    os.remove(tmp_path / "last.ckpt")  # and no link: the checkpoint is found behind the path
    paths = PathCheckpoints(ONE_WRITER)  # the restarted job
    assert paths.exists(tmp_path / "last.ckpt")  # the lookup lets the core repair first
    assert not os.path.exists(old)
    assert_same(state, paths.load(tmp_path / "last.ckpt"))
    paths.close()


@pytest.mark.slow
def test_plain_file_stays_in_place_until_its_replacement_commits(tmp_path):
    """Another engine's plain file replaced by a datastates checkpoint: the job dies with the
    save in flight (its commit held back), and the file is still at the path, untouched."""
    plain = {"v": torch.arange(6.0)}
    target = tmp_path / "last.ckpt"
    torch.save(plain, target)
    inode = os.stat(target).st_ino
    code = textwrap.dedent(f"""
        import os, threading, torch, datastates
        import datastates.format.codec as codec
        from datastates.integrations._paths import PathCheckpoints
        codec.encode_index_items = lambda *a: threading.Event().wait()  # the commit never comes
        p = PathCheckpoints(datastates.CheckpointConfig(host_cache_bytes=1 << 20))
        p.save({{"v": torch.zeros(6)}}, {str(target)!r}, snapshot=True)
        os._exit(0)  # die between the save's return and its commit
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env=subprocess_env())
    assert os.stat(target).st_ino == inode
    assert_same(plain, torch.load(target))
    kept = tmp_path / "kept"
    shutil.copytree(tmp_path, kept, ignore=shutil.ignore_patterns("kept"))
    paths = PathCheckpoints(ONE_WRITER)
    assert paths.exists(target)
    assert_same(plain, paths.load(target))
    paths.remove(kept / "last.ckpt")
    assert not paths.exists(kept / "last.ckpt")
    paths.save({"v": torch.ones(6)}, target, snapshot=True)  # the next save commits: replaced
    paths.wait()
    assert paths.load(target)["v"].tolist() == [1.0] * 6
    assert torch.load(target)["v"].tolist() == [1.0] * 6
    paths.close()


def test_plain_file_set_aside_by_an_earlier_version_is_read_and_removed(tmp_path):
    plain = {"v": torch.arange(6.0)}
    torch.save(plain, tmp_path / ".plain.last.ckpt")  # a crash of an earlier version's save
    os.mkdir(tmp_path / "last.ckpt")  # and its placeholder
    paths = PathCheckpoints(ONE_WRITER)
    assert paths.exists(tmp_path / "last.ckpt")
    assert_same(plain, paths.load(tmp_path / "last.ckpt"))
    paths.save({"v": torch.ones(6)}, tmp_path / "last.ckpt", snapshot=True)
    paths.wait()
    assert torch.load(tmp_path / "last.ckpt")["v"].tolist() == [1.0] * 6
    assert not os.path.exists(tmp_path / ".plain.last.ckpt")
    paths.close()


def test_plain_file_stays_when_its_replacement_fails(tmp_path, monkeypatch):
    plain = {"v": torch.arange(6.0)}
    target = tmp_path / "last.ckpt"
    torch.save(plain, target)
    inode = os.stat(target).st_ino
    paths = PathCheckpoints(ONE_WRITER)
    _fail_in_background(monkeypatch)
    paths.save({"v": torch.zeros(6)}, target, snapshot=False)
    with pytest.raises(KeyError, match="injected"):
        paths.wait()
    assert os.stat(target).st_ino == inode
    assert_same(plain, torch.load(target))
    paths.close()
