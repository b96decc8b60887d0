"""Folders someone handed over, through the tools: a planted pickle never runs (the marker file
it would create never appears), a link out of the checkpoint is never copied into an export,
and every layout the integrations write is understood by list, verify, inspect and export."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint")
import torch.distributed.checkpoint as dcp  # noqa: E402

import datastates  # noqa: E402
from datastates import CheckpointConfig, Checkpointer  # noqa: E402
from datastates.cli import EXIT_ERROR, EXIT_OK, main  # noqa: E402
from datastates.integrations.dcp import DatastatesReader, DatastatesWriter  # noqa: E402

CFG = CheckpointConfig(host_cache_bytes=8 << 20, chunk_bytes=1 << 20)


class _Touch:
    """Unpickling this runs ``touch MARKER`` (a shell command from the file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _dotted_system(marker) -> bytes:
    """A pickle naming ``os.system`` through a module under torch.distributed.checkpoint
    (pickle resolves the dotted name ``os.system`` inside it): ``os.system("touch MARKER")``."""
    def text(s: str) -> bytes:  # SHORT_BINUNICODE
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()
    # PROTO 4, module, name, STACK_GLOBAL, argument, TUPLE1, REDUCE, STOP
    return (b"\x80\x04" + text("torch.distributed.checkpoint.filesystem") + text("os.system")
            + b"\x93" + text(f"touch {marker}") + b"\x85R.")


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _planted_ours(tmp_path, marker, blob=None, version=1):
    """A DatastatesWriter folder whose metadata was replaced by a pickle that touches
    ``marker``, the manifest made to agree (size, CRC-32, version 1: pickled metadata)."""
    folder = tmp_path / "planted"
    dcp.save({"w": torch.ones(4)}, storage_writer=DatastatesWriter(folder), no_dist=True)
    blob = blob if blob is not None else pickle.dumps(_Touch(marker))
    os.remove(folder / "dcp_metadata.json")
    (folder / "dcp.metadata").write_bytes(blob)
    manifest = json.loads((folder / "dcp_manifest.json").read_bytes())
    manifest.update(version=version, metadata_bytes=len(blob),
                    metadata_crc32=datastates.format.crc32(blob))
    (folder / "dcp_manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_dotted_name_pickle_does_run_code(tmp_path):
    """The planted bytes of the tests below are live: unpickled, they create the marker."""
    marker = tmp_path / "MARKER"
    pickle.loads(_dotted_system(marker))
    assert marker.exists()


@pytest.mark.parametrize("trick", ["reduce", "dotted"])
def test_read_metadata_of_a_planted_folder_runs_nothing(tmp_path, trick):
    marker = tmp_path / "MARKER"
    blob = _dotted_system(marker) if trick == "dotted" else None
    folder = _planted_ours(tmp_path, marker, blob)
    with pytest.raises(datastates.UnsafeObjectError, match="pass trusted=True"):
        DatastatesReader(folder).read_metadata()
    assert not marker.exists()
    (folder / "dcp.metadata").write_bytes(b"")  # version 2 reads JSON: the pickle is no JSON
    _planted_ours(tmp_path / "v2", marker, blob, version=2)
    with pytest.raises(datastates.CorruptCheckpointError):
        DatastatesReader(tmp_path / "v2" / "planted").read_metadata()
    assert not marker.exists()


@pytest.mark.parametrize("command", [
    ["inspect", "{f}"], ["inspect", "{f}", "--json"], ["export", "{f}", "--to", "torch", "{o}"],
    ["verify", "{f}"], ["list", "{p}"], ["import", "{f}", "--from", "dcp", "{o}"]])
def test_cli_on_a_planted_folder_runs_nothing(tmp_path, capsys, command):
    marker = tmp_path / "MARKER"
    folder = _planted_ours(tmp_path, marker, _dotted_system(marker))
    argv = [a.format(f=folder, o=tmp_path / "out", p=tmp_path) for a in command]
    code, out, err = _run(capsys, *argv)
    assert not marker.exists()
    if command[0] == "list":  # listing reads the manifest only (a valid one of version 1)
        assert code == EXIT_OK and "planted" in out and "1 checkpoint(s)" in out
        return
    assert code == EXIT_ERROR and not os.path.exists(tmp_path / "out")
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("error:") for line in lines), err
    assert "trusted" in err and "Traceback" not in err
    if command[0] != "verify":
        assert len(lines) == 1, err


def test_import_of_a_stock_dcp_folder_needs_trusted(tmp_path, capsys):
    """torch's own .metadata is a pickle: refused without --trusted (a planted one never
    runs), imported with it."""
    marker = tmp_path / "MARKER"
    stock = tmp_path / "stock"
    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(stock)),
             no_dist=True)
    good = (stock / ".metadata").read_bytes()
    (stock / ".metadata").write_bytes(_dotted_system(marker))
    code, _, err = _run(capsys, "import", stock, "--from", "dcp", tmp_path / "ck")
    assert code == EXIT_ERROR and "--trusted" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "ck").exists()
    (stock / ".metadata").write_bytes(good)
    code, out, _ = _run(capsys, "import", stock, "--from", "dcp", tmp_path / "ck", "--trusted")
    assert code == EXIT_OK and "committed" in out
    with Checkpointer(tmp_path / "ck") as ck:
        assert torch.equal(ck.load()["w"], torch.arange(6.0))


def test_export_of_a_dcp_value_that_needs_unpickling(tmp_path, capsys):
    """A value of a DatastatesWriter folder is a torch.save blob: export loads it with
    weights_only=True, so a planted object is refused (marker never created) unless trusted."""
    marker = tmp_path / "MARKER"
    folder = tmp_path / "ours"
    dcp.save({"w": torch.ones(2), "obj": _Touch(marker)},
             storage_writer=DatastatesWriter(folder), no_dist=True)
    code, _, err = _run(capsys, "export", folder, "--to", "torch", tmp_path / "o.pt")
    assert code == EXIT_ERROR and "'obj'" in err and "--trusted" in err
    assert not marker.exists() and not (tmp_path / "o.pt").exists()
    dcp.save({"w": torch.ones(2), "n": 5}, storage_writer=DatastatesWriter(folder), no_dist=True)
    code, _, _ = _run(capsys, "export", folder, "--to", "torch", tmp_path / "o.pt")
    assert code == EXIT_OK
    assert torch.load(tmp_path / "o.pt", weights_only=True)["n"] == 5
