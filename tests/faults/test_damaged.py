"""A damaged checkpoint (its ``manifest.json`` no longer reads or validates) is reported, never
skipped in silence, and never in the way: ``latest()``/``restore()`` log a WARNING naming it and
the checkpoint used, the documented resume loop keeps running (the next save of that name moves
the damaged directory aside, its bytes kept), and retention removes damaged directories only
once they are older than every checkpoint it keeps. Real files, damaged by flipping one bit."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer
from datastates.format import codec as fmt
from datastates.commit.catalog import DamagedCheckpoint
from datastates.errors import CheckpointExistsError, CheckpointNotFoundError

SMALL = dict(host_cache_bytes=256 << 10, chunk_bytes=16 << 10)


def flip_bit(path, offset: int | None = None, keep_mtime: bool = False) -> bytes:
    """Flip one bit of the file in place (the middle byte by default); returns the new bytes.
    ``keep_mtime``: damage that leaves the modification time as it was (a media error)."""
    before = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if offset is None else offset] ^= 0x04
    with open(path, "r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return bytes(data)


def warnings_of(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "datastates" and r.levelno == logging.WARNING
    ]


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def snapshot(model, opt, progress: dict) -> dict:
    """What a checkpoint of this state must hold, copied."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
        },
        "progress": dict(progress),
    }


def holds(loaded: dict, expected: dict) -> bool:
    """Bit-exact: every tensor the same bytes, the plain values equal."""
    if loaded["progress"] != expected["progress"]:
        return False
    if set(loaded["model"]) != set(expected["model"]):
        return False
    if not all(torch.equal(loaded["model"][k], v) for k, v in expected["model"].items()):
        return False
    state = loaded["optimizer"]["state"]
    return set(state) == set(expected["optimizer"]) and all(
        torch.equal(state[i][k], v) for i, s in expected["optimizer"].items() for k, v in s.items()
    )


def run_loop(directory, seed: int, stop: int, saved: dict):
    """The README's resume loop, saving every step, keep_last=3; records in ``saved`` what each
    checkpoint must hold. Returns the step it started at, the restore report (None: nothing to
    resume) and what the state held right after the restore."""
    model, opt = build(seed)
    progress = {"samples": 0}
    state = {"model": model, "optimizer": opt, "progress": progress}
    with Checkpointer(directory, CheckpointConfig(keep_last=3, **SMALL)) as ckpt:
        report = ckpt.restore(state) if ckpt.latest() else None
        start = report.step + 1 if report else 0
        resumed = snapshot(model, opt, state["progress"])
        for step in range(start, stop):
            train_step(model, opt, step)
            state["progress"]["samples"] += 32
            ckpt.save(state, step=step).wait(60)
            saved[step] = snapshot(model, opt, state["progress"])
    return start, report, resumed


