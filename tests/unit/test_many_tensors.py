"""States of many small tensors: what the per-tensor fast paths of the save, commit and restore
do is what the general code does (the same checks, the same bytes, the same records).

Each fast path stands next to the general code it shortens: the capture copies plain CPU tensors
by address, the layout places a tensor that fits in the current unit at once, the manifest's
parser takes an ordinary tensor entry in one function, the writer checks and encodes entries a
batch at a time, the reader converts entries as they are decoded, the restore reads a plain live
tensor in place. These tests hold each one to the general code on the inputs where they differ.
"""

from __future__ import annotations

import collections
import copy
import gc
import json
import random
import threading

import numpy as np
import pytest
import torch

import datastates
from datastates import Checkpointer, CorruptCheckpointError
from datastates import format as fmt
from datastates.format import codec, files, plain, validate
from datastates.format.checks import _At
from datastates.format.records import FileRef, ReportEntry, ShardRef, TensorEntry
from datastates.format.tree import key_of
from datastates.providers import ProviderRegistry
from datastates.providers.tree import flatten
from datastates.save.planning import Unit, plan_layout

from helpers import assert_same, clone_state
from testkit import MEDIUM


def _many(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1 + i % 5, generator=g) for i in range(n)}


# ------------------------------------------------------------------ save: capture and layout


def test_many_small_tensors_round_trip_and_verify(tmp_path):
    """Many tensors of a few bytes (several units of them, each zeroed whole before its copies)
    restore bit-exact, in place, and the files verify (padding zero, every checksum right)."""
    state = {
        **_many(3000),
        "ints": torch.arange(7, dtype=torch.int16),
        "flag": torch.tensor(True),
        "half": torch.ones(3, dtype=torch.float16),
    }
    ref = clone_state(state)
    with Checkpointer(tmp_path, MEDIUM) as ck:
        handle = ck.save(state, step=1)
        for t in state.values():
            t.zero_()  # eager: already in the host cache when save() returned
        handle.wait()
        live = {k: torch.empty_like(v) for k, v in ref.items()}
        report = ck.restore(live)
        assert len(report.restored) == len(ref)
        assert_same(live, ref)
    from datastates.tools import cli

    assert cli.main(["verify", str(tmp_path)]) == 0


def test_views_of_one_buffer_back_to_back_are_saved_exactly(tmp_path):
    """Views of one flat buffer laid out back to back in the file (copied as one range) and
    views with gaps between them (copied one by one) keep their own bytes."""
    flat = torch.arange(64 * 40, dtype=torch.float32)
    state = {
        "dense": [flat[i * 16 : (i + 1) * 16] for i in range(40)],  # 64 B each: adjacent
        "gaps": [flat[i * 64 + 3 : i * 64 + 10] for i in range(40)],
    }  # 28 B, apart
    with Checkpointer(tmp_path, MEDIUM) as ck:
        ck.save(state, step=1).wait()
        loaded = ck.load()
    assert_same(loaded, clone_state(state))


def test_tensors_that_are_not_plain_go_through_their_bytes(tmp_path):
    """Non-contiguous, zero-dim, empty, numpy and requires-grad tensors next to plain ones."""
    base = torch.randn(6, 5)
    state = {
        "t": base.t(),
        "step": base[1:4:2, ::2],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "np": np.arange(5, dtype=np.int32),
        "param": torch.nn.Parameter(torch.randn(4)),
        "plain": torch.randn(9),
    }
    with Checkpointer(tmp_path, MEDIUM) as ck:
        ck.save(state, step=1).wait()
        loaded = ck.load()
    assert isinstance(loaded["np"], np.ndarray) and loaded["np"].tolist() == [0, 1, 2, 3, 4]
    for key in ("t", "step", "scalar", "empty", "param", "plain"):
        assert torch.equal(loaded[key], state[key].detach()), key


def test_a_conjugate_or_negative_view_is_saved_with_its_values(tmp_path):
    """A tensor whose bytes are not its values (a lazy conjugate, a lazy negation) is not copied
    by address: the general path saves its values (``format.codec.tensor_bytes``), never the
    bytes of the memory under it."""
    base = torch.randn(3, dtype=torch.complex64)
    state = {"c": base.conj(), "n": torch.randn(4, dtype=torch.complex64).conj().imag}
    assert state["c"].is_conj() and state["n"].is_neg()
    with Checkpointer(tmp_path, MEDIUM) as ck:
        ck.save(state, step=1).wait()
        loaded = ck.load()
    for key, value in state.items():
        expected = value.resolve_conj().resolve_neg()
        assert not loaded[key].is_conj() and not loaded[key].is_neg()
        assert torch.equal(loaded[key], expected), key


