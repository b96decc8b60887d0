"""The catalog of committed checkpoints (catalog.py): a commit lists the root once and reads only
the manifests that are new or changed since the writer's previous scan, yet sees every checkpoint
another process committed, replaced, damaged or deleted in between (docs/format.md, "Which
checkpoint is the latest"). Manifest reads are counted through the store's ``read_bytes``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer, CorruptCheckpointError
from datastates.commit import catalog, retention
from datastates.format import codec as fmt
from datastates.commit.catalog import Catalog
from datastates.storage.store import LOCAL

SMALL = dict(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)


def save(ck: Checkpointer, value: float, **kwargs):
    return ck.save({"x": torch.full((3,), float(value))}, **kwargs).wait(60)


class Counter:
    """Counts, per call, the manifests the store reads and the listings of the root."""

    def __init__(self, monkeypatch):
        self.manifests: list[str] = []
        self.listings = 0
        read, stamps = LOCAL.read_bytes, LOCAL.file_stamps

        def counting_read(path, **kwargs):
            if os.path.basename(path) == "manifest.json":
                self.manifests.append(os.path.basename(os.path.dirname(path)))
            return read(path, **kwargs)

        def counting_stamps(path, file_name):
            self.listings += 1
            return stamps(path, file_name)

        monkeypatch.setattr(LOCAL, "read_bytes", counting_read)
        monkeypatch.setattr(LOCAL, "file_stamps", counting_stamps)

    def take(self) -> tuple[list[str], int]:
        out = (sorted(self.manifests), self.listings)
        self.manifests, self.listings = [], 0
        return out


def test_commits_read_no_manifest_back_and_list_once(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ck:
        for step in range(1, 7):
            info = save(ck, step, step=step)
            assert info.seq == step
            assert counter.take() == ([], 1)  # one listing, no manifest read, however many exist
        assert [i.seq for i in ck.list()] == [1, 2, 3, 4, 5, 6]
        assert counter.take() == ([], 1)


def test_retention_uses_the_commits_listing(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=2, **SMALL)) as ck:
        for step in range(1, 6):
            save(ck, step, step=step)
            assert counter.take() == ([], 1)
        assert [i.name for i in ck.list()] == ["step-0000000004", "step-0000000005"]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == [
        "step-0000000004",
        "step-0000000005",
    ]


def test_a_commit_by_another_checkpointer_is_numbered_and_retained(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    with (
        Checkpointer(tmp_path, CheckpointConfig(keep_last=2, **SMALL)) as ck1,
        Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ck2,
    ):
        save(ck1, 1, step=1)
        save(ck1, 2, step=2)
        counter.take()
        assert save(ck2, 3, step=3).seq == 3  # ck2 reads the two manifests it never saw
        assert counter.take() == (["step-0000000001", "step-0000000002"], 1)
        info = save(ck1, 4, step=4)
        # ck1 read only ck2's manifest, numbered after it and counted it in retention
        assert counter.take() == (["step-0000000003"], 1)
        assert info.seq == 4
        assert [(i.name, i.seq) for i in ck1.list()] == [
            ("step-0000000003", 3),
            ("step-0000000004", 4),
        ]
        assert counter.take() == ([], 1)


def test_a_replaced_manifest_is_read_again(tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    with (
        Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck1,
        Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck2,
    ):
        save(ck1, 1, tag="best", step=1)
        save(ck1, 2, step=2)
        assert ck2.latest().name == "step-0000000002"
        save(ck2, 3, tag="best", step=3, overwrite=True)  # replaces ck1's "best"
        counter.take()
        assert [(i.name, i.seq, i.step) for i in ck1.list()] == [
            ("step-0000000002", 2, 2),
            ("best", 3, 3),
        ]
        assert counter.take() == (["best"], 1)
        assert save(ck1, 4, step=4).seq == 4
        assert counter.take() == ([], 1)


def test_a_damaged_then_repaired_manifest(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        save(ck, 1, step=1)
        save(ck, 2, step=2)
        manifest = tmp_path / "step-0000000002" / "manifest.json"
        good = manifest.read_bytes()
        assert [i.seq for i in ck.list()] == [1, 2]
        manifest.write_bytes(good[:-5])  # damaged: left out, as a full listing does
        assert [i.name for i in ck.list()] == ["step-0000000001"]
        assert ck.latest().name == "step-0000000001"
        tmp = tmp_path / "step-0000000002" / "manifest.json.new"
        tmp.write_bytes(good)
        os.replace(tmp, manifest)  # repaired by a rename
        assert [i.name for i in ck.list()] == ["step-0000000001", "step-0000000002"]
        assert save(ck, 3, step=3).seq == 3


def test_deletions_by_another_process_are_seen(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        for step in (1, 2, 3):
            save(ck, step, step=step)
        shutil.rmtree(tmp_path / "step-0000000003")
        assert ck.latest().name == "step-0000000002"
        assert save(ck, 4, step=4).seq == 3  # one more than the highest committed at that time


def test_retention_skips_a_checkpoint_deleted_meanwhile(tmp_path):
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        for step in (1, 2, 3):
            save(ck, step, step=step)
        committed = ck.list()
    shutil.rmtree(tmp_path / "step-0000000001")  # gone since that listing
    removed = retention.RetentionPolicy(keep_last=1).apply(
        str(tmp_path), protect="step-0000000003", fsync=False, committed=committed
    )
    assert removed == ["step-0000000002"]
    assert [i.name for i in catalog.list_checkpoints(str(tmp_path))] == ["step-0000000003"]


def test_catalog_of_a_missing_directory(tmp_path):
    with pytest.raises(catalog.CheckpointNotFoundError):
        Catalog(str(tmp_path / "absent")).scan()


def test_local_stamps_change_when_a_file_is_replaced(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "plain").write_bytes(b"x")
    written = LOCAL.write_atomic(str(tmp_path / "a" / "m"), b"one", False)
    stamps = LOCAL.file_stamps(str(tmp_path), "m")
    assert stamps == {"a": written}  # b has no such file, plain is not a directory
    again = LOCAL.write_atomic(str(tmp_path / "a" / "m"), b"one", False)
    assert again != written and LOCAL.file_stamps(str(tmp_path), "m") == {"a": again}


def test_restore_of_the_latest_reads_its_manifest_once(tmp_path, monkeypatch):
    """The newest checkpoint's validated manifest is kept by the catalog: restoring right after
    the commit reads no manifest; a fresh Checkpointer reads each manifest once (the scan that
    finds the newest), not the newest a second time for the reader."""
    counter = Counter(monkeypatch)
    with Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as ck:
        for step in (1, 2, 3):
            save(ck, step, step=step)
        counter.take()
        state = {"x": torch.zeros(3)}
        assert ck.restore(state).step == 3
        assert torch.equal(state["x"], torch.full((3,), 3.0))
        assert counter.take() == ([], 1)
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as fresh:
        counter.take()
        state = {"x": torch.zeros(3)}
        assert fresh.restore(state).step == 3
        assert torch.equal(state["x"], torch.full((3,), 3.0))
        assert counter.take() == ([fmt.step_name(s) for s in (1, 2, 3)], 1)
        assert fresh.restore(state).step == 3  # nothing changed: no manifest read at all
        assert counter.take() == ([], 1)


def test_kept_manifest_is_not_used_once_the_checkpoint_changed(tmp_path):
    """Another writer replaces the newest checkpoint, or commits a newer one, after this
    Checkpointer's last scan: restore() reads what is on disk now, never the kept manifest."""
    with (
        Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as mine,
        Checkpointer(tmp_path, CheckpointConfig(keep_last=None, **SMALL)) as other,
    ):
        save(mine, 1.0, step=1)
        assert mine.latest().step == 1
        save(other, 7.0, step=1, overwrite=True)
        state = {"x": torch.zeros(3)}
        mine.restore(state, step=1)  # by step: no scan first, so the kept manifest is stale
        assert torch.equal(state["x"], torch.full((3,), 7.0))
        state = {"x": torch.zeros(3)}
        mine.restore(state)
        assert torch.equal(state["x"], torch.full((3,), 7.0))
        save(other, 9.0, step=2)
        assert mine.restore(state).step == 2
        assert torch.equal(state["x"], torch.full((3,), 9.0))
        shutil.rmtree(
            tmp_path / fmt.step_name(2)
        )  # deleted behind its back: the previous one again
        assert mine.restore(state).step == 1
        assert torch.equal(state["x"], torch.full((3,), 7.0))


