"""The record of which ranks a memory directory holds (memory/nodes.py): read as hostile input,
and what a job whose ranks moved to other nodes does with the memory it finds."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import datastates
from datastates import CorruptCheckpointError
from datastates.memory import nodes
from datastates.memory.persist import persist_newest

WHOLE = nodes.NodeRanks(2, (0, 1))
PART = nodes.NodeRanks(4, (2, 3))


def _record(memdir, text: str | bytes) -> None:
    with open(os.path.join(memdir, nodes.NODE_FILE), "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def test_groups_are_the_ranks_sharing_a_host_and_a_memory_directory():
    answers = {
        0: {"host": "a", "memdir": "/m"},
        1: {"host": "b", "memdir": "/m"},
        2: {"host": "a", "memdir": "/m"},
        3: {"host": "b", "memdir": "/m"},
        4: {"host": "a", "memdir": "/other"},
    }
    assert nodes.groups(answers) == [[0, 2], [1, 3], [4]]


@pytest.mark.parametrize(
    "text, where, found",
    [
        ("", "top level", "expected JSON, found b''"),
        ("{", "top level", "expected JSON, found b'{'"),
        ("[]", "top level", "expected an object, found list []"),
        (
            '{"world_size": 4}',
            "top level",
            "expected the fields ['ranks', 'world_size'], found ['world_size']",
        ),
        (
            '{"world_size": 4, "ranks": [0], "x": 1}',
            "top level",
            "expected the fields ['ranks', 'world_size'], found ['ranks', 'world_size', 'x']",
        ),
        (
            '{"world_size": 0, "ranks": [0]}',
            "world_size",
            f"expected an integer in [1, {1 << 24}], found 0",
        ),
        ('{"world_size": 4, "ranks": []}', "ranks", "expected at least one rank, found none"),
        ('{"world_size": 4, "ranks": [4]}', "ranks[0]", "expected an integer in [0, 3], found 4"),
        ('{"world_size": 4, "ranks": [1, 1]}', "ranks", "expected distinct ranks, found [1, 1]"),
        (
            '{"world_size": true, "ranks": [0]}',
            "world_size",
            "expected an integer, found bool True",
        ),
        (
            '{"world_size": 4, "ranks": [0, 0.0]}',
            "ranks[1]",
            "expected an integer, found float 0.0",
        ),
        ('{"world_size": 4, "ranks": "01"}', "ranks", "expected a list, found str '01'"),
    ],
)
def test_a_record_that_does_not_describe_ranks_is_refused(tmp_path, text, where, found):
    _record(tmp_path, text)
    path = os.path.join(tmp_path, nodes.NODE_FILE)
    with pytest.raises(CorruptCheckpointError) as info:
        nodes.read(str(tmp_path))
    assert str(info.value) == f"{path} (a record of ranks): {where}: {found}"
    assert isinstance(info.value, ValueError)  # what adopt() takes for another job's record
    assert nodes.part_only(str(tmp_path)) == f"its record of ranks does not read ({info.value})"


def test_a_record_that_is_no_regular_file_is_never_opened_for_reading(tmp_path):
    path = os.path.join(tmp_path, nodes.NODE_FILE)
    os.mkfifo(path)  # a reader that opened it for reading would block here forever
    with pytest.raises(ValueError, match="expected a regular file"):
        nodes.read(str(tmp_path))
    os.remove(path)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"world_size": 2, "ranks": [0, 1]}))
    os.symlink(target, path)
    with pytest.raises(ValueError):
        nodes.read(str(tmp_path))
    os.remove(path)
    _record(tmp_path, b" " * (nodes._MAX_BYTES + 1))
    with pytest.raises(ValueError, match="at most"):
        nodes.read(str(tmp_path))


def test_a_record_round_trips_and_says_whether_it_is_a_part(tmp_path):
    assert nodes.read(str(tmp_path)) is None and nodes.part_only(str(tmp_path)) is None
    nodes.adopt(str(tmp_path), str(tmp_path / "ckpt"), PART)
    assert nodes.read(str(tmp_path)) == PART
    assert (
        nodes.part_only(str(tmp_path)) == "it holds ranks [2, 3] of 4 only, one node's "
        "part of the job"
    )
    nodes.adopt(str(tmp_path), str(tmp_path / "ckpt"), WHOLE)
    assert nodes.read(str(tmp_path)) == WHOLE and nodes.part_only(str(tmp_path)) is None


def _memory_with_a_checkpoint(memdir) -> str:
    ckpt = os.path.join(memdir, "ckpt")
    with datastates.Checkpointer(ckpt) as ck:
        ck.save({"w": torch.arange(4.0)}, step=1).wait()
    return ckpt


@pytest.mark.parametrize(
    "before, now, kept",
    [
        (None, WHOLE, True),  # a memory of an older version: one node
        (nodes.NodeRanks(4, (0, 1, 2, 3)), WHOLE, True),  # one node, another world size: reshards
        (PART, PART, True),  # the same ranks on this node again
        (PART, nodes.NodeRanks(4, (1, 3)), False),  # other ranks on this node now
        (PART, WHOLE, False),  # a part, and now the whole job
        (None, PART, False),  # the whole job, and now a part
        ("garbage", WHOLE, False),  # a record that does not read
    ],
)
def test_the_memory_of_other_ranks_is_removed_before_it_is_used(
    tmp_path, caplog, before, now, kept
):
    memdir = str(tmp_path)
    ckpt = _memory_with_a_checkpoint(memdir)
    if isinstance(before, nodes.NodeRanks):
        nodes._write(memdir, before)
    elif before is not None:
        _record(memdir, before)
    with caplog.at_level(logging.WARNING, logger="datastates"):
        nodes.adopt(memdir, ckpt, now)
    assert os.path.isdir(os.path.join(ckpt, "step-0000000001")) == kept
    assert ("are removed" in caplog.text) == (not kept), caplog.text
    assert nodes.read(memdir) == now


def test_one_node_s_part_is_never_written_to_storage(tmp_path):
    memdir = str(tmp_path / "mem")
    os.makedirs(memdir)
    ckpt = _memory_with_a_checkpoint(memdir)
    nodes._write(memdir, PART)
    storage = str(tmp_path / "storage")
    with pytest.raises(datastates.KeeperError, match="one node's part of the job"):
        persist_newest(ckpt, storage, datastates.CheckpointConfig())
    assert not os.path.exists(storage)
    nodes._write(memdir, WHOLE)
    assert persist_newest(ckpt, storage, datastates.CheckpointConfig()).step == 1
