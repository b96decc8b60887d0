"""Bad input to the command line: one line on stderr starting with ``error:``, exit 1, no
traceback, nothing written; and the output of ``inspect`` stays readable (long values
collapsed, ``--keys``; a closed pipe ends it quietly)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import datastates
from datastates import Checkpointer, RNGState
from datastates.tools.cli import EXIT_ERROR, EXIT_OK, main
from testkit import LARGE


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error(code, err, *words):
    assert code == EXIT_ERROR, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for w in words:
        assert w in lines[0], (w, err)


def _bad_files(tmp_path):
    """A text file, a truncated torch.save zip, a safetensors file whose header is not JSON."""
    text = tmp_path / "notes.txt"
    text.write_text("these are not tensors\n")
    good = tmp_path / "good.pt"
    torch.save({"w": torch.randn(1000)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:1500])
    bad_header = tmp_path / "bad.safetensors"
    bad_header.write_bytes((20).to_bytes(8, "little") + b"{not json at all}   " + bytes(8))
    return text, truncated, bad_header


@pytest.mark.parametrize("which", ["text", "truncated"])
def test_import_of_a_bad_torch_file_is_one_line(tmp_path, capsys, which):
    text, truncated, _ = _bad_files(tmp_path)
    src = text if which == "text" else truncated
    code, _, err = _run(capsys, "import", src, "--from", "torch", tmp_path / "ck")
    _one_error(code, err, str(src), "not a readable torch.save file")
    assert not (tmp_path / "ck").exists() or not os.listdir(tmp_path / "ck")


def test_import_of_a_legacy_torch_file(tmp_path, capsys):
    """The legacy (non-zip) format cannot be memory-mapped: it is read whole, bit-exact."""
    state = {"w": torch.randn(4, 3), "n": torch.arange(5)}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    code, out, err = _run(capsys, "import", tmp_path / "old.pt", "--from", "torch", tmp_path / "ck")
    assert code == EXIT_OK, err
    with Checkpointer(tmp_path / "ck") as ck:
        got = ck.load()
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["n"], state["n"])


def test_import_of_a_bad_safetensors_file_is_one_line(tmp_path, capsys):
    pytest.importorskip("safetensors")
    _, _, bad = _bad_files(tmp_path)
    code, _, err = _run(capsys, "import", bad, "--from", "safetensors", tmp_path / "ck")
    _one_error(code, err, str(bad), "not a readable safetensors file")


def test_import_from_safetensors_without_the_package(tmp_path):
    """Without safetensors importable (it is blocked in the child's module table, as Python
    does for a module that is not there), the import says what to install."""
    _, _, bad = _bad_files(tmp_path)
    script = (
        "import sys; sys.modules['safetensors'] = None; sys.modules['safetensors.torch'] = "
        "None\nfrom datastates.tools.cli import main\n"
        f"sys.exit(main(['import', {str(bad)!r}, '--from', 'safetensors', "
        f"{str(tmp_path / 'ck')!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert (proc.returncode, proc.stdout) == (EXIT_ERROR, "")
    assert proc.stderr == (
        f"error: import --from safetensors: expected the safetensors package "
        f"to read {bad}, found it not installed: pip install safetensors (or "
        "pip install '.[safetensors]' in a datastates checkout)\n"
    )
    assert not (tmp_path / "ck").exists()


def test_import_of_an_empty_dcp_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = _run(capsys, "import", tmp_path / "empty", "--from", "dcp", tmp_path / "ck")
    _one_error(code, err, "not a torch.distributed.checkpoint folder", ".metadata")


def test_export_safetensors_of_complex128_is_one_line(tmp_path, capsys):
    with Checkpointer(tmp_path / "ck", LARGE) as ck:
        ck.save({"z": torch.randn(3, dtype=torch.complex128), "w": torch.ones(2)}, step=1).wait()
    code, _, err = _run(
        capsys,
        "export",
        tmp_path / "ck",
        "--to",
        "safetensors",
        tmp_path / "z.safetensors",
        "--no-progress",
    )
    _one_error(code, err, "'z'", "complex128", "safetensors cannot hold")
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # nothing written, no temporary left


def test_a_message_over_several_lines_is_printed_on_one(tmp_path, capsys):
    """A path with a newline in it is still one line of stderr."""
    odd = tmp_path / "two\nlines"
    odd.mkdir()
    code, _, err = _run(capsys, "verify", odd / "missing")
    _one_error(code, err, "does not exist")


def _rng_checkpoint(root):
    with Checkpointer(root, LARGE) as ck:
        ck.save(
            {
                "model": {"w": torch.ones(3)},
                "rng": RNGState(),
                "epoch": 4,
                "history": list(range(100)),
            },
            step=1,
        ).wait()


def test_inspect_collapses_long_values_and_takes_keys(tmp_path, capsys):
    """A long list of values is one row, not 100; the Python RNG state's 625 words are one
    tensor row; --keys keeps only what is asked."""
    _rng_checkpoint(tmp_path)
    code, out, _ = _run(capsys, "inspect", tmp_path)
    assert code == EXIT_OK and len(out.splitlines()) < 30, out
    row = next(line for line in out.splitlines() if line.startswith("history"))
    assert "100 values" in row and len(row) < 120, row
    row = next(line for line in out.splitlines() if line.startswith("rng/python/1"))
    assert "int64" in row and "[625]" in row
    code, out, _ = _run(capsys, "inspect", tmp_path, "--json", "--keys", "epoch", "history")
    summary = json.loads(out)
    assert summary["values"] == {"epoch": 4, "history": list(range(100))}
    assert summary["tensors"] == [] and summary["objects"] == []
    code, out, _ = _run(capsys, "inspect", tmp_path, "--json", "--keys", "model")
    assert [t["key"] for t in json.loads(out)["tensors"]] == ["model/w"]
    assert datastates.inspect(tmp_path)["values"]["history"] == list(range(100))  # every value


def test_inspect_json_into_a_closed_pipe_is_quiet(tmp_path):
    """`datastates inspect --json | head`: the reader goes away; no BrokenPipeError, no
    traceback. The output is larger than a pipe's buffer, so the write fails whatever the
    timing."""
    with Checkpointer(tmp_path, LARGE) as ck:
        ck.save({f"t{i:04d}": torch.ones(1) for i in range(2000)}, step=1).wait()
    proc = subprocess.Popen(
        [sys.executable, "-m", "datastates", "inspect", str(tmp_path), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader leaves before reading anything
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == EXIT_OK
    assert err == "", err


def test_inspect_and_export_of_the_newest_name_a_damaged_newer_checkpoint(tmp_path, capsys, caplog):
    """The newest readable checkpoint is used, and the damaged newer one is named on stderr
    (a WARNING: the CLI prints it through logging's last-resort handler)."""
    root = tmp_path / "ckpts"
    with Checkpointer(root, LARGE) as ck:
        for step in (1, 2):
            ck.save({"w": torch.full((4,), float(step))}, step=step).wait()
    manifest = root / "step-0000000002" / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    raw[30] ^= 1
    manifest.write_bytes(bytes(raw))
    code, out, _ = _run(capsys, "inspect", root, "--json")
    assert code == EXIT_OK and json.loads(out)["name"] == "step-0000000001"
    code, out, _ = _run(capsys, "export", root, "--to", "torch", tmp_path / "w.pt")
    assert code == EXIT_OK and torch.equal(
        torch.load(tmp_path / "w.pt")["w"], torch.full((4,), 1.0)
    )
    named = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(named) == 2 and all(
        "passed over the damaged checkpoint step-0000000002" in m and "used step-0000000001" in m
        for m in named
    ), named


@pytest.mark.parametrize("command", ["inspect", "verify", "export", "import"])
@pytest.mark.parametrize("tag", ["../x", "a/b", "latest", ".hidden", "t" * 129])
def test_an_invalid_tag_is_a_usage_error_not_a_traceback(tmp_path, capsys, command, tag):
    """``--tag`` names one checkpoint folder: anything else is refused by the argument parser
    (exit 2, its usage line), before any folder is opened."""
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    argv = {
        "inspect": ["inspect", tmp_path],
        "verify": ["verify", tmp_path],
        "export": ["export", tmp_path, tmp_path / "out.pt"],
        "import": ["import", tmp_path / "w.pt", "--from", "torch", tmp_path / "ck"],
    }[command]
    with pytest.raises(SystemExit) as exited:
        main([str(a) for a in argv] + ["--tag", tag])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"error: argument --tag: invalid checkpoint name {tag[:40]!r}"[:-1] in err
    assert "Traceback" not in err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "out.pt").exists()
