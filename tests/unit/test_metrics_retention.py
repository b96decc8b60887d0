"""Metrics saved with a checkpoint (``save(metrics=...)``) and retention by them (``keep_best``):
what save() refuses, how the manifest records them and how a reader checks them, which
checkpoints a root keeps, and where the tools show them."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

import datastates
from datastates import CheckpointConfig, Checkpointer, ConfigError, CorruptCheckpointError
from datastates import format as fmt
from datastates.commit import catalog, review
from datastates.commit.retention import RetentionPolicy
from datastates.format import files, validate
from datastates.format.records import CheckpointInfo, Verdict
from datastates.tools.cli import EXIT_OK, main

SMALL = dict(host_cache_bytes=256 << 10, chunk_bytes=64 << 10)
#: The validation loss of steps 1..6: the lowest are steps 4 and 2, the highest 3 and 5.
LOSSES = [0.5, 0.2, 0.9, 0.1, 0.7, 0.3]


def _save_all(root, metrics_of, **config) -> list[str]:
    """One checkpoint per entry of ``metrics_of`` (steps 1, 2, ...; None: no metrics); the names
    the root keeps, oldest first."""
    with Checkpointer(root, CheckpointConfig(**SMALL, **config)) as ck:
        for step, metrics in enumerate(metrics_of, 1):
            ck.save({"w": torch.full((4,), float(step))}, step=step, metrics=metrics).wait()
        kept = [i.name for i in ck.list()]
    assert kept == [i.name for i in catalog.list_checkpoints(str(root))]  # as on disk
    return kept


def _names(*steps) -> list[str]:
    return [fmt.step_name(s) for s in steps]


def _info(order: int, metrics: dict) -> CheckpointInfo:
    return CheckpointInfo(
        name=f"c{order}",
        path=f"/d/c{order}",
        step=order,
        created_unix=0.0,
        world_size=1,
        nbytes=0,
        seq=order + 1,
        metrics=metrics,
    )


# ------------------------------------------------------------------ which checkpoints are kept


def test_keep_best_min_keeps_the_lowest_and_the_newest(tmp_path):
    kept = _save_all(
        tmp_path,
        [{"val_loss": v} for v in LOSSES],
        keep_last=1,
        keep_best=2,
        best_metric="val_loss",
    )
    assert kept == _names(2, 4, 6)


def test_keep_best_max_keeps_the_highest_and_the_newest(tmp_path):
    kept = _save_all(
        tmp_path,
        [{"acc": v} for v in LOSSES],
        keep_last=1,
        keep_best=2,
        best_metric="acc",
        best_mode="max",
    )
    assert kept == _names(3, 5, 6)


def test_the_newest_is_kept_whatever_its_metric(tmp_path):
    kept = _save_all(
        tmp_path,
        [{"val_loss": v} for v in (0.1, 0.2, 5.0)],
        keep_last=1,
        keep_best=1,
        best_metric="val_loss",
    )
    assert kept == _names(1, 3)


def test_of_equal_values_the_newer_wins(tmp_path):
    kept = _save_all(
        tmp_path,
        [{"val_loss": v} for v in (0.3, 0.1, 0.1, 0.5)],
        keep_last=1,
        keep_best=1,
        best_metric="val_loss",
    )
    assert kept == _names(3, 4)


def test_a_checkpoint_without_the_metric_is_never_best_but_other_rules_keep_it(tmp_path):
    saves = [{"val_loss": 0.1}, None, {"acc": 1.0}, {"val_loss": 0.5}, None]
    kept = _save_all(tmp_path / "a", saves, keep_last=1, keep_best=3, best_metric="val_loss")
    assert kept == _names(1, 4, 5)  # 2 and 3 lack it; 5, the newest, lacks it too
    kept = _save_all(
        tmp_path / "b", saves, keep_last=1, keep_every=2, keep_best=1, best_metric="val_loss"
    )
    assert kept == _names(1, 2, 4, 5)  # 2 and 4 by keep_every


def test_keep_best_without_keep_last_keeps_everything(tmp_path):
    kept = _save_all(
        tmp_path, [{"val_loss": v} for v in LOSSES], keep_best=1, best_metric="val_loss"
    )
    assert kept == _names(1, 2, 3, 4, 5, 6)


def test_best_ranks_by_value_then_newer_and_skips_those_without():
    found = [
        _info(0, {"m": 2}),
        _info(1, {"m": 1.5}),
        _info(2, {}),
        _info(3, {"m": 2.0}),
        _info(4, {"other": 0}),
    ]
    low = RetentionPolicy(keep_last=1, keep_best=3, best_metric="m")
    assert low.best(found) == ["c1", "c3", "c0"]
    high = RetentionPolicy(keep_last=1, keep_best=2, best_metric="m", best_mode="max")
    assert high.best(found) == ["c3", "c0"]
    assert RetentionPolicy(keep_last=1).best(found) == []
    assert RetentionPolicy(keep_last=1, keep_best=9, best_metric="none").best(found) == []


def test_the_config_builds_the_policy(tmp_path):
    config = CheckpointConfig(
        **SMALL, keep_last=2, keep_every=5, keep_best=3, best_metric="acc", best_mode="max"
    )
    with Checkpointer(tmp_path, config) as ck:
        assert ck.storage.retention == RetentionPolicy(2, 5, 3, "acc", "max")


# ------------------------------------------------------------------ the configuration


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"keep_best": 2}, "best_metric"),
        ({"keep_best": 0, "best_metric": "m"}, "keep_best"),
        ({"keep_best": -1, "best_metric": "m"}, "keep_best"),
        ({"keep_best": True, "best_metric": "m"}, "keep_best"),
        ({"keep_best": 1.0, "best_metric": "m"}, "keep_best"),
        ({"keep_best": 1, "best_metric": ""}, "best_metric"),
        ({"keep_best": 1, "best_metric": 3}, "best_metric"),
        ({"keep_best": 1, "best_metric": "m", "best_mode": "median"}, "best_mode"),
        ({"best_mode": None}, "best_mode"),
    ],
)
def test_config_refuses_bad_best_fields(fields, named):
    with pytest.raises(ConfigError, match=named) as info:
        CheckpointConfig(**fields)
    assert info.type is ConfigError


def test_config_defaults_keep_no_best():
    config = CheckpointConfig()
    assert (config.keep_best, config.best_metric, config.best_mode) == (None, None, "min")
    assert CheckpointConfig(best_metric="m").keep_best is None  # named, not used


# ------------------------------------------------------------------ save(metrics=...)


@pytest.mark.parametrize(
    "metrics, error, named",
    [
        ({"loss": math.nan}, ValueError, "'loss'"),
        ({"loss": math.inf}, ValueError, "'loss'"),
        ({"loss": -math.inf}, ValueError, "'loss'"),
        ({"ok": True}, TypeError, "'ok'"),
        ({"loss": "0.3"}, TypeError, "'loss'"),
        ({"loss": None}, TypeError, "'loss'"),
        ({"loss": torch.tensor(0.3)}, TypeError, "'loss'"),
        ({"loss": 0.3, 7: 0.1}, TypeError, "7"),
        ([("loss", 0.3)], TypeError, "dict"),
        ("loss=0.3", TypeError, "dict"),
    ],
)
def test_bad_metrics_are_refused_with_nothing_written(tmp_path, metrics, error, named):
    root = tmp_path / "ck"
    with Checkpointer(root, CheckpointConfig(**SMALL)) as ck:
        with pytest.raises(error, match=named) as info:
            ck.save({"w": torch.ones(4)}, step=1, metrics=metrics)
        assert info.type is error
        assert ck.list() == []
        assert not root.exists() or os.listdir(root) == []
        ck.save({"w": torch.ones(4)}, step=1, metrics={"loss": 0.3}).wait()  # still usable
        assert [i.metrics for i in ck.list()] == [{"loss": 0.3}]


def test_metrics_are_recorded_exactly_and_given_back(tmp_path):
    metrics = {
        "val_loss": 0.30999999403953857,
        "tokens": 1 << 40,
        "acc": np.float64(0.75),
        "epoch": 0,
    }
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        info = ck.save({"w": torch.ones(4)}, step=1, metrics=metrics).wait()
        assert info.metrics == metrics
        assert ck.save({"w": torch.ones(4)}, step=2).wait().metrics == {}
    on_disk = files.read_manifest(str(tmp_path / fmt.step_name(1)))
    assert on_disk.metrics == metrics
    assert [type(v) for v in on_disk.metrics.values()] == [float, int, float, int]
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:  # read back by a new one
        assert [i.metrics for i in ck.list()] == [metrics, {}]
    raw = json.loads((tmp_path / fmt.step_name(2) / fmt.MANIFEST).read_bytes())
    assert raw["metrics"] == {}  # optional to readers; written always, in the head


# ------------------------------------------------------------------ the manifest field


def _report(rank: int):
    entries = [
        {
            "key": "a",
            "kind": "tensor",
            "dtype": "float32",
            "shape": [],
            "offset": 4096,
            "nbytes": 4,
            "checksums": [[4, 7]],
        }
    ]
    return validate.parse_rank_report(
        {
            "rank": rank,
            "save": {"name": "step-0000000001", "step": 1, "nonce": "n"},
            "root": "/d",
            "entries": entries,
            "tree": {"t": "dict", "items": [["a", {"t": "tensor", "e": 0}]]},
            "file": {"name": fmt.shard_file_name(rank), "nbytes": 8192, "index_crc32": 1},
        },
        f"rank {rank}",
    )


@pytest.mark.parametrize("metrics", [None, {}, {"val_loss": 0.31, "step_tokens": 12}])
def test_manifest_json_round_trips_with_and_without_metrics(metrics):
    manifest = review.build_manifest(
        [_report(0)], name="step-0000000001", step=1, metadata={}, save_id="n", metrics=metrics
    )
    manifest = dataclasses.replace(manifest, seq=1)  # as published
    obj = manifest.to_json()
    assert obj["metrics"] == (metrics or {})  # always written: part of the head
    parsed = validate.parse_manifest(json.loads(fmt.encode_json(obj)), "m.json")
    assert parsed == manifest and parsed.metrics == (metrics or {})
    data, written = fmt.manifest_record_bytes(manifest)
    assert fmt.parse_manifest_bytes(data, "m.json") == written == manifest


def test_a_reader_skips_fields_it_does_not_know():
    manifest = review.build_manifest(
        [_report(0)], name="step-0000000001", step=1, metadata={}, metrics={"m": 1}
    )
    obj = {
        **json.loads(fmt.encode_json(manifest.to_json())),
        "seq": 1,
        "some_later_field": {"x": [1, 2]},
    }
    assert validate.parse_manifest(obj, "m.json").metrics == {"m": 1}


def test_the_verdict_carries_the_metrics():
    info = CheckpointInfo(
        name="a",
        path="/d/a",
        step=3,
        created_unix=1.5,
        world_size=2,
        nbytes=9,
        seq=4,
        metrics={"val_loss": 0.25, "n": 3},
    )
    verdict = Verdict.committed(info)
    assert validate.parse_verdict(json.loads(fmt.encode_json(verdict.to_json())), "v") == verdict
    with pytest.raises(CorruptCheckpointError, match="metrics"):
        validate.parse_verdict({"ok": True, "info": {**info.to_json(), "metrics": {"n": "3"}}}, "v")


@pytest.mark.parametrize(
    "bad",
    [
        [0.3],
        "0.3",
        {"loss": True},
        {"loss": "0.3"},
        {"loss": None},
        {"loss": [0.3]},
        {"loss": {"v": 1}},
        {"loss": 1e400},
        {"loss": -1e400},
    ],
)
def test_a_hostile_metrics_field_is_refused_by_the_reader(tmp_path, bad):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.save({"w": torch.ones(4)}, step=1, metrics={"loss": 0.3}).wait()
    ckpt = tmp_path / fmt.step_name(1)
    path = ckpt / fmt.MANIFEST
    obj = json.loads(path.read_bytes())
    obj.pop("manifest_crc32")
    body = json.dumps(obj, separators=(",", ":"))
    body = body.replace('"metrics":{"loss":0.3}', '"metrics":' + json.dumps(bad))
    body = body.replace("Infinity", "1e400")  # valid JSON that decodes to an infinity
    path.write_bytes(fmt.seal_manifest(body.encode()))
    with pytest.raises(CorruptCheckpointError, match="metrics") as info:
        files.read_manifest(str(ckpt))
    assert info.type is CorruptCheckpointError
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        assert ck.list() == [] and [d.name for d in ck.damaged()] == [fmt.step_name(1)]
        with pytest.raises(CorruptCheckpointError, match="metrics"):
            ck.load(step=1)


# ------------------------------------------------------------------ the tools


def test_cli_list_shows_the_metrics(tmp_path, capsys):
    _save_all(tmp_path, [{"val_loss": 0.31, "acc": 0.5}, None])
    assert main(["list", str(tmp_path)]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "metrics"
    first = next(line for line in lines if fmt.step_name(1) in line)
    assert first.endswith("acc=0.5 val_loss=0.31")
    second = next(line for line in lines if fmt.step_name(2) in line)
    assert second.split()[-1] == "-"


def test_cli_list_without_metrics_has_no_metrics_column(tmp_path, capsys):
    _save_all(tmp_path, [None, None])
    assert main(["list", str(tmp_path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-1] == "ranks" and "metrics" not in out


def test_inspect_shows_the_metrics(tmp_path, capsys):
    _save_all(tmp_path, [{"val_loss": 0.31}, None])
    assert datastates.inspect(tmp_path, step=1)["metrics"] == {"val_loss": 0.31}
    assert datastates.inspect(tmp_path, step=2)["metrics"] == {}
    assert main(["inspect", str(tmp_path), "--step", "1"]) == EXIT_OK
    assert "metrics     val_loss=0.31" in capsys.readouterr().out.splitlines()
    assert main(["inspect", str(tmp_path), "--step", "1", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["metrics"] == {"val_loss": 0.31}
