"""``save()`` refuses, before anything is written, every step, tag and metadata that a reader of
the checkpoint would refuse or could not read; ``delete()`` needs exactly one of step= and tag=.

Each refusal is a ConfigError (a ValueError) naming the value; the folder is left as it was.
"""

from __future__ import annotations

import os

import pytest
import torch

import datastates
from datastates import Checkpointer, ConfigError
from testkit import SMALL

MAX_STEP = 2**63 - 1


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "ckpts")


def _entries(root: str) -> list[str]:
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def _nested(depth: int) -> dict:
    """A dict nesting ``depth`` levels of dicts (itself the first)."""
    top = inner = {}
    for _ in range(depth - 1):
        inner["a"] = {}
        inner = inner["a"]
    return top


# ---------------------------------------------------------------- step


@pytest.mark.parametrize("step", [2**63, 2**64 + 5, -1])
def test_step_outside_the_format_is_refused_before_any_io(root, step):
    with Checkpointer(root, SMALL) as ckpt:
        with pytest.raises(ConfigError, match=str(step)):
            ckpt.save({"w": torch.ones(2)}, step=step)
        assert _entries(root) == []
        with pytest.raises(ConfigError, match=str(step)):
            ckpt.load(step=step)


def test_largest_step_commits_and_reads_back(root):
    saved = torch.arange(4.0)
    with Checkpointer(root, SMALL) as ckpt:
        info = ckpt.save({"w": saved}, step=MAX_STEP).wait(60)
        assert info.step == MAX_STEP and info.name == f"step-{MAX_STEP}"
        assert ckpt.latest().step == MAX_STEP
        assert torch.equal(ckpt.load(step=MAX_STEP)["w"], saved)


# ---------------------------------------------------------------- tag


@pytest.mark.parametrize("tag", ["x" * 129, "\u00e9" * 65, "\U0001f600" * 33])
def test_tag_too_long_for_its_temporaries_is_refused(root, tag):
    """More than 128 bytes in UTF-8 (65 two-byte or 33 four-byte characters are too many)."""
    with Checkpointer(root, SMALL) as ckpt:
        with pytest.raises(ConfigError, match="expected at most 128"):
            ckpt.save({"w": torch.ones(2)}, tag=tag)
        assert _entries(root) == []


@pytest.mark.parametrize("tag", ["x" * 128, "\u00e9" * 64])
def test_tag_of_128_bytes_commits(root, tag):
    with Checkpointer(root, SMALL) as ckpt:
        assert ckpt.save({"w": torch.ones(2)}, tag=tag).wait(60).name == tag
        assert torch.equal(ckpt.load(tag=tag)["w"], torch.ones(2))
    assert _entries(root) == sorted(["latest", tag])


@pytest.mark.parametrize(
    "tag", ["a/b", ".x", "a\x00b", "latest", "", "bad\x01tag", "a\nb", "a\tb", "a\x7fb"]
)
def test_invalid_tag_is_a_config_error(root, tag):
    with Checkpointer(root, SMALL) as ckpt:
        with pytest.raises(ConfigError, match="invalid checkpoint name"):
            ckpt.save({"w": torch.ones(2)}, tag=tag)
    assert _entries(root) == []


# ---------------------------------------------------------------- metadata


def test_metadata_deeper_than_a_reader_decodes_is_refused(root):
    with Checkpointer(root, SMALL) as ckpt:
        with pytest.raises(ConfigError, match="deeper than 256"):
            ckpt.save({"w": torch.ones(2)}, step=1, metadata=_nested(300))
        assert _entries(root) == []
        ckpt.save({"w": torch.ones(2)}, step=2, metadata=_nested(256)).wait(60)
    with Checkpointer(root, SMALL) as reader:
        assert reader.latest().metadata == _nested(256)


def test_metadata_holding_itself_is_refused(root):
    """A cycle is refused (not walked forever), even one reached twice per level."""
    loop: dict = {}
    loop["a"], loop["b"] = loop, [loop]
    with Checkpointer(root, SMALL) as ckpt:
        with pytest.raises(ConfigError, match="deeper than 256"):
            ckpt.save({"w": torch.ones(2)}, step=1, metadata=loop)
    assert _entries(root) == []


# ---------------------------------------------------------------- delete


def test_delete_needs_exactly_one_of_step_and_tag(root):
    with Checkpointer(root, SMALL) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).wait(60)
        ckpt.save({"w": torch.ones(2)}, tag="best").wait(60)
        with pytest.raises(ConfigError, match="step= or tag=") as neither:
            ckpt.delete()
        assert "step=None, tag=None" in str(neither.value)
        with pytest.raises(ConfigError, match="step= or tag=") as both:
            ckpt.delete(step=1, tag="best")
        assert "step=1, tag='best'" in str(both.value)
        with pytest.raises(ConfigError, match="-1"):
            ckpt.delete(step=-1)
        assert [i.name for i in ckpt.list()] == ["step-0000000001", "best"]
        ckpt.delete(tag="best")
        ckpt.delete(step=1)
        assert ckpt.list() == []


# ---------------------------------------------------------------- lazy=


@pytest.mark.parametrize("lazy", ["auto", "always", "never"])
def test_lazy_setting_changes_when_save_returns_not_what_is_lazy(root, lazy):
    """The same tensors are lazy under every setting (the marked one; the plain one stays
    eager); "auto" without a guarded optimizer and "never" return with the snapshot complete;
    under "always" wait_snapshot() makes changing the lazy tensor safe."""
    plain, marked = torch.arange(64.0), torch.arange(128.0)
    with Checkpointer(root, SMALL.replace(lazy=lazy)) as ckpt:
        handle = ckpt.save({"plain": plain, "marked": datastates.lazy(marked)}, step=1)
        assert handle.stats.lazy_nbytes == marked.numel() * 4
        if lazy != "always":
            assert handle.snapshot_done()
        handle.wait_snapshot()
        plain.add_(1)
        marked.add_(1)
        handle.wait(60)
        loaded = ckpt.load(step=1)
    assert torch.equal(loaded["plain"], torch.arange(64.0))
    assert torch.equal(loaded["marked"], torch.arange(128.0))
