"""Containers of plain data are values: a loss history or a dict of counters that grew during
training restores into a freshly built state. A dict, list or tuple holding only plain values
(None, bool, int, float, complex, str, bytes, nested containers of them), live and saved, takes
the saved items whatever its live length, and a dict the keys only the checkpoint holds (a key
only the live dict holds is still missing); the caller's list or dict stays the same object
(nested ones too), a tuple is replaced in its parent. A container holding tensors or objects
restored in place is structure and must match; its message says what to build, and that fix
restores the saved data. ``load()`` is unaffected."""

from __future__ import annotations

import struct

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer, StateMismatchError

CONFIG = CheckpointConfig(host_cache_bytes=1 << 20)
LOSSES = [1.0 / (i + 3) for i in range(21)]  # floats whose bits a round trip must keep


def _bits(values: list) -> list:
    return [struct.pack("<d", v) for v in values]


@pytest.fixture
def ck(tmp_path):
    with Checkpointer(tmp_path / "ck", CONFIG) as ck:
        yield ck


@pytest.mark.parametrize("keys", [None, ["extra/losses"]])
def test_a_loss_history_grown_from_empty_restores_into_the_same_list(ck, keys):
    ck.save({"w": torch.arange(4.0), "extra": {"losses": list(LOSSES)}}, step=1).wait()
    losses = []
    live = {"w": torch.zeros(4), "extra": {"losses": losses}}
    report = ck.restore(live, keys=keys)
    assert report.mismatched == [] and report.unexpected == [] and report.missing == []
    assert live["extra"]["losses"] is losses
    assert _bits(losses) == _bits(LOSSES)
    assert torch.equal(live["w"], torch.arange(4.0) if keys is None else torch.zeros(4))


def test_a_shorter_saved_history_replaces_a_longer_live_one(ck):
    ck.save({"losses": [0.5, 0.25]}, step=1).wait()
    losses = [9.0, 9.0, 9.0]
    ck.restore({"losses": losses})
    assert losses == [0.5, 0.25]


def test_a_dict_of_counters_takes_the_saved_keys_into_the_same_dict(ck):
    saved = {"seen": 40, "skipped": 2, "by_label": {"cat": 30, "dog": 10}}
    ck.save({"w": torch.ones(2), "counters": saved}, step=1).wait()
    by_label = {}
    counters = {"seen": 0, "by_label": by_label}
    live = {"w": torch.zeros(2), "counters": counters}
    assert ck.restore(live).mismatched == []
    assert live["counters"] is counters and counters["by_label"] is by_label
    assert counters == saved


def test_a_key_only_the_live_dict_holds_is_still_missing(ck):
    """A key the checkpoint cannot know (an option added since) is never dropped in silence:
    strict, the restore raises naming it; strict=False keeps its live value."""
    ck.save({"counters": {"seen": 40}}, step=1).wait()
    counters = {"new_label": 3}
    with pytest.raises(StateMismatchError) as info:
        ck.restore({"counters": counters})
    assert "missing from the checkpoint: counters/new_label" in str(info.value)
    assert "Or pass strict=False: everything saved is restored" in str(info.value)
    assert counters == {"new_label": 3}
    report = ck.restore({"counters": counters}, strict=False)
    assert report.missing == ["counters/new_label"] and report.unexpected == []
    assert counters == {"new_label": 3, "seen": 40}


def test_nested_lists_of_dicts_keep_every_live_container(ck):
    saved = [
        {"step": 1, "tags": ["a"], "note": None},
        {"step": 2, "tags": ["b", "c"], "note": b"\x00\xff", "lr": float("inf")},
    ]
    ck.save({"w": torch.ones(2), "log": saved}, step=1).wait()
    first, tags = {"step": 0, "tags": []}, []
    first["tags"] = tags
    log = [first]
    live = {"w": torch.zeros(2), "log": log}
    assert ck.restore(live).mismatched == []
    assert live["log"] is log and log[0] is first and first["tags"] is tags
    assert log == saved


def test_a_tuple_of_plain_values_is_replaced_in_its_dict(ck):
    ck.save({"w": torch.ones(2), "meta": {"shape": (3, 4, 5), "name": "run"}}, step=1).wait()
    meta = {"shape": (1, 2), "name": "x"}
    live = {"w": torch.zeros(2), "meta": meta}
    assert ck.restore(live).mismatched == []
    assert live["meta"] is meta and meta["shape"] == (3, 4, 5) and type(meta["shape"]) is tuple