# ---------------------------------------------------------------- a manifest that cannot be read

#: A second process on the root: runs LATEST / SAVE <step> commands read from stdin and prints
#: what came of each (the name, or the error's type).
_READER = r"""
import sys, torch, datastates
config = datastates.CheckpointConfig(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)
with datastates.Checkpointer(sys.argv[1], config) as ck:
    print("READY", flush=True)
    for line in sys.stdin:
        command = line.split()
        try:
            if command[0] == "LATEST":
                print(ck.latest().name, flush=True)
            else:
                info = ck.save({"x": torch.full((3,), 9.0)}, step=int(command[1])).wait(60)
                print(f"seq {info.seq}", flush=True)
        except Exception as exc:
            print(type(exc).__name__, flush=True)
"""


def _without_dac_override() -> list[str] | None:
    """The command prefix that runs a process unable to read a file of mode 000: none needed
    for a user other than root; ``capsh`` dropping root's override of file permissions; None if
    neither can be had."""
    import shutil as which

    if os.geteuid() != 0:
        return []
    if which.which("capsh") is None:
        return None
    return ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", 'exec "$0" "$@"']


def test_an_unreadable_manifest_is_no_damage_and_its_number_is_never_reused(tmp_path):
    """The newest manifest cannot be read for a while (a real EACCES, in a process without
    root's permission override): latest() fails with StorageError instead of returning the
    older checkpoint, and a commit fails with CommitError instead of reusing the commit number
    of the checkpoint it cannot read. Once the manifest reads again, the same process sees it
    (nothing of the failed read was kept) and commits with the next number."""
    import subprocess
    import sys

    prefix = _without_dac_override()
    if prefix is None:
        pytest.skip("running as root without capsh: no process here is refused a mode-000 file")
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        save(ck, 1, step=1)
        save(ck, 2, step=2)
    manifest = tmp_path / fmt.step_name(2) / fmt.MANIFEST
    child = subprocess.Popen(
        [*prefix, sys.executable, "-c", _READER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def ask(command: str) -> str:
        child.stdin.write(command + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    try:
        assert child.stdout.readline() == "READY\n"
        os.chmod(manifest, 0)
        try:
            assert ask("LATEST") == "StorageError"
            assert ask("SAVE 3") == "CommitError"
            assert ask("LATEST") == "StorageError"  # read again, not taken from a cache
        finally:
            os.chmod(manifest, 0o644)
        assert ask("LATEST") == fmt.step_name(2)
        assert ask("SAVE 3") == "seq 3"
    finally:
        child.stdin.close()
        assert child.wait(60) == 0
    infos = catalog.list_checkpoints(os.fspath(tmp_path))
    assert [(i.name, i.seq) for i in infos] == [(fmt.step_name(s), s) for s in (1, 2, 3)]


class _LaggingStore(type(LOCAL)):
    """The local store, except that its listing of the root misses the names in ``hidden``: a
    directory listing that lags behind another node's rename (NFS attribute caching)."""

    def __init__(self, hidden: set[str]):
        super().__init__()
        self.hidden = hidden

    def file_stamps(self, path, file_name):
        return {
            n: s for n, s in super().file_stamps(path, file_name).items() if n not in self.hidden
        }


def test_a_recorded_commit_survives_a_listing_that_lags_behind_it(tmp_path):
    """What the commit recorded stays the latest while a stale listing misses it, and is
    forgotten once its manifest is really gone."""
    root = str(tmp_path)
    with Checkpointer(root, CheckpointConfig(**SMALL)) as ck:
        save(ck, 1, step=1)
        second = save(ck, 2, step=2)
    store = _LaggingStore({second.name})
    catalog = Catalog(root, store)
    assert [i.name for i in catalog.scan()] == ["step-0000000001"]  # what the listing shows
    catalog.record(second, None)
    assert [i.name for i in catalog.scan()] == ["step-0000000001", second.name]
    shutil.rmtree(os.path.join(root, second.name))
    assert [i.name for i in catalog.scan()] == ["step-0000000001"]
    store.hidden.clear()
    assert [i.name for i in catalog.scan()] == ["step-0000000001"]


# ---------------------------------------------------------------- the head of a manifest
def _body(path: str) -> dict:
    """The JSON object of a checkpoint's manifest, without its checksum field."""
    with open(os.path.join(path, fmt.MANIFEST), "rb") as f:
        obj = json.loads(f.read())
    obj.pop("manifest_crc32")
    return obj


def _reseal(path: str, obj: dict) -> None:
    """Write ``obj`` as the checkpoint's manifest, sealed with a valid checksum (what a faulty
    or hostile writer could write: only its fields are wrong)."""
    with open(os.path.join(path, fmt.MANIFEST), "wb") as f:
        f.write(fmt.seal_manifest(json.dumps(obj, separators=(",", ":")).encode()))


def test_the_fields_a_listing_needs_come_before_the_entries(tmp_path):
    """docs/format.md, "The head": every field of a checkpoint's description is written before
    ``entries``, and the description read from the head alone equals the one read whole."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        save(ck, 1, step=1, metrics={"loss": 0.5}, metadata={"entries": [1], "seq": "x"})
        save(ck, 2, tag="best")
    for name in ("step-0000000001", "best"):
        path = str(tmp_path / name)
        keys = list(_body(path))
        assert keys.index("entries") > max(
            keys.index(k)
            for k in (
                "format",
                "version",
                "name",
                "step",
                "created_unix",
                "world_size",
                "seq",
                "metadata",
                "files",
            )
        )
        assert "metrics" not in keys or keys.index("metrics") < keys.index("entries")
        head, none = catalog.examine(path, head=True)
        whole, manifest = catalog.examine(path)
        assert none is None and manifest is not None and head == whole
    assert whole.metrics == {} and catalog.examine(str(tmp_path / "step-0000000001"), head=True)[
        0
    ].metrics == {"loss": 0.5}


def test_a_scan_parses_only_the_newest_manifest_whole(tmp_path):
    """A new catalog of a directory of five checkpoints decodes the entries of the newest only
    (the one restore() and the next commit's number use); the others are described by their
    heads, and restoring one of them reads its manifest whole."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        for step in range(1, 6):
            save(ck, step, step=step)
    cat = Catalog(str(tmp_path))
    infos = cat.scan()
    assert [i.seq for i in infos] == [1, 2, 3, 4, 5]
    assert cat._heads == {fmt.step_name(s) for s in range(1, 5)}
    assert cat.manifest(infos[-1]) is not None and cat.manifest(infos[0]) is None
    with Checkpointer(tmp_path) as ck:
        live = {"x": torch.zeros(3)}
        assert ck.restore(live, step=2).step == 2 and torch.equal(live["x"], torch.full((3,), 2.0))


def _dup(path: str, tail: bytes) -> None:
    """Give fields of the manifest again after its last one (``tail``: ``,"k":v``), sealed."""
    raw = json.dumps(_body(path), separators=(",", ":")).encode()
    with open(os.path.join(path, fmt.MANIFEST), "wb") as f:
        f.write(fmt.seal_manifest(raw[:-1] + tail + b"}"))


def test_a_body_that_fails_behind_a_valid_head(tmp_path):
    """Manifests sealed with a valid checksum (what a faulty or hostile writer could write):
    bodies that do not validate (an entry's offset negative), fields given twice (a head
    decoder and a whole one would take different values), and a valid manifest whose fields
    come in another order. The newest ones that fail are damaged and passed over; an older one
    is listed from its head, and reading it raises CorruptCheckpointError, never other data;
    the one in another order is listed and restored as written."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        for step in range(1, 7):
            save(ck, step, step=step, metrics={"loss": float(step)})
    paths = {step: str(tmp_path / fmt.step_name(step)) for step in range(1, 7)}
    for step in (1, 6):
        bad = _body(paths[step])
        bad["entries"][0]["shards"][0]["offset"] = -1
        _reseal(paths[step], bad)
    _dup(paths[2], b',"step":7,"metrics":{"loss":-100}')
    _dup(paths[5], b',"seq":9')
    body = _body(paths[3])
    _reseal(paths[3], {"entries": body.pop("entries"), **body})  # entries first: no head
    with Checkpointer(tmp_path) as ck:
        assert ck.latest().step == 4
        assert [(i.step, i.metrics["loss"]) for i in ck.list()] == [
            (1, 1.0),
            (2, 2.0),
            (3, 3.0),
            (4, 4.0),
        ]
        assert [d.name for d in ck.damaged()] == ["step-0000000005", "step-0000000006"]
        assert "given twice" in ck.damaged()[0].reason and "offset" in ck.damaged()[1].reason
        live = {"x": torch.zeros(3)}
        for step, error in ((1, "offset"), (2, "given twice")):
            with pytest.raises(CorruptCheckpointError, match=error):
                ck.restore(live, step=step)
            assert torch.equal(live["x"], torch.zeros(3))
        assert ck.restore(live, step=3).step == 3 and torch.equal(live["x"], torch.full((3,), 3.0))
        assert ck.restore(live).step == 4 and torch.equal(live["x"], torch.full((3,), 4.0))


def test_a_manifest_replaced_after_its_head_was_read_is_no_damage(tmp_path):
    """The newest checkpoint is known from a head read earlier when its manifest is replaced by
    another valid one between the listing and the whole read (step 2 saved again with
    overwrite, its successor deleted): the whole read is compared with its own head, not with
    the old one, so it is the new checkpoint, not damage."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        for step in (1, 2, 3):
            save(ck, step, step=step)
    cat = Catalog(str(tmp_path))
    cat.scan()
    seen, heads = dict(cat._seen), set(cat._heads)
    assert "step-0000000002" in heads
    del seen["step-0000000003"]  # as a listing taken after the deletion below saw it
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.delete(step=3)
        save(ck, 20, step=2, overwrite=True)
    assert cat._parse_newest(seen, heads, None) == []
    found = seen["step-0000000002"][1]
    assert isinstance(found, catalog.CheckpointInfo) and found.seq == 3


def test_a_manifest_written_before_the_head_came_first_is_parsed_whole(tmp_path):
    """A manifest whose ``seq`` and ``metrics`` follow its entries (the order of earlier
    writers) is read whole by a scan, with the same description."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        save(ck, 1, step=1, metrics={"loss": 0.25})
        save(ck, 2, step=2)
    path = str(tmp_path / "step-0000000001")
    before = catalog.examine(path)[0]
    obj = _body(path)
    tail = {k: obj.pop(k) for k in ("seq", "metrics", "save_id")}
    _reseal(path, {**obj, **tail})
    assert list(_body(path))[-3:] == ["seq", "metrics", "save_id"]
    cat = Catalog(str(tmp_path))
    assert cat.scan()[0] == before and cat._heads == set()


def test_the_head_decoder_stops_at_its_field_only():
    """``codec.parse_json_head``: the fields before the top-level array field, as json.loads
    gives them; None (a whole parse follows) for anything else."""
    head = fmt.parse_json_head
    assert head(b'{"a":{"entries":[1]},"b":[2],"entries":[{"x":1}],"c":3}', "entries") == {
        "a": {"entries": [1]},
        "b": [2],
    }
    assert head(b' { "a" : 1 , "entries" : [ ] } ', "entries") == {"a": 1}
    assert fmt.parse_json(b'{"a":{"b":1,"b":2},"c":1}', "m", unique=True) == {
        "a": {"b": 2},
        "c": 1,
    }  # only the object's own fields must be unique
    with pytest.raises(CorruptCheckpointError, match="given twice"):
        fmt.parse_json(b'{"a":{"b":1},"c":1,"c":1}', "m", unique=True)
    for raw in (
        b'{"a":1,"a":2,"entries":[]}',  # a field twice: json.loads keeps the last
        b'{"a":1,"c":[]}',  # never reached
        b'{"a":1,"entries":7}',  # not an array
        b'[{"entries":[]}]',
        b'{"a":NaN,"entries":[]}',
        b'{"a":1 "entries":[]}',
        b'{"a":1,',
        b"\xff\xfe{",
        b"",
    ):
        assert head(raw, "entries") is None, raw


@pytest.mark.parametrize("dim", [1 << 63, (1 << 64) - 1])
def test_a_dimension_torch_cannot_hold_is_damage_even_with_no_element(tmp_path, dim):
    """A tensor of shape [0, 2**63] holds no byte, so every byte count checks; its allocation
    would raise an untyped error in torch. The manifest is refused (the checkpoint damaged,
    a read of it CorruptCheckpointError); [2**62, 0] is a valid empty tensor."""
    with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
        ck.save({"e": torch.empty(0, 3), "b": torch.ones(2)}, step=1).wait()
        ck.save({"e": torch.empty(0, 3), "b": torch.ones(2)}, step=2).wait()
    for step, shape in ((1, [1 << 62, 0]), (2, [0, dim])):
        path = str(tmp_path / fmt.step_name(step))
        obj = _body(path)
        entry = next(e for e in obj["entries"] if e["key"] == "e")
        entry["shape"] = entry["shards"][0]["shape"] = shape
        _reseal(path, obj)
    with Checkpointer(tmp_path) as ck:
        assert [d.name for d in ck.damaged()] == ["step-0000000002"]
        assert ck.load()["e"].shape == (1 << 62, 0)
        with pytest.raises(CorruptCheckpointError, match="shape"):
            ck.load(step=2)


def test_an_empty_directory_at_a_name_is_free_and_quiet(tmp_path, caplog):
    """An empty directory at a checkpoint's name (the placeholder a path adapter makes for a
    save in flight) is no checkpoint, named in no WARNING, and the commit of that name renames
    the checkpoint over it; a folder holding anything else is still never replaced."""
    import logging
    from datastates import CheckpointExistsError

    (tmp_path / "held").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("kept")
    with caplog.at_level(logging.WARNING, logger="datastates"):
        with Checkpointer(tmp_path, CheckpointConfig(**SMALL)) as ck:
            assert ck.list() == [] and ck.latest() is None
            ck.save({"x": torch.arange(3.0)}, tag="held").wait()
            assert [i.name for i in ck.list()] == ["held"]
            assert torch.equal(ck.load(tag="held")["x"], torch.arange(3.0))
            with pytest.raises(CheckpointExistsError, match="not a checkpoint"):
                ck.save({"x": torch.ones(1)}, tag="other").wait()
    assert (tmp_path / "other" / "notes.txt").read_text() == "kept"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [m for m in warned if "held" in m] == [] and len(warned) == 1  # the refused save


@pytest.mark.parametrize("name", ["hpc_ckpt_3.ckpt", "last.ckpt", "step-0000000007"])
def test_temporaries_do_not_spell_the_checkpoint_name(name):
    """What a framework matches in a listing (Lightning: 'hpc_ckpt_' and its digits, 'last')
    is in no temporary's name; an .old. still gives back the name it is to be put back under,
    and the names of earlier versions are still recognised, with their owner."""
    from datastates.storage.temporaries import (
        old_name,
        owner_token,
        parse_temporary,
        tmp_name,
        trash_name,
    )

    token = owner_token("a-run")
    made = [tmp_name(name, token, 123456789), old_name(name, token), trash_name(token)]
    for entry in made:
        assert name not in entry and "ckpt_" not in entry and "last" not in entry, entry
        assert parse_temporary(entry).owner == token
    assert [parse_temporary(e).kind for e in made] == ["tmp", "old", "trash"]
    assert parse_temporary(made[1]).original == name
    earlier = [
        f".tmp.{name}.{token}-7",
        f".old.{name}.{token}.89abcdef",
        f".trash.{name}.{token}.89abcdef",
    ]
    assert [(parse_temporary(e).kind, parse_temporary(e).owner) for e in earlier] == [
        ("tmp", token),
        ("old", token),
        ("trash", token),
    ]
    assert parse_temporary(earlier[1]).original == name
    with pytest.raises(ValueError, match="at most 112 bytes.*found 113 bytes"):
        old_name("x" * 113, token)
