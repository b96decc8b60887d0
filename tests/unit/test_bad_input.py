"""Bad input to the public API: each case raises its exact error type, at the call that got the
bad input, with a message that says what is wrong, and leaves the directory and live state as
they were."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

import datastates
from datastates import (
    CheckpointConfig,
    CheckpointExistsError,
    CheckpointNotFoundError,
    Checkpointer,
    ConfigError,
    RestoreReport,
    SerializationError,
    StateMismatchError,
    UnsafeObjectError,
)
from testkit import SMALL


@dataclasses.dataclass
class Point:
    """A user class at module level: picklable, but not on the safe-loading allowlist."""

    x: int
    y: float


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
        )
    )


def entries(directory) -> list[str]:
    """What is left in the directory (a Checkpointer creates it only at its first save)."""
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


@pytest.fixture
def ck(tmp_path):
    with Checkpointer(tmp_path / "ck", SMALL) as ck:
        yield ck


def mlp(out: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, out))


# ---------------------------------------------------------------- directory and missing checkpoints


def test_directory_is_a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    with pytest.raises((FileExistsError, NotADirectoryError)) as info:
        Checkpointer(path, SMALL)
    assert str(path) in str(info.value)
    with pytest.raises(NotADirectoryError):
        Checkpointer(path / "sub", SMALL)
    assert path.read_text() == "x"


def test_restore_and_load_with_no_checkpoint(ck):
    live = {"w": torch.ones(3)}
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        ck.restore(live)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        ck.load()
    assert isinstance(CheckpointNotFoundError(), FileNotFoundError)
    assert same_bits(live["w"], torch.ones(3))
    assert ck.list() == [] and ck.latest() is None


def test_missing_step_or_tag(ck):
    ck.save({"w": torch.ones(3)}, step=1).wait(60)
    with pytest.raises(CheckpointNotFoundError, match="step-0000000123"):
        ck.load(step=123)
    with pytest.raises(CheckpointNotFoundError, match="step-0000000123"):
        ck.restore({"w": torch.ones(3)}, step=123)
    with pytest.raises(CheckpointNotFoundError, match="nightly"):
        ck.load(tag="nightly")
    with pytest.raises(CheckpointNotFoundError):
        ck.delete(step=7)


# ---------------------------------------------------------------- restore mismatches


def test_shape_mismatch_raises_and_modifies_nothing(ck):
    ck.save({"model": mlp(out=4), "t": torch.arange(10.0)}, step=1).wait(60)
    live_model, live_t = mlp(out=5, seed=1), torch.full((10,), -1.0)
    before = copy.deepcopy(live_model.state_dict())
    with pytest.raises(StateMismatchError) as info:
        ck.restore({"model": live_model, "t": live_t})
    msg = str(info.value)
    assert "model/2.weight" in msg and "model/2.bias" in msg
    assert "[4, 8]" in msg and "[5, 8]" in msg
    assert "Nothing was modified" in msg
    assert isinstance(info.value, ValueError)
    # Not even the tensors that do match were touched.
    for k, v in live_model.state_dict().items():
        assert same_bits(v, before[k]), k
    assert same_bits(live_t, torch.full((10,), -1.0))


def test_dtype_mismatch_raises(ck):
    ck.save({"t": torch.arange(6, dtype=torch.int64)}, step=1).wait(60)
    live = {"t": torch.zeros(6, dtype=torch.int32)}
    with pytest.raises(StateMismatchError, match=r"t \(checkpoint int64\[6\], live int32\[6\]\)"):
        ck.restore(live)
    assert same_bits(live["t"], torch.zeros(6, dtype=torch.int32))


@pytest.mark.parametrize("change", ["missing", "unexpected", "both"])
def test_key_mismatch_strict(ck, change):
    saved = {"a": torch.arange(4.0), "b": torch.arange(5.0)}
    ck.save(saved, step=1).wait(60)
    live = {"a": torch.zeros(4), "b": torch.zeros(5)}
    if change in ("missing", "both"):
        live["c"] = torch.zeros(2)
    if change in ("unexpected", "both"):
        del live["b"]
    with pytest.raises(StateMismatchError) as info:
        ck.restore(live)
    msg = str(info.value)
    if change in ("missing", "both"):
        assert "missing from the checkpoint: c" in msg
    if change in ("unexpected", "both"):
        assert "not in the live state: b" in msg
    assert all(same_bits(v, torch.zeros_like(v)) for v in live.values())


def test_non_strict_restores_what_matches(ck):
    saved = {
        "model": mlp(out=4),
        "a": torch.arange(4.0),
        "gone": torch.ones(2),
        "t": torch.arange(3),
    }
    ck.save(saved, step=1).wait(60)
    live_model = mlp(out=5, seed=1)
    before = copy.deepcopy(live_model.state_dict())
    live = {
        "model": live_model,
        "a": torch.zeros(4),
        "new": torch.zeros(7),
        "t": torch.zeros(3, dtype=torch.int32),
    }
    report = ck.restore(live, strict=False)
    assert isinstance(report, RestoreReport)
    assert report.name == "step-0000000001" and report.step == 1
    assert report.missing == ["new"]
    assert report.unexpected == ["gone"]
    assert sorted(m.split(" ")[0] for m in report.mismatched) == [
        "model/2.bias",
        "model/2.weight",
        "t",
    ]
    assert sorted(report.restored) == ["a", "model/0.bias", "model/0.weight"]
    # Restored: bit-exact. Mismatched or missing: untouched.
    assert same_bits(live["a"], torch.arange(4.0))
    sd, ref = live_model.state_dict(), saved["model"].state_dict()
    assert same_bits(sd["0.weight"], ref["0.weight"]) and same_bits(sd["0.bias"], ref["0.bias"])
    assert same_bits(sd["2.weight"], before["2.weight"])
    assert same_bits(sd["2.bias"], before["2.bias"])
    assert same_bits(live["new"], torch.zeros(7))
    assert same_bits(live["t"], torch.zeros(3, dtype=torch.int32))


def test_restore_into_wrong_kind_of_object(ck):
    ck.save({"model": mlp()}, step=1).wait(60)
    with pytest.raises(StateMismatchError, match="model"):
        ck.restore({"model": torch.optim.SGD(mlp().parameters(), lr=0.1)})


# ---------------------------------------------------------------- Python objects


def _local_class_instance():
    class Local:
        pass

    return Local()


@pytest.mark.parametrize(
    "obj,what",
    [
        (lambda x: x, "function"),
        (_local_class_instance(), "Local"),
        ((i for i in range(3)), "generator"),
        (__import__("threading").Lock(), "lock"),
    ],
)
def test_unpicklable_object_fails_in_save(ck, obj, what):
    ck.save({"w": torch.ones(2)}, step=1).wait(60)
    before = entries(ck.directory)
    with pytest.raises(SerializationError) as info:
        ck.save({"w": torch.ones(2), "inner": {"bad": obj}}, step=2)
    msg = str(info.value)
    assert "'inner/bad'" in msg and what in msg
    assert isinstance(info.value, TypeError)
    assert entries(ck.directory) == before  # nothing started in the background
    ck.save({"w": torch.ones(2)}, step=2).wait(60)  # and the Checkpointer still works
    assert [i.step for i in ck.list()] == [1, 2]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), (2, 4)),
        lambda: torch.sparse_coo_tensor(
            torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (0, 4)
        ),
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.ones(3).to_mkldnn(),
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        lambda: torch.empty(3, device="meta"),
    ],
    ids=["coo", "coo without elements", "csr", "mkldnn", "nested", "jagged", "meta"],
)
def test_a_tensor_no_checkpoint_holds_is_refused_in_save_by_its_key(ck, make):
    """A tensor that is not strided, a nested one and a meta one with elements fail inside
    save() with SerializationError naming the key and the kind, before anything is written
    (a sparse one without elements too: it is not turned into a dense one)."""
    ck.save({"w": torch.ones(2)}, step=1).wait(60)
    before = entries(ck.directory)
    with pytest.raises(SerializationError) as info:
        ck.save({"w": torch.ones(2), "inner": {"sp": make()}}, step=2)
    assert "'inner/sp'" in str(info.value)
    assert any(kind in str(info.value) for kind in ("layout", "nested", "meta")), info.value
    assert entries(ck.directory) == before
    ck.save({"w": torch.ones(2)}, step=2).wait(60)
    assert [i.step for i in ck.list()] == [1, 2]


def test_custom_class_needs_trust(ck, tmp_path):
    state = {"p": Point(3, 0.5), "plain": {"tuple": (1, "a"), "bytes": b"xy", "set": {1, 2}}}
    with pytest.raises(UnsafeObjectError, match="'p'.*allow_unsafe_objects=True"):
        ck.save(state, step=1)  # what a default restore would refuse is refused at save
    assert ck.list() == []
    ck.close()
    ck = Checkpointer(tmp_path / "ck", SMALL.replace(allow_unsafe_objects=True))
    ck.save(state, step=1).wait(60)
    with pytest.raises(UnsafeObjectError) as info:
        ck.load()
    assert "'p'" in str(info.value) and "trusted=True" in str(info.value)
    assert isinstance(info.value, SerializationError)
    with pytest.raises(UnsafeObjectError):
        ck.load(keys="p")
    # Plain containers need no trust.
    assert ck.load(keys="plain") == {"plain": state["plain"]}
    assert ck.load(trusted=True) == state
    assert ck.load(safe_globals=[Point]) == state
    assert type(ck.load(safe_globals=[Point])["p"]) is Point
    ck.close()


# ---------------------------------------------------------------- existing checkpoints


def test_existing_step_needs_overwrite(ck):
    ck.save({"w": torch.ones(3)}, step=1).wait(60)
    with pytest.raises(CheckpointExistsError, match="overwrite=True") as info:
        ck.save({"w": torch.zeros(3)}, step=1)
    assert isinstance(info.value, FileExistsError)
    assert same_bits(ck.load(step=1)["w"], torch.ones(3))
    ck.save({"w": torch.full((3,), 7.0)}, step=1, overwrite=True).wait(60)
    assert same_bits(ck.load(step=1)["w"], torch.full((3,), 7.0))
    assert [i.name for i in ck.list()] == ["step-0000000001"]
    # no temporary is left; the open Checkpointer's lease file (.owner.*) is its only entry
    assert [
        n for n in entries(ck.directory) if n.startswith(".") and not n.startswith(".owner.")
    ] == []


def test_existing_tag_needs_overwrite(ck):
    ck.save({"w": torch.ones(3)}, tag="best").wait(60)
    with pytest.raises(CheckpointExistsError, match="best"):
        ck.save({"w": torch.zeros(3)}, tag="best")
    ck.save({"w": torch.zeros(3)}, tag="best", overwrite=True).wait(60)
    assert same_bits(ck.load(tag="best")["w"], torch.zeros(3))


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "field,value",
    [
        ("host_cache_bytes", 0),
        ("host_cache_bytes", 8191),
        ("host_cache_bytes", "1GB"),
        ("host_cache_bytes", 1.5e9),
        ("chunk_bytes", 100),
        ("chunk_bytes", None),
        ("writer_threads", 0),
        ("writer_threads", 1.5),
        ("reader_threads", 0),
        ("reader_threads", -2),
        ("io_mode", "fast"),
        ("io_mode", None),
        ("max_pending_saves", 0),
        ("keep_last", 0),
        ("keep_last", -1),
        ("keep_last", 2.0),
        ("keep_every", 0),
        ("commit_timeout_s", 0),
        ("commit_timeout_s", -5.0),
        ("commit_timeout_s", float("nan")),
        ("lazy", "sometimes"),
        ("lazy", True),
    ],
)
def test_invalid_config(field, value):
    with pytest.raises(ConfigError) as info:
        CheckpointConfig(**{field: value})
    assert field in str(info.value) and repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match=field):
        SMALL.replace(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("commit_timeout_s", "10"),
        ("stale_tmp_age_s", -1.0),
        ("stale_tmp_age_s", "1h"),
    ],
)
def test_invalid_config_time_fields(field, value):
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(**{field: value})


def test_valid_config_edges():
    cfg = CheckpointConfig(host_cache_bytes=8192, chunk_bytes=4096, keep_last=1, keep_every=1)
    assert cfg.unit_bytes == 4096
    assert CheckpointConfig(chunk_bytes=4097).unit_bytes == 4096


# ---------------------------------------------------------------- save arguments


@pytest.mark.parametrize("step", [-1, True, False, "3", 1.0, None])
def test_invalid_step(ck, step):
    with pytest.raises(ValueError, match="step") as info:
        ck.save({"w": torch.ones(1)}, step=step)
    assert "step" in str(info.value)
    assert entries(ck.directory) == []


@pytest.mark.parametrize(
    "tag",
    [
        "a/b",
        ".hidden",
        "",
        "latest",
        "latest.tmp",
        "..",
        "a\\b",
        "x\x00y",
        ".tmp.step-0000000001.x",
    ],
)
def test_invalid_tag(ck, tag):
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        ck.save({"w": torch.ones(1)}, tag=tag)
    with pytest.raises(ValueError, match="invalid checkpoint name"):
        ck.load(tag=tag)
    assert entries(ck.directory) == []


@pytest.mark.parametrize("step", [True, -1])
def test_invalid_step_on_load(ck, step):
    ck.save({"w": torch.ones(1)}, step=1).wait(60)
    with pytest.raises(ValueError, match="step"):
        ck.load(step=step)


@pytest.mark.parametrize(
    "metadata,error",
    [
        ({"obj": object()}, TypeError),
        ({"set": {1, 2}}, TypeError),
        ({"t": torch.ones(1)}, TypeError),
        ({"nan": float("nan")}, ValueError),
        ({"inf": [float("inf")]}, ValueError),
        (["not", "a", "dict"], TypeError),
    ],
)
def test_metadata_not_json_fails_in_save(ck, metadata, error):
    with pytest.raises(error) as info:
        ck.save({"w": torch.ones(1)}, step=1, metadata=metadata)
    assert "JSON" in str(info.value) or "dict" in str(info.value)
    assert entries(ck.directory) == []
    ck.save({"w": torch.ones(1)}, step=1, metadata={"ok": [1, "two", None]}).wait(60)
    assert ck.latest().metadata == {"ok": [1, "two", None]}


def test_use_after_close(tmp_path):
    ck = Checkpointer(tmp_path, SMALL)
    ck.save({"w": torch.ones(1)}, step=1).wait(60)
    ck.close()
    ck.close()  # idempotent
    for call in (
        lambda: ck.save({"w": torch.ones(1)}, step=2),
        lambda: ck.load(),
        lambda: ck.restore({"w": torch.zeros(1)}),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert entries(tmp_path) == ["latest", "step-0000000001"]


@pytest.mark.parametrize("metadata", [{1: "int key"}, {"t": (1, 2)}])
def test_metadata_must_round_trip_through_json(tmp_path, metadata):
    with datastates.Checkpointer(tmp_path) as ck:
        with pytest.raises(TypeError, match="JSON round trip"):
            ck.save({"w": torch.ones(1)}, step=1, metadata=metadata)
        assert ck.list() == []


def test_tensor_without_data_fails_its_save_not_the_process(tmp_path):
    """A meta tensor has no bytes to copy: marked lazy, it still fails inside save() (not in
    the background), and the next save goes on."""
    with datastates.Checkpointer(tmp_path, datastates.CheckpointConfig(lazy="always")) as ck:
        with pytest.raises(SerializationError, match="'t': a meta tensor"):
            ck.save({"t": datastates.lazy(torch.empty(4, device="meta"))}, step=1)
        ck.save({"t": torch.ones(2)}, step=2).wait()
        assert [i.name for i in ck.list()] == ["step-0000000002"]
