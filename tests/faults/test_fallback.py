"""Fallback resume (``restore(fallback=True)``): the newest checkpoint that verifies is restored,
a damaged newer one is skipped, quarantined and reported, and nothing live changes before the
checks passed. Multi-rank agreement is in tests/dist/test_fallback_dist.py."""

from __future__ import annotations

import glob
import logging
import os

import pytest
import torch

import datastates
from datastates.directory import TierCheckpointer
from datastates import Checkpointer, CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from datastates.format import codec as fmt
from datastates.storage.store import LocalStore

from testkit import step_state


def _blank() -> dict:
    return {"w": torch.zeros(3000), "b": torch.zeros(7), "meta": {"step": -1, "name": ""}}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["meta"] == b["meta"]


def _save_steps(ckpt: Checkpointer, steps) -> None:
    for s in steps:
        ckpt.save(step_state(s), step=s).wait()


def _shard(root: str, step: int) -> str:
    return os.path.join(root, fmt.step_name(step), fmt.shard_file_name(0))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.fixture()
def root(tmp_path):
    return str(tmp_path / "ckpts")


def test_a_damaged_payload_falls_back_and_is_quarantined(root, caplog):
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1, 2, 3))
        _flip(_shard(root, 3), 4096 + 17)  # inside the first tensor's bytes
        live = _blank()
        with caplog.at_level(logging.WARNING, logger="datastates"):
            report = ckpt.restore(live, fallback=True)
        assert report.step == 2 and _same(live, step_state(2))
        assert [s.name for s in report.skipped] == [fmt.step_name(3)]
        skipped = report.skipped[0]
        assert "checksum mismatch" in skipped.reason and skipped.reason.startswith("rank 0:")
        assert report.verified_nbytes == os.path.getsize(_shard(root, 2))
        # moved aside whole, never listed, with its reason; the log names it
        assert os.path.basename(skipped.quarantined).startswith(f".damaged.{fmt.step_name(3)}.")
        assert sorted(os.listdir(skipped.quarantined)) == sorted(
            [fmt.MANIFEST, "reason.txt", fmt.shard_file_name(0)]
        )
        with open(os.path.join(skipped.quarantined, "reason.txt")) as f:
            assert f.read() == skipped.reason
        assert [i.step for i in ckpt.list()] == [1, 2] and ckpt.latest().step == 2
        assert any(
            fmt.step_name(3) in r.getMessage() and "damaged" in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING
        )
        # the resume loop goes on: step 3 is saved again without overwrite=True
        ckpt.save(step_state(3), step=3).wait()
        live = _blank()
        assert ckpt.restore(live, fallback=True).skipped == [] and _same(live, step_state(3))


def test_a_damaged_index_and_a_missing_file_fall_back_further(root):
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1, 2, 3))
        size = os.path.getsize(_shard(root, 3))
        _flip(_shard(root, 3), size - 10)  # inside the index: its CRC no longer matches
        os.remove(_shard(root, 2))
        live = _blank()
        report = ckpt.restore(live, fallback=True)
        assert report.step == 1 and _same(live, step_state(1))
        assert [s.name for s in report.skipped] == [fmt.step_name(3), fmt.step_name(2)]
        assert "CheckpointNotFoundError" in report.skipped[1].reason
        assert all(s.quarantined for s in report.skipped)
        assert [i.step for i in ckpt.list()] == [1]


def test_nothing_intact_raises_and_leaves_the_live_state_alone(root):
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1, 2))
        for step in (1, 2):
            _flip(_shard(root, step), 4096 + 3)
        live = _blank()
        with pytest.raises(CheckpointNotFoundError, match="every rank can restore"):
            ckpt.restore(live, fallback=True)
        assert _same(live, _blank())
        assert ckpt.list() == []


def test_a_mismatch_is_no_damage(root):
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1, 2))
        live = _blank()
        live["w"] = torch.zeros(10)
        with pytest.raises(datastates.StateMismatchError):
            ckpt.restore(live, fallback=True)
        assert [i.step for i in ckpt.list()] == [1, 2]  # nothing skipped or moved
        assert not glob.glob(os.path.join(root, ".damaged.*"))
        assert torch.equal(live["w"], torch.zeros(10)) and live["meta"]["step"] == -1


class _ShardsUnreachable(LocalStore):
    """The local store, its service failing every open of a shard file (a timed-out HEAD)."""

    def open_read(self, path):
        if path.endswith(".dsf"):
            raise datastates.StorageError(f"{path}: HEAD failed: read timeout")
        return super().open_read(path)


def test_a_storage_failure_opening_a_shard_is_no_damage(root):
    """The store fails the opens of the shard files: the restore raises that StorageError; no
    checkpoint is skipped, moved aside or left out of the listing, and the live state is
    untouched (an outage never costs a good checkpoint)."""
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1, 2))
    with TierCheckpointer(root, store=_ShardsUnreachable()) as ckpt:
        live = _blank()
        with pytest.raises(datastates.StorageError, match="HEAD failed"):
            ckpt.restore(live, fallback=True)
        assert _same(live, _blank())
        assert [i.step for i in ckpt.list()] == [1, 2]
    assert not glob.glob(os.path.join(root, ".damaged.*"))


def test_fallback_takes_no_step_or_tag(root):
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1,))
        with pytest.raises(ConfigError, match="fallback=True"):
            ckpt.restore(_blank(), step=1, fallback=True)
        with pytest.raises(ConfigError, match="fallback=True"):
            ckpt.load(tag="x", fallback=True)


def test_load_falls_back_too(root):
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1, 2))
        _flip(_shard(root, 2), 4096 + 5)
        loaded = ckpt.load(fallback=True)
        assert _same(loaded, step_state(1))
        assert [i.step for i in ckpt.list()] == [1]


def test_a_damaged_manifest_is_passed_over_and_named(root):
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1, 2))
        with open(os.path.join(root, fmt.step_name(2), fmt.MANIFEST), "r+b") as f:
            f.seek(20)
            f.write(b"#")
        live = _blank()
        report = ckpt.restore(live, fallback=True)
        assert report.step == 1 and _same(live, step_state(1))
        assert report.passed_over == [fmt.step_name(2)] and report.skipped == []


def test_without_fallback_damage_is_a_typed_error_and_plain_values_stay(root):
    """Damage met while reading into the live tensors (no check first): CorruptCheckpointError;
    the plain values and what providers apply are set only after every read verified."""
    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1,))
        _flip(_shard(root, 1), 4096 + 5)
        live = _blank()
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            ckpt.restore(live)
        assert live["meta"] == {"step": -1, "name": ""}
        assert [i.step for i in ckpt.list()] == [1]  # nothing moved without fallback


def test_bytes_changed_after_the_check_are_an_error_not_a_fallback(root):
    """The window between the check and the reads: a reader planned and verified, then the file
    changes; applying the plan raises CorruptCheckpointError and leaves plain values alone."""
    from datastates.restore.reader import Reader

    with Checkpointer(root) as ckpt:
        _save_steps(ckpt, (1,))
        live = _blank()
        with Reader(os.path.join(root, fmt.step_name(1)), registry=ckpt.registry) as reader:
            plan = reader.plan_restore(live)
            assert reader.verify_planned(plan) == os.path.getsize(_shard(root, 1))
            _flip(_shard(root, 1), 4096 + 5)
            with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
                reader.apply(plan)
        assert live["meta"] == {"step": -1, "name": ""}
