"""Folders someone handed over, through the tools: a planted pickle never runs (the marker file
it would create never appears), a link out of the checkpoint is never copied into an export,
and every layout the integrations write is understood by list, verify, inspect and export."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from testkit import LARGE

pytest.importorskip("torch.distributed.checkpoint")
import torch.distributed.checkpoint as dcp  # noqa: E402

import datastates  # noqa: E402
from datastates import Checkpointer  # noqa: E402
from datastates.tools.cli import EXIT_ERROR, EXIT_OK, main  # noqa: E402
from datastates.integrations.dcp import DatastatesReader, DatastatesWriter  # noqa: E402


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
    return (
        b"\x80\x04"
        + text("torch.distributed.checkpoint.filesystem")
        + text("os.system")
        + b"\x93"
        + text(f"touch {marker}")
        + b"\x85R."
    )


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
    manifest.update(
        version=version,
        metadata_bytes=len(blob),
        metadata_crc32=datastates.format.codec.crc32(blob),
    )
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


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "{f}"],
        ["inspect", "{f}", "--json"],
        ["export", "{f}", "--to", "torch", "{o}"],
        ["verify", "{f}"],
        ["list", "{p}"],
        ["import", "{f}", "--from", "dcp", "{o}"],
    ],
)
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
    dcp.save(
        {"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(stock)), no_dist=True
    )
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
    dcp.save(
        {"w": torch.ones(2), "obj": _Touch(marker)},
        storage_writer=DatastatesWriter(folder),
        no_dist=True,
    )
    code, _, err = _run(capsys, "export", folder, "--to", "torch", tmp_path / "o.pt")
    assert code == EXIT_ERROR and "'obj'" in err and "--trusted" in err
    assert not marker.exists() and not (tmp_path / "o.pt").exists()
    dcp.save({"w": torch.ones(2), "n": 5}, storage_writer=DatastatesWriter(folder), no_dist=True)
    code, _, _ = _run(capsys, "export", folder, "--to", "torch", tmp_path / "o.pt")
    assert code == EXIT_OK
    assert torch.load(tmp_path / "o.pt", weights_only=True)["n"] == 5


# ---------------------------------------------------------------- every layout, every command

_DS_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _deepspeed_save_dir(root, tags=("global_step1", "global_step2"), layout="files"):
    """The layout DeepSpeed's engine writes through datastates, ``root/<tag>/<file>`` and
    ``root/latest`` naming the newest tag, where each file is: ``"files"``, a hard link to the
    shard of the checkpoint ``root/<tag>/.datastates/<file>/`` behind it (this version);
    ``"directories"``, the checkpoint directory itself, the tag folder's own ``latest`` naming
    the last one written (earlier versions)."""
    from datastates.integrations._paths import PathCheckpoints

    for step, tag in enumerate(tags, 1):
        for name in _DS_FILES:
            state = {"x": torch.full((64,), float(step)), "file": name}
            if layout == "files":
                paths = PathCheckpoints(LARGE)
                paths.save(state, root / tag / name, snapshot=True)
                paths.close()
            else:
                with Checkpointer(root / tag, LARGE) as ck:
                    ck.save(state, tag=name).wait()
    (root / "latest").write_text(tags[-1])
    return root


def _ds_shard(tag_folder, name, layout):
    behind = tag_folder / ".datastates" / name if layout == "files" else tag_folder / name
    return behind / "rank-00000.dsf"


def _flip(path, offset=4096 + 10):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["files", "directories"])
def test_verify_of_a_deepspeed_tag_folder_checks_every_file(tmp_path, capsys, layout):
    """The tag folder's checkpoints' `latest` names the optimizer file; the model file is
    checked too."""
    tag = _deepspeed_save_dir(tmp_path, layout=layout) / "global_step2"
    hint = tag / ".datastates" / "latest" if layout == "files" else tag / "latest"
    assert hint.read_text() == _DS_FILES[1]
    if layout == "files":
        assert sorted(os.listdir(tag)) == sorted([".datastates", *_DS_FILES])
    code, out, _ = _run(capsys, "verify", tag)
    assert code == EXIT_OK and "verified 2 checkpoint(s)" in out and _DS_FILES[0] in out
    _flip(_ds_shard(tag, _DS_FILES[0], layout))
    code, out, err = _run(capsys, "verify", tag)
    assert code == EXIT_ERROR and _DS_FILES[0] in err and "checksum" in err
    assert "1 failed" in out
    code, out, _ = _run(capsys, "inspect", tag, "--json")
    assert code == EXIT_OK and [s["name"] for s in json.loads(out)] == list(_DS_FILES)
    code, _, err = _run(capsys, "export", tag, "--to", "torch", tmp_path / "x.pt")
    assert code == EXIT_ERROR and "holds 2 checkpoints" in err and _DS_FILES[0] in err
    code, _, _ = _run(
        capsys, "export", tag, "--tag", _DS_FILES[1], "--to", "torch", tmp_path / "x.pt"
    )
    assert code == EXIT_OK and torch.load(tmp_path / "x.pt")["file"] == _DS_FILES[1]


@pytest.mark.parametrize("layout", ["files", "directories"])
def test_a_deepspeed_save_dir_is_understood(tmp_path, capsys, layout):
    root = _deepspeed_save_dir(tmp_path / "run", layout=layout)
    code, out, _ = _run(capsys, "list", root)
    assert code == EXIT_OK and "4 checkpoint(s)" in out
    for tag in ("global_step1", "global_step2"):
        assert all(f"{tag}/{name}" in out for name in _DS_FILES)
    code, out, _ = _run(capsys, "verify", root)  # the tag `latest` names, every file of it
    assert code == EXIT_OK and "verified 2 checkpoint(s)" in out and "global_step2/" in out
    code, out, _ = _run(capsys, "inspect", root, "--json")
    summaries = json.loads(out)
    assert [s["values"]["file"] for s in summaries] == list(_DS_FILES)
    _flip(_ds_shard(root / "global_step1", _DS_FILES[0], layout))
    code, out, err = _run(capsys, "verify", root, "--all")
    assert code == EXIT_ERROR and "verified 4 checkpoint(s)" in out
    assert f"global_step1/{_DS_FILES[0]}" in err and "global_step2" not in err


def test_dcp_folders_are_listed_verified_and_inspected(tmp_path, capsys):
    for step in (1, 2):
        dcp.save(
            {"w": torch.full((256,), float(step)), "n": step},
            storage_writer=DatastatesWriter(tmp_path / f"step-{step}"),
            no_dist=True,
        )
    code, out, _ = _run(capsys, "list", tmp_path)
    assert code == EXIT_OK and "step-1" in out and "step-2" in out and "2 checkpoint(s)" in out
    code, out, _ = _run(capsys, "verify", tmp_path / "step-2")
    assert code == EXIT_OK and "all OK" in out
    code, out, _ = _run(capsys, "inspect", tmp_path / "step-2", "--json")
    assert code == EXIT_OK and json.loads(out)["tensors"][0]["key"] == "w"
    _flip(tmp_path / "step-1" / "rank-00000.dsf", 4096 + 3)
    code, out, err = _run(capsys, "verify", tmp_path, "--all")
    assert code == EXIT_ERROR and "step-1" in err and "checksum" in err
    assert "verified 2 checkpoint(s)" in out and "1 failed (step-1)" in out


def test_damaged_newest_is_listed_and_fails_verify_all(tmp_path, capsys):
    """One flipped bit in the newest manifest: list shows it marked with the reason, and
    verify --all checks every other checkpoint too, then fails naming each bad one."""
    with Checkpointer(tmp_path, LARGE) as ck:
        for step in (1, 2, 3):
            ck.save({"w": torch.full((1024,), float(step))}, step=step).wait()
    _flip(tmp_path / "step-0000000003" / "manifest.json", 40)
    _flip(tmp_path / "step-0000000001" / "rank-00000.dsf")
    code, out, _ = _run(capsys, "list", tmp_path)
    rows = out.splitlines()
    assert code == EXIT_OK and "1 damaged" in out
    damaged = [r for r in rows if r.startswith("!")]
    assert len(damaged) == 1 and "step-0000000003" in damaged[0] and "DAMAGED" in damaged[0]
    assert any(r.startswith("*") and "step-0000000002" in r for r in rows)
    code, out, err = _run(capsys, "verify", tmp_path, "--all")
    assert code == EXIT_ERROR
    assert "step-0000000002: OK" in out and "verified 3 checkpoint(s)" in out
    assert "2 failed (step-0000000001, step-0000000003)" in out
    assert "step-0000000001: FAILED" in err and "step-0000000003: DAMAGED" in err


# ---------------------------------------------------------------- export --to hf


def test_export_hf_copies_no_link_out_of_the_checkpoint(tmp_path, capsys, caplog):
    """A tokenizer.json linking to a file outside the checkpoint (a key meant to stay private)
    and a FIFO are not copied: logged as WARNINGs, named in the report; the rest is copied."""
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    with Checkpointer(tmp_path / "run", LARGE) as ck:
        info = ck.save({"model": {"w": torch.arange(6.0)}}, tag="checkpoint-1").wait()
    ckpt = tmp_path / "run" / "checkpoint-1"
    assert info.path == str(ckpt)
    (ckpt / "config.json").write_text('{"model_type": "gpt2"}')
    os.symlink(secret, ckpt / "tokenizer.json")
    os.mkfifo(ckpt / "vocab.txt")
    with caplog.at_level("WARNING", logger="datastates"):
        report = datastates.export(ckpt, tmp_path / "hf", "hf")
    out = tmp_path / "hf"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == '{"model_type": "gpt2"}'
    assert report.refused == (
        ("tokenizer.json", "a symbolic link"),
        ("vocab.txt", "not a regular file"),
    )
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("tokenizer.json" in m for m in warned) and any("vocab.txt" in m for m in warned)
    code, out_text, _ = _run(
        capsys, "export", ckpt, "--to", "hf", tmp_path / "hf2", "--no-progress"
    )
    assert code == EXIT_OK and "not copied: tokenizer.json (a symbolic link)" in out_text
    assert not (tmp_path / "hf2" / "tokenizer.json").exists()


def test_a_deepspeed_save_dir_whose_latest_is_a_fifo_does_not_hang(tmp_path, capsys):
    """`latest` of a handed DeepSpeed save folder is read as a regular file only: a FIFO (or a
    link) there is ignored and the newest tag by step is taken, with no hang."""
    import threading

    root = _deepspeed_save_dir(tmp_path / "run")
    os.remove(root / "latest")
    os.mkfifo(root / "latest")
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=_run(capsys, "verify", root)))
    worker.start()
    worker.join(timeout=60)  # a hang detector, not synchronization
    assert not worker.is_alive(), "verify blocked on a FIFO named latest"
    code, out, _ = result["out"]
    assert code == EXIT_OK and "global_step2/" in out and "global_step1/" not in out