def _reference_layout(sizes, unit_bytes):
    """The layout loop without the fast path of a tensor that fits in the last unit."""
    units, offsets, pos = [], [], 0
    for item, size in enumerate(sizes):
        pos = codec.align_up(pos, codec.DATA_ALIGN)
        offsets.append(codec.HEADER_BYTES + pos)
        done = 0
        while done < size:
            index, within = divmod(pos, unit_bytes)
            while len(units) <= index:
                units.append(Unit(codec.HEADER_BYTES + len(units) * unit_bytes))
            n = min(size - done, unit_bytes - within)
            units[index].pieces.append((item, done, within, n))
            units[index].nbytes = within + n
            pos, done = pos + n, done + n
    return units, offsets


@pytest.mark.parametrize("seed", range(5))
def test_layout_fast_path_places_every_piece_as_the_general_loop(seed):
    rng = random.Random(seed)
    unit = 4096 * rng.choice([1, 2, 4])
    sizes = [
        rng.choice([0, 1, 8, 63, 64, 65, 500, 4095, 4096, 4097, 3 * unit + 7]) for _ in range(300)
    ]
    layout = plan_layout(sizes, [], unit)
    units, offsets = _reference_layout(sizes, unit)
    assert layout.tensor_offsets == offsets
    assert [(u.file_offset, u.nbytes, u.pieces) for u in layout.units] == [
        (u.file_offset, u.nbytes, u.pieces) for u in units
    ]


def test_save_leaves_the_collector_no_object_per_tensor(tmp_path, monkeypatch):
    """While ``save()`` of N plain tensors is in flight, the garbage collector tracks no new
    object per tensor: the records of the items are columns and the tree's mappings hold their
    keys and nodes in two lists (the ``[key, node]`` pairs of the manifest are made on the
    commit thread). A full collection scans every tracked object, and it is triggered by how
    many survive: with 100k tensors, two per tensor made one fall inside ``save()``."""
    n = 20000
    state = {f"layer{i // 100}.t{i}": torch.randn(2) for i in range(n)}
    state["nested"] = {"a": [torch.ones(1), {"b": torch.ones(1)}], "c": 3}
    gate = threading.Event()
    from datastates.save import pipeline

    finish = pipeline.finish_file

    def gated(job, fsync):  # the commit thread waits here until the count is taken
        gate.wait(60)
        return finish(job, fsync)

    with Checkpointer(tmp_path) as ck:
        ck.save(state, step=0).wait()
        monkeypatch.setattr(pipeline, "finish_file", gated)
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        handle = ck.save(state, step=1)
        gc.collect(0)
        gc.collect(1)  # plain tuples of untracked items are untracked by a collection
        new = collections.Counter(type(o).__name__ for o in gc.get_objects() if id(o) not in before)
        gate.set()
        handle.wait()
        assert sum(new.values()) < n // 20, new.most_common(5)
        loaded = ck.load(step=1)
    assert_same(loaded, state)


def test_walker_keys_are_key_of_their_paths():
    """Keys built as the walk descends are ``key_of(path)``, for every kind of dict key (the
    root's children bare, an empty key an empty part)."""
    state = {
        "": {"x": torch.ones(1), 3: [torch.ones(1), {"": torch.ones(1)}]},
        "a": {"b": torch.ones(1)},
        1.5: torch.ones(1),
        None: torch.ones(1),
        True: torch.ones(1),
        7: (torch.ones(1),),
    }
    paths = [("", "x"), ("", 3, 0), ("", 3, 1, ""), ("a", "b"), (1.5,), (None,), (True,), (7, 0)]
    items = flatten(state, ProviderRegistry.default()).items
    assert items.keys == [key_of(p) for p in paths]


def test_empty_dict_keys_round_trip(tmp_path):
    """An empty key at any depth: the manifest's checker derives the keys the writer did
    (``{"": {"x": t}}`` has the entry key ``/x``), so it commits and loads bit-exactly."""
    state = {
        "": {"x": torch.arange(3.0), "": {"": torch.ones(2)}, 3: [torch.zeros(1)]},
        "y": {"": torch.full((2,), 5.0)},
    }
    with datastates.Checkpointer(tmp_path) as ck:
        ck.save(state, step=1).wait()
        loaded = ck.load()
        live = {
            "": {"x": torch.zeros(3), "": {"": torch.zeros(2)}, 3: [torch.ones(1)]},
            "y": {"": torch.zeros(2)},
        }
        ck.restore(live)
    for got in (loaded, live):
        assert torch.equal(got[""]["x"], state[""]["x"])
        assert torch.equal(got[""][""][""], state[""][""][""])
        assert torch.equal(got[""][3][0], state[""][3][0])
        assert torch.equal(got["y"][""], state["y"][""])


