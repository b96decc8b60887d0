"""The tools around checkpoints: list, inspect, verify, export and import, through the Python API
and the command line (its output and exit codes)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest
import torch

import datastates
from datastates import Checkpointer
from datastates.tools import describe
from datastates.tools.cli import EXIT_EMPTY, EXIT_ERROR, EXIT_OK, main

import zygote
from helpers import assert_same, make_training, train_step
from testkit import LARGE


def _saved(root, steps=(1, 2), **extra):
    model, opt, sched, loader = make_training()
    tied = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "model": model,
        "optimizer": opt,
        "epoch": 3,
        "name": "run-a",
        "tied": {"a": tied, "b": tied},
        **extra,
    }
    with Checkpointer(root, LARGE) as ck:
        for step in steps:
            train_step(model, opt, sched, loader)
            ck.save(state, step=step, metadata={"lr": 0.01}).wait()
        return ck.load(step=steps[-1])


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_describes_every_key(tmp_path):
    _saved(tmp_path)
    s = datastates.inspect(tmp_path)  # the folder of checkpoints: its newest
    assert s["name"] == "step-0000000002" and s["step"] == 2 and s["format_version"] >= 2
    assert s["metadata"] == {"lr": 0.01} and s["world_size"] == 1
    by_key = {t["key"]: t for t in s["tensors"]}
    # the GPT's lm_head.weight is tied to its embedding: listed, stored once under wte.weight
    assert by_key["model/lm_head.weight"]["alias_of"] == "model/wte.weight"
    weight = by_key["model/wte.weight"]
    assert weight["dtype"] == "float32" and weight["ranks"] == [0]
    assert weight["nbytes"] == 4 * int(torch.tensor(weight["shape"]).prod())
    assert s["values"]["epoch"] == 3 and s["values"]["name"] == "run-a"
    same = datastates.inspect(os.path.join(tmp_path, "step-0000000001"))
    assert same["step"] == 1
    assert datastates.inspect(tmp_path, step=1) == same


def test_cli_inspect_text_and_json(tmp_path, capsys):
    _saved(tmp_path)
    code, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert code == EXIT_OK and "step 2" in out and "model/" in out and "float32" in out
    code, out, _ = _run(capsys, "inspect", str(tmp_path), "--json", "--step", "1")
    assert code == EXIT_OK and json.loads(out)["step"] == 1


def test_cli_list_human_sizes_and_newest_mark(tmp_path, capsys):
    _saved(tmp_path)
    code, out, _ = _run(capsys, "list", str(tmp_path))
    lines = out.splitlines()
    assert code == EXIT_OK
    assert any(line.startswith("*") and "step-0000000002" in line for line in lines)
    assert any(line.startswith(" ") and "step-0000000001" in line for line in lines)
    assert "KiB" in out or "MiB" in out
    assert "2 checkpoint(s)" in out


def test_cli_reports_empty_foreign_and_file_paths(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(capsys, "list", str(empty))
    assert code == EXIT_EMPTY and "no datastates checkpoint" in err and "empty" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    torch.save({"w": torch.ones(2)}, foreign / "model.pt")
    code, _, err = _run(capsys, "inspect", str(foreign))
    assert code == EXIT_EMPTY and "torch.save files" in err and "model.pt" in err
    code, _, err = _run(capsys, "verify", str(foreign / "model.pt"))
    assert code == EXIT_ERROR and "is a file" in err
    code, _, err = _run(capsys, "list", str(tmp_path / "missing"))
    assert code == EXIT_ERROR and "does not exist" in err


class _Tied(torch.nn.Module):
    """A tiny language model whose output layer is tied to its embedding."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_cli_inspect_lists_tied_names_as_sharing_the_storage(tmp_path):
    with Checkpointer(tmp_path, LARGE) as ck:
        ck.save({"model": _Tied()}, step=1).wait()
        loaded = ck.load()
    assert sorted(loaded["model"]) == ["emb.weight", "head.weight"]
    run = lambda *extra: zygote.run(
        [sys.executable, "-m", "datastates", "inspect", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    proc = run()
    assert (proc.returncode, proc.stderr) == (EXIT_OK, "")
    lines = proc.stdout.splitlines()
    assert lines[3] == (
        "contents    1 tensors (60 B) and 1 tied name(s) sharing their storage, "
        "0 objects, 0 plain values"
    )
    assert lines[-3:] == [
        "key                dtype    shape   size  where",
        "model/emb.weight   float32  [5, 3]  60 B  rank 0",
        "model/head.weight  float32  [5, 3]  -     shares the storage of model/emb.weight",
    ]
    proc = run("--json")
    assert proc.returncode == EXIT_OK
    tensors = {t["key"]: t for t in json.loads(proc.stdout)["tensors"]}
    assert set(tensors) == {f"model/{k}" for k in loaded["model"]}
    assert tensors["model/emb.weight"]["alias_of"] is None
    assert tensors["model/head.weight"]["alias_of"] == "model/emb.weight"
    assert (tensors["model/head.weight"]["nbytes"], tensors["model/emb.weight"]["nbytes"]) == (
        0,
        60,
    )  # stored once: the bytes of the summary add up to what the files hold
    assert tensors["model/head.weight"]["shape"] == [5, 3]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """A folder holding the checkpoint of step 1, and an empty folder beside it."""
    root = tmp_path_factory.mktemp("not-found")
    _saved(root / "ck", steps=(1,))
    (root / "empty").mkdir()
    return root


#: Asking for what is not there, by step, by tag, in an empty folder: exit code 3 for every
#: command that reads a checkpoint (the README's table), with one error line.
NOT_FOUND = {
    "step": (["ck", "--step", "3"], "no checkpoint 'step-0000000003' in '{root}/ck'"),
    "tag": (["ck", "--tag", "nope"], "no checkpoint 'nope' in '{root}/ck'"),
    "empty": (["empty"], "no datastates checkpoint in {root}/empty (the folder is empty)"),
}


@pytest.mark.parametrize(
    "command, case",
    [("list", "empty")]
    + [
        (command, case) for command in ("inspect", "verify", "export") for case in sorted(NOT_FOUND)
    ],
)
def test_cli_not_found_is_exit_code_3_for_every_command(one_step, command, case):
    which, line = NOT_FOUND[case]
    out = one_step / f"out-{command}-{case}.pt"
    extra = ["--to", "torch", str(out)] if command == "export" else []
    proc = zygote.run(
        [sys.executable, "-m", "datastates", command, str(one_step / which[0]), *which[1:], *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stdout) == (EXIT_EMPTY, "")
    assert proc.stderr == f"error: {line.format(root=one_step)}\n"
    assert not out.exists()


def _on_a_terminal(argv, cwd) -> tuple[int, bytes, bytes]:
    """Run the command with stderr on a pseudo-terminal of 24 x 80: its exit code, its stdout
    and what it drew on the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    with os.fdopen(slave, "wb") as terminal:
        proc = zygote.run(
            [sys.executable, "-m", "datastates", *argv],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=terminal,
            timeout=300,
        )
    screen = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer of the terminal has closed it, all is read
            break
        if not chunk:
            break
        screen += chunk
    os.close(master)
    return proc.returncode, proc.stdout, screen


def test_cli_draws_progress_bars_on_a_terminal_unless_told_not_to(one_step):
    code, out, screen = _on_a_terminal(["verify", "ck"], one_step)
    assert code == EXIT_OK and b": OK, manifest and 1 shard file(s)" in out
    assert b"verify:" in screen and b"0%" in screen
    code, out, screen = _on_a_terminal(["export", "ck", "--to", "torch", "w.pt"], one_step)
    assert code == EXIT_OK and out.startswith(b"wrote ") and b"w.pt:" in screen
    code, _, screen = _on_a_terminal(["verify", "ck", "--no-progress"], one_step)
    assert (code, screen) == (EXIT_OK, b"")


def test_the_cli_imports_tqdm_unconditionally():
    """tqdm is a dependency: the command line has no path without it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['tqdm'] = None\nimport datastates.tools.cli",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "ModuleNotFoundError: import of tqdm halted; None in sys.modules"
    )


def test_cli_verify_all_summary_and_corruption(tmp_path, capsys):
    _saved(tmp_path, steps=(1, 2, 3))
    code, out, _ = _run(capsys, "verify", str(tmp_path), "--all")
    assert code == EXIT_OK
    assert "verified 3 checkpoint(s)" in out and "all OK" in out and "GB/s" in out
    shard = tmp_path / "step-0000000002" / "rank-00000.dsf"
    data = bytearray(shard.read_bytes())
    data[4096 + 10] ^= 0xFF  # a byte of the first tensor
    shard.write_bytes(bytes(data))
    code, out, err = _run(capsys, "verify", str(tmp_path), "--all")
    assert code == EXIT_ERROR and "checksum" in err and "step-0000000002" in err


def test_verify_reports_progress_inside_a_checkpoint(tmp_path):
    """Progress moves inside one checkpoint (one call per span of checksum pieces, at most
    64 MiB, then the rest of each file) and the increments add up to the bytes verified, which are the shard files' sizes."""
    from datastates.restore import verify as verify_mod
    from datastates.providers import ProviderRegistry
    from datastates.restore.reader import Reader

    with datastates.Checkpointer(tmp_path, datastates.CheckpointConfig(chunk_bytes=1 << 20)) as ck:
        ck.save(
            {
                "big": torch.arange(40 << 20, dtype=torch.uint8).view(-1, 4096),
                "small": torch.ones(3),
            },
            step=1,
        ).wait()
        info = ck.latest()
    seen = []
    old_span, verify_mod.SPAN_BYTES = verify_mod.SPAN_BYTES, 8 << 20
    try:
        with Reader(info.path, registry=ProviderRegistry.default()) as reader:
            total = reader.verify_all(seen.append)
    finally:
        verify_mod.SPAN_BYTES = old_span
    assert total == info.nbytes == sum(seen)
    assert len(seen) >= 5 and all(n > 0 for n in seen[:-1])  # several steps inside one file


def test_export_torch_round_trips_with_weights_only(tmp_path):
    expected = _saved(tmp_path / "ck")
    out = tmp_path / "state.pt"
    report = datastates.export(tmp_path / "ck", out, "torch")
    assert report.tensors > 0 and report.nbytes > 0 and out.is_file()
    got = torch.load(out, weights_only=True)
    assert_same(expected, got)
    assert got["tied"]["a"].data_ptr() == got["tied"]["b"].data_ptr()  # tied stays tied
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]


def test_export_safetensors_model_only_and_tied_names(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    expected = _saved(tmp_path / "ck")
    out = tmp_path / "model.safetensors"
    report = datastates.export(tmp_path / "ck", out, "safetensors", keys=["model"])
    got = safetensors.load_file(str(out))
    assert report.aliases == {"lm_head.weight": "wte.weight"}  # the demo GPT ties its head
    resolved = {k: got[report.aliases.get(k, k)] for k in expected["model"]}
    assert_same(dict(expected["model"]), resolved)
    out2 = tmp_path / "tied.safetensors"
    report = datastates.export(tmp_path / "ck", out2, "safetensors", keys=["tied"])
    assert report.aliases == {"b": "a"}
    got = safetensors.load_file(str(out2))
    assert list(got) == ["a"] and torch.equal(got["a"], expected["tied"]["a"])
    from safetensors import safe_open

    with safe_open(str(out2), "pt") as f:
        assert json.loads(f.metadata()["datastates.aliases"]) == {"b": "a"}


def test_export_of_a_damaged_checkpoint_leaves_no_file(tmp_path):
    _saved(tmp_path / "ck", steps=(1,))
    shard = tmp_path / "ck" / "step-0000000001" / "rank-00000.dsf"
    data = bytearray(shard.read_bytes())
    data[4096 + 3] ^= 0x01
    shard.write_bytes(bytes(data))
    for fmt in ("torch", "safetensors"):
        with pytest.raises(datastates.CorruptCheckpointError, match="checksum"):
            datastates.export(tmp_path / "ck", tmp_path / f"out.{fmt}", fmt)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_export_memory_stays_bounded(tmp_path):
    """A 256 MiB state exports without the process's anonymous memory growing by its size."""
    big = torch.randn(64 << 20)  # 256 MiB
    with Checkpointer(tmp_path / "ck", LARGE) as ck:
        ck.save({"w": big}, step=1).wait()
    del big
    script = (
        "import datastates, sys\n"
        "def anon():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon'))"
        ".split()[1]) * 1024\n"
        "before = anon()\n"
        f"datastates.export({str(tmp_path / 'ck')!r}, {str(tmp_path / 'w.pt')!r}, 'torch')\n"
        "print(anon() - before)\n"
    )
    # forked from the session's zygote: its anonymous memory is measured from its own start
    grown = int(
        zygote.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
        ).stdout
    )
    assert grown < (64 << 20), f"anonymous memory grew by {grown} bytes exporting 256 MiB"
    assert torch.equal(
        torch.load(tmp_path / "w.pt", weights_only=True, mmap=True)["w"],
        datastates.Checkpointer(tmp_path / "ck").load()["w"],
    )


@pytest.mark.parametrize("source", ["torch", "torch-legacy", "safetensors", "dcp", "dcp-ours"])
def test_import_then_load_is_bit_exact(tmp_path, source):
    """A stock DCP folder imports with trusted=True (its metadata is a pickle); one written by
    DatastatesWriter and a legacy (non-zip) torch.save file import without it."""
    state = {"w": torch.randn(5, 7), "b": torch.arange(9, dtype=torch.int64)}
    trusted = source == "dcp"
    if source == "torch":
        src = tmp_path / "in.pt"
        torch.save(state, src)
    elif source == "torch-legacy":
        src = tmp_path / "in.pt"
        torch.save(state, src, _use_new_zipfile_serialization=False)
    elif source == "safetensors":
        safetensors = pytest.importorskip("safetensors.torch")
        src = tmp_path / "in.safetensors"
        safetensors.save_file(state, str(src))
    else:
        import torch.distributed.checkpoint as dcp
        from datastates.integrations.dcp import DatastatesWriter

        src = tmp_path / "dcp"
        writer = dcp.FileSystemWriter(str(src)) if source == "dcp" else DatastatesWriter(src)
        dcp.save(state, storage_writer=writer, no_dist=True)
    source = source.split("-")[0]
    info = datastates.import_checkpoint(
        src, tmp_path / "ck", source=source, step=7, trusted=trusted
    )
    assert info.step == 7 and info.metadata["imported_format"] == source
    with Checkpointer(tmp_path / "ck") as ck:
        assert_same(dict(sorted(state.items())), dict(sorted(ck.load(step=7).items())))


def test_cli_export_import_round_trip(tmp_path, capsys):
    expected = _saved(tmp_path / "ck")
    code, out, _ = _run(
        capsys,
        "export",
        str(tmp_path / "ck"),
        "--to",
        "torch",
        str(tmp_path / "x.pt"),
        "--no-progress",
    )
    assert code == EXIT_OK and "wrote" in out
    code, out, _ = _run(
        capsys,
        "import",
        str(tmp_path / "x.pt"),
        "--from",
        "torch",
        str(tmp_path / "ck2"),
        "--tag",
        "imported",
    )
    assert code == EXIT_OK and "committed" in out
    with Checkpointer(tmp_path / "ck2") as ck:
        assert_same(expected, ck.load(tag="imported"))


def test_find_rejects_ambiguous_folder_for_inspect(tmp_path):
    for name in ("a.pt", "b.pt"):  # path-addressed checkpoints, as the integrations write them
        with Checkpointer(tmp_path, LARGE) as ck:
            ck.save({"x": torch.ones(2)}, tag=name).wait()
    os.remove(tmp_path / "latest")
    assert [i.name for i in describe.find(tmp_path)] == ["a.pt", "b.pt"]
    with pytest.raises(datastates.ConfigError, match="holds 2 checkpoints"):
        datastates.inspect(tmp_path)
    assert datastates.inspect(tmp_path, tag="b.pt")["name"] == "b.pt"


def test_cli_inspect_shows_every_checkpoint_of_a_tag_folder(tmp_path, capsys):
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        with Checkpointer(tmp_path, LARGE) as ck:  # the layout the DeepSpeed engine writes
            ck.save({"x": torch.ones(2)}, tag=name).wait()
    os.remove(tmp_path / "latest")
    code, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert code == EXIT_OK
    assert (
        "mp_rank_00_model_states.pt" in out and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in out
    )
    code, out, _ = _run(capsys, "inspect", str(tmp_path), "--json")
    assert code == EXIT_OK and [s["name"] for s in json.loads(out)] == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]


@pytest.mark.parametrize(
    "to,keys", [("torch", None), ("safetensors", ["model"]), ("torch", ["tied"])]
)
def test_export_progress_total_is_known_before_it_starts(tmp_path, to, keys):
    """The total of export's progress bar (planned_bytes, from the manifest alone) is what the
    progress calls add up to and what the export reports (tied tensors once)."""
    from datastates.tools import export

    _saved(tmp_path / "ck")
    total = export.planned_bytes(tmp_path / "ck", to, keys=keys)
    seen: list[int] = []
    report = datastates.export(
        tmp_path / "ck", tmp_path / f"out.{to}", to, keys=keys, progress=seen.append
    )
    assert total == sum(seen) == report.nbytes > 0
