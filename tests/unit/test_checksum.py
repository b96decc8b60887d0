"""CRC-32 backends: every backend gives zlib's values; the fallback works; formats interoperate."""

from __future__ import annotations

import importlib
import sys
import zlib

import pytest
import torch

from datastates import Checkpointer
from datastates.format import checksum
from datastates.format import codec as fmt
from datastates.storage.posix import buffer_of

SIZES = [
    0,
    1,
    3,
    63,
    64,
    65,
    4095,
    4096,
    4097,
    5 * 1024 - 1,
    5 * 1024 + 1,
    65_537,
    (1 << 20) + 3,
    (8 << 20) + 17,
]
OFFSETS = [0, 1, 7, 63, 4095]


@pytest.fixture(scope="module")
def blob() -> bytes:
    gen = torch.Generator().manual_seed(5)
    return bytes(
        torch.randint(0, 256, ((8 << 20) + 4096 + 64,), dtype=torch.uint8, generator=gen)
        .numpy()
        .tobytes()
    )


def backends():
    return [pytest.param(b, id=b.name) for b in checksum.available()]


@pytest.mark.parametrize("backend", backends())
def test_values_equal_zlib_for_sizes_and_offsets(backend, blob):
    view = memoryview(blob)
    for size in SIZES:
        for off in OFFSETS:
            piece = view[off : off + size]
            assert backend.crc32(piece) == zlib.crc32(piece), (backend.name, size, off)


@pytest.mark.parametrize("backend", backends())
def test_incremental_chaining_equals_one_pass(backend, blob):
    data = memoryview(blob)[: (1 << 20) + 12_345]
    whole = zlib.crc32(data)
    for cuts in ([1], [4096], [5 * 1024, 70_000], [3, 4, 5, 1 << 19], list(range(1, 40, 7))):
        value, pos = 0, 0
        for cut in cuts + [len(data)]:
            value = backend.crc32(data[pos:cut], value)
            pos = cut
        assert value == whole, (backend.name, cuts)
    assert backend.crc32(b"", 0xDEADBEEF) == 0xDEADBEEF


@pytest.mark.parametrize("backend", backends())
def test_accepts_bytes_bytearray_memoryview_and_tensor_views(backend, blob):
    data = blob[:100_003]
    expected = zlib.crc32(data)
    assert backend.crc32(data) == expected
    assert backend.crc32(bytearray(data)) == expected
    assert backend.crc32(memoryview(data)) == expected
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert backend.crc32(buffer_of(t)) == expected
    assert backend.crc32(buffer_of(t)[10:20]) == zlib.crc32(data[10:20])
    # A value with the top bit set comes back unsigned, as zlib's does.
    assert all(0 <= backend.crc32(blob[:n]) < 2**32 for n in range(1, 64))


@pytest.mark.parametrize("backend", backends())
def test_inputs_larger_than_a_chunk_are_fed_in_pieces(backend, blob, monkeypatch):
    monkeypatch.setattr(checksum, "CHUNK", 4096 + 3)
    for size in (4096 + 3, 4096 + 4, 3 * 4099 + 1, 100_000):
        data = blob[:size]
        assert backend.crc32(data) == zlib.crc32(data)
        assert checksum.crc32(memoryview(data), 77) == zlib.crc32(data, 77)
        assert backend.crc32(bytearray(data)) == zlib.crc32(data)


def test_preference_picks_the_fastest_installed(monkeypatch):
    names = [b.name for b in checksum.available()]
    assert names[-1] == "zlib"
    assert checksum.BACKEND == names[0] == checksum.select().name
    if importlib.util.find_spec("isal") is not None:
        assert checksum.BACKEND == "isal"


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="unknown CRC-32 backend 'crc32c'"):
        checksum.load("crc32c")


@pytest.fixture
def zlib_only(monkeypatch):
    """checksum reloaded as if neither ISA-L nor zlib-ng were installed; restored afterwards."""
    for name in ("isal", "isal.isal_zlib", "zlib_ng", "zlib_ng.zlib_ng"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it raises ImportError
    importlib.reload(checksum)
    yield checksum
    monkeypatch.undo()
    importlib.reload(checksum)


def test_fallback_is_zlib_when_no_fast_backend_imports(zlib_only, blob):
    assert zlib_only.load("isal") is None and zlib_only.load("zlib-ng") is None
    assert zlib_only.BACKEND == "zlib"
    assert [b.name for b in zlib_only.available()] == ["zlib"]
    for size in SIZES:
        assert zlib_only.crc32(blob[:size]) == zlib.crc32(blob[:size])
        assert fmt.crc32(blob[:size]) == zlib.crc32(blob[:size])


def test_checkpoint_written_by_fallback_verifies_with_fast_backend(tmp_path, monkeypatch):
    state = {"w": torch.randn(300_000), "b": torch.arange(1000), "obj": {"k": [1, 2]}}
    for name in ("isal", "isal.isal_zlib", "zlib_ng", "zlib_ng.zlib_ng"):
        monkeypatch.setitem(sys.modules, name, None)
    importlib.reload(checksum)
    try:
        assert checksum.BACKEND == "zlib"
        with Checkpointer(tmp_path) as ckpt:
            ckpt.save(state, step=1).wait()
    finally:
        monkeypatch.undo()
        importlib.reload(checksum)
    with Checkpointer(tmp_path) as ckpt:
        loaded = ckpt.load(step=1, verify=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["obj"] == {"k": [1, 2]}