def test_the_same_view_under_two_keys_is_one_item():
    t = torch.randn(4)
    flat = flatten({"a": t, "b": t, "c": t[1:], "d": t.view(2, 2)}, ProviderRegistry.default())
    assert flat.items.keys == ["a", "c", "d"]
    assert flat.tree["keys"][1] == "b" and flat.tree["nodes"][1]["e"] == 0


# ------------------------------------------------------------------ the manifest's parser

# an entry's shards: the tensor whole in two checksum pieces; whole in one piece, or two rows in
# one piece each (the commonest kinds, which the parser and the writer check in a frame of
# their own: plain._is_box)
SHARDS = {
    "whole, two pieces": [
        {
            "file": 0,
            "offset": 4096,
            "nbytes": 24,
            "global_offset": [0, 0],
            "shape": [2, 3],
            "checksums": [[16, 5], [8, 9]],
        }
    ],
    "whole, one piece": [
        {
            "file": 0,
            "offset": 4096,
            "nbytes": 24,
            "global_offset": [0, 0],
            "shape": [2, 3],
            "checksums": [[24, 5]],
        }
    ],
    "two rows": [
        {
            "file": 0,
            "offset": 4096,
            "nbytes": 12,
            "global_offset": [0, 0],
            "shape": [1, 3],
            "checksums": [[12, 5]],
        },
        {
            "file": 1,
            "offset": 4096,
            "nbytes": 12,
            "global_offset": [1, 0],
            "shape": [1, 3],
            "checksums": [[12, 9]],
        },
    ],
}
FORMS = pytest.mark.parametrize("form", sorted(SHARDS))


def _entry_json(form: str = "whole, two pieces") -> dict:
    return {
        "kind": "tensor",
        "key": "w",
        "dtype": "float32",
        "shape": [2, 3],
        "shards": copy.deepcopy(SHARDS[form]),
        "rank": 0,
    }


def _mutations(rng: random.Random, form: str = "whole, two pieces"):
    """Valid and invalid variants of a tensor entry, one field changed at a time."""
    values = [
        None,
        True,
        False,
        0,
        1,
        -1,
        2,
        3,
        12,
        24,
        4096,
        4160,
        1 << 64,
        1.0,
        "",
        "x",
        [],
        [0],
        [2],
        [2, 3],
        [3, 2],
        [1, 3],
        [0, 0],
        [1, 0],
        [2, 0],
        [True],
        {},
        [[24, 5]],
        [[12, 5]],
        [[16, 5], [8, 9]],
        [[24, -1]],
        [[0, 0], [24, 1]],
        "float32",
        "bfloat16",
        "int8",
        [2, 3, 1],
        [-1, 0],
        [0, -1],
        [2, 4],
        [-1, -3],
    ]
    for _ in range(3000):
        e = _entry_json(form)
        shard = rng.choice(e["shards"])
        for _ in range(rng.choice([1, 1, 2])):
            target = rng.choice([e, shard, e, shard, None])
            if target is None:
                e["shards"] = rng.choice([[], [shard, copy.deepcopy(shard)], "x", [None]])
                continue
            key = rng.choice(sorted(target) + ["replicated", "rank", "extra"])
            if rng.random() < 0.1:
                target.pop(key, None)
            else:
                target[key] = copy.deepcopy(rng.choice(values))
        yield e


@FORMS
def test_plain_entry_parser_agrees_with_the_general_one(form):
    """Wherever the one-function parser of a tensor entry accepts, the general parser accepts
    it too and makes the same record; wherever the general one refuses, the fast one refuses."""
    files_ = (
        FileRef(name=fmt.shard_file_name(0), rank=0, nbytes=8192, index_crc32=0),
        FileRef(name=fmt.shard_file_name(1), rank=1, nbytes=4096 + 64, index_crc32=0),
    )
    _assert_agree(
        _mutations(random.Random(7), form),
        lambda e: plain.tensor_entry(e, files_, 2),
        lambda e: validate._entry(e, _At("m"), files_, 2),
    )


def _assert_agree(cases, fast_parse, general_parse) -> None:
    """Where ``fast_parse`` accepts, ``general_parse`` makes the same record; where the general
    one raises CorruptCheckpointError, the fast one refuses (None); over 100 accepted."""
    accepted = 0
    for e in cases:
        fast = fast_parse(e)
        try:
            general = general_parse(e)
        except CorruptCheckpointError:
            assert fast is None, e
            continue
        if fast is not None:
            accepted += 1
            assert fast == general, e
    assert accepted > 100


