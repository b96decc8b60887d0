"""The small records beside checkpoints (format/small_records.py) are parsed as every record of
the format is: each malformed one is refused with one typed error naming where it came from, the
field, what was expected and what was found."""

from __future__ import annotations

import json
import signal
from collections import OrderedDict

import pytest

from datastates import ConfigError, CorruptCheckpointError, ElasticSampler
from datastates.format import small_records as sr
from datastates.preemption import StopPlan

USR1 = int(signal.SIGUSR1)
WHERE = "the stop plan 'preemption/1/stop'"


def _plan(**fields) -> bytes:
    return json.dumps({"step": 7, "signum": USR1, "rank": 1, **fields}).encode()


def test_a_stop_plan_reads_back():
    assert StopPlan.parse(StopPlan(7, USR1, 1).to_json().encode(), WHERE) == StopPlan(7, USR1, 1)


@pytest.mark.parametrize(
    "raw, where, found",
    [
        (b"", "top level", "expected JSON, found b''"),
        (b"\xff", "top level", "expected JSON, found b'\\xff'"),
        (b"[7]", "top level", "expected an object, found list [7]"),
        (_plan(step=-1), "step", "expected an integer in [0, 9223372036854775807], found -1"),
        (_plan(step=True), "step", "expected an integer, found bool True"),
        (_plan(rank="1"), "rank", "expected an integer, found str '1'"),
        (_plan(signum=0), "signum", "expected an integer in [1, 65536], found 0"),
        (
            _plan(extra=1),
            "top level",
            "expected the fields ['rank', 'signum', 'step'], found ['extra', 'rank', 'signum', 'step']",
        ),
        (
            b'{"step": 7, "rank": 1}',
            "top level",
            "expected the fields ['rank', 'signum', 'step'], found ['rank', 'step']",
        ),
    ],
)
def test_a_malformed_stop_plan_is_refused(raw, where, found):
    with pytest.raises(CorruptCheckpointError) as info:
        StopPlan.parse(raw, WHERE)
    assert str(info.value) == f"{WHERE}: {where}: {found}"


def test_a_stop_plan_names_a_signal_of_this_platform():
    missing = next(n for n in range(1, 65536) if n not in signal.valid_signals())
    with pytest.raises(
        CorruptCheckpointError,
        match=f"signum: expected a signal number of this platform, found {missing}$",
    ):
        StopPlan.parse(_plan(signum=missing), WHERE)


# ---------------------------------------------------------------- a data loader's position

GOOD = {"seed": 3, "shuffle": True, "epoch": 2, "consumed": 5, "dataset_len": 37}


@pytest.mark.parametrize(
    "state, found",
    [
        ([1, 2], "top level: expected an object, found list [1, 2]"),
        (None, "top level: expected an object, found NoneType None"),
        (
            {**GOOD, "rank": 0},
            "top level: expected the fields ['consumed', 'dataset_len', 'epoch', "
            "'seed', 'shuffle'], found ['consumed', 'dataset_len', 'epoch', "
            "'rank', 'seed', 'shuffle']",
        ),
        (
            {**GOOD, 1: 0},
            "top level: expected the fields ['consumed', 'dataset_len', 'epoch', "
            "'seed', 'shuffle'], found ['1', 'consumed', 'dataset_len', 'epoch', "
            "'seed', 'shuffle']",
        ),
        ({**GOOD, "seed": 2**63}, f"seed: expected an integer in [0, {2**63 - 1}], found {2**63}"),
        ({**GOOD, "epoch": 1.0}, "epoch: expected an integer, found float 1.0"),
        ({**GOOD, "shuffle": 1}, "shuffle: expected true or false, found int 1"),
        ({**GOOD, "dataset_len": "37"}, "dataset_len: expected an integer, found str '37'"),
        (
            {**GOOD, "consumed": 38},
            "consumed: expected at most the dataset's length 37 (and at least 0), found 38",
        ),
        ({**GOOD, "consumed": True}, "consumed: expected an integer, found bool True"),
    ],
)
def test_a_malformed_position_is_a_config_error(state, found):
    with pytest.raises(ConfigError) as info:
        sr.parse_position(state, "ElasticSampler.load_state_dict")
    assert str(info.value) == f"ElasticSampler.load_state_dict: {found}"
    sampler = ElasticSampler(range(37), num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match="^ElasticSampler.load_state_dict: "):
        sampler.load_state_dict(state)
    assert (sampler.epoch, sampler.consumed) == (0, 0)


def test_a_position_may_be_any_mapping():
    assert sr.parse_position(OrderedDict(GOOD), "here") == GOOD
    assert type(sr.parse_position(GOOD, "here")) is dict


# ---------------------------------------------------------------- the keeper's marks

DIGEST = "ab" * 32


def _mark(**fields) -> bytes:
    return json.dumps(
        {"name": "step-1", "manifest": DIGEST, "files": {"rank-00000.dsf": [1, 2, 3, 4]}, **fields}
    ).encode()


def test_a_mark_reads_back():
    mark = sr.Mark("step-1", DIGEST, {"rank-00000.dsf": (1, 2, 3, 4)})
    assert sr.parse_mark(json.dumps(mark.to_json()).encode(), "m") == mark


@pytest.mark.parametrize(
    "raw, found",
    [
        (b"{", "top level: expected JSON, found b'{'"),
        (
            _mark(manifest="AB" * 32),
            f"manifest: expected 64 hex digits (a SHA-256), found str '{('AB' * 20)[:39]}...",
        ),
        (_mark(files={}), "files: expected at least one file, found none"),
        (_mark(files=[]), "files: expected an object, found list []"),
        (
            _mark(files={"../x": [1, 2, 3, 4]}),
            "files.../x: expected a file name without a path, found str '../x'",
        ),
        (
            _mark(files={"a": [1, 2, 3]}),
            "files.a: expected [size, inode, mtime_ns, ctime_ns], found 3 values",
        ),
        (
            _mark(files={"a": [1, 2, 3, -4]}),
            f"files.a[3]: expected an integer in [0, {(1 << 64) - 1}], found -4",
        ),
        (_mark(name=1), "name: expected a string, found int 1"),
    ],
)
def test_a_malformed_mark_is_refused(raw, found):
    with pytest.raises(CorruptCheckpointError) as info:
        sr.parse_mark(raw, "/mem/verified/step-1")
    assert str(info.value) == f"/mem/verified/step-1: {found}"
