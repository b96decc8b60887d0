"""Values that are not tensors, stored natively instead of pickled, against real numpy:

- numpy arrays of a dtype torch has are tensor entries (``"np": true`` in their tree node) and
  come back from ``load()`` as arrays of the same dtype, shape and bytes; ``restore()`` fills a
  live array in place;
- numpy's random states (the legacy tuple, ``bit_generator.state`` dicts, ``Generator`` and
  ``RandomState`` objects) round-trip under the default safe loading, with no numpy callable
  added to the unpickler's allowlist;
- ``save()`` refuses what a default ``restore()`` would refuse (a torch DataLoader, a class
  outside the allowlist), naming the key and writing nothing, unless the config allows it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from datastates import (
    CheckpointConfig,
    Checkpointer,
    ConfigError,
    CorruptCheckpointError,
    SerializationError,
    StateMismatchError,
    StateProvider,
    UnsafeObjectError,
    inspect,
)
from datastates.format import codec as fmt
from datastates.format import serialization
from datastates.providers.tree import flatten
from datastates.providers import NumpyRandomProvider, ProviderRegistry
from datastates.restore.reader import Reader
from datastates.testing import ProviderConformance
from testkit import SMALL

UNSAFE = SMALL.replace(allow_unsafe_objects=True)
NATIVE_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
BIT_GENERATORS = ["MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64"]


@pytest.fixture
def ck(tmp_path):
    with Checkpointer(tmp_path / "ck", SMALL) as ck:
        yield ck


def sample(dtype: str, shape: tuple, seed: int = 0) -> np.ndarray:
    """An array whose bytes are all random (every bit pattern of the dtype, NaNs included)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) if shape else 1
    raw = np.random.default_rng(seed).integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    if dt == np.bool_:
        raw = raw % 2
    return raw.view(dt).reshape(shape)


