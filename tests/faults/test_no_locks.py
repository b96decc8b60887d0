"""A local root on a file system that refuses ``flock`` (Lustre mounted without it, some FUSE
file systems): saves, overwrites, deletions and restores work without leases, with one WARNING,
and the cleanup of stale temporaries falls back to age alone.

The refusal is played at the one call that locks a lease file
(``datastates.storage.temporaries.flock``), which raises as such a file system's ``flock(2)`` does.
"""

from __future__ import annotations

import errno
import logging
import os
import time

import pytest
import torch

import datastates
from datastates.commit import retention
from datastates.format import codec as fmt
from datastates.storage import temporaries

from _faults_helpers import WAIT_S, assert_bit_exact, hidden_entries, zeros_like_state

SMALL = dict(host_cache_bytes=256 << 10, chunk_bytes=16 << 10)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(20_000, generator=g),
            "b": torch.randn(33, generator=g).to(torch.float64),
        },
        "ids": torch.randint(-99, 99, (500,), generator=g),
        "step": seed,
    }


def _lock_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "datastates"
        and r.levelno == logging.WARNING
        and "refused a lock" in r.getMessage()
    ]


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK])
def test_a_root_without_flock_saves_and_cleans_up_by_age(tmp_path, monkeypatch, caplog, code):
    def no_flock(fd, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(temporaries, "flock", no_flock)
    caplog.set_level(logging.WARNING, logger="datastates")
    root = tmp_path / "root"
    config = datastates.CheckpointConfig(keep_last=3, **SMALL)
    with datastates.Checkpointer(root, config) as ck:
        for step in (1, 2, 3):
            ck.save(_state(step), step=step).wait(WAIT_S)
        ck.save(_state(10), tag="best", step=3).wait(WAIT_S)  # step 1 deleted by retention
        ck.save(_state(11), tag="best", step=3, overwrite=True).wait(WAIT_S)  # replaced
        ck.delete(step=2)
        live = zeros_like_state(_state(0))
        report = ck.restore(live, tag="best")
        assert_bit_exact(live, _state(11))
        assert report.name == "best"
        assert_bit_exact(ck.load(step=3), _state(3))
        assert [i.name for i in ck.list()] == [fmt.step_name(3), "best"]
    assert len(_lock_warnings(caplog)) == 1, caplog.text  # once for the root, not per save
    assert hidden_entries(root) == []
    assert [n for n in os.listdir(root) if n.startswith(temporaries.LEASE_PREFIX)] == []

    # Two dead saves' directories, one old and one fresh, the old one with a lease file whose
    # lock can be neither taken nor tested: the cleanup goes by age alone.
    old, fresh = (root / f".tmp.step-000000000{n}.{n}{'0' * 15}-0" for n in (7, 8))
    for folder in (old, fresh):
        folder.mkdir()
        (folder / fmt.shard_file_name(0)).write_bytes(b"partial")
    (root / (temporaries.LEASE_PREFIX + "7" + "0" * 15)).write_bytes(b"")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    removed = retention.clean_stale(str(root), 600.0)
    assert removed == [old.name]
    assert hidden_entries(root) == [fresh.name]
    assert len(_lock_warnings(caplog)) == 1
