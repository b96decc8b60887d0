"""The one walker of saved state trees (format/tree.py): keys, the ``keys=`` prefix rule, leaves
in tree order, and the folds that rebuild a tree (a new saved tree, or Python values)."""

from __future__ import annotations

import copy
import random
import sys
from collections import OrderedDict

import pytest

from datastates import CorruptCheckpointError
from datastates.format import checks, tree


def _value(v):
    return {"t": "value", "v": v}


def _dict(*pairs, t="dict"):
    return {"t": t, "items": [[k, v] for k, v in pairs]}


def _seq(*nodes, t="list"):
    return {"t": t, "items": list(nodes)}


#: model/w (tensor 0), model/b (tensor 1), opt (a provider's state: a list with an object and an
#: odict), epoch (a value), tied/a and tied/b (both tensor 0), 3 (an int key) -> a tuple.
TREE = _dict(
    ("model", _dict(("w", {"t": "tensor", "e": 0, "param": True}), ("b", {"t": "tensor", "e": 1}))),
    (
        "opt",
        {
            "t": "provider",
            "name": "sgd",
            "state": _seq({"t": "object", "e": 2}, _dict(("lr", _value(0.1)), t="odict")),
        },
    ),
    ("epoch", _value(3)),
    ("tied", _dict(("a", {"t": "tensor", "e": 0}), ("b", {"t": "tensor", "e": 0}))),
    (3, _seq(_value(None), _value("x"), t="tuple")),
)

LEAF_PATHS = [
    ("model", "w"),
    ("model", "b"),
    ("opt", 0),
    ("opt", 1, "lr"),
    ("epoch",),
    ("tied", "a"),
    ("tied", "b"),
    (3, 0),
    (3, 1),
]


def test_keys_join_the_parts_with_slashes():
    assert tree.key_of(()) == ""
    assert tree.key_of(("model", 0, "w")) == "model/0/w"
    assert tree.key_of((3, None, True)) == "3/None/True"
    for path in [(), ("a",), ("a", 1), (1, "b", 2), ("",), ("", "")]:
        key = tree.key_of(path) if path else None  # None: the root
        assert tree.child_key(key, "z") == tree.key_of(path + ("z",))


def test_prefixes_of_a_keys_argument():
    assert tree.prefixes(None) is None
    assert tree.prefixes("/model/") == ["model"]
    assert tree.prefixes(["a/", "b/c", ""]) == ["a", "b/c", ""]
    assert tree.prefixes(k for k in ("x",)) == ["x"]


@pytest.mark.parametrize(
    "path,wanted,expected",
    [
        ((), None, "all"),
        (("a",), None, "all"),
        ((), ["a"], "some"),
        (("a",), ["a"], "all"),
        (("a", "b"), ["a"], "all"),
        (("ab",), ["a"], None),
        (("a",), ["a/b"], "some"),
        (("a", "c"), ["a/b"], None),
        (("x",), [""], "all"),
        (("m", 0), ["m/0/w", "n"], "some"),
        (("n", 1), ["m/0/w", "n"], "all"),
        (("x",), [], None),
        ((), [], "some"),
    ],
)
def test_scope_of_a_path(path, wanted, expected):
    assert tree.scope(path, wanted) == expected


def test_items_are_keys_or_positions():
    assert tree.items(TREE["items"][0][1]) == [
        ("w", TREE["items"][0][1]["items"][0][1]),
        ("b", TREE["items"][0][1]["items"][1][1]),
    ]
    seq = _seq(_value(1), _value(2), t="tuple")
    assert tree.items(seq) == [(0, seq["items"][0]), (1, seq["items"][1])]


def test_leaves_in_tree_order_with_their_paths():
    found = list(tree.leaves(TREE))
    assert [p for p, _ in found] == LEAF_PATHS
    assert [n["t"] for _, n in found] == [
        "tensor",
        "tensor",
        "object",
        "value",
        "value",
        "tensor",
        "tensor",
        "value",
        "value",
    ]
    assert found[0][1] is TREE["items"][0][1]["items"][0][1]  # the nodes themselves


