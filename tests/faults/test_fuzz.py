"""Fuzz of the manifest, the shard header and the shard index (deterministic seeds, bounded).

Two kinds of cases:

- **damage** (random byte or bit flips, JSON-structure mutations written without fixing any
  checksum): load, restore and verify must each raise ``CorruptCheckpointError`` (or its subclass
  ``UnsupportedFormatError``) or return data bit-identical to what was saved;
- **forgery** (JSON-structure mutations written with every checksum made valid, as a buggy or
  hostile writer would): the checksums cannot help, so the parsers must: every outcome is a
  datastates error or a result — never ``KeyError``, ``IndexError``, ``TypeError``,
  ``AttributeError``, ``OSError``, ``RuntimeError``, ``MemoryError``, ``RecursionError``.

All cases run with the address space capped at what is mapped plus 2 GiB, so an allocation sized
by a damaged field fails the test. Listing and ``latest()`` of the directory never raise.
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct

import pytest

from datastates import CorruptCheckpointError, DatastatesError
from datastates.commit import catalog
from datastates.format import codec as fmt

from _faults_helpers import assert_bit_exact
from _integrity_helpers import (
    NAME,
    assert_same_view,
    bounded_memory,
    index_of,
    load,
    manifest_path,
    read_bytes,
    restore,
    restore_live,
    save_pristine,
    shard_file,
    verify,
    with_index,
    write_bytes,
)

# slow: 540 damaged copies, each read three ways
pytestmark = pytest.mark.slow

CASES = int(os.environ.get("FUZZ_CASES", "60"))  # per test below: 9 tests, 540 cases

_ODD_VALUES = [
    None,
    True,
    False,
    "",
    "x",
    "../x",
    1.5,
    -1,
    0,
    1,
    2**31,
    2**64,
    10**30,
    -(2**63),
    1e308,
    float("nan"),
    float("inf"),
    [],
    {},
    [1, 2],
    {"t": "x"},
    [[0, 0]],
    [-1, 64],
    [1e15],
]


@pytest.fixture(scope="module")
def original(pristine):
    """{root, saved view, pristine load, shard size, manifest bytes, shard bytes}."""
    root, (saved, loaded) = pristine(save_pristine)
    ckpt = os.path.join(root, NAME)
    return {
        "root": root,
        "saved": saved,
        "loaded": loaded,
        "size": os.path.getsize(shard_file(ckpt)),
        "manifest": read_bytes(manifest_path(ckpt)),
        "shard": read_bytes(shard_file(ckpt)),
    }


@pytest.fixture
def work(original, private_copy):
    return os.path.join(private_copy(original["root"]), NAME)


# ---------------------------------------------------------------- mutations


def flip_byte(data: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    hi = len(data) if hi is None else hi
    at = rng.randrange(lo, hi)
    value = rng.choice([b for b in range(256) if b != data[at]])
    return data[:at] + bytes([value]) + data[at + 1 :]


def flip_bit(data: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    hi = len(data) if hi is None else hi
    at = rng.randrange(lo, hi)
    return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :]


def _paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, path + (i,))


def mutate_json(obj: dict, rng: random.Random) -> tuple[dict, str]:
    """One structural mutation of a copy of ``obj``; returns it and a description."""
    obj = copy.deepcopy(obj)
    path = rng.choice([p for p in _paths(obj) if p])
    parent = obj
    for part in path[:-1]:
        parent = parent[part]
    key, value = path[-1], parent[path[-1]]
    op = rng.choice(["delete", "retype", "number", "swap", "nest", "duplicate"])
    if op == "delete":
        del parent[key]
    elif op == "retype" or (op == "number" and type(value) is not int):
        op = "retype"
        parent[key] = copy.deepcopy(rng.choice(_ODD_VALUES))
    elif op == "number":
        parent[key] = rng.choice(
            [value + 1, value - 1, -value, -1, value * 2**40, 2**63, float(value), 10**15, 0]
        )
    elif op == "swap":
        siblings = list(range(len(parent))) if isinstance(parent, list) else list(parent)
        other = rng.choice(siblings)
        parent[key], parent[other] = parent[other], parent[key]
    elif op == "nest":  # spliced in by encode(): too deep for the encoder itself
        parent[key] = f"{_DEEP}{rng.choice([300, 5000])}"
    else:
        if isinstance(parent, list):
            parent.append(copy.deepcopy(value))
        else:
            parent[key] = [copy.deepcopy(value), copy.deepcopy(value)]
    return obj, f"{op} at {list(path)}"


_DEEP = "@@deep-nesting@@"


def encode(obj) -> bytes:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    marker = raw.find(_DEEP.encode())
    if marker < 0:
        return raw
    end = raw.index(b'"', marker)
    depth = int(raw[marker + len(_DEEP) : end])
    deep = b'{"t":"list","items":[' * depth + b'{"t":"value","v":1}' + b"]}" * depth
    return raw[: marker - 1] + deep + raw[end + 1 :]


def manifest_obj(raw: bytes) -> dict:
    obj = json.loads(raw)
    del obj["manifest_crc32"]
    return obj


# ---------------------------------------------------------------- running a case


def run_case(original, ckpt: str, manifest: bytes, shard: bytes, forged: bool, what: str) -> None:
    write_bytes(manifest_path(ckpt), manifest)
    write_bytes(shard_file(ckpt), shard)
    outcomes = {}
    # A forged manifest may restore other values (keys, types) than the live state had: only
    # the absence of untyped errors is checked there, so the live state is not inspected.
    for name, action in (
        ("load", load),
        ("restore", restore_live if forged else restore),
        ("verify", verify),
    ):
        try:
            outcomes[name] = action(ckpt)
        except RecursionError as exc:  # never acceptable, even though it is a RuntimeError
            raise AssertionError(f"{what}: {name} raised {exc!r}") from exc
        except CorruptCheckpointError:
            continue
        except DatastatesError as exc:
            assert forged, f"{what}: {name} raised {type(exc).__name__}: {exc}"
        except Exception as exc:
            raise AssertionError(f"{what}: {name} raised {type(exc).__name__}: {exc}") from exc
    if not forged:  # damage: whatever was returned is exactly what was saved
        if "load" in outcomes:
            assert_bit_exact(outcomes["load"], original["loaded"], f"{what}: load")
        if "restore" in outcomes:
            assert_same_view(outcomes["restore"], original["saved"])
        if "verify" in outcomes:
            assert outcomes["verify"] == original["size"], what
    root = os.path.dirname(ckpt)
    assert {i.name for i in catalog.list_checkpoints(root)} <= {NAME, "step-0000000006"}, what
    assert catalog.latest(root) is not None, what


def run_cases(original, ckpt: str, seed: int, make) -> None:
    with bounded_memory():
        for i in range(CASES):
            rng = random.Random(seed * 1000 + i)
            manifest, shard, forged, what = make(rng)
            run_case(original, ckpt, manifest, shard, forged, f"case {seed}/{i}: {what}")


# ---------------------------------------------------------------- the cases


@pytest.mark.parametrize("how", ["byte", "bit"])
def test_manifest_flips(original, work, how):
    flip = flip_byte if how == "byte" else flip_bit

    def make(rng):
        return flip(original["manifest"], rng), original["shard"], False, f"manifest {how} flip"

    run_cases(original, work, 1 if how == "byte" else 2, make)


@pytest.mark.parametrize("sealed", [False, True])
def test_manifest_json_mutations(original, work, sealed):
    base = manifest_obj(original["manifest"])

    def make(rng):
        obj, what = mutate_json(base, rng)
        body = encode(obj)
        return (
            (fmt.seal_manifest(body) if sealed else body),
            original["shard"],
            sealed,
            f"manifest {what}",
        )

    run_cases(original, work, 3 if sealed else 4, make)


@pytest.mark.parametrize("how", ["byte", "bit"])
def test_header_flips(original, work, how):
    flip = flip_byte if how == "byte" else flip_bit

    at, used = _header_at(original["shard"])

    def make(rng):
        # mostly the fields (and a version-3 file's first local header), some reserved bytes
        hi = at + used if rng.random() < 0.8 else fmt.HEADER_BYTES
        return (
            original["manifest"],
            flip(original["shard"], rng, 0, hi),
            False,
            f"header {how} flip",
        )

    run_cases(original, work, 5 if how == "byte" else 6, make)


def test_header_fields_with_valid_crc(original, work):
    """Header fields changed and the header CRC recomputed: only the manifest ties it down."""
    at, used = _header_at(original["shard"])
    fields = [(8, "<I"), (12, "<I"), (16, "<Q"), (24, "<Q"), (32, "<I")]
    if at:  # version 3: the tail's offset, length and CRC, the first slot's length too
        fields += [(36, "<Q"), (44, "<Q"), (52, "<I"), (56, "<I")]

    def make(rng):
        head = bytearray(original["shard"][: at + used])
        field = rng.choice(fields)
        (old,) = struct.unpack_from(field[1], head, at + field[0])
        new = rng.choice([0, 1, 3, old + 1, old - 1 if old else 7, old + 4096, 2**32 - 1])
        struct.pack_into(
            field[1], head, at + field[0], new & (2 ** (8 * struct.calcsize(field[1])) - 1)
        )
        struct.pack_into("<I", head, at + used - 4, fmt.crc32(bytes(head[at : at + used - 4])))
        return (
            original["manifest"],
            bytes(head) + original["shard"][at + used :],
            False,
            f"header field at {at + field[0]} = {new}",
        )

    run_cases(original, work, 7, make)


def _header_at(shard: bytes) -> tuple[int, int]:
    """(where the header starts, the bytes of its fields and CRC): at 0, 40 bytes (versions 1
    and 2), or at 64 after the first ZIP local header, 64 bytes (version 3)."""
    return (64, 64) if shard.startswith(b"PK\x03\x04") else (0, 40)


def test_index_flips(original, work):
    offset, index = index_of(original["shard"])

    def make(rng):
        flip = flip_byte if rng.random() < 0.5 else flip_bit
        return original["manifest"], flip(original["shard"], rng, offset), False, "index flip"

    run_cases(original, work, 8, make)


@pytest.mark.parametrize("forged", [False, True])
def test_index_json_mutations(original, work, forged):
    """Index mutated with the header made valid; forged: the manifest updated to match it."""
    _, index = index_of(original["shard"])
    base = json.loads(index)

    def make(rng):
        obj, what = mutate_json(base, rng)
        shard = with_index(original["shard"], encode(obj))
        manifest = original["manifest"]
        if forged:
            m = manifest_obj(manifest)
            m["files"][0].update(nbytes=len(shard), index_crc32=fmt.crc32(encode(obj)))
            manifest = fmt.seal_manifest(encode(m))
        return manifest, shard, forged, f"index {what}"

    run_cases(original, work, 9 if forged else 10, make)