def _report_json() -> dict:
    return {
        "key": "w",
        "kind": "tensor",
        "dtype": "int16",
        "shape": [3],
        "offset": 4160,
        "nbytes": 6,
        "checksums": [[6, 11]],
    }


def _shard_report_json() -> dict:
    """A rank's shard of a global tensor (what ``TensorShard`` reports)."""
    return {
        "key": "w",
        "kind": "tensor",
        "dtype": "int16",
        "shape": [1, 3],
        "global_shape": [4, 3],
        "global_offset": [2, 0],
        "offset": 4160,
        "nbytes": 6,
        "checksums": [[6, 11]],
    }


def _replica_report_json() -> dict:
    """A replica this rank holds but does not write."""
    return {
        "key": "w",
        "kind": "tensor",
        "dtype": "int16",
        "shape": [3],
        "replicated": True,
        "written": False,
    }


_REPORT_VALUES = [
    None,
    True,
    False,
    0,
    1,
    2,
    3,
    4,
    6,
    64,
    4160,
    8192,
    -1,
    "",
    "w",
    [],
    [3],
    [6],
    [2, 3],
    [1, 3],
    [4, 3],
    [2, 0],
    [3, 0],
    [-1, 0],
    [0, 0, 0],
    [True, 0],
    [[6, 11]],
    [[3, 1], [3, 2]],
    [[6, -1]],
    "int16",
    "float32",
    "uint8",
]


def _report_mutations(rng: random.Random, template):
    """Variants of a report entry, one or two fields changed or removed at a time."""
    for _ in range(3000):
        e = template()
        for _ in range(rng.choice([1, 1, 2])):
            key = rng.choice(
                sorted(e) + ["replicated", "written", "global_shape", "global_offset", "extra"]
            )
            if rng.random() < 0.1:
                e.pop(key, None)
            else:
                e[key] = copy.deepcopy(rng.choice(_REPORT_VALUES))
        yield e


@pytest.mark.parametrize("template", [_report_json, _shard_report_json, _replica_report_json])
def test_plain_report_entry_parser_agrees_with_the_general_one(template):
    """The same, for the entries of another rank's report: tensors held whole, shards of a
    global tensor, replicas not written by this rank."""
    f = FileRef(name=fmt.shard_file_name(0), rank=0, nbytes=8192, index_crc32=0)
    _assert_agree(
        _report_mutations(random.Random(11), template),
        lambda e: plain.report_entry(e, f),
        lambda e: validate._report_entry(e, _At("r"), f),
    )


def _general_only(monkeypatch):
    """Every fast path of the report parser and of the manifest writer off: each entry goes
    through the general parser (and the writer's general check and encoding)."""
    monkeypatch.setattr(plain, "report_entry", lambda e, f: None)
    monkeypatch.setattr(plain, "tensor_entry_json", lambda e, files, world: None)
    monkeypatch.setattr(validate, "report_entry_converter", lambda fields: None)


