"""A checkpoint folder is input from someone else: its files may be FIFOs, links to devices or to
files outside it, or huge. Every reader (find, list/latest/restore/load, verify, export) refuses
them with CorruptCheckpointError naming the path, never blocks and never reads without bound.

Each operation runs in a thread joined with a 30 s timeout: a hang detector (a reader blocked in
``open()`` of a FIFO is released by opening its write end), not synchronization."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

import datastates
from datastates.tools import cli, describe
from datastates import format as fmt
from datastates.commit.catalog import Catalog
from datastates.storage.posix import remove_tree

from _faults_helpers import assert_bit_exact
from _integrity_helpers import bounded_memory
from testkit import SMALL

STEP1, STEP2 = fmt.step_name(1), fmt.step_name(2)


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 100, generator=g),
        "n": torch.arange(seed, seed + 50),
        "meta": {("tuple", "key"): f"object {seed}"},
    }


def fresh_state() -> dict:
    return {"w": torch.zeros(64, 100), "n": torch.zeros(50, dtype=torch.int64), "meta": None}


def _two_steps(root) -> None:
    with datastates.Checkpointer(root, SMALL) as ck:
        ck.save(make_state(1), step=1).wait(60)
        ck.save(make_state(2), step=2).wait(60)


@pytest.fixture
def root(pristine, private_copy):
    """A private copy of two committed checkpoints (step 1 and step 2) to damage."""
    return private_copy(pristine(_two_steps)[0])


def bounded(fn, *args, fifos=(), **kwargs) -> dict:
    """Run ``fn`` in a thread; {'value': ...} or {'error': exc}. Fails the test if it is still
    running after 30 s (then the FIFOs' write ends are opened, so a blocked open returns)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    with bounded_memory(1 << 30):  # a read of /dev/zero fails here instead of exhausting memory
        thread.start()
        thread.join(timeout=30)
        if thread.is_alive():
            for fifo in fifos:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(timeout=30)
            pytest.fail(f"{getattr(fn, '__name__', fn)} blocked on a special file")
    return box


def assert_refused(box: dict, path: str, *words: str) -> None:
    error = box.get("error")
    assert isinstance(error, datastates.CorruptCheckpointError), box
    assert path in str(error), str(error)
    for word in words:
        assert word in str(error), str(error)


def plant(path: str, kind: str, tmp_path) -> None:
    """Replace the file ``path`` by a FIFO, a link to /dev/zero, or a link to an intact copy of
    itself outside the checkpoint (refused too: a link may point anywhere)."""
    outside = os.path.join(str(tmp_path), "outside-" + os.path.basename(path))
    shutil.copyfile(path, outside)
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero" if kind == "devzero" else outside, path)


KINDS = {"fifo": "FIFO", "devzero": "symbolic link", "outside": "symbolic link"}


# ---------------------------------------------------------------- manifest.json


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_manifest_is_refused_by_every_reader(root, tmp_path, kind, capsys):
    ckpt = os.path.join(root, STEP2)
    manifest = os.path.join(ckpt, fmt.MANIFEST)
    plant(manifest, kind, tmp_path)
    fifos = [manifest] if kind == "fifo" else []

    assert_refused(bounded(describe.find, ckpt, fifos=fifos), manifest, KINDS[kind])
    with datastates.Checkpointer(root, SMALL) as ck:
        state = fresh_state()
        assert_refused(bounded(ck.restore, state, step=2, fifos=fifos), manifest, KINDS[kind])
        assert_refused(bounded(ck.load, step=2, fifos=fifos), manifest, KINDS[kind])
        listed = bounded(ck.list, fifos=fifos)
        latest = bounded(ck.latest, fifos=fifos)
    assert [i.name for i in listed["value"]] == [STEP1]
    assert latest["value"].name == STEP1
    assert torch.equal(state["w"], torch.zeros(64, 100))  # the refused restore changed nothing

    catalog = Catalog(root)
    bounded(catalog.scan, fifos=fifos)
    damaged = catalog.damaged()
    assert [d.name for d in damaged] == [STEP2] and manifest in damaged[0].reason

    code = bounded(cli.main, ["verify", ckpt], fifos=fifos)
    assert code["value"] != 0
    assert manifest in capsys.readouterr().err


def test_manifest_over_the_format_limit_is_refused_before_reading(root):
    """A sparse manifest of MAX_MANIFEST_BYTES + 1 bytes: refused from its size alone."""
    ckpt = os.path.join(root, STEP2)
    manifest = os.path.join(ckpt, fmt.MANIFEST)
    with open(manifest, "r+b") as f:
        f.truncate(fmt.MAX_MANIFEST_BYTES + 1)
    box = bounded(fmt.read_manifest, ckpt)
    assert_refused(box, manifest, str(fmt.MAX_MANIFEST_BYTES))


# ---------------------------------------------------------------- shard files


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_shard_file_is_refused_by_every_reader(root, tmp_path, kind, capsys):
    ckpt = os.path.join(root, STEP2)
    shard = os.path.join(ckpt, fmt.shard_file_name(0))
    plant(shard, kind, tmp_path)
    fifos = [shard] if kind == "fifo" else []

    with datastates.Checkpointer(root, SMALL) as ck:
        state = fresh_state()
        assert_refused(bounded(ck.restore, state, fifos=fifos), shard, KINDS[kind])
        assert_refused(bounded(ck.load, fifos=fifos), shard, KINDS[kind])
    assert torch.equal(state["n"], torch.zeros(50, dtype=torch.int64))
    assert_refused(bounded(fmt.read_index, shard, fifos=fifos), shard, KINDS[kind])
    out = os.path.join(str(tmp_path), "export.pt")
    assert_refused(
        bounded(datastates.export, ckpt, out, to="safetensors", fifos=fifos), shard, KINDS[kind]
    )
    assert not os.path.exists(out)

    code = bounded(cli.main, ["verify", ckpt], fifos=fifos)
    assert code["value"] != 0
    assert shard in capsys.readouterr().err


def test_index_longer_than_the_format_limit_is_refused(root):
    ckpt = os.path.join(root, STEP2)
    shard = os.path.join(ckpt, fmt.shard_file_name(0))
    with open(shard, "r+b") as f:
        offset = int.from_bytes(f.read(fmt.HEADER_BYTES)[16:24], "little")
        forged = bytearray(fmt.pack_header(offset, b"x"))
        forged[24:32] = (fmt.MAX_INDEX_BYTES + 1).to_bytes(8, "little")  # the index length
        forged[36:40] = fmt.crc32(bytes(forged[:36])).to_bytes(4, "little")  # header CRC
        f.seek(0)
        f.write(forged)
        f.truncate(offset + fmt.MAX_INDEX_BYTES + 1)  # sparse: the index "fits" in the file
    assert_refused(bounded(fmt.read_index, shard), shard, str(fmt.MAX_INDEX_BYTES))


# ---------------------------------------------------------------- folders and links


def test_linked_checkpoint_folder_inside_the_root_is_refused(root, tmp_path, caplog):
    """root/step-3 -> an intact checkpoint elsewhere: never read, and no checkpoint of this
    root (datastates writes no links): named in a WARNING, left alone."""
    elsewhere = os.path.join(str(tmp_path), "elsewhere", fmt.step_name(3))
    with datastates.Checkpointer(os.path.dirname(elsewhere), SMALL) as ck:
        ck.save(make_state(3), step=3).wait(60)
    link = os.path.join(root, fmt.step_name(3))
    os.symlink(elsewhere, link)
    with datastates.Checkpointer(root, SMALL) as ck:
        assert [i.name for i in bounded(ck.list)["value"]] == [STEP1, STEP2]
        assert bounded(ck.latest)["value"].name == STEP2
        assert_refused(bounded(ck.load, step=3), link, "symbolic link")
    catalog = Catalog(root)
    catalog.scan()
    assert catalog.damaged() == []
    assert any(
        r.getMessage().startswith(f"{link} is not a checkpoint and is left alone")
        and "symbolic link" in r.getMessage()
        for r in caplog.records
    )
    assert os.path.islink(link)
    assert_refused(bounded(describe.find, root, step=3), link, "symbolic link")


def test_linked_root_and_a_named_linked_checkpoint_are_read(root, tmp_path, capsys):
    """The folder a user names may itself be a link: it is followed, and restores bit-exactly."""
    link_root = os.path.join(str(tmp_path), "link-root")
    os.symlink(root, link_root)
    with datastates.Checkpointer(link_root, SMALL) as ck:
        state = fresh_state()
        ck.restore(state)
    expected = make_state(2)
    assert_bit_exact(state["w"], expected["w"], "w")
    assert_bit_exact(state["n"], expected["n"], "n")
    link_ckpt = os.path.join(str(tmp_path), "link-ckpt")
    os.symlink(os.path.join(root, STEP1), link_ckpt)
    assert [i.name for i in describe.find(link_ckpt)] == [STEP1]
    assert cli.main(["verify", link_ckpt]) == 0


def test_removing_a_linked_entry_removes_the_link_only(root, tmp_path):
    target = os.path.join(str(tmp_path), "target")
    os.mkdir(target)
    with open(os.path.join(target, "keep"), "wb") as f:
        f.write(b"private")
    link = os.path.join(root, fmt.step_name(9))
    os.symlink(target, link)
    remove_tree(link)
    assert not os.path.lexists(link)
    with open(os.path.join(target, "keep"), "rb") as f:
        assert f.read() == b"private"