def assert_same_array(got, want) -> None:
    assert type(got) is np.ndarray, type(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def manifest(ck: Checkpointer, name: str = "step-0000000001") -> dict:
    with open(os.path.join(ck.directory, name, fmt.MANIFEST), "rb") as f:
        return json.loads(f.read())


def tree_nodes(node: dict):
    yield node
    if node["t"] in ("dict", "odict"):
        for _, child in node["items"]:
            yield from tree_nodes(child)
    elif node["t"] in ("list", "tuple"):
        for child in node["items"]:
            yield from tree_nodes(child)
    elif node["t"] == "provider":
        yield from tree_nodes(node["state"])


def draws(gen, n: int = 5) -> np.ndarray:
    return gen.random(n) if isinstance(gen, np.random.Generator) else gen.random_sample(n)


# ---------------------------------------------------------------- 1. numpy arrays as tensors


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("shape", [(), (0, 3), (7,), (3, 5, 2)])
def test_numpy_array_round_trips_as_array(ck, dtype, shape):
    array = sample(dtype, shape)
    ck.save({"a": array}, step=1).wait(60)
    assert_same_array(ck.load()["a"], array)


def test_numpy_arrays_are_tensor_entries_marked_np(ck):
    state = {"x": sample("float32", (4, 4)), "z": np.array(7, dtype=np.int16), "t": torch.arange(3)}
    ck.save(state, step=1).wait(60)
    m = manifest(ck)
    assert {e["key"]: e["kind"] for e in m["entries"]} == {
        "x": "tensor",
        "z": "tensor",
        "t": "tensor",
    }
    assert {e["key"]: (e["dtype"], e["shape"]) for e in m["entries"]} == {
        "x": ("float32", [4, 4]),
        "z": ("int16", []),
        "t": ("int64", [3]),
    }
    nodes = {key: node for key, node in m["ranks"][0]["tree"]["items"]}
    assert nodes["x"]["np"] is True and nodes["z"]["np"] is True and "np" not in nodes["t"]
    assert [
        o["key"] for o in inspect(os.path.join(ck.directory, "step-0000000001"))["objects"]
    ] == []
    loaded = ck.load()
    assert type(loaded["t"]) is torch.Tensor and type(loaded["x"]) is np.ndarray


def test_contiguous_array_is_shared_others_are_copied():
    base = sample("float64", (6, 8))
    views = {
        "whole": base,
        "cols": base[:, ::2],
        "transposed": base.T,
        "reversed": base[::-1],
        "readonly": base.copy(),
    }
    views["readonly"].flags.writeable = False
    flat = flatten(views, ProviderRegistry.default())
    by_key = dict(zip(flat.items.keys, flat.items.tensors))
    assert by_key["whole"].data_ptr() == base.ctypes.data  # zero copy
    for key in ("cols", "transposed", "reversed", "readonly"):
        tensor = by_key[key]
        assert tensor.is_contiguous() and tensor.data_ptr() != views[key].ctypes.data, key
        assert tensor.numpy().tobytes() == np.ascontiguousarray(views[key]).tobytes(), key


def test_non_contiguous_arrays_round_trip(ck):
    base = sample("int32", (6, 8))
    state = {"cols": base[:, 1::3], "t": base.T, "rev": base[::-1, ::-1]}
    ck.save(state, step=1).wait(60)
    loaded = ck.load()
    for key, view in state.items():
        assert_same_array(loaded[key], view)
        assert loaded[key].flags.c_contiguous


def test_array_is_captured_when_save_returns(ck):
    array = sample("float32", (64,))
    want = array.copy()
    handle = ck.save({"a": array}, step=1)
    array[:] = -1.0  # the training loop changes it right after save() returned
    handle.wait(60)
    assert_same_array(ck.load()["a"], want)


def test_same_array_under_two_keys_is_stored_once(ck):
    array = sample("uint8", (100,))
    ck.save({"a": array, "b": array, "c": [array]}, step=1).wait(60)
    assert len(manifest(ck)["entries"]) == 1
    loaded = ck.load()
    for got in (loaded["a"], loaded["b"], loaded["c"][0]):
        assert_same_array(got, array)


def test_restore_fills_live_array_in_place(ck):
    saved = {
        "a": sample("float32", (3, 4)),
        "z": np.array(9, dtype=np.int64),
        "b": sample("bool", (5,)),
    }
    ck.save(saved, step=1).wait(60)
    live = {"a": np.zeros((3, 4), np.float32), "z": np.array(0), "b": np.zeros(5, bool)}
    held = dict(live)  # other references to the live arrays
    report = ck.restore(live)
    assert sorted(report.restored) == ["a", "b", "z"]
    for key in saved:
        assert live[key] is held[key]
        assert_same_array(held[key], saved[key])


def test_restore_into_non_contiguous_live_array(ck):
    saved = sample("int16", (4, 3))
    ck.save({"a": saved}, step=1).wait(60)
    backing = np.zeros((3, 8), np.int16)
    live = {"a": backing.T[::2]}  # a (4, 3) strided view of `backing`
    view = live["a"]
    ck.restore(live)
    assert live["a"] is view
    assert_same_array(np.ascontiguousarray(backing.T[::2]), saved)


def test_restore_into_torch_tensor_and_tensor_into_array(ck):
    ck.save({"from_np": sample("float32", (4,)), "from_torch": torch.arange(4.0)}, step=1).wait(60)
    live = {"from_np": torch.zeros(4), "from_torch": np.zeros(4, np.float32)}
    ck.restore(live)
    assert live["from_np"].numpy().tobytes() == sample("float32", (4,)).tobytes()
    assert_same_array(live["from_torch"], np.arange(4.0, dtype=np.float32))


@pytest.mark.parametrize(
    "live_array",
    [
        np.zeros((3, 5), np.float32),  # other shape
        np.zeros((3, 4), np.float64),
    ],
)  # other dtype
def test_restore_mismatched_array_is_refused_and_left_alone(ck, live_array):
    ck.save({"a": sample("float32", (3, 4)), "n": 1}, step=1).wait(60)
    live = {"a": live_array, "n": 0}
    with pytest.raises(StateMismatchError, match="'?a'? ?\\(checkpoint float32\\[3, 4\\]"):
        ck.restore(live)
    assert not live_array.any() and live["n"] == 0  # nothing modified
    report = ck.restore(live, strict=False)
    assert report.mismatched and report.mismatched[0].startswith("a ")
    assert live["a"] is live_array and not live_array.any() and live["n"] == 1


def test_restore_replaces_read_only_live_array(ck):
    saved = sample("uint32", (6,))
    ck.save({"a": saved}, step=1).wait(60)
    frozen = np.zeros(6, np.uint32)
    frozen.flags.writeable = False
    live = {"a": frozen}
    ck.restore(live)
    assert live["a"] is not frozen and not frozen.any()
    assert_same_array(live["a"], saved)


@pytest.mark.parametrize(
    "array",
    [
        np.array([1, "a", None], dtype=object),
        np.array(["x", "yz"]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.arange(3, dtype=np.clongdouble),
        np.arange(3, dtype=">f4"),  # non-native byte order
        np.ma.masked_array([1.0, 2.0], mask=[0, 1]),  # a subclass
    ],
    ids=["object", "str", "datetime64", "clongdouble", "big-endian", "masked"],
)
def test_arrays_torch_cannot_hold_are_pickled(tmp_path, array):
    # With the default config they are refused at save (a default restore refuses them) ...
    with Checkpointer(tmp_path / "safe", SMALL) as ck:
        with pytest.raises(UnsafeObjectError, match="'inner/a'"):
            ck.save({"inner": {"a": array}}, step=1)
        assert ck.list() == []
    # ... and saved as objects when the config allows it, loading back with trust.
    with Checkpointer(tmp_path / "unsafe", UNSAFE) as ck:
        ck.save({"a": array}, step=1).wait(60)
        assert [e["kind"] for e in manifest(ck)["entries"]] == ["object"]
        with pytest.raises(UnsafeObjectError, match="'a'"):
            ck.load()
        got = ck.load(trusted=True)["a"]
    assert type(got) is type(array)  # (numpy's own pickle may normalize the byte order)
    assert got.dtype.newbyteorder("=") == array.dtype.newbyteorder("=")
    assert np.array_equal(np.asarray(got), np.asarray(array))
    assert np.array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(array))


def test_np_flag_is_validated(ck):
    ck.save(
        {"a": sample("float32", (2,)), "o": 3.5, "bf": torch.ones(2, dtype=torch.bfloat16)}, step=1
    ).wait(60)
    path = os.path.join(ck.directory, "step-0000000001")
    m = manifest(ck)
    del m["manifest_crc32"]

    def forge(change):
        forged = json.loads(json.dumps(m))
        change(dict(forged["ranks"][0]["tree"]["items"]))
        with open(os.path.join(path, fmt.MANIFEST), "wb") as f:
            f.write(fmt.seal_manifest(json.dumps(forged, separators=(",", ":")).encode()))

    def load():
        with Reader(path, registry=ProviderRegistry.default()) as reader:
            return reader.load()

    forge(lambda nodes: nodes["a"].update(np="yes"))
    with pytest.raises(CorruptCheckpointError, match=r"items\[0\]\[1\]\.np: expected true"):
        load()
    assert ck.list() == []  # a damaged checkpoint is not listed
    forge(lambda nodes: nodes["o"].update(np=True))  # only tensor nodes carry it
    with pytest.raises(CorruptCheckpointError, match="on a value node"):
        load()
    forge(lambda nodes: nodes["bf"].update(np=True))  # numpy has no bfloat16
    with pytest.raises(CorruptCheckpointError, match="'bf' is marked as a numpy array"):
        load()
    forge(lambda nodes: nodes["a"].pop("np"))  # an older writer: a tensor comes back
    assert type(ck.load()["a"]) is torch.Tensor


# ---------------------------------------------------------------- 2. numpy random states


def test_legacy_global_state_round_trips_with_safe_loading(ck):
    np.random.seed(1234)
    np.random.standard_normal()  # a cached gaussian in the state
    state = {"np_rng": np.random.get_state()}
    want = np.random.random_sample(8)
    ck.save(state, step=1).wait(60)
    loaded = ck.load()["np_rng"]  # default: safe loading, nothing trusted
    assert type(loaded) is tuple and loaded[0] == "MT19937"
    assert_same_array(loaded[1], state["np_rng"][1])
    assert loaded[2:] == state["np_rng"][2:]
    np.random.set_state(loaded)
    assert np.array_equal(np.random.random_sample(8), want)
    live = {"np_rng": np.random.get_state()}
    ck.restore(live)
    np.random.set_state(live["np_rng"])
    assert np.array_equal(np.random.random_sample(8), want)


@pytest.mark.parametrize("name", BIT_GENERATORS)
def test_bit_generator_state_dict_round_trips(ck, name):
    gen = np.random.Generator(getattr(np.random, name)(99))
    gen.random(3)
    state = gen.bit_generator.state
    want = gen.random(8)
    ck.save({"bits": state}, step=1).wait(60)
    loaded = ck.load()["bits"]
    assert json.dumps(_plain(loaded)) == json.dumps(_plain(state))  # 128-bit ints exact
    fresh = np.random.Generator(getattr(np.random, name)())
    fresh.bit_generator.state = loaded
    assert np.array_equal(fresh.random(8), want)
    assert not [e for e in manifest(ck)["entries"] if e["kind"] == "object"]


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return [str(value.dtype), value.tolist()]
    return value


def generators(seed: int) -> dict:
    out = {name: np.random.Generator(getattr(np.random, name)(seed)) for name in BIT_GENERATORS}
    out["legacy"] = np.random.RandomState(seed)
    out["legacy_pcg"] = np.random.RandomState(np.random.PCG64(seed))
    out["legacy"].standard_normal()  # a cached gaussian
    return out


def test_generator_objects_round_trip_by_load_and_restore(ck):
    gens = generators(5)
    ck.save({"g": gens}, step=1).wait(60)
    want = {k: draws(g) for k, g in gens.items()}
    assert not [e for e in manifest(ck)["entries"] if e["kind"] == "object"]
    loaded = ck.load()["g"]  # safe loading: rebuilt by the provider, nothing unpickled
    for key, gen in loaded.items():
        assert type(gen) is type(gens[key]), key
        assert np.array_equal(draws(gen), want[key]), key
    live = generators(6)
    held = dict(live)
    ck.restore({"g": live})
    for key, gen in live.items():
        assert gen is held[key] and np.array_equal(draws(gen), want[key]), key


def test_generator_restore_refuses_another_kind_or_bit_generator(ck):
    ck.save({"g": np.random.default_rng(1)}, step=1).wait(60)
    for other in (np.random.RandomState(0), np.random.Generator(np.random.MT19937(0))):
        before = (
            other.bit_generator.state
            if hasattr(other, "bit_generator")
            else other.get_state(legacy=False)
        )
        with pytest.raises(StateMismatchError, match="'g'.*PCG64"):
            ck.restore({"g": other})
        after = (
            other.bit_generator.state
            if hasattr(other, "bit_generator")
            else other.get_state(legacy=False)
        )
        assert json.dumps(_plain(after)) == json.dumps(_plain(before))


def test_rebuild_constructs_only_numpys_own_bit_generators():
    provider = NumpyRandomProvider()
    for name in ("system", "load", "__import__", "BitGenerator", "SeedSequence"):
        with pytest.raises(CorruptCheckpointError, match=repr(name)):
            provider.rebuild({"kind": "Generator", "state": {"bit_generator": name}})
    for bad in (
        {"kind": "os.system", "state": {"bit_generator": "PCG64"}},
        {"kind": "Generator"},
        ["Generator"],
    ):
        with pytest.raises(CorruptCheckpointError, match="expected a saved numpy"):
            provider.rebuild(bad)


class _Reduce:
    """Pickles as a call of ``func(*args)`` (what a crafted checkpoint holds)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: _Reduce(os.mkdir, str(tmp / "pwned")),
        lambda tmp: _Reduce(os.system, f"mkdir {tmp / 'pwned'}"),
        lambda tmp: _Reduce(np.save, str(tmp / "pwned"), np.zeros(1)),
        lambda tmp: _Reduce(np.load, str(tmp / "pwned.npy")),
        lambda tmp: _Reduce(np.random.Generator, np.random.PCG64(0)),
        lambda tmp: _Reduce(np.random.RandomState, 0),
        lambda tmp: np.arange(3.0).astype(object),
    ],
    ids=[
        "os.mkdir",
        "os.system",
        "numpy.save",
        "numpy.load",
        "numpy.random.Generator",
        "numpy.random.RandomState",
        "object-array",
    ],
)
def test_no_numpy_or_os_callable_is_allowed_by_safe_loading(tmp_path, make):
    """A checkpoint whose object calls numpy or os functions when unpickled (written by a
    trusting writer, or forged) is refused by the default load; nothing is called."""
    obj = make(tmp_path)
    with Checkpointer(tmp_path / "ck", UNSAFE) as ck:
        handle = ck.save({"x": obj}, step=1)  # pickled, as allowed by the config
        handle.wait(60)
        # save refused it when unsafe objects are not allowed
        assert [e["kind"] for e in manifest(ck)["entries"]] == ["object"]
        for action in (ck.load, lambda: ck.restore({"x": None})):
            with pytest.raises(UnsafeObjectError, match="'x'"):
                action()
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned.npy").exists()
    with Checkpointer(tmp_path / "default", SMALL) as ck:
        with pytest.raises(UnsafeObjectError, match="'x'"):
            ck.save({"x": obj}, step=1)


@pytest.mark.parametrize(
    "obj", [np.random.default_rng(0), np.random.RandomState(0), np.random.get_state()]
)
def test_numpy_pickles_of_generators_stay_refused(obj):
    """No numpy reconstruction callable was added to the allowlist: numpy's own pickle of a
    generator (or of the legacy state tuple) is still refused; the provider and native arrays
    are what make them restorable."""
    with pytest.raises(UnsafeObjectError, match="'x'"):
        serialization.loads(serialization.dumps(obj, "x"), "x")


class TestNumpyRandomProvider(ProviderConformance):
    def make_provider(self):
        return NumpyRandomProvider()

    def make_object(self, seed):
        return np.random.Generator(np.random.Philox(seed))

    def mutate(self, obj):
        obj.random(3)
        return True

    def assert_same_state(self, a, b):
        provider = NumpyRandomProvider()
        assert json.dumps(_plain(provider.state(a))) == json.dumps(_plain(provider.state(b)))

    def make_mismatched_object(self):
        return np.random.RandomState(0)

    def make_forged_state(self):
        """numpy's Philox setter accepts any buffer position; the next draw would read past
        its 4-word buffer."""
        state = NumpyRandomProvider().state(self.make_object(0))
        state["state"]["buffer_pos"] = 1000
        return state


@pytest.mark.parametrize(
    "kind, bits, change, match",
    [
        ("Generator", "MT19937", lambda s: s["state"].update(pos=100_000), r"state/state/pos'"),
        ("Generator", "PCG64", lambda s: s["state"].update(inc=1 << 130), r"state/state/inc'"),
        ("Generator", "PCG64DXSM", lambda s: s.update(has_uint32=3), r"state/has_uint32'"),
        (
            "Generator",
            "SFC64",
            lambda s: s["state"].update(state=np.zeros(3, dtype="uint64")),
            r"state/state/state'.*uint64 array of shape \[4\]",
        ),
        ("RandomState", "MT19937", lambda s: s.update(gauss="x"), r"state/gauss'"),
        ("RandomState", "MT19937", lambda s: s.update(has_gauss=-1), r"state/has_gauss'"),
    ],
)
def test_forged_bit_generator_states_are_refused_on_restore_and_load(
    tmp_path, kind, bits, change, match
):
    provider = NumpyRandomProvider()
    build = np.random.Generator if kind == "Generator" else np.random.RandomState
    state = provider.state(build(getattr(np.random, bits)(1)))
    change(state["state"])

    class Forged:
        pass

    class Impostor(StateProvider):
        name = provider.name

        def can_handle(self, obj):
            return isinstance(obj, Forged)

        def state(self, obj):
            return state

        def load(self, obj, state):
            raise AssertionError("only saves")

    with Checkpointer(tmp_path, SMALL, registry=ProviderRegistry([Impostor()])) as writer:
        writer.save({"g": Forged()}, step=1).wait()
    live = build(getattr(np.random, bits)(2))
    before = json.dumps(_plain(provider.state(live)))
    with Checkpointer(tmp_path, SMALL) as reader:
        with pytest.raises(CorruptCheckpointError, match=match):
            reader.restore({"g": live})
        with pytest.raises(CorruptCheckpointError, match=match):
            reader.load()
    assert json.dumps(_plain(provider.state(live))) == before


# ---------------------------------------------------------------- 3. refused at save


def loader():
    data = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2))
    return torch.utils.data.DataLoader(data, batch_size=2)


def test_dataloader_is_refused_at_save_with_key_and_hint(ck):
    with pytest.raises(UnsafeObjectError) as info:
        ck.save({"model": {"w": torch.ones(4)}, "train": {"loader": loader()}}, step=1)
    msg = str(info.value)
    assert "'train/loader'" in msg and "DataLoader" in msg
    assert "state_dict()" in msg and "StatefulProvider" in msg
    assert "allow_unsafe_objects=True" in msg
    assert isinstance(info.value, SerializationError) and isinstance(info.value, TypeError)
    assert ck.list() == [] and ck.latest() is None
    leftovers = os.listdir(ck.directory) if os.path.isdir(ck.directory) else []
    assert leftovers == []  # no temporary, no manifest, no latest
    ck.save({"w": torch.ones(4)}, step=1).wait(60)  # the Checkpointer still works
    assert [i.step for i in ck.list()] == [1]


def test_stateful_loader_is_saved_through_its_state_dict(ck):
    class Stateful:
        def __init__(self):
            self.position = 0

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

    class StatefulLoader(torch.utils.data.DataLoader):  # as torchdata's StatefulDataLoader
        def state_dict(self):
            return {"position": 5}

        def load_state_dict(self, state):
            self.position = state["position"]

    live = Stateful()
    live.position = 17
    data = torch.utils.data.TensorDataset(torch.arange(4.0))
    ck.save({"loader": live, "dl": StatefulLoader(data)}, step=1).wait(60)
    assert not [e for e in manifest(ck)["entries"] if e["kind"] == "object"]
    target, target_dl = Stateful(), StatefulLoader(data)
    ck.restore({"loader": target, "dl": target_dl})
    assert target.position == 17 and target_dl.position == 5


def test_dataloader_is_saved_when_the_config_allows_unsafe_objects(tmp_path):
    with Checkpointer(tmp_path / "ck", UNSAFE) as ck:
        ck.save({"loader": loader()}, step=1).wait(60)
        with pytest.raises(UnsafeObjectError, match="'loader'"):
            ck.load()
        got = ck.load(trusted=True)["loader"]
    assert isinstance(got, torch.utils.data.DataLoader)
    assert [b[0].tolist() for b in got] == [b[0].tolist() for b in loader()]


def test_allow_unsafe_objects_must_be_a_bool():
    with pytest.raises(ConfigError, match="allow_unsafe_objects"):
        CheckpointConfig(allow_unsafe_objects="yes")