def _outcome(fn):
    """What ``fn()`` gives: ("ok", value) or ("error", type, message)."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 -- compared, whatever it is
        return ("error", type(exc), str(exc))


def _sharded_report(rank: int) -> dict:
    """The JSON report of ``rank`` holding rows ``rank`` of two global tensors and a replica."""
    entries = [
        {
            "key": k,
            "kind": "tensor",
            "dtype": "float32",
            "shape": [1, 2],
            "global_shape": [4, 2],
            "global_offset": [rank, 0],
            "offset": 4096 + 64 * i,
            "nbytes": 8,
            "checksums": [[8, 100 + i]],
        }
        for i, k in enumerate(("a", "b"))
    ]
    entries.append(
        {
            "key": "c",
            "kind": "tensor",
            "dtype": "int64",
            "shape": [2],
            "replicated": True,
            **(
                {"offset": 4224, "nbytes": 16, "checksums": [[16, 5]]}
                if rank == 0
                else {"written": False}
            ),
        }
    )
    tree = {
        "t": "dict",
        "items": [[k, {"t": "tensor", "e": i}] for i, k in enumerate(("a", "b", "c"))],
    }
    return {
        "rank": rank,
        "save": {"name": "step-0000000001", "step": 1, "nonce": "n"},
        "root": "/d",
        "file": {"name": fmt.shard_file_name(rank), "nbytes": 8192, "index_crc32": 1},
        "entries": entries,
        "tree": tree,
        "replicas": {"c": "d0"},
    }


def _report_mutation(rng: random.Random) -> tuple[int, dict]:
    """A rank and its report with one or two fields of its entries (or of itself) changed."""
    rank = rng.randrange(4)
    report = _sharded_report(rank)
    for _ in range(rng.choice([1, 1, 2])):
        entries = report.get("entries")
        targets = [report, report.get("file")] + (entries if type(entries) is list else [])
        target = rng.choice([t for t in targets if type(t) is dict])
        key = rng.choice(sorted(target) + ["written", "replicated", "global_shape"])
        if rng.random() < 0.15:
            target.pop(key, None)
        else:
            target[key] = copy.deepcopy(rng.choice(_REPORT_VALUES + [[0, 0], [1, 0], [3, 0]]))
    return rank, report


def _review_outcome(reports: dict) -> tuple:
    """Rank 0's review of the JSON reports: the parsed reports, then the manifest bytes (or
    the problems found), or the error raised on the way."""
    from datastates.commit.review import build_manifest, check_replicas, check_tiling
    import dataclasses

    parsed = {r: _parse_sent(rep, f"report {r}") for r, rep in sorted(reports.items())}
    manifest = build_manifest(
        [parsed[r] for r in sorted(parsed)], name="step-1", step=1, metadata={}, save_id="n"
    )
    manifest = dataclasses.replace(manifest, created_unix=0.0, seq=1)
    problems = check_tiling(manifest) + check_replicas(parsed)
    return parsed, problems, fmt.manifest_record_bytes(manifest)


def _parse_sent(report: dict, where: str):
    """A report as rank 0 parses it from the bytes another rank sent (commit/round.py)."""
    obj, checked = validate.decode_rank_report(json.dumps(report).encode())
    return validate.parse_rank_report(obj, where, checked=checked)


def test_a_sent_report_is_decoded_as_json_decodes_it():
    """A report whose file precedes its entries (as a rank sends it) has its ordinary entries
    made records as they are decoded, and parses into the record the JSON gives; in another
    order its entries are left as decoded; not an object, or not JSON, it is what
    ``json.loads`` makes of it (or raises)."""
    report = _sharded_report(1)
    expected = validate.parse_rank_report(copy.deepcopy(report), "r")
    obj, checked = validate.decode_rank_report(json.dumps(report).encode())
    assert checked and all(type(e) is not dict for e in obj["entries"][:2])
    assert validate.parse_rank_report(obj, "r", checked=True) == expected
    in_order = json.dumps(report, sort_keys=True)  # its entries before its file: as decoded
    assert validate.decode_rank_report(in_order.encode())[0] == json.loads(in_order)
    for text in ("[1]", '{"entries": [NaN]}'):
        assert validate.decode_rank_report(text.encode()) == (json.loads(text), False)
    with pytest.raises(ValueError):
        validate.decode_rank_report(b'{"rank": 1,')


def test_review_of_mutated_reports_is_that_of_the_general_path(monkeypatch):
    """Rank 0's review of four reports, one of them changed (wrong types, negative or
    misaligned offsets, boxes outside the tensor or overlapping another rank's, missing
    fields): the same reports, problems, manifest bytes and record, or the same error (type
    and message), with the fast paths as with the general parser and writer alone."""
    rng = random.Random(5)
    outcomes = []
    for _ in range(600):
        rank, changed = _report_mutation(rng)
        reports = {r: _sharded_report(r) for r in range(4)}
        reports[rank] = changed
        outcomes.append((reports, _outcome(lambda: _review_outcome(reports))))
    with monkeypatch.context() as m:
        _general_only(m)
        general = [_outcome(lambda: _review_outcome(reports)) for reports, _ in outcomes]
    assert [o for _, o in outcomes] == general
    kinds = {o[0] if o[0] == "ok" else o[1].__name__ for o in general}
    assert kinds >= {"ok", "CorruptCheckpointError"}, kinds
    assert sum(o[0] == "ok" and not o[1][1] for o in general) > 50  # committed as they are


def _written_mutations(rng: random.Random, entry):
    """Records of a manifest entry with one field of it or of its shard changed (records a
    writer must refuse: a list for a tuple, a bool or a numpy int for an int, a box outside,
    a misaligned offset, pieces not covering the bytes)."""
    values = [
        None,
        True,
        0,
        1,
        2,
        3,
        -1,
        12,
        24,
        4096,
        4100,
        4160,
        1 << 64,
        1.0,
        "x",
        [2, 3],
        (2, 3),
        (3, 2),
        (1, 3),
        (0, 0),
        (1, 0),
        (2, 0),
        (2,),
        (),
        np.int64(1),
        ((24, 5),),
        ((12, 5),),
        ((16, 5), (8, 9)),
        ((0, 1), (24, 5)),
        [[16, 5], [8, 9]],
        ([16, 5], [8, 9]),
        ((24, -1),),
        ((24, 1 << 32),),
        "float32",
        "int8",
        torch.Size([2, 3]),
        (-1, 0),
        (0, -1),
        (2, 4),
        (-1, -3),
    ]
    for _ in range(3000):
        e = entry
        for _ in range(rng.choice([1, 1, 2])):
            if rng.random() < 0.5:
                e = e._replace(**{rng.choice(e._fields): rng.choice(values)})
            else:
                i = rng.randrange(len(entry.shards))
                shard = entry.shards[i]
                shard = shard._replace(**{rng.choice(shard._fields): rng.choice(values)})
                shards = entry.shards[:i] + (shard,) + entry.shards[i + 1 :]
                e = e._replace(shards=rng.choice([shards, shards + (shard,), list(shards)]))
        yield e


@FORMS
def test_written_entry_fast_path_is_the_general_check_and_encoding(form):
    """Where the writer's record check of an ordinary tensor entry accepts, its bytes are those
    of the entry's JSON form and the general check (JSON form, parse, compare) accepts it;
    so where the general check refuses, the fast one refuses."""
    files_ = (
        FileRef(name=fmt.shard_file_name(0), rank=0, nbytes=8192, index_crc32=0),
        FileRef(name=fmt.shard_file_name(1), rank=1, nbytes=4096 + 64, index_crc32=0),
    )
    entry = validate._entry(_entry_json(form), _At("m"), files_, 2)
    head = validate._Head(3, "n", 1, 1, 0.0, 2, {}, files_)
    accepted = 0
    for e in _written_mutations(random.Random(3), entry):
        fast = plain.tensor_entry_json(e, head.files, head.world)
        general = _outcome(lambda: validate._written_entry(e, _At("m"), head))
        if fast is not None:
            accepted += 1
            assert general == ("ok", fast) == ("ok", codec.encode_json(e.to_json())), e
        # else the writer takes the general path: its outcome is the general one
    assert accepted > 40  # (mutations that duplicate a box overlap: refused by both)


@pytest.mark.parametrize("pieces", [[], [[0, 0]], [[0, 7]]])
def test_an_empty_tensor_is_checked_by_both_paths_alike(pieces):
    """A tensor without elements stores no bytes: no checksum piece (a piece covers at least
    one byte). The parsers and the writer's check agree with the general ones on it, the
    record forms too (three fields changed at once, which the mutations above never reach)."""
    files_ = (FileRef(name=fmt.shard_file_name(0), rank=0, nbytes=8192, index_crc32=0),)
    e = _entry_json()
    e["shape"] = e["shards"][0]["shape"] = [0, 3]
    e["shards"][0]["nbytes"], e["shards"][0]["checksums"] = 0, pieces
    general = _outcome(lambda: validate._entry(e, _At("m"), files_, 1))
    assert general[0] == ("ok" if not pieces else "error")
    assert plain.tensor_entry(e, files_, 1) == (general[1] if not pieces else None)
    record = TensorEntry(
        "w",
        "float32",
        (0, 3),
        (ShardRef(0, 4096, 0, (0, 0), (0, 3), tuple(map(tuple, pieces))),),
        False,
        0,
    )
    head = validate._Head(3, "n", 1, 1, 0.0, 1, {}, files_)
    written = _outcome(lambda: validate._written_entry(record, _At("m"), head))
    assert written[0] == general[0]
    assert plain.tensor_entry_json(record, files_, 1) == (written[1] if not pieces else None)


def _index_mutations(rng: random.Random):
    """Report entries of tensors (whole, a shard, a replica, not written) and an object, with
    up to two fields replaced by values of other types or forms (an int subclass, a list for a
    tuple, NaN)."""
    import enum

    class Small(enum.IntEnum):
        ONE = 1

    base = [
        ReportEntry("w", "tensor", True, 4096, 24, "float32", (2, 3), ((16, 7), (8, 9))),
        ReportEntry(
            'a/\u00e9"x', "tensor", True, 4160, 8, "int64", (1,), ((8, 0),), None, (4,), (3,), False
        ),
        ReportEntry("r", "tensor", True, 8192, 0, "uint8", (0,), (), None, None, None, True),
        ReportEntry("r", "tensor", False, None, None, "int16", (3,), (), None, None, None, True),
        ReportEntry("o", "object", True, 4096, 5, crc32=3),
    ]
    values = [
        None,
        True,
        False,
        0,
        7,
        Small.ONE,
        2**40,
        -1,
        float("nan"),
        1.0,
        "",
        "w",
        (),
        (2,),
        [2],
        (Small.ONE,),
        (True,),
        ((8, 1),),
        [(8, 1)],
        ((8, True),),
        ((8, 1, 2),),
        ([8, 1],),
        "float16",
    ]
    for _ in range(3000):
        e = rng.choice(base)
        for _ in range(rng.choice([0, 1, 1, 2])):
            e = e._replace(**{rng.choice(e._fields): rng.choice(values)})
        yield e


def test_index_entry_fast_path_is_the_entrys_json():
    """Where the writer's direct encoding of an index entry gives text, it is exactly the
    JSON of the entry's dict form; anything else goes through that form."""
    encoded = 0
    for e in _index_mutations(random.Random(5)):
        fast = plain.report_entry_json(e)
        if fast is not None:
            encoded += 1
            assert fast.encode() == codec.encode_json(e.to_json()), e
    assert encoded > 300


