"""DatastatesWriter takes FileSystemWriter's ``thread_count`` and ``_extensions`` keywords:
``thread_count`` is accepted, a compression extension is refused by name (datastates does not
compress), never a TypeError."""

from __future__ import annotations

import pytest
import torch

dcp = pytest.importorskip("torch.distributed.checkpoint")

import datastates  # noqa: E402
from datastates.integrations.dcp import DatastatesReader, DatastatesWriter  # noqa: E402


@pytest.mark.parametrize("extensions", [None, []])
def test_writer_takes_thread_count_and_no_extensions(tmp_path, extensions):
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.int64)}
    writer = DatastatesWriter(tmp_path / "ckpt", thread_count=4, _extensions=extensions)
    assert writer.thread_count == 4
    dcp.save(state, storage_writer=writer)
    back = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int64)}
    dcp.load(back, storage_reader=DatastatesReader(tmp_path / "ckpt"))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


def test_writer_refuses_a_compression_extension(tmp_path):
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Compress(StreamTransformExtension):  # what DCP's ZStandard is, without zstandard
        @staticmethod
        def registry_name() -> str:
            return "compress"

        def transform_to(self, output):
            return output

        def transform_from(self, input):
            return input

        def get_descriptor(self) -> str:
            return "compress"

        @staticmethod
        def from_descriptor(version: str) -> "Compress":
            return Compress()

    with pytest.raises(datastates.ConfigError, match=r"\[Compress\].*does not compress"):
        DatastatesWriter(tmp_path / "ckpt", _extensions=[Compress()])


@pytest.mark.parametrize("count", [0, 1.5, "2"])
def test_writer_refuses_a_bad_thread_count(tmp_path, count):
    with pytest.raises(datastates.ConfigError, match="thread_count must be an int >= 1"):
        DatastatesWriter(tmp_path / "ckpt", thread_count=count)