@pytest.mark.slow
def test_readme_loop_resumes_past_a_damaged_newest_manifest(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datastates")
    saved: dict[int, dict] = {}
    assert run_loop(tmp_path, 0, 6, saved)[:2] == (0, None)
    newest = tmp_path / fmt.step_name(5)
    damaged_bytes = flip_bit(newest / fmt.MANIFEST)
    shard_bytes = (newest / fmt.shard_file_name(0)).read_bytes()
    caplog.clear()

    start, report, resumed = run_loop(tmp_path, 1, 9, saved)

    assert start == 5 and report.step == 4  # resumed from the previous good step
    assert holds(
        {
            "model": resumed["model"],
            "optimizer": {"state": resumed["optimizer"]},
            "progress": resumed["progress"],
        },
        saved[4],
    )
    assert report.passed_over == [fmt.step_name(5)]
    path = str(newest)
    reason = f"CorruptCheckpointError: {path}/{fmt.MANIFEST}: manifest checksum mismatch"
    warned = warnings_of(caplog)
    assert len(warned) == 3, warned
    for caller, text in zip(("latest()", "restore()"), warned[:2]):
        assert text.startswith(
            f"{caller} passed over the damaged checkpoint step-0000000005 at "
            f"{path} and used step-0000000004: {reason}"
        ), text
    moved = re.fullmatch(
        rf"the damaged checkpoint step-0000000005 was moved to "
        rf"({re.escape(str(tmp_path))}/\.damaged\.step-0000000005\.[0-9a-f]{{8}}) "
        rf"to make room for a new save of that name: (.*)",
        warned[2],
    )
    assert moved and moved.group(2).startswith(reason), warned[2]
    aside = moved.group(1)
    # the damaged bytes are still on disk, out of sight of every listing
    assert open(os.path.join(aside, fmt.MANIFEST), "rb").read() == damaged_bytes
    assert open(os.path.join(aside, fmt.shard_file_name(0)), "rb").read() == shard_bytes
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        assert [i.step for i in ckpt.list()] == [6, 7, 8] and ckpt.damaged() == []
        for step in (6, 7, 8):  # every later checkpoint restores bit-exactly
            assert holds(ckpt.load(step=step), saved[step]), step


def test_latest_and_damaged_name_a_newer_damaged_checkpoint(tmp_path, caplog):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
        flip_bit(tmp_path / fmt.step_name(3) / fmt.MANIFEST)
        caplog.clear()
        assert ckpt.latest().step == 2
        [damaged] = ckpt.damaged()
        assert isinstance(damaged, DamagedCheckpoint)
        assert (damaged.name, damaged.path) == (fmt.step_name(3), str(tmp_path / fmt.step_name(3)))
        assert damaged.reason.startswith("CorruptCheckpointError: ")
        assert damaged.mtime == os.stat(tmp_path / fmt.step_name(3) / fmt.MANIFEST).st_mtime
        assert warnings_of(caplog) == [
            f"latest() passed over the damaged checkpoint step-0000000003 at {damaged.path} and "
            f"used step-0000000002: {damaged.reason}"
        ]
        caplog.clear()
        loaded = ckpt.load()
        assert torch.equal(loaded["x"], torch.full((4,), 2.0))
        assert warnings_of(caplog) == [
            f"load() passed over the damaged checkpoint step-0000000003 at {damaged.path} and "
            f"used step-0000000002: {damaged.reason}"
        ]


def test_an_older_damaged_checkpoint_is_listed_but_not_passed_over(tmp_path, caplog):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    flip_bit(tmp_path / fmt.step_name(1) / fmt.MANIFEST, keep_mtime=True)
    caplog.clear()
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:  # a resumed job
        state = {"x": torch.zeros(4)}
        report = ckpt.restore(state)
        assert report.step == 2 and report.passed_over == []
        assert torch.equal(state["x"], torch.full((4,), 2.0))
        assert [d.name for d in ckpt.damaged()] == [fmt.step_name(1)]
        assert warnings_of(caplog) == []


def test_only_damaged_checkpoints(tmp_path, caplog):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        ckpt.save({"x": torch.ones(4)}, step=1).wait(60)
        flip_bit(tmp_path / fmt.step_name(1) / fmt.MANIFEST)
        caplog.clear()
        assert ckpt.latest() is None
        [text] = warnings_of(caplog)
        assert text.startswith(
            "latest() passed over the damaged checkpoint step-0000000001 at "
            f"{tmp_path / fmt.step_name(1)} and used none (no readable "
            "checkpoint): CorruptCheckpointError: "
        )
        with pytest.raises(
            CheckpointNotFoundError,
            match=r"no committed checkpoint in .*; step-0000000001 is damaged "
            r"\(CorruptCheckpointError: ",
        ):
            ckpt.restore({"x": torch.zeros(4)})


def test_overwrite_of_a_damaged_checkpoint_keeps_its_bytes(tmp_path, caplog):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        ckpt.save({"x": torch.ones(4)}, tag="best").wait(60)
        damaged = flip_bit(tmp_path / "best" / fmt.MANIFEST)
        ckpt.save({"x": torch.full((4,), 2.0)}, tag="best", overwrite=True).wait(60)
        assert torch.equal(ckpt.load(tag="best")["x"], torch.full((4,), 2.0))
    [aside] = [n for n in os.listdir(tmp_path) if n.startswith(".damaged.best.")]
    assert (tmp_path / aside / fmt.MANIFEST).read_bytes() == damaged
    assert any(
        t.startswith(f"the damaged checkpoint best was moved to {tmp_path / aside} ")
        for t in warnings_of(caplog)
    )


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path):
    taken = tmp_path / fmt.step_name(3)
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_bytes(b"mine")
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ckpt:
        for overwrite in (False, True):
            with pytest.raises(
                CheckpointExistsError,
                match=r"step-0000000003 exists and is not "
                r"a checkpoint \(it holds no "
                r"manifest.json datastates wrote\)",
            ):
                ckpt.save({"x": torch.ones(4)}, step=3, overwrite=overwrite)
        assert ckpt.list() == []
    assert sorted(os.listdir(taken)) == ["notes.txt"]
    assert (taken / "notes.txt").read_bytes() == b"mine"