def _saved_manifest(tmp_path, state=None):
    with Checkpointer(tmp_path, MEDIUM) as ck:
        info = ck.save(
            state if state is not None else _many(600),
            step=1,
            metadata={"entries": [], "note": '"entries":[]'},
        ).wait()
    return files.read_manifest(info.path)


def test_manifest_bytes_are_those_of_its_whole_json_form(tmp_path):
    """The entries checked and encoded a batch at a time make the same bytes as encoding the
    whole JSON object (and an ``"entries"`` text inside the metadata is not mistaken for the
    field); the record given back holds the manifest's own entries, equal to what a reader
    parses from the bytes."""
    manifest = _saved_manifest(tmp_path)
    data, written = fmt.manifest_record_bytes(manifest)
    assert data == codec.seal_manifest(codec.encode_json(manifest.to_json()))
    assert written.entries is manifest.entries
    assert fmt.parse_manifest_bytes(data, "again") == written == manifest


def test_index_bytes_are_those_of_its_whole_json_form():
    entries = [
        {"key": f"k{i}", "kind": "object", "offset": 4096 + 64 * i, "nbytes": 1, "crc32": i}
        for i in range(codec.ENCODE_BATCH * 2 + 3)
    ]
    for some in (entries, entries[:1], []):
        expect = json.dumps(
            {
                "format": codec.SHARD_FORMAT,
                "version": codec.PLAIN_VERSION,
                "rank": 3,
                "entries": some,
            },
            separators=(",", ":"),
            allow_nan=False,
        ).encode()
        assert codec.encode_index(3, iter(some)) == expect


