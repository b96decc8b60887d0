"""restore() fills the caller's own dicts and lists in place, refuses live tensors torch cannot
write into before any tensor is written, and logs one record per restore."""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict

import pytest
import torch

from datastates import Checkpointer, StateMismatchError
from testkit import ROOMY


# ---------------------------------------------------------------- containers keep their identity


def test_a_kept_reference_sees_the_restore_and_every_later_save_holds_its_values(tmp_path):
    """The loop keeps its own reference to a nested dict; after a resume, each later checkpoint
    holds what the loop wrote into that reference, not the values restored."""
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save(
            {"progress": {"epoch": 4, "samples": [400, 4]}, "w": torch.full((8,), 4.0)}, step=4
        ).wait()
    progress = {"epoch": 0, "samples": [0, 0]}
    samples = progress["samples"]
    state = {"progress": progress, "w": torch.zeros(8)}
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        start = ckpt.restore(state).step + 1
        assert state["progress"] is progress and progress["samples"] is samples
        assert progress == {"epoch": 4, "samples": [400, 4]}
        for step in range(start, start + 3):
            progress["epoch"] = step
            samples[0] = step * 100
            samples[1] = step
            state["w"].fill_(float(step))
            ckpt.save(state, step=step).wait()
        for step in range(start, start + 3):
            loaded = ckpt.load(step=step)
            assert loaded["progress"] == {"epoch": step, "samples": [step * 100, step]}
            assert torch.equal(loaded["w"], torch.full((8,), float(step)))
    assert state["progress"] is progress and progress["samples"] is samples


def test_dict_subclasses_and_nested_lists_keep_their_type_and_identity(tmp_path):
    saved = {"od": OrderedDict(a=1, b=[1, 2]), "dd": {"x": 3}, "nest": [[1, 2], {"k": "v"}]}
    live = {
        "od": OrderedDict(a=0, b=[0, 0]),
        "dd": defaultdict(int, x=0),
        "nest": [[0, 0], {"k": ""}],
    }
    objects = [
        live["od"],
        live["od"]["b"],
        live["dd"],
        live["nest"],
        live["nest"][0],
        live["nest"][1],
    ]
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save(saved, step=1).wait()
        ckpt.restore(live)
    after = [
        live["od"],
        live["od"]["b"],
        live["dd"],
        live["nest"],
        live["nest"][0],
        live["nest"][1],
    ]
    assert all(a is b for a, b in zip(objects, after))
    assert type(live["dd"]) is defaultdict and type(live["od"]) is OrderedDict
    assert live["od"] == OrderedDict(a=1, b=[1, 2]) and live["dd"] == {"x": 3}
    assert live["nest"] == [[1, 2], {"k": "v"}]


def test_restoring_some_keys_leaves_the_neighbours_in_the_same_containers(tmp_path):
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save({"a": {"x": 1, "y": 2}, "l": [1, 2, 3], "t": (1, 2)}, step=1).wait()
        live = {"a": {"x": 0, "y": 0}, "l": [0, 0, 0], "t": (0, 0)}
        a, lst = live["a"], live["l"]
        report = ckpt.restore(live, keys=["a/x", "l/1", "t/1"])
    assert live == {"a": {"x": 1, "y": 0}, "l": [0, 2, 0], "t": (0, 2)}
    assert live["a"] is a and live["l"] is lst  # a tuple is rebuilt: it cannot be filled
    assert report.missing == report.unexpected == report.mismatched == []


def test_non_strict_keeps_live_keys_the_checkpoint_lacks_in_nested_dicts(tmp_path):
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save({"cfg": {"lr": 0.1}}, step=1).wait()
        live = {"cfg": {"lr": 1.0, "new_option": "kept"}}
        cfg = live["cfg"]
        report = ckpt.restore(live, strict=False)
        assert report.missing == ["cfg/new_option"]
        with pytest.raises(StateMismatchError, match="cfg/new_option"):
            ckpt.restore({"cfg": {"lr": 5.0, "new_option": "x"}})
    assert live["cfg"] is cfg and cfg == {"lr": 0.1, "new_option": "kept"}


# ---------------------------------------------------------------- live tensors torch cannot write


