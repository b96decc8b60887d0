"""How a shard file is cut into multipart-upload parts (objstore.plan_parts): S3's rules — every
part but the last at least 5 MiB, at most 10,000 parts — for every unit size, and the units that
can be uploaded straight from the host cache."""

import pytest

from datastates.format import codec as fmt
from datastates.errors import ConfigError
from datastates.storage.s3 import MAX_PARTS, MIN_PART, plan_parts
from datastates.save.planning import plan_layout

MiB = 1 << 20


def check(layout, parts):
    assert parts[0].start == 0
    for a, b in zip(parts, parts[1:]):
        assert a.end == b.start  # contiguous, in file order, numbered from 1
        assert a.end - a.start >= MIN_PART
        assert b.number == a.number + 1
    assert parts[-1].end is None  # the last part takes whatever follows (objects, index)
    assert parts[0].number == 1 and not parts[0].direct  # the header is known only at the end
    assert sum(p.units for p in parts) == len(layout.units)
    for p in parts:
        if p.direct:  # exactly one whole unit
            assert p.units == 1
            assert any(
                u.file_offset == p.start
                and u.file_offset + fmt.align_up(u.nbytes, fmt.UNIT_ALIGN) == p.end
                for u in layout.units
            )


@pytest.mark.parametrize("unit", [64 << 10, 1 * MiB, 5 * MiB, 8 * MiB, 64 * MiB])
@pytest.mark.parametrize("total", [1000, 3 * MiB, 20 * MiB + 123, 200 * MiB])
def test_parts_follow_the_s3_rules(unit, total):
    layout = plan_layout([total // 2, total - total // 2], [100], unit)
    parts = plan_parts(layout)
    check(layout, parts)
    if total < MIN_PART:
        assert len(parts) == 1  # one PUT
    if unit >= MIN_PART and total >= 3 * unit:
        assert any(p.direct for p in parts)  # big units go out straight from the cache


def test_too_many_parts_is_refused_with_a_hint():
    layout = plan_layout([(MAX_PARTS + 5) * MIN_PART], [], MIN_PART)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        plan_parts(layout)


def test_local_write_new_refuses_an_existing_file(tmp_path):
    from datastates.storage.store import LOCAL

    path = str(tmp_path / "f")
    LOCAL.write_new(path, b"one", fsync=True)
    with pytest.raises(FileExistsError):
        LOCAL.write_new(path, b"two", fsync=True)
    assert open(path, "rb").read() == b"one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no temporary left