def test_leaves_within_prefixes_include_those_on_the_way():
    assert [p for p, _ in tree.leaves(TREE, ["model/w", "3"])] == [("model", "w"), (3, 0), (3, 1)]
    assert [p for p, _ in tree.leaves(TREE, ["opt/1"])] == [("opt", 1, "lr")]
    assert list(tree.leaves(TREE, ["nothing"])) == []
    # a leaf whose key is a prefix of a wanted key is on the way to it, so it is yielded
    assert [p for p, _ in tree.leaves(TREE, ["epoch/deeper"])] == [("epoch",)]
    assert [p for p, _ in tree.leaves(TREE, [""])] == LEAF_PATHS


def test_whole_containers_are_yielded_as_leaves():
    def sequences(node):
        return node["t"] in tree.SEQUENCES

    found = list(tree.leaves(TREE, whole=sequences))
    assert [p for p, _ in found] == [
        ("model", "w"),
        ("model", "b"),
        ("opt",),
        ("epoch",),
        ("tied", "a"),
        ("tied", "b"),
        (3,),
    ]
    assert found[2][1] is TREE["items"][1][1]["state"]  # the provider's state, not the provider


def test_leaves_keep_no_interpreter_stack():
    node = _value(7)
    for i in range(sys.getrecursionlimit() + 100):
        node = _seq(node) if i % 2 else _dict(("k", node))
    [(path, leaf)] = list(tree.leaves(node))
    assert leaf == _value(7) and len(path) == sys.getrecursionlimit() + 100


def test_map_leaves_renumbers_entries_as_the_commit_does():
    before = copy.deepcopy(TREE)
    table = [5, 6, 7]
    out = tree.map_leaves(
        TREE, lambda path, n: {**n, "e": table[n["e"]]} if n["t"] in tree.ENTRY_LEAVES else n
    )
    assert TREE == before  # the input is not modified
    assert [(p, n.get("e")) for p, n in tree.leaves(out)] == [
        (("model", "w"), 5),
        (("model", "b"), 6),
        (("opt", 0), 7),
        (("opt", 1, "lr"), None),
        (("epoch",), None),
        (("tied", "a"), 5),
        (("tied", "b"), 5),
        ((3, 0), None),
        ((3, 1), None),
    ]
    assert out["items"][0][1]["items"][0][1] == {"t": "tensor", "e": 5, "param": True}
    assert out["items"][1][1]["name"] == "sgd" and out["items"][1][1]["t"] == "provider"
    assert out["items"][1][1]["state"]["items"][1]["t"] == "odict"
    assert out["items"][4] == [3, TREE["items"][4][1]]  # values kept, containers rebuilt
    assert out["items"][4][1] is not TREE["items"][4][1]


def test_map_leaves_identity_is_an_equal_tree():
    assert tree.map_leaves(TREE, lambda path, n: n) == TREE


def test_build_gives_python_containers_of_the_saved_types():
    seen = []

    def leaf(path, node):
        seen.append(path)
        return node.get("v", f"e{node.get('e')}")

    def provider(path, node, state):
        return ("rebuilt", node["name"], path, state)

    got = tree.build(TREE, leaf, provider=provider)
    assert seen == LEAF_PATHS
    assert got == {
        "model": {"w": "e0", "b": "e1"},
        "opt": ("rebuilt", "sgd", ("opt",), ["e2", OrderedDict(lr=0.1)]),
        "epoch": 3,
        "tied": {"a": "e0", "b": "e0"},
        3: (None, "x"),
    }
    assert type(got["opt"][3][1]) is OrderedDict and type(got[3]) is tuple
    assert type(got["model"]) is dict
    assert tree.build(TREE, leaf)["opt"] == ["e2", OrderedDict(lr=0.1)]  # default: the state


def test_build_within_prefixes():
    got = tree.build(TREE, lambda path, n: tree.key_of(path), wanted=["model/b", "3/1"])
    assert got == {"model": {"b": "model/b"}, 3: ("3/1",)}


