"""The fast writers of a version-3 shard file's framing write the same bytes as the plain ones:
the pickle of a state tree (``zipframe.pickle_state``) as the C pickler with ``_Pickler``'s
hooks writes it, the tensors' local headers and central directory entries as
``local_header``/``_central`` write each record, and the tail as it was written from a list of
records."""

from __future__ import annotations

import collections
import io
import pickle
import random
import zlib

import pytest
import torch

from datastates.format import pickler, placeholders, zipframe

T = placeholders.placeholder


def _old_form(obj, done):
    """``obj`` as the plain state held tensors before: ``_Tensor`` objects, what ``_Pickler``
    writes (each container and placeholder converted once, so sharing stays sharing)."""
    if type(obj) not in (dict, list, tuple, collections.OrderedDict):
        return obj
    if id(obj) in done:
        return done[id(obj)][1]
    if type(obj) is tuple and len(obj) == 4 and obj[0] is placeholders.TENSOR_MARK:
        new = zipframe._Tensor(*obj[1:])
    elif type(obj) in (dict, collections.OrderedDict):
        new = type(obj)((k, _old_form(v, done)) for k, v in obj.items())
    else:
        new = type(obj)(_old_form(v, done) for v in obj)
    done[id(obj)] = (obj, new)
    return new


def _reference(state) -> bytes:
    buf = io.BytesIO()
    zipframe._Pickler(buf, protocol=2).dump(_old_form(state, {}))
    return buf.getvalue()


def _fast(state) -> bytes:
    return placeholders.TensorPickler().dumps(state)


def _tensors(n: int, dtype=torch.float32, shape=(2,)) -> dict:
    return {f"t{i}": T(str(i), dtype, tuple(list(shape))) for i in range(n)}


@pytest.mark.parametrize("n", [0, 1, 2, 3, 255, 256, 300, 999, 1000, 1001, 2000, 2001])
def test_containers_of_every_batch_size(n):
    """The C pickler's batches of 1000: a dict of a multiple of 1000 items ends with an empty
    batch, a list does not, an OrderedDict (reduced, its items from an iterator) neither, and
    writes a last lone item as SETITEM."""
    cases = [
        {f"k{i}": i for i in range(n)},
        [i * 3 for i in range(n)],
        collections.OrderedDict((f"k{i}", [i]) for i in range(n)),
        tuple(range(n)),
        _tensors(n),
        [T(str(i), torch.float16, (i % 3,) * (i % 5)) for i in range(n)],
    ]
    for state in cases:
        assert _fast(state) == _reference(state)


def test_values_of_every_encoding():
    state = {
        "ints": [0, 1, 255, 256, 65535, 65536, -1, -(2**31), 2**31 - 1, 2**31, -(2**31) - 1],
        "longs": [2**63, -(2**64), 2**2100, -(2**2100)],
        "floats": [0.0, -0.0, 1.5, 1e300, float("inf"), float("nan")],
        "others": [None, True, False, "", "é", "\ud800", "x" * 300],
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ((), ("a",))],
        "nested": {"a": {"b": [collections.OrderedDict(c=())]}},
    }
    assert _fast(state) == _reference(state)