def _saved_and_live(tmp_path, bad_live: torch.Tensor, bad_saved: torch.Tensor):
    """22 tensors saved; a live state whose 21 ordinary tensors hold other values, and ``bad``
    as the live tensor of the key ``x`` (planned after all of them)."""
    saved = {f"t{i:02d}": torch.full((64,), float(i + 1)) for i in range(21)}
    saved["x"] = bad_saved
    ckpt = Checkpointer(tmp_path, ROOMY)
    ckpt.save(saved, step=1).wait()
    live = {f"t{i:02d}": torch.full((64,), -1.0) for i in range(21)}
    live["x"] = bad_live
    return ckpt, saved, live


def _assert_untouched(live: dict) -> None:
    for i in range(21):
        assert torch.equal(live[f"t{i:02d}"], torch.full((64,), -1.0)), i


def test_an_expanded_live_tensor_is_refused_before_any_tensor_is_written(tmp_path):
    base = torch.zeros(1, 4)
    ckpt, saved, live = _saved_and_live(tmp_path, base.expand(3, 4), torch.arange(12.0).view(3, 4))
    with ckpt:
        with pytest.raises(
            StateMismatchError,
            match=r"x \(the live tensor overlaps itself: "
            r"dimension 0 of size 3 has stride 0",
        ):
            ckpt.restore(live)
        _assert_untouched(live)
        assert torch.equal(base, torch.zeros(1, 4))
        report = ckpt.restore(live, strict=False)  # the rest is restored, x is left alone
    assert [m.split(" ")[0] for m in report.mismatched] == ["x"]
    assert len(report.restored) == 21 and torch.equal(base, torch.zeros(1, 4))
    for i in range(21):
        assert torch.equal(live[f"t{i:02d}"], saved[f"t{i:02d}"])


def test_an_inference_tensor_is_refused_before_any_tensor_is_written(tmp_path):
    with torch.inference_mode():
        frozen = torch.zeros(5)
    ckpt, _, live = _saved_and_live(tmp_path, frozen, torch.ones(5))
    with ckpt:
        with pytest.raises(StateMismatchError, match=r"x \(the live tensor is an inference "):
            ckpt.restore(live)
    _assert_untouched(live)
    assert torch.equal(frozen, torch.zeros(5))


def test_a_strided_view_sharing_elements_is_refused(tmp_path):
    storage = torch.zeros(5)
    overlapping = storage.as_strided((3, 3), (1, 1))  # no stride 0, yet elements repeat
    ckpt, _, live = _saved_and_live(tmp_path, overlapping, torch.arange(9.0).view(3, 3))
    with ckpt:
        with pytest.raises(StateMismatchError, match="strides"):
            ckpt.restore(live)
    _assert_untouched(live)
    assert torch.equal(storage, torch.zeros(5))


def test_interleaved_strides_without_shared_elements_are_filled(tmp_path):
    """Offsets i*2 + j*3 for a (3, 2) view: distinct, though no dimension steps past the
    others' span: the exact count decides, and the restore fills it."""
    storage = torch.full((8,), -5.0)
    view = storage.as_strided((3, 2), (2, 3))
    value = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    ckpt, _, live = _saved_and_live(tmp_path, view, value)
    with ckpt:
        ckpt.restore(live)
    assert torch.equal(view, value) and live["x"] is view
    assert storage[6].item() == -5.0  # the one location the view does not cover


# ---------------------------------------------------------------- one log record per restore


def test_one_info_record_per_restore_names_checkpoint_bytes_seconds_and_rate(tmp_path, caplog):
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save({"w": torch.zeros(3 << 16), "epoch": 1}, step=7).wait()
        caplog.set_level(logging.INFO, logger="datastates")
        caplog.clear()
        ckpt.restore({"w": torch.ones(3 << 16), "epoch": 0})
    records = [r for r in caplog.records if r.name == "datastates" and r.levelno == logging.INFO]
    assert len(records) == 1
    text = records[0].getMessage()
    assert text.startswith("restored step-0000000007 (step 7) from ")
    assert str(tmp_path) in text and "768.0 KiB in " in text and " GB/s" in text
    assert not text.startswith("datastates")
