"""Commit order (docs/format.md, "Which checkpoint is the latest"): every manifest carries a commit
sequence number; list(), latest() and retention follow it, for steps and tags alike, and the
``latest`` file is only a hint."""

from __future__ import annotations

import os

import torch

from datastates import CheckpointConfig, Checkpointer
from testkit import SMALL


def save(ck: Checkpointer, value: float, **kwargs) -> None:
    ck.save({"x": torch.full((3,), float(value))}, **kwargs).wait(60)


def test_sequence_numbers_follow_commits(tmp_path):
    with Checkpointer(tmp_path, SMALL) as ck:
        save(ck, 1, step=10)
        save(ck, 2, tag="best")
        save(ck, 3, step=5)  # a lower step committed later is newer
        assert [(i.name, i.seq) for i in ck.list()] == [
            ("step-0000000010", 1),
            ("best", 2),
            ("step-0000000005", 3),
        ]
        assert ck.latest().name == "step-0000000005"
        save(ck, 4, tag="best", overwrite=True)  # overwriting commits it again
        assert [(i.name, i.seq) for i in ck.list()] == [
            ("step-0000000010", 1),
            ("step-0000000005", 3),
            ("best", 4),
        ]
        assert ck.latest().name == "best"
        assert torch.equal(ck.load()["x"], torch.full((3,), 4.0))


def test_latest_file_is_a_hint_only(tmp_path):
    with Checkpointer(tmp_path, SMALL) as ck:
        save(ck, 1, step=1)
        save(ck, 2, step=2)
    with open(tmp_path / "latest", "w") as f:
        f.write("step-0000000001")  # as a crash between the commit and its update leaves it
    with Checkpointer(tmp_path, SMALL) as ck:
        assert ck.latest().name == "step-0000000002"
        assert ck.restore({"x": torch.zeros(3)}).step == 2
        save(ck, 3, step=3)  # the resume loop's next save does not collide
    assert (tmp_path / "latest").read_text() == "step-0000000003"


def test_keep_last_counts_tags_by_commit_order(tmp_path):
    """A tag has no step: it is kept or deleted by when it was committed, not first."""
    with Checkpointer(
        tmp_path, CheckpointConfig(keep_last=2, host_cache_bytes=64 << 10, chunk_bytes=16 << 10)
    ) as ck:
        save(ck, 1, step=1)
        save(ck, 2, step=2)
        save(ck, 3, tag="best")
        save(ck, 4, step=3)
        assert [i.name for i in ck.list()] == ["best", "step-0000000003"]
        save(ck, 5, step=4)
        save(ck, 6, step=5)
        assert [i.name for i in ck.list()] == ["step-0000000004", "step-0000000005"]


def test_keep_every_applies_to_steps(tmp_path):
    config = CheckpointConfig(
        keep_last=1, keep_every=2, host_cache_bytes=64 << 10, chunk_bytes=16 << 10
    )
    with Checkpointer(tmp_path, config) as ck:
        save(ck, 1, step=2, tag="best")  # a tag saved with its step counts by that step
        save(ck, 2, tag="other")
        for step in (3, 4, 5):
            save(ck, step, step=step)
        assert [i.name for i in ck.list()] == ["best", "step-0000000004", "step-0000000005"]


def test_seq_is_one_more_than_the_highest_committed(tmp_path):
    with Checkpointer(tmp_path, SMALL) as ck:
        save(ck, 1, step=1)
        assert ck.latest().seq == 1
        save(ck, 2, step=2)
        ck.delete(step=2)  # the highest is gone: numbering continues from what is left
        save(ck, 2, step=2)
        assert ck.latest().seq == 2
        ck.delete(step=1)
        save(ck, 3, tag="t")
        assert ck.latest().seq == 3 and ck.latest().name == "t"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
