"""What an in-place restore cannot do at the top level is never skipped in silence: the state
passed is the caller's own object, so a top-level tuple's items that would have to be replaced
(plain values, arrays that cannot be filled), or a top-level array that cannot be filled, are
mismatches -- StateMismatchError before anything changes, or named in the report with
strict=False. What can be filled in place (tensors, dicts, lists, modules inside the tuple) is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import datastates
from datastates import Checkpointer, CheckpointConfig
from datastates.errors import StateMismatchError


def _saved(tmp_path, state):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(host_cache_bytes=1 << 20))
    ckpt.save(state, step=1).wait(60)
    return ckpt


def test_a_top_level_tuple_with_a_plain_value_is_refused_before_anything_changes(tmp_path):
    with _saved(tmp_path, (torch.ones(2), 5, {"x": 7})) as ckpt:
        live = (torch.zeros(2), 0, {"x": 0})
        with pytest.raises(
            StateMismatchError,
            match=r"do not match: 1 \(an item of a top-level "
            r"tuple would have to be replaced",
        ):
            ckpt.restore(live)
        assert torch.equal(live[0], torch.zeros(2)) and live[2] == {"x": 0}  # nothing changed
        report = ckpt.restore(live, strict=False)
        assert report.mismatched == [
            "1 (an item of a top-level tuple would have to be replaced, "
            "which restore() cannot do in place: pass a list or dict, "
            "or use load())"
        ]
        assert torch.equal(live[0], torch.ones(2)) and live[2] == {"x": 7} and live[1] == 0
        loaded = ckpt.load()
        assert torch.equal(loaded[0], torch.ones(2)) and loaded[1:] == (5, {"x": 7})


def test_nested_tuples_are_looked_into(tmp_path):
    with _saved(tmp_path, ((torch.ones(2), "a"), [1])) as ckpt:
        live = ((torch.zeros(2), "b"), [0])
        with pytest.raises(StateMismatchError, match=r"do not match: 0/1 \(an item"):
            ckpt.restore(live)
        assert torch.equal(live[0][0], torch.zeros(2)) and live[1] == [0]


def test_a_top_level_tuple_of_what_is_filled_in_place_restores(tmp_path):
    model = torch.nn.Linear(3, 2)
    saved = (
        torch.arange(4.0),
        [torch.ones(2), 3],
        {"k": torch.full((2,), 2.0)},
        model,
        np.arange(3.0),
    )
    expected = [p.detach().clone() for p in model.parameters()]
    with _saved(tmp_path, saved) as ckpt:
        live_model = torch.nn.Linear(3, 2)
        live = (torch.zeros(4), [torch.zeros(2), 0], {"k": torch.zeros(2)}, live_model, np.zeros(3))
        report = ckpt.restore(live)
        assert report.mismatched == []
        assert torch.equal(live[0], torch.arange(4.0)) and live[1][1] == 3
        assert torch.equal(live[1][0], torch.ones(2)) and torch.equal(live[2]["k"], saved[2]["k"])
        assert all(torch.equal(a, b) for a, b in zip(live_model.parameters(), expected))
        assert np.array_equal(live[4], np.arange(3.0))


def _read_only():
    array = np.zeros(3)
    array.flags.writeable = False
    return array


def test_a_top_level_array_that_cannot_be_filled_is_refused(tmp_path):
    live = _read_only()
    with _saved(tmp_path, np.ones(3)) as ckpt:
        with pytest.raises(
            StateMismatchError,
            match=r"do not match: \(top level\) \(the state passed would "
            "have to be replaced",
        ):
            ckpt.restore(live)
        assert not live.any()


def test_an_eager_marked_top_level_tuple_item_restores(tmp_path):
    t = torch.ones(2)
    with _saved(tmp_path, (datastates.eager(t),)) as ckpt:
        live = (datastates.eager(torch.zeros(2)),)
        assert ckpt.restore(live).mismatched == []
        assert torch.equal(live[0].value, torch.ones(2))


@pytest.mark.parametrize("where", ["top", "nested"])
def test_an_array_with_negative_strides_is_filled_in_place(tmp_path, where):
    """torch cannot view negative strides; numpy fills the caller's array from a temporary, so
    the array and its base see the restored values."""
    saved = np.arange(12.0).reshape(3, 4)
    base = np.zeros((3, 4))
    live = base[::-1, ::-2]  # a view on every other column, both axes reversed
    state = (lambda v: v) if where == "top" else (lambda v: {"a": v, "n": 1})
    with _saved(tmp_path, state(saved[::-1, ::-2].copy())) as ckpt:
        report = ckpt.restore(state(live))
        assert report.mismatched == [] and report.restored == ([""] if where == "top" else ["a"])
        assert np.array_equal(live, saved[::-1, ::-2])
        assert np.array_equal(base[:, 1::2], saved[:, 1::2]) and not base[:, ::2].any()


def test_a_top_level_tuple_whose_plain_values_are_equal_restores(tmp_path):
    """Equal plain values are no replacement, whether or not they are one object."""
    name, count, rate = "".join(["run", "-A"]), int("1000"), float("0.5")  # built at run time
    with _saved(tmp_path, (torch.ones(2), "run-A", 1000, 0.5, None)) as ckpt:
        live = (torch.zeros(2), name, count, rate, None)
        assert ckpt.restore(live).mismatched == []
        assert torch.equal(live[0], torch.ones(2))
        with pytest.raises(StateMismatchError, match=r"do not match: 2 \(an item"):
            ckpt.restore((torch.zeros(2), name, 1001, rate, None))