def test_a_value_inside_a_provider_state_grows_too(ck):
    class History:
        def __init__(self):
            self.values = []

        def state_dict(self):
            return {"values": self.values}

        def load_state_dict(self, state):
            self.values = list(state["values"])

    saved = History()
    saved.values.extend(LOSSES)
    ck.save({"history": saved}, step=1).wait()
    fresh = History()
    assert ck.restore({"history": fresh}).mismatched == []
    assert _bits(fresh.values) == _bits(LOSSES)


def test_a_list_holding_a_tensor_must_match_and_its_message_says_what_to_build(ck):
    ck.save({"h": [torch.ones(2), torch.full((2,), 2.0)]}, step=1).wait()
    short = [torch.zeros(2)]
    with pytest.raises(StateMismatchError) as info:
        ck.restore({"h": short})
    msg = str(info.value)
    assert "h (checkpoint 2 items, live 1; " in msg and "build it with the 2 saved items" in msg
    assert "strict=False would skip" in msg and "Or pass strict=False" not in msg
    assert len(short) == 1 and torch.equal(short[0], torch.zeros(2))
    built = [torch.zeros(2), torch.zeros(2)]  # the fix the message names
    assert ck.restore({"h": built}).mismatched == []
    assert torch.equal(built[0], torch.ones(2)) and torch.equal(built[1], torch.full((2,), 2.0))


def test_an_empty_live_list_where_tensors_were_saved_is_structure(ck):
    ck.save({"h": [torch.ones(2)], "losses": [0.5]}, step=1).wait()
    h, losses = [], []
    report = ck.restore({"h": h, "losses": losses}, strict=False)
    assert [m.split(" ")[0] for m in report.mismatched] == ["h"]
    assert h == [] and losses == [0.5]


def test_a_plain_value_of_another_type_in_a_growing_list_is_still_a_mismatch(ck):
    ck.save({"h": [1, 2]}, step=1).wait()
    with pytest.raises(StateMismatchError, match=r"h/0 \(checkpoint int, live str\)"):
        ck.restore({"h": ["a"]})


def _set_none(live):
    live["best"] = None


def _add_key(live):
    live["b"] = torch.zeros(3)


def _saved_shape(live):
    live["w"] = torch.zeros(4)


@pytest.mark.parametrize(
    "saved, live, advice, fix",
    [
        (
            {"w": torch.ones(4), "best": 0.25},
            {"w": torch.zeros(4), "best": "x"},
            "set it to None, which takes whatever was saved",
            _set_none,
        ),
        (
            {"w": torch.ones(4), "b": torch.full((3,), 2.0)},
            {"w": torch.zeros(4)},
            "add the keys only the checkpoint holds",
            _add_key,
        ),
        (
            {"w": torch.ones(4)},
            {"w": torch.zeros(5)},
            "each tensor the saved shape and dtype",
            _saved_shape,
        ),
    ],
)
def test_the_fix_a_mismatch_message_suggests_restores_the_saved_data(ck, saved, live, advice, fix):
    ck.save(saved, step=1).wait()
    with pytest.raises(StateMismatchError) as info:
        ck.restore(live)
    msg = str(info.value)
    assert advice in msg and "strict=False would skip what is listed here" in msg
    fix(live)
    report = ck.restore(live)
    assert report.mismatched == [] and report.unexpected == [] and report.missing == []
    assert set(live) == set(saved)
    for k, v in saved.items():
        assert torch.equal(live[k], v) if isinstance(v, torch.Tensor) else live[k] == v, k


def test_load_returns_new_objects_as_saved(ck):
    state = {"w": torch.ones(2), "losses": list(LOSSES), "counters": {"a": 1}}
    ck.save(state, step=1).wait()
    loaded = ck.load()
    assert loaded["losses"] is not state["losses"] and _bits(loaded["losses"]) == _bits(LOSSES)
    assert loaded["counters"] == {"a": 1} and loaded["counters"] is not state["counters"]


def test_a_live_value_where_a_module_was_saved_says_to_build_the_module(ck):
    saved = torch.nn.Linear(2, 2)
    ck.save({"m": saved, "losses": [0.5]}, step=1).wait()
    with pytest.raises(
        StateMismatchError,
        match=r"'m': the checkpoint holds a .* state, the "
        r"live object is a int; put the kind of object "
        r"it was saved from there before restoring",
    ):
        ck.restore({"m": 0, "losses": []})
    built = torch.nn.Linear(2, 2)  # the fix the message names
    ck.restore({"m": built, "losses": []})
    assert torch.equal(built.weight, saved.weight) and torch.equal(built.bias, saved.bias)
