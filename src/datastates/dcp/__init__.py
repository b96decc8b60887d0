"""``torch.distributed.checkpoint`` interoperation: the storage layer that writes datastates files
under DCP's planners (``layer``), its JSON metadata (``metadata``), and the folders it writes, as
the tools read them (``folders``). DCP ships with torch, so this is core code; the documented import
path is :mod:`datastates.integrations.dcp`."""

from .layer import DatastatesReader, DatastatesWriter

__all__ = ["DatastatesReader", "DatastatesWriter"]
