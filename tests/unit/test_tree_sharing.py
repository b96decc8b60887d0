"""Per-rank subtrees equal to rank 0's are written once (format/sharing.py): the round trip gives
the same trees, what differs stays per rank, and a forged ``same`` node is refused."""

from __future__ import annotations

import copy
import json

import pytest

from datastates.errors import CorruptCheckpointError
from datastates.format import sharing

BASE = {
    "t": "dict",
    "items": [
        [
            "model",
            {
                "t": "dict",
                "items": [["w", {"t": "tensor", "e": 0}], ["b", {"t": "tensor", "e": 1}]],
            },
        ],
        [
            "rng",
            {
                "t": "provider",
                "name": "datastates.RNGState",
                "state": {"t": "dict", "items": [["torch", {"t": "tensor", "e": 2}]]},
            },
        ],
        ["steps", {"t": "list", "items": [{"t": "value", "v": 1}, {"t": "value", "v": 2}]}],
    ],
}


def _rank1():
    tree = copy.deepcopy(BASE)
    tree["items"][1][1]["state"]["items"][0][1]["e"] = 3  # its own RNG tensor
    return tree


def test_equal_subtrees_become_markers_and_come_back():
    mine = _rank1()
    written = json.loads(json.dumps(sharing.share(mine, BASE)))
    assert written["items"][0][1] == {"t": "same", "r": 0}  # the model: shared
    assert written["items"][2][1] == {"t": "same", "r": 0}
    assert written["items"][1][1]["state"]["items"][0][1] == {"t": "tensor", "e": 3}
    back = sharing.resolve(written, 1, [BASE], "m", 256)
    assert back == mine and back["items"][0][1] is BASE["items"][0][1]
    assert sharing.share(copy.deepcopy(BASE), BASE) == {"t": "same", "r": 0}


@pytest.mark.parametrize(
    "mine, theirs",
    [(1, True), (0, False), (1, 1.0), (-0.0, 0.0), ("1", 1), (None, False), ([1], [True])],
)
def test_values_equal_only_to_python_stay_per_rank(mine, theirs):
    """Rank 1's value, or a key of its dict, equals rank 0's under Python's ``==`` but is other
    JSON: it is written, and reads back as its own, with its own type."""

    def tree(value, key):
        return {
            "t": "dict",
            "items": [[key, {"t": "value", "v": value}], ["w", {"t": "tensor", "e": 0}]],
        }

    for node, base in ((tree(mine, "k"), tree(theirs, "k")), (tree(0, mine), tree(0, theirs))):
        written = json.loads(json.dumps(sharing.share(node, base)))
        assert written != {"t": "same", "r": 0}
        back = sharing.resolve(written, 1, [base], "m", 256)
        assert json.dumps(back) == json.dumps(node) != json.dumps(base)


def test_different_keys_or_lengths_are_written_in_full():
    other = copy.deepcopy(BASE)
    other["items"][0][1]["items"].reverse()  # same keys, another order
    other["items"][2][1]["items"].append({"t": "value", "v": 3})
    written = sharing.share(other, BASE)
    assert written["items"][0][1] == other["items"][0][1]
    assert written["items"][2][1] == other["items"][2][1]


@pytest.mark.parametrize(
    "marker, rank, match",
    [
        ({"t": "same", "r": 1}, 2, "naming rank 0"),
        ({"t": "same", "r": 0, "x": 1}, 1, "naming rank 0"),
        ({"t": "same", "r": "0"}, 1, "naming rank 0"),
        ({"t": "same", "r": 0}, 0, "naming rank 0"),  # rank 0 itself cannot refer to rank 0
    ],
)
def test_a_forged_marker_is_refused(marker, rank, match):
    tree = {"t": "dict", "items": [["model", marker]]}
    with pytest.raises(CorruptCheckpointError, match=match):
        sharing.resolve(tree, rank, [BASE], "manifest", 256)


def test_a_marker_where_rank_0_has_no_node_is_refused():
    tree = {"t": "dict", "items": [["elsewhere", {"t": "same", "r": 0}]]}
    with pytest.raises(CorruptCheckpointError, match="'elsewhere'.*has no node there"):
        sharing.resolve(tree, 1, [BASE], "manifest", 256)


def test_depth_is_bounded():
    deep = {"t": "value", "v": 0}
    for _ in range(300):
        deep = {"t": "list", "items": [deep]}
    with pytest.raises(CorruptCheckpointError, match="deeper than 256"):
        sharing.resolve(deep, 1, [BASE], "manifest", 256)


def test_only_the_containers_on_the_way_to_a_marker_are_new():
    """A resolved tree is the tree read with rank 0's nodes in place of its markers: the
    containers leading to a marker are new (the tree read is not modified), every subtree
    without a marker is the one read (no copy of what shares nothing)."""
    written = json.loads(json.dumps(sharing.share(_rank1(), BASE)))
    kept = copy.deepcopy(written)
    back = sharing.resolve(written, 1, [BASE], "m", 256)
    assert back == _rank1() and written == kept
    assert back is not written and back["items"][0] is not written["items"][0]
    assert back["items"][1] is written["items"][1]  # the provider: no marker below it
    alone = json.loads(json.dumps(_rank1()))
    assert sharing.resolve(alone, 1, [BASE], "m", 256) is alone