def test_fold_sees_children_before_their_parent():
    order = []
    tree.fold(
        TREE,
        lambda path, n: order.append(tree.key_of(path)),
        mapping=lambda node, kids: order.append(("map", [k for k, _ in kids])),
        sequence=lambda node, kids: order.append(("seq", len(kids))),
        provider=lambda path, node, state: order.append(("provider", path)),
    )
    assert order[:3] == ["model/w", "model/b", ("map", ["w", "b"])]
    assert order[3:7] == ["opt/0", "opt/1/lr", ("map", ["lr"]), ("seq", 2)]
    assert order[7] == ("provider", ("opt",)) and order[-1] == (
        "map",
        ["model", "opt", "epoch", "tied", 3],
    )


def test_the_validator_shares_the_node_kinds_and_keys():
    assert checks._NODE_TYPES == tree.NODE_TYPES
    refs: dict = {}
    checks.check_tree(
        copy.deepcopy(TREE), checks._At("manifest.json"), ["tensor", "tensor", "object"], refs
    )
    by_entry = {}
    for path, node in tree.leaves(TREE):
        if node["t"] in tree.ENTRY_LEAVES:
            by_entry.setdefault(node["e"], set()).add(tree.key_of(path))
    assert refs == by_entry == {0: {"model/w", "tied/a", "tied/b"}, 1: {"model/b"}, 2: {"opt/0"}}


def _random_tree(rng: random.Random, depth: int = 0) -> dict:
    if depth > 5 or rng.random() < 0.3:
        kind = rng.choice(tree.LEAVES)
        return _value(rng.randrange(9)) if kind == "value" else {"t": kind, "e": rng.randrange(4)}
    kind = rng.choice(tree.MAPPINGS + tree.SEQUENCES + ("provider",))
    if kind == "provider":
        return {"t": "provider", "name": "p", "state": _random_tree(rng, depth + 1)}
    if kind in tree.MAPPINGS:
        return _dict(
            *(
                (k, _random_tree(rng, depth + 1))
                for k in rng.sample(["a", "b", "c", 1, None], rng.randrange(4))
            ),
            t=kind,
        )
    return _seq(*(_random_tree(rng, depth + 1) for _ in range(rng.randrange(4))), t=kind)


@pytest.mark.parametrize("seed", range(20))
def test_leaves_and_fold_agree_on_random_trees(seed):
    rng = random.Random(seed)
    root = _random_tree(rng)
    wanted = rng.choice([None, ["a"], ["b/0", "1"], ["a/a", "c/1/b"], [""]])
    visited = []
    tree.build(root, lambda path, n: visited.append((path, n["t"])), wanted=wanted)
    assert [(p, n["t"]) for p, n in tree.leaves(root, wanted)] == visited
    assert tree.map_leaves(root, lambda path, n: n) == root


@pytest.mark.parametrize("container", ["dict", "list"])
@pytest.mark.parametrize("leaf", [{"t": "tensor", "e": 0}, {"t": "value", "v": 1}])
def test_the_validator_holds_a_leaf_to_the_depth_limit(container, leaf):
    """A leaf is checked where its parent meets it (no stack item for the commonest node), and
    still counts as one level: at MAX_TREE_DEPTH it is read, one deeper it is refused."""

    def nested(levels: int) -> dict:
        node = copy.deepcopy(leaf)
        for _ in range(levels - 1):
            node = {"t": container, "items": [["k", node] if container == "dict" else node]}
        return node

    refs: dict = {}
    checks.check_tree(nested(checks.MAX_TREE_DEPTH), checks._At("m"), ["tensor"], refs)
    assert refs == (
        {0: {"/".join(["k" if container == "dict" else "0"] * (checks.MAX_TREE_DEPTH - 1))}}
        if leaf["t"] == "tensor"
        else {}
    )
    with pytest.raises(CorruptCheckpointError, match=f"deeper than {checks.MAX_TREE_DEPTH}"):
        checks.check_tree(nested(checks.MAX_TREE_DEPTH + 1), checks._At("m"), ["tensor"], refs)
