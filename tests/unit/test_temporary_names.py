"""The names of temporaries, data directories and damaged checkpoints set aside: one module gives
them and recognises them (storage/temporaries.py), and each name it gives reads back."""

from __future__ import annotations

import pytest

from datastates.format import codec
from datastates.storage import temporaries as tm

TOKEN = tm.owner_token("run")


def test_a_data_directory_is_recognised_by_its_name():
    name = tm.data_dir_name(TOKEN, 7)
    assert name == f".data.{TOKEN}-7" and tm.is_data_dir(name)
    for other in (
        ".data.x-7",
        f".data.{TOKEN}-",
        f".data.{TOKEN}-7/",
        f".tmp.{TOKEN}-7",
        f".data.{TOKEN.upper()}-7",
        f".data.{TOKEN}-\u0667",
    ):  # an Arabic-Indic 7
        assert not tm.is_data_dir(other), other
    assert tm.parse_temporary(name) is None  # not a temporary of a root: its manifest names it


@pytest.mark.parametrize(
    "key, expected",
    [
        (f"step-1/.data.{TOKEN}-7/rank-00003.dsf", True),
        (f"step-1/.data.{TOKEN}-7/manifest-00001.json", True),
        (f"step-1/.data.{TOKEN}-7/manifest.json", False),  # the manifest commits: never aborted
        (f"step-1/.data.{TOKEN}-7/notes.txt", False),  # someone else's
        (f"/.data.{TOKEN}-7/rank-00003.dsf", False),
        (f"a/step-1/.data.{TOKEN}-7/rank-00003.dsf", False),
        (f"step-1/.data.{TOKEN}/rank-00003.dsf", False),
    ],
)
def test_a_data_key_is_a_saved_file_of_a_data_directory(key, expected):
    assert tm.is_data_key(key, codec.saved_file) is expected


def test_saved_files_are_shard_files_and_parts():
    assert codec.saved_file(codec.shard_file_name(12)) and codec.saved_file(codec.part_name(3))
    assert codec.saved_file("rank-123456.dsf")
    for other in ("rank-1.dsf", "manifest.json", "manifest-1.json", "rank-00001.dsf.tmp"):
        assert not codec.saved_file(other), other


def test_the_names_a_writer_gives_read_back():
    old = tm.old_name("step-5", TOKEN)
    found = tm.parse_temporary(old)
    assert found is not None and (found.kind, found.original, found.owner) == (
        "old",
        "step-5",
        TOKEN,
    )
    trash = tm.parse_temporary(tm.trash_name(TOKEN))
    assert trash is not None and (trash.kind, trash.owner) == ("trash", TOKEN)
    tmp = tm.parse_temporary(tm.tmp_name("step-5", TOKEN, 3))
    assert tmp is not None and (tmp.kind, tmp.owner) == ("tmp", TOKEN)
    aside = tm.damaged_name("step-5")
    assert aside.startswith(".damaged.step-5.") and tm.parse_temporary(aside) is None