def test_written_entry_that_does_not_read_back_is_refused(tmp_path):
    """An entry record whose JSON form parses into another record (a shape held as a list) is
    refused by the writer's check, naming it: what is written is what a reader finds."""
    import dataclasses

    manifest = _saved_manifest(tmp_path, {"w": torch.ones(2, 3)})
    odd = manifest.entries[0]._replace(shape=[2, 3])
    with pytest.raises(CorruptCheckpointError, match=r"manifest being written: entries\[0\]"):
        fmt.manifest_record_bytes(dataclasses.replace(manifest, entries={0: odd}))


@pytest.mark.parametrize(
    "text",
    [
        b'{"a":1,"entries":[{"x":1},{"y":[2]}],"b":{"c":null}}',
        b' \n{ "a" : 1 ,\t"entries" : [ {"x" : 1} , 2 ] , "b" : [] }\r\n',
        b'{"entries":[]}',
        b"{}",
        b'{"entries":{"not":"a list"}}',
        b'{"entries":"x"}',
        '{"k\\u00e9":"\\ud83d\\ude00","entries":[1]}'.encode(),
        '{"entries":["é"]}'.encode("utf-16"),
        b'\xef\xbb\xbf{"entries":[1]}',
    ],
)
def test_streamed_decoding_gives_what_json_gives(text):
    got = codec.parse_json_streamed(text, "entries", lambda fields: lambda item: None)
    assert got == json.loads(text)


@pytest.mark.parametrize(
    "text",
    [
        b'{"a":1,"a":2}',
        b"[1]",
        b'{"entries":[1,]}',
        b'{"entries":[1] "b":2}',
        b'{"a":NaN}',
        b'{"entries":[1]} x',
        b'{"a":1',
        b'{"entries":[1',
        b"",
        b"\xff{}",
        b'{"a":1,}',
    ],
)
def test_streamed_decoding_gives_up_on_anything_unusual(text):
    assert codec.parse_json_streamed(text, "entries", lambda fields: lambda item: None) is None


def test_streamed_decoding_converts_the_entries_it_can(tmp_path):
    """Entries decoded after ``files`` become records at once; a manifest whose entries come
    first is decoded whole and parsed as usual; both give the same manifest."""
    manifest = _saved_manifest(tmp_path)
    data, _ = fmt.manifest_record_bytes(manifest)
    obj = codec.parse_json(data, "m")
    seen = []
    streamed = codec.parse_json_streamed(
        data,
        "entries",
        lambda fields: seen.append(sorted(fields)) or validate.entry_converter(fields),
    )
    assert "files" in seen[0] and "ranks" not in seen[0]
    assert all(type(e) is not dict for e in streamed["entries"])
    reordered = {"entries": obj.pop("entries"), **obj}
    again = codec.seal_manifest(
        codec.encode_json({k: v for k, v in reordered.items() if k != "manifest_crc32"})
    )
    assert fmt.parse_manifest_bytes(again, "reordered") == manifest