def test_retention_removes_a_damaged_checkpoint_once_older_than_every_kept_one(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datastates")
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    flip_bit(tmp_path / fmt.step_name(1) / fmt.MANIFEST, keep_mtime=True)  # older than all kept
    flip_bit(tmp_path / fmt.step_name(4) / fmt.MANIFEST)  # damaged now: newer than step 3
    caplog.clear()
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=2, **SMALL)) as ckpt:
        ckpt.save({"x": torch.full((4,), 5.0)}, step=5).wait(60)
        assert [i.step for i in ckpt.list()] == [3, 5]
        assert [d.name for d in ckpt.damaged()] == [fmt.step_name(4)]
    names = sorted(n for n in os.listdir(tmp_path) if not n.startswith("latest"))
    assert names == [fmt.step_name(3), fmt.step_name(4), fmt.step_name(5)]
    infos = [
        r.getMessage()
        for r in caplog.records
        if r.name == "datastates"
        and r.levelno == logging.INFO
        and r.getMessage().startswith("retention")
    ]
    assert len(infos) == 2 and infos[0].startswith("retention deleted step-0000000002 (")
    assert infos[1].startswith(
        "retention deleted the damaged checkpoint step-0000000001, older "
        "than every checkpoint kept: CorruptCheckpointError: "
        f"{tmp_path / fmt.step_name(1) / fmt.MANIFEST}: manifest checksum "
        "mismatch"
    ), infos[1]


def _object_key(url: str) -> str:
    return url.split("/", 3)[3]


def test_object_store_damaged_newest_is_reported_and_replaced(
    s3_server, s3_root, s3_storage_options, caplog
):
    client = s3_server.client()
    with Checkpointer(
        s3_root, CheckpointConfig(**SMALL), storage_options=s3_storage_options
    ) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
        key = f"{_object_key(s3_root)}/{fmt.step_name(2)}/{fmt.MANIFEST}"
        body = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
        body[len(body) // 2] ^= 0x04
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(body))
        caplog.clear()
        assert ckpt.latest().step == 1
        assert [d.name for d in ckpt.damaged()] == [fmt.step_name(2)]
        ckpt.save({"x": torch.full((4,), 7.0)}, step=2).wait(60)
        assert torch.equal(ckpt.load(step=2)["x"], torch.full((4,), 7.0))
        assert ckpt.damaged() == []
    warned = warnings_of(caplog)
    assert len(warned) == 2, warned
    assert warned[0].startswith(
        "latest() passed over the damaged checkpoint step-0000000002 at "
        f"{s3_root}/step-0000000002 and used step-0000000001: "
        "CorruptCheckpointError: "
    )
    assert warned[1].startswith(
        f"the damaged checkpoint {s3_root}/step-0000000002 is replaced by a new save of that name"
    )


def _newer_format(ckpt_dir) -> None:
    """Rewrite a checkpoint's manifest as a newer datastates would (a newer version), sealed: intact,
    only unreadable to this version."""
    path = ckpt_dir / fmt.MANIFEST
    raw = path.read_bytes()
    body = json.loads(raw[: raw.rindex(b',"manifest_crc32"')] + b"}")
    body["version"] = fmt.SPLIT_VERSION + 1  # newer than any this reader reads
    path.write_bytes(fmt.seal_manifest(json.dumps(body, separators=(",", ":")).encode()))
    old = os.stat(path).st_mtime - 3600
    os.utime(path, (old, old))


def test_retention_never_deletes_a_kept_step_or_a_newer_format_it_cannot_read(tmp_path):
    """A damaged checkpoint whose step keep_every keeps (or may keep: an unreadable tag), and a
    checkpoint of a newer format, survive retention however old their manifests are."""
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
        ckpt.save({"x": torch.zeros(4)}, tag="best").wait(60)
    flip_bit(tmp_path / fmt.step_name(2) / fmt.MANIFEST, keep_mtime=True)  # a kept milestone
    flip_bit(tmp_path / "best" / fmt.MANIFEST, keep_mtime=True)  # step unknown
    flip_bit(tmp_path / fmt.step_name(1) / fmt.MANIFEST, keep_mtime=True)  # not a milestone
    _newer_format(tmp_path / fmt.step_name(3))
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=1, keep_every=2, **SMALL)) as ckpt:
        assert [d.newer_format for d in ckpt.damaged()] == [False, False, False, True]
        for step in (5, 7):
            ckpt.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    names = sorted(n for n in os.listdir(tmp_path) if not n.startswith(("latest", ".")))
    assert names == ["best", fmt.step_name(2), fmt.step_name(3), fmt.step_name(7)], names


def test_a_lease_that_cannot_be_opened_keeps_its_temporaries_and_breaks_nothing(tmp_path):
    """A lease file that is a link (or another user's): the directory still opens, and the
    temporaries of that owner are kept, as a live owner's are."""
    token = "0123456789abcdef"
    (tmp_path / f".owner.{token}").symlink_to(tmp_path / "elsewhere")
    leftover = tmp_path / f".tmp.step-0000000009.{token}-0"
    leftover.mkdir()
    with Checkpointer(tmp_path, CheckpointConfig(stale_tmp_age_s=1e-6, **SMALL)) as ckpt:
        ckpt.save({"x": torch.ones(4)}, step=1).wait(60)
        assert [i.step for i in ckpt.list()] == [1]
    assert leftover.is_dir() and (tmp_path / f".owner.{token}").is_symlink()