def test_tensor_placeholders_of_every_kind():
    """Typed and untyped storages (``_rebuild_tensor_v2``/``_v3``), scalars, empty and long
    shapes, before and after the memo holds 256 objects (BINPUT, then LONG_BINPUT)."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]
    dtypes += [torch.complex64, torch.uint16]
    shapes = [(), (0,), (2,), (3, 0, 2), (2, 3, 4, 5), (70000,), (1, 2**33)]
    state = {
        f"{d}-{s}-{r}": T(f"{i}", d, tuple(list(s)))
        for i, (r, d, s) in enumerate((r, d, s) for r in range(3) for d in dtypes for s in shapes)
    }
    assert _fast(state) == _reference(state)


def test_shared_objects_are_memo_references():
    """What the C pickler finds in its memo (the same object met again) is a BINGET: a shape
    tuple shared by two placeholders, a key met as a value, a placeholder met twice, the
    interned "storage" and "cpu" met as keys."""
    shape = (2, 2)
    key = "shared key"
    one = T("9", torch.float32, (5,))
    pad = {f"p{i}": T(f"p{i}", torch.float32, (1,)) for i in range(300)}
    state = {
        **pad,
        "a": T("0", torch.float32, shape),
        "b": T("1", torch.float32, shape),
        key: [key, key],
        "c": T(key, torch.float32, (3,)),
        "one": one,
        "again": [one, one],
        "storage": "cpu",
        "cpu": ("storage",),
    }
    assert _fast(state) == _reference(state)


def test_random_trees():
    rng = random.Random(7)
    leaves = [
        lambda: rng.randrange(-(2**40), 2**40),
        lambda: rng.random(),
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: f"s{rng.randrange(50)}",
        lambda: T(str(rng.randrange(1000)), rng.choice([torch.float32, torch.float8_e5m2]), (3,)),
    ]

    def tree(depth: int):
        pick = rng.randrange(8 if depth < 4 else 0, 14)
        if pick < 2:
            return {f"k{i}": tree(depth + 1) for i in range(rng.randrange(5))}
        if pick < 4:
            return [tree(depth + 1) for _ in range(rng.randrange(5))]
        if pick < 6:
            return tuple(tree(depth + 1) for _ in range(rng.randrange(5)))
        if pick < 8:
            return collections.OrderedDict(
                (f"o{i}", tree(depth + 1)) for i in range(rng.randrange(5))
            )
        return rng.choice(leaves)()

    for _ in range(200):
        state = tree(0)
        assert _fast(state) == _reference(state)


def test_plain_state_of_a_tree_pickles_as_before():
    """The pickle of a rank's tree through ``plain_state``, with its shapes as the items give
    them (a tuple per tensor; a view saved twice shares its entry, so its shape)."""
    n = 3000
    shapes = [(2,) if i % 7 else (4, 4) for i in range(n)]
    shapes = [tuple(list(s)) for s in shapes]
    nodes = [(f"t{i}", {"t": "tensor", "e": i}) for i in range(n)]
    nodes.append(("again", {"t": "tensor", "e": 5}))
    nodes.append(("elsewhere", {"t": "tensor", "e": n + 1}))
    nodes.append(("obj", {"t": "object", "e": n + 2}))
    nodes.append(("v", {"t": "list", "items": [{"t": "value", "v": 3}, {"t": "value", "v": "x"}]}))
    tree = {"t": "dict", "items": nodes}

    def held(i: int):
        return (i, torch.float32, shapes[i]) if i < n else None

    state = zipframe.plain_state(tree, held)
    assert zipframe.pickle_state(state) == _reference(state)
    buf = io.BytesIO()
    zipframe._Pickler(buf, protocol=2).dump(_old_plain_state(tree, held))
    assert zipframe.pickle_state(state) == buf.getvalue()


def _old_plain_state(node: dict, tensor_of):
    """``plain_state`` as it was, with its tensors as ``_Tensor`` objects."""
    t = node["t"]
    if t == "dict":
        return {k: _old_plain_state(v, tensor_of) for k, v in node["items"]}
    if t == "list":
        return [_old_plain_state(v, tensor_of) for v in node["items"]]
    if t == "value":
        return node["v"]
    if t == "tensor":
        held = tensor_of(node["e"])
        return None if held is None else zipframe._Tensor(str(held[0]), held[1], tuple(held[2]))
    assert t == "object"
    return None


def test_placeholders_are_not_tracked_by_the_garbage_collector():
    """A placeholder is an exact tuple of untracked objects: the collector stops tracking it."""
    import gc

    held = (3, torch.float32, (2, 2))
    state = zipframe.plain_state({"t": "tensor", "e": 0}, lambda e: held)
    gc.collect()
    assert not gc.is_tracked(state)


def test_what_it_does_not_write_goes_to_the_pickler():
    """A tree holding another type is written by the C pickler, unchanged."""

    others = [{"a": b"bytes"}, {"a": {1, 2}}, [collections.Counter(a=1)]]
    for state in [
        *others,
        {"a": T("0", torch.float32, [2])},
        {"a": T("0", torch.float32, (True,))},
    ]:
        with pytest.raises(pickler.Unsupported):
            _fast(state)
        assert zipframe.pickle_state(state) == _reference(state)
    shared = [T("0", torch.float32, (2,))] * 2
    with pytest.raises(pickler.Unsupported):
        _fast([b"", shared, shared])
    assert zipframe.pickle_state([b"", shared, shared]) == _reference([b"", shared, shared])
    assert pickle.loads(zipframe.pickle_state({"a": b"bytes"})) == {"a": b"bytes"}


SIZES = [0, 1, 8, 4095, 2**31, zipframe.ZIP64_LIMIT - 1, zipframe.ZIP64_LIMIT, 2**40]


def test_tensor_headers_are_local_headers():
    for k in [0, 9, 10, 99, 100, 12345, 10**7]:
        for nbytes in SIZES:
            expected = zipframe.local_header(
                zipframe.tensor_name(k), nbytes, zipframe.slot_of(nbytes)
            )
            assert zipframe.tensor_header(k, nbytes) == expected


def test_tensor_headers_written_in_place():
    slots = [
        (64 + 192 * j, k, n)
        for j, (k, n) in enumerate((k, n) for k in [0, 7, 12, 4321] for n in SIZES)
    ]
    buffer = bytearray(64 + 192 * len(slots) + 64)
    zipframe.write_tensor_headers(memoryview(buffer), slots)
    expected = bytearray(len(buffer))
    for at, k, n in slots:
        data = zipframe.local_header(zipframe.tensor_name(k), n, zipframe.slot_of(n))
        expected[at : at + len(data)] = data
    assert buffer == expected


def _records(offsets, sizes, crcs) -> list:
    return [
        zipframe.Record(zipframe.tensor_name(k), offset - zipframe.slot_of(n), n, crc)
        for k, (offset, n, crc) in enumerate(zip(offsets, sizes, crcs))
    ]


def test_tensor_entries_are_central_entries():
    """Below and above 4 GiB, in size and in offset (ZIP64 extra fields)."""
    rng = random.Random(3)
    sizes = [rng.choice(SIZES) for _ in range(500)] + [8] * 1500
    offsets, at = [], 4096
    for n in sizes:
        at += zipframe.slot_of(n)
        offsets.append(at)
        at += -(-max(n, 1) // 64) * 64 + rng.choice([0, 64, 2**32])
    crcs = [rng.randrange(2**32) for _ in sizes]
    expected = zipframe.central_entries(_records(offsets, sizes, crcs))
    assert zipframe.tensor_entries(offsets, sizes, crcs) == expected
    assert b"".join(zipframe._central(r) for r in _records(offsets, sizes, crcs)) == expected


def _reference_tail(at: int, records: list, pickled: bytes, crc32) -> bytes:
    """The tail as written from the list of all records before (one ``_central`` each)."""
    out = bytearray()
    everything = list(records)
    for name, data in ((f"{zipframe.FOLDER}/data.pkl", pickled), *zipframe.TAIL_RECORDS):
        crc = crc32(data)
        everything.append(zipframe.Record(name, at + len(out), len(data), crc))
        out += zipframe._padded(name, at + len(out), data, crc)
    directory_at = at + len(out)
    for r in everything:
        out += zipframe._central(r)
    directory_size = at + len(out) - directory_at
    count = len(everything)
    z64_at = at + len(out)
    out += zipframe._Z64_EOCD.pack(
        0x06064B50, 44, 45, 45, 0, 0, count, count, directory_size, directory_at
    )
    out += zipframe._Z64_LOC.pack(0x07064B50, 0, z64_at, 1)
    out += zipframe._EOCD.pack(
        0x06054B50,
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        min(directory_size, zipframe.ZIP64_LIMIT),
        min(directory_at, zipframe.ZIP64_LIMIT),
        0,
    )
    return bytes(out)


@pytest.mark.parametrize("n", [0, 1, 70000])
def test_the_tail_is_as_written_from_records(n):
    sizes = [8 if k % 3 else 100 for k in range(n)]
    offsets = [4096 + 64 + 192 * k for k in range(n)]
    crcs = [zlib.crc32(b"%d" % k) for k in range(n)]
    index_at = 4096 + 192 * n + 64
    head = zipframe.Record(zipframe.HEADER_RECORD, 0, 0, 0)
    index = zipframe.Record(zipframe.INDEX_RECORD, index_at - 64, 1000, 77)
    pickled = zipframe.pickle_state(_tensors(n))
    tail_at = index_at + 1024
    directory = (
        zipframe.central_entries([head])
        + zipframe.tensor_entries(offsets, sizes, crcs)
        + zipframe.central_entries([index])
    )
    records = [head, *_records(offsets, sizes, crcs), index]
    expected = _reference_tail(tail_at, records, pickled, zlib.crc32)
    assert zipframe.tail_after(tail_at, directory, n + 2, pickled, zlib.crc32) == expected
    assert zipframe.tail(tail_at, records, pickled, zlib.crc32) == expected


def test_one_checksum_piece_is_its_crc():
    assert zipframe.crc_of_pieces(((8, 123),)) == 123
    assert zipframe.crc_of_pieces([(8, 123)]) == 123
    assert zipframe.crc_of_pieces(()) == 0
    a, b = b"abc" * 10, b"xyz" * 7
    assert zipframe.crc_of_pieces(((30, zlib.crc32(a)), (21, zlib.crc32(b)))) == zlib.crc32(a + b)