def test_a_bad_entry_among_converted_ones_is_named(tmp_path):
    manifest = _saved_manifest(tmp_path)
    obj = codec.parse_json(fmt.manifest_record_bytes(manifest)[0], "m")
    obj.pop("manifest_crc32")
    obj["entries"][123]["shards"][0]["nbytes"] += 1
    with pytest.raises(CorruptCheckpointError, match=r"bad: entries\[123\]"):
        fmt.parse_manifest_bytes(codec.seal_manifest(codec.encode_json(obj)), "bad")


# ------------------------------------------------------------------ restore


def test_restore_in_place_of_plain_and_other_live_tensors(tmp_path):
    """Plain live tensors are read into as they are; parameters, non-contiguous and numpy
    live values through the general path; the same values everywhere."""
    model = torch.nn.Linear(3, 2)
    state = {
        **_many(500),
        "model": model.state_dict(),
        "np": np.arange(4.0),
        "wide": torch.randn(4, 6),
    }
    ref = clone_state({k: v for k, v in state.items() if k != "np"})
    with Checkpointer(tmp_path, MEDIUM) as ck:
        ck.save(state, step=1).wait()
        live = {
            **{k: torch.zeros_like(v) for k, v in _many(500).items()},
            "model": torch.nn.Linear(3, 2).state_dict(),
            "np": np.zeros(4),
            "wide": torch.zeros(6, 4).t(),
        }
        params = torch.nn.Linear(3, 2)
        ck.restore({**live, "model": {"weight": params.weight, "bias": params.bias}})
    assert_same(
        {k: v for k, v in live.items() if k not in ("np", "model")},
        {k: v for k, v in ref.items() if k != "model"},
    )
    assert torch.equal(params.weight.detach(), model.weight.detach())
    assert params.weight.requires_grad
    assert live["np"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_flipped_byte_of_a_small_tensor_is_caught(tmp_path):
    state = _many(300)
    with Checkpointer(tmp_path, MEDIUM) as ck:
        info = ck.save(state, step=1).wait()
    entry = next(e for e in files.read_manifest(info.path).entries.values() if e.key == "t123")
    path = tmp_path / info.name / fmt.shard_file_name(0)
    with open(path, "r+b") as f:
        f.seek(entry.shards[0].offset + 1)
        byte = f.read(1)
        f.seek(entry.shards[0].offset + 1)
        f.write(bytes([byte[0] ^ 1]))
    with Checkpointer(tmp_path, MEDIUM) as ck:
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch for 't123'"):
            ck.restore({k: torch.empty_like(v) for k, v in state.items()})


class _File:
    """A file of ``data`` read by ``read_run``: records the reads it was asked for."""

    step_bytes = 1 << 20

    def __init__(self, data: bytes):
        self.data, self.reads = data, []

    def read_into(self, views, offset):
        self.reads.append(offset)
        for view in views:
            view[:] = self.data[offset : offset + view.nbytes]
            offset += view.nbytes


def test_small_regions_are_checked_at_once_with_the_checkers_messages():
    from datastates.restore.plan import Read
    from datastates.restore.reads import read_run

    data = bytes(range(256)) * 2
    good = [
        Read(
            0,
            64 * i,
            8,
            torch.zeros(8, dtype=torch.uint8),
            [[8, codec.crc32(data[64 * i : 64 * i + 8])]],
            f"k{i}",
        )
        for i in range(4)
    ]
    read_run(_File(data), good, "f", verify=True)
    assert bytes(good[2].dest.tolist()) == data[128:136]
    bad = good[:2] + [Read(0, 128, 8, torch.zeros(8, dtype=torch.uint8), [[8, 1]], "k2")]
    with pytest.raises(
        CorruptCheckpointError,
        match=r"f: checksum mismatch for 'k2' in bytes "
        r"\[0, 8\) of the tensor \(file offset 128\)",
    ):
        read_run(_File(data), bad, "f", verify=True)
    odd = Read(0, 0, 8, torch.zeros(8, dtype=torch.uint8), [[-8, 0]], "k")
    f = _File(data)
    with pytest.raises(CorruptCheckpointError, match="invalid checksum piece"):
        read_run(f, [odd], "f", verify=True)
    assert f.reads == [] and not odd.dest.any()  # refused before a byte was read
