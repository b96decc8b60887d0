"""States a checkpoint must never apply, and states save() must never write.

A forged or damaged provider state (a Python ``random`` state, a torch generator state, NumPy's
legacy state) is refused with CorruptCheckpointError naming its key before anything changes:
plain values, the scheduler, every generator and every live tensor keep their values. The forged
checkpoints are written by the library itself, through a provider that saves a chosen state under
the RNG provider's name, so every checksum in them is valid. A state nested deeper than a
checkpoint may hold is refused by save() with SerializationError.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from datastates import (
    Checkpointer,
    CorruptCheckpointError,
    ProviderRegistry,
    RNGState,
    RNGStateProvider,
    SerializationError,
    StatefulProvider,
    StateProvider,
)
from datastates.format.checks import MAX_TREE_DEPTH
from testkit import ROOMY


class Forged:
    """Stands for the RNG state in the checkpoint written by ``Impostor``."""


class Impostor(StateProvider):
    name = RNGStateProvider.name

    def __init__(self, state):
        self._state = state

    def can_handle(self, obj):
        return isinstance(obj, Forged)

    def state(self, obj):
        return self._state

    def load(self, obj, state):
        raise AssertionError("only saves")


class Scheduler:
    """A stateful object applied by a provider (as an LR scheduler is)."""

    def __init__(self):
        self.last_epoch = 0

    def state_dict(self):
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, sd):
        self.last_epoch = sd["last_epoch"]


def _real_rng_state() -> dict:
    return RNGStateProvider().state(RNGState())


def _forge(tmp_path, change) -> None:
    """Save a checkpoint whose RNG state is the real one changed by ``change(state)``."""
    state = _real_rng_state()
    change(state)
    registry = ProviderRegistry([Impostor(state), StatefulProvider()])
    with Checkpointer(tmp_path, ROOMY, registry=registry) as ckpt:
        sched = Scheduler()
        sched.last_epoch = 9
        ckpt.save(
            {"epoch": 5, "w": torch.arange(64.0), "sched": sched, "rng": Forged()}, step=1
        ).wait()


def _assert_refused_and_nothing_changed(tmp_path, match: str) -> None:
    live = {"epoch": 0, "w": torch.zeros(64), "sched": Scheduler(), "rng": RNGState()}
    random.seed(1)
    torch.manual_seed(2)
    np.random.seed(3)
    before = (random.getstate(), torch.get_rng_state(), np.random.get_state()[1].copy())
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        for strict in (True, False):
            with pytest.raises(CorruptCheckpointError, match=match):
                ckpt.restore(live, strict=strict)
        with pytest.raises(CorruptCheckpointError, match=match):
            ckpt.load()
    assert live["epoch"] == 0 and live["sched"].last_epoch == 0
    assert torch.equal(live["w"], torch.zeros(64))
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    assert np.array_equal(np.random.get_state()[1], before[2])


def _python(change):
    """The Python state in the form of checkpoints written before the 625 words became a
    tensor (a tuple of ints), changed by ``change``: old checkpoints are validated as strictly."""

    def apply(state):
        version, internal, gauss = state["python"]
        state["python"] = change(version, internal.tolist(), gauss)

    return apply


def _python_tensor(index, value):
    """The Python state as saved now (the words an int64 tensor), one word set to ``value``."""

    def apply(state):
        version, internal, gauss = state["python"]
        words = internal.clone()
        words[index] = value
        state["python"] = (version, words, gauss)

    return apply


def _word(index, value):
    def change(version, internal, gauss):
        internal[index] = value
        return (version, tuple(internal), gauss)

    return change


@pytest.mark.parametrize(
    "change, match",
    [
        (_word(0, -1), r"rng/python/1/0'.*\[0, 4294967296\)"),  # setstate: OverflowError
        (_word(3, 1 << 64), r"rng/python/1/3'"),  # setstate: OverflowError
        (_word(5, 1 << 32), r"rng/python/1/5'"),  # setstate truncates it
        (_word(7, 1.5), r"rng/python/1/7'"),  # setstate: TypeError
        (_word(624, 625), r"rng/python/1/624'.*\[0, 625\)"),  # setstate: ValueError
        (lambda v, i, g: (v, tuple(i[:624]), g), r"rng/python/1'.*625 integers"),
        (lambda v, i, g: ("3", tuple(i), g), r"rng/python/0'"),
        (lambda v, i, g: (v, tuple(i), "x"), r"rng/python/2'.*a float"),  # setstate accepts it
        (lambda v, i, g: (v, tuple(i)), r"rng/python'"),
    ],
    ids=[
        "negative-word",
        "word-over-64-bits",
        "word-over-32-bits",
        "float-word",
        "position-past-end",
        "624-words",
        "version-str",
        "gauss-str",
        "two-fields",
    ],
)
def test_forged_python_random_state_is_refused_before_anything_changes(tmp_path, change, match):
    _forge(tmp_path, _python(change))
    _assert_refused_and_nothing_changed(tmp_path, match)


@pytest.mark.parametrize(
    "change, match",
    [
        (_python_tensor(0, -1), r"rng/python/1/0'.*\[0, 4294967296\)"),
        (_python_tensor(5, 1 << 32), r"rng/python/1/5'"),
        (_python_tensor(624, 625), r"rng/python/1/624'.*\[0, 625\)"),
        (
            lambda state: state.update(python=(3, state["python"][1][:600].clone(), None)),
            r"rng/python/1'.*625 elements",
        ),
        (
            lambda state: state.update(python=(3, state["python"][1].to(torch.int32), None)),
            r"rng/python/1'.*int64",
        ),
    ],
    ids=["negative-word", "word-over-32-bits", "position-past-end", "600-words", "int32"],
)
def test_forged_python_random_state_tensor_is_refused_before_anything_changes(
    tmp_path, change, match
):
    _forge(tmp_path, change)
    _assert_refused_and_nothing_changed(tmp_path, match)


def test_torch_generator_bytes_torch_refuses_are_refused_before_anything_changes(tmp_path):
    def change(state):
        state["torch"] = torch.full_like(state["torch"], 255)  # torch: "Invalid mt19937 state"

    _forge(tmp_path, change)
    _assert_refused_and_nothing_changed(tmp_path, r"rng/torch'.*torch refuses")


def test_torch_generator_state_of_another_size_is_refused(tmp_path):
    def change(state):
        state["torch"] = state["torch"][:100].clone()

    _forge(tmp_path, change)
    _assert_refused_and_nothing_changed(
        tmp_path,
        r"rng/torch'.*5056 elements, found "
        r"torch.uint8\[100\]",
    )


def _cuda_state(offset: int, nbytes: int = 16) -> torch.Tensor:
    state = torch.zeros(16, dtype=torch.uint8)
    state[8:16] = torch.tensor([offset], dtype=torch.int64).view(torch.uint8)
    return state[:nbytes].clone()


@pytest.mark.parametrize(
    "cuda, match",
    [
        ([_cuda_state(4), _cuda_state(6)], r"rng/cuda/1'.*Philox offset 6 is not a multiple of 4"),
        ([_cuda_state(4, 12)], r"rng/cuda/0'.*16 or 8 elements"),
    ],
    ids=["offset", "size"],
)
def test_forged_cuda_generator_states_are_refused_without_touching_a_device(tmp_path, cuda, match):
    def change(state):
        state["cuda"] = cuda

    _forge(tmp_path, change)
    _assert_refused_and_nothing_changed(tmp_path, match)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("pos", 5000, r"rng/numpy/pos'"),  # numpy accepts it and would read past its keys
        ("has_gauss", 7, r"rng/numpy/has_gauss'"),
        ("kind", "PCG64", r"rng/numpy/kind'"),
    ],
)
def test_forged_numpy_legacy_state_is_refused_before_anything_changes(
    tmp_path, field, value, match
):
    def change(state):
        state["numpy"][field] = value

    _forge(tmp_path, change)
    _assert_refused_and_nothing_changed(tmp_path, match)


def test_numpy_key_words_outside_32_bits_are_refused(tmp_path):
    def change(state):
        state["numpy"]["keys"] = state["numpy"]["keys"].clone()
        state["numpy"]["keys"][10] = 1 << 40

    _forge(tmp_path, change)
    _assert_refused_and_nothing_changed(tmp_path, r"rng/numpy/keys: expected 32-bit words")


def test_a_valid_rng_state_still_restores_every_generator(tmp_path):
    random.seed(11)
    torch.manual_seed(12)
    np.random.seed(13)
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save({"rng": RNGState()}, step=1).wait()
        expected = (random.random(), torch.rand(3), np.random.rand(3))
        random.seed(0)
        torch.manual_seed(0)
        np.random.seed(0)
        ckpt.restore({"rng": RNGState()})
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])
    assert np.array_equal(np.random.rand(3), expected[2])


# ---------------------------------------------------------------- nesting depth at save time


def _nested(levels: int):
    """A state tree ``levels`` deep counting the root dict (as the reader counts)."""
    value = 0
    for _ in range(levels - 2):
        value = [value]
    return {"x": value}


@pytest.mark.parametrize("levels", [MAX_TREE_DEPTH + 1, 300, 1000])
def test_save_refuses_a_state_nested_too_deep_with_a_typed_error(tmp_path, levels):
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        with pytest.raises(SerializationError) as info:
            ckpt.save(_nested(levels), step=1)
        assert ckpt.list() == []
    message = str(info.value)
    assert not isinstance(info.value, CorruptCheckpointError)
    assert message.startswith("'x/0/0/0/0/0/0/0/...': ")
    assert f"nested more than {MAX_TREE_DEPTH} levels deep" in message


def _tensor_in_a_dict(levels: int, tensor: torch.Tensor):
    """A state whose tensor is ``levels`` deep, the child of a dict (the walk's fast path)."""
    value = {"w": tensor}
    for _ in range(levels - 3):
        value = [value]
    return {"x": value}


def test_a_tensor_in_a_dict_is_held_to_the_depth_limit_too(tmp_path):
    tensor = torch.arange(4.0)
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save(_tensor_in_a_dict(MAX_TREE_DEPTH, tensor), step=1).wait()
        loaded = ckpt.load()["x"]
        while isinstance(loaded, list):
            loaded = loaded[0]
        assert torch.equal(loaded["w"], tensor)
        with pytest.raises(SerializationError, match="nested more than"):
            ckpt.save(_tensor_in_a_dict(MAX_TREE_DEPTH + 1, tensor), step=2)
        assert [i.step for i in ckpt.list()] == [1]


def test_save_refuses_a_list_that_holds_itself(tmp_path):
    loop = [1]
    loop.append(loop)
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        with pytest.raises(SerializationError, match=r"'loop/1/1/1/1/1/1/1/\.\.\.'"):
            ckpt.save({"loop": loop}, step=1)
        assert ckpt.list() == []


def test_the_deepest_state_a_checkpoint_holds_round_trips(tmp_path):
    state = _nested(MAX_TREE_DEPTH)
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.save(state, step=1).wait()
        assert ckpt.load() == state


def test_a_python_random_state_saved_as_a_tuple_of_ints_still_restores(tmp_path):
    """Checkpoints written before the 625 words became a tensor hold them as JSON values."""
    random.seed(42)
    expected = random.getstate()
    _forge(tmp_path, lambda state: state.update(python=expected))
    random.seed(7)
    with Checkpointer(tmp_path, ROOMY) as ckpt:
        ckpt.restore({"epoch": 0, "w": torch.zeros(64), "sched": Scheduler(), "rng": RNGState()})
        assert random.getstate() == expected
        assert ckpt.load()["rng"]["python"] == expected
