"""``save(view=key)``: each rank file's ``torch.load`` gives the value of one top-level key of
the state instead of the whole state (docs/format.md, "The pickle"). Only the pickle of the
tail changes: the tensor bytes, the index, the manifest and datastates' own reading and
checks are those of a save without a view."""

from __future__ import annotations

import collections
import os
import struct

import pytest
import torch

import datastates
from datastates import Checkpointer, CheckpointConfig, ConfigError, CorruptCheckpointError
from datastates.restore.reader import Reader
from datastates.tools import cli

CONFIG = CheckpointConfig(host_cache_bytes=1 << 20)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("count", torch.tensor(7))


def _state():
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.body(model.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    extra = {
        "t": torch.arange(5.0),
        "od": collections.OrderedDict(z=torch.ones(2), a=3),
        "l": [torch.zeros(2), "s", (1, torch.full((2,), 2.0))],
        "obj": {1, 2},
        "none": None,
    }
    return model, {"model": model, "optimizer": opt, "extra": extra, "n": 3}


def _save(root, state, **kw) -> str:
    with Checkpointer(root, CONFIG) as ckpt:
        info = ckpt.save(state, step=1, **kw).wait()
    return os.path.join(info.path, "rank-00000.dsf")


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _load(path):
    return torch.load(path, weights_only=True, mmap=True)


def test_a_module_view_is_its_state_dict_with_tied_weights_shared(tmp_path):
    model, state = _state()
    view = _load(_save(tmp_path, state, view="model"))
    expected = model.state_dict()
    assert type(view) is collections.OrderedDict and list(view) == list(expected)
    for key, value in expected.items():
        assert view[key].dtype == value.dtype and view[key].shape == value.shape
        assert _bits(view[key]) == _bits(value), key
    assert view["head.weight"].data_ptr() == view["emb.weight"].data_ptr()


def test_other_views_are_the_values_as_the_whole_state_holds_them(tmp_path):
    _, state = _state()
    whole = _load(_save(tmp_path / "whole", state))
    extra = _load(_save(tmp_path / "extra", state, view="extra"))
    assert list(extra) == list(whole["extra"]) == list(state["extra"])
    assert extra["obj"] == whole["extra"]["obj"] == {1, 2}  # as torch.save pickles it
    assert extra["od"]["a"] == 3 and type(extra["od"]) is collections.OrderedDict
    assert extra["l"][1] == "s" and extra["l"][2][0] == 1
    for got, want in ((extra["t"], state["extra"]["t"]), (extra["l"][2][1], torch.full((2,), 2.0))):
        assert _bits(got) == _bits(want)
    assert _load(_save(tmp_path / "n", state, view="n")) == 3
    assert {"state", "param_groups"} <= set(_load(_save(tmp_path / "opt", state, view="optimizer")))


def _tail_at(raw: bytes) -> int:
    return struct.unpack_from("<Q", raw, 100)[0]


def test_only_the_pickle_of_the_tail_changes(tmp_path):
    """Header fields before the tail's, every region (tensors, blobs, index) and the tail's
    offset are the bytes of a save without a view; the manifest's entries too."""
    _, state = _state()
    plain = open(_save(tmp_path / "a", state), "rb").read()
    viewed = open(_save(tmp_path / "b", state, view="model"), "rb").read()
    assert _tail_at(plain) == _tail_at(viewed)
    assert plain[:100] == viewed[:100]
    assert plain[128 : _tail_at(plain)] == viewed[128 : _tail_at(viewed)]
    assert plain[_tail_at(plain) :] != viewed[_tail_at(viewed) :]
    a = datastates.inspect(tmp_path / "a")
    b = datastates.inspect(tmp_path / "b")
    assert (a["tensors"], a["objects"], a["values"]) == (b["tensors"], b["objects"], b["values"])


def test_datastates_reads_and_verifies_a_view_checkpoint(tmp_path):
    model, state = _state()
    path = _save(tmp_path, state, view="model")
    with Checkpointer(tmp_path, CONFIG) as ckpt:
        loaded = ckpt.load()
    assert set(loaded) == {"model", "optimizer", "extra", "n"}
    assert loaded["extra"]["obj"] == {1, 2} and loaded["n"] == 3
    for key, value in model.state_dict().items():
        assert _bits(loaded["model"][key]) == _bits(value), key
    with Reader(os.path.dirname(path), registry=datastates.ProviderRegistry.default()) as r:
        assert r.verify_all() == os.path.getsize(path)
    assert cli.main(["verify", str(tmp_path)]) == 0


def test_a_flipped_byte_in_the_view_pickle_is_a_typed_error(tmp_path):
    """``verify`` checks the tail's CRC-32, sealed in the header, as without a view."""
    _, state = _state()
    path = _save(tmp_path, state, view="model")
    raw = open(path, "rb").read()
    at = raw.index(b"archive/data.pklDS", _tail_at(raw)) + 40  # inside data.pkl's record
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([raw[at] ^ 0x40]))
    with pytest.raises(CorruptCheckpointError):
        with Reader(os.path.dirname(path), registry=datastates.ProviderRegistry.default()) as r:
            r.verify_all()
    assert cli.main(["verify", str(tmp_path)]) != 0
    with Checkpointer(tmp_path, CONFIG) as ckpt:  # a load reads no byte of the tail
        assert ckpt.load()["n"] == 3


@pytest.mark.parametrize(
    "state, view, found",
    [
        ({"model": 1}, 3, "found int 3"),
        ({"model": 1}, b"model", "found bytes b'model'"),
        ({"model": 1, "x": 2}, "optimizer", "found the keys ['model', 'x']"),
        ([torch.ones(2)], "model", "found a state of type list"),
        ({"model": 1, (1, 2): 3}, "model", "saved as a whole"),
    ],
)
def test_a_view_that_is_not_a_top_level_key_is_refused_before_anything_is_written(
    tmp_path, state, view, found
):
    with Checkpointer(tmp_path, CONFIG) as ckpt:
        with pytest.raises(ConfigError) as err:
            ckpt.save(state, step=1, view=view)
        assert found in str(err.value)
        if isinstance(view, str):
            assert "expected a top-level key of the state" in str(err.value)
        assert ckpt.list() == []
        assert not [n for n in os.listdir(tmp_path) if n.startswith("step-")]
        ckpt.save({"model": torch.ones(2)}, step=2, view="model").wait()  # the next one works
    assert [i.step for i in datastates.Checkpointer(tmp_path, CONFIG).list()] == [2]
