"""``torch.distributed.checkpoint`` storage layer writing datastates files: the documented import
path of :class:`DatastatesWriter` and :class:`DatastatesReader` (code: ``datastates.dcp``,
core code because DCP ships with torch)."""

from __future__ import annotations

from datastates.dcp import DatastatesReader, DatastatesWriter

__all__ = ["DatastatesWriter", "DatastatesReader"]
