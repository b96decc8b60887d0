"""The memory root's store: shard files are recycled, as the two slots of an A/B buffer are.

On a tmpfs, a new file costs a page allocation (and its zeroing) per page written, and removing
one frees them again: for a checkpoint at every step that is more work than the copy itself.
Here, when a checkpoint of the memory root is removed (retention, a delete), each of its shard
files ``rank-RRRRR.dsf`` is moved to ``<memdir>/spare/`` instead (replacing an older spare of
that name); the next save of that rank renames the spare into its temporary directory and writes
over it (:class:`MappedShardWriter`: the capture copies the tensors
straight into a mapping of the file, and what the save does not write is zeroed). Host memory then holds the committed checkpoints, the one being written, and one
spare per rank at most, which the next save consumes: with ``keep_last=1``, two copies of the
state, as two slots would. ``spare/`` is outside the checkpoint root, so it is never listed, and
it goes with the memory directory.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
import threading

import torch

from ..format import codec as fmt
from ..format.codec import HEADER_BYTES, UNIT_ALIGN
from ..storage import LocalStore
from ..storage.posix import ReusedShardWriter

SPARE = "spare"

log = logging.getLogger("datastates")


class RecyclingStore(LocalStore):
    """A local store whose removed shard files become the next save's (module docstring)."""

    def __init__(self, spare_dir: str):
        self.spare_dir = spare_dir
        #: The shard files' mappings, kept from one save to the next.
        self.mappings = Mappings()

    def close(self) -> None:
        """Unmap the shard files kept mapped (the memory Checkpointer closed)."""
        self.mappings.close()

    def remove_tree(self, path: str) -> None:
        try:
            names = os.listdir(path)
        except OSError:
            names = []
        for name in names:
            if not _is_shard_name(name):
                continue
            source = os.path.join(path, name)
            try:
                if not stat.S_ISREG(os.lstat(source).st_mode):
                    continue
                os.makedirs(self.spare_dir, mode=0o700, exist_ok=True)
                os.rename(source, os.path.join(self.spare_dir, name))
            except OSError:
                pass  # removed with the rest below
        super().remove_tree(path)
        self.mappings.forget_removed()  # a spare replaced, a file removed: its pages go now

    #: The pipeline captures the tensor units of a state straight into the shard file
    #: (``MappedShardWriter.unit_view``) instead of through the host cache.
    maps_units = True

    @property
    def maps_cuda(self) -> bool:
        """Whether a state with CUDA tensors is captured in place too: its mapping registered
        with CUDA (``MappedShardWriter.pin``), unless a registration failed before."""
        return torch.cuda.is_available() and not self.mappings.pin_failed

    def shard_writer(self, path: str, io_mode: str, layout) -> MappedShardWriter:
        try:
            os.rename(os.path.join(self.spare_dir, os.path.basename(path)), path)
        except OSError:
            return MappedShardWriter(path, layout, reused=False, mappings=self.mappings)
        return MappedShardWriter(path, layout, reused=True, mappings=self.mappings)


def _is_shard_name(name: str) -> bool:
    return (
        name.startswith("rank-")
        and name.endswith(".dsf")
        and name == fmt.shard_file_name(int(name[5:-4]))
        if name[5:-4].isdigit()
        else False
    )


class _Mapping:
    """One shard file's shared mapping of ``length`` bytes from ``start``, its tensor, and a
    descriptor of the file (to tell when it has been removed)."""

    def __init__(self, fd: int, start: int, length: int):
        self.start, self.length = start, length
        self.fd = os.dup(fd)
        try:
            # Not MAP_POPULATE: that would fault in every page inside save() (the capture of
            # the eager units waits for the file's opening); the capture's copies fault them in
            # on the capture thread instead, once per kept mapping.
            self.map = mmap.mmap(
                fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start
            )
        except BaseException:
            os.close(self.fd)
            raise
        # Through a memoryview: a tensor's storage holds it, and it holds an export of the
        # mapping until the storage's last view is gone (torch.frombuffer keeps only a
        # reference, and a bare mmap would close under a live view).
        self.tensor = torch.frombuffer(memoryview(self.map), dtype=torch.uint8)
        #: Registered with CUDA (page-locked), so device copies land in it directly.
        self.pinned = False

    def pin(self) -> bool:
        """Register the mapping with CUDA once (``cudaHostRegister``); whether it is. Its pages
        are touched first (registering faulted-in pages is far cheaper than letting the driver
        fault them); the bytes are the file's, which the save overwrites anyway."""
        if self.pinned:
            return True
        cudart = torch.cuda.cudart()
        ctypes.memset(self.tensor.data_ptr(), 0, self.length)  # no OpenMP team off the main thread
        error = cudart.cudaHostRegister(self.tensor.data_ptr(), self.length, 0)
        if error != cudart.cudaError.success:
            log.warning(
                "datastates: cudaHostRegister of a memory shard file's mapping (%d bytes) "
                "failed (%s): CUDA states go through the pinned host cache instead",
                self.length,
                error,
            )
            return False
        self.pinned = True
        return True

    def removed(self) -> bool:
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        if self.pinned:  # every copy into it was fenced: the writer using it has finished
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the mapping's last view let go
        try:
            self.map.close()
        except BufferError:  # a view is still alive: unmapped when it goes
            pass
        os.close(self.fd)


class Mappings:
    """The memory shard files' mappings, kept from one save to the next.

    The first write of each 4 KiB page of a new mapping is a page fault, which costs about as
    much as copying the page. The shard files are recycled (an A/B pair with ``keep_last=1``),
    so a file's mapping is kept after its save and taken again by the save that reuses the
    file: from then on, the capture costs only the copy.
    A kept mapping whose file has been removed (a spare replaced, the memory removed) is
    dropped at the next removal or save, so it holds no memory for long; at most ``limit`` are
    kept (the least recently used go first)."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self._lock = threading.Lock()
        self._kept: dict[tuple[int, int], _Mapping] = {}  # by (device, inode), oldest first
        #: A ``cudaHostRegister`` failed: CUDA states go through the pinned host cache.
        self.pin_failed = False

    def take(self, fd: int, start: int, length: int, pin: bool = False) -> torch.Tensor | None:
        """A writable uint8 tensor over ``length`` bytes of the file ``fd`` from ``start``
        (page-aligned; the file at least that long): a kept mapping of that file, or a new one
        (kept in turn). ``pin``: registered with CUDA as well (kept registered with the
        mapping); None if that failed."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            kept = self._kept.pop(key, None)
            if kept is not None and (kept.start != start or kept.length < length):
                kept.close()
                kept = None
            if kept is None:
                kept = _Mapping(fd, start, length)
            self._kept[key] = kept
            self._forget(lambda m: m.removed())
            while len(self._kept) > self.limit:
                self._kept.pop(next(iter(self._kept))).close()
            if pin and not kept.pin():
                self.pin_failed = True
                return None
            return kept.tensor[:length]

    def forget_removed(self) -> None:
        with self._lock:
            self._forget(lambda m: m.removed())

    def close(self) -> None:
        with self._lock:
            self._forget(lambda m: True)

    def __len__(self) -> int:
        return len(self._kept)

    def _forget(self, which) -> None:
        for key in [k for k, m in self._kept.items() if which(m)]:
            self._kept.pop(key).close()


class MappedShardWriter(ReusedShardWriter):
    """A shard file of the memory tier whose tensor units are captured in place: the pipeline
    copies each unit straight into a shared mapping of the file (:meth:`unit_view`), so a save
    to memory copies its bytes once, where a save through the host cache copies them into a
    cache slot and then into the file. The object blobs, the index and the header go through
    :meth:`write`, as for any shard file.

    ``reused``: the file exists (a spare shard file: its pages are already allocated);
    otherwise it is created and sized to the units' region. The mapping comes from
    ``mappings``: kept from the save that last wrote this file (no page faults), else made. The capture writes every byte of a unit it maps, its
    gaps and padding zeroed; every other byte is zeroed by :meth:`finish` unless this save
    wrote it (``ReusedShardWriter``), so no byte of an older file is left inside the new one.

    The mapping is exported to tensor views: it cannot be unmapped while any view lives, so a
    thread still filling a unit of a failed save never writes into unmapped memory."""

    def __init__(self, path: str, layout, reused: bool, mappings: Mappings):
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | (0 if reused else os.O_CREAT | os.O_EXCL)
        self.path = path
        self.fd = os.open(path, flags, 0o644)
        self.direct_fd = -1
        self._use_direct = False
        self._lock = threading.Lock()
        self._written = []
        self._tensor = None
        self._mappings = mappings
        self._allocated = 0
        end = max((u.file_offset + u.nbytes for u in layout.units), default=HEADER_BYTES)
        end = -(-end // UNIT_ALIGN) * UNIT_ALIGN
        self._start = HEADER_BYTES
        try:
            st = os.fstat(self.fd)
            # Below this offset every page has its block (a file with no hole: a committed
            # shard file is written whole), so the capture allocates nothing there.
            self._allocated = st.st_size if st.st_blocks * 512 >= st.st_size else 0
            if end > HEADER_BYTES:
                if st.st_size < end:
                    os.ftruncate(self.fd, end)
                self._tensor = mappings.take(self.fd, HEADER_BYTES, end - HEADER_BYTES)
        except BaseException:
            self.close()
            raise

    def pin(self) -> bool:
        """Register the mapping with CUDA (kept registered for the next save of this file), so
        the capture's device copies go straight into it; False if that failed (the pipeline
        then stages this save in the pinned host cache and writes it as any file)."""
        if self._tensor is None:
            return False
        length = self._tensor.numel()
        try:  # registering touches every page: allocate them first (a full tmpfs: no SIGBUS)
            if self._start + length > self._allocated:
                os.posix_fallocate(self.fd, self._start, length)
                self._allocated = self._start + length
        except OSError as exc:
            log.warning(
                "datastates: allocating %d bytes of %s to register its mapping with CUDA "
                "failed (%s); this save goes through the pinned host cache",
                length,
                self.path,
                exc,
            )
            return False
        pinned = self._mappings.take(self.fd, self._start, length, pin=True)
        if pinned is None:
            return False
        self._tensor = pinned
        return True

    def unit_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` of the file at ``offset`` (inside the units' region), as a writable
        uint8 tensor on the mapping, for the capture to fill; counted as written by this save.

        Their pages are allocated first: a page of a shared mapping that the file system cannot
        give (a full tmpfs) is a SIGBUS, which kills the process, on the first write through
        the mapping. Allocated here, a full file system is an OSError (ENOSPC) naming the file,
        and the save fails as a write to disk would."""
        begin = max(offset, self._allocated)
        try:
            if offset + nbytes > begin:
                os.posix_fallocate(self.fd, begin, offset + nbytes - begin)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"allocating the {nbytes} bytes at offset {offset} of "
                f"{self.path} for the capture: {exc.strerror}",
                self.path,
            ) from None
        with self._lock:
            self._written.append((offset, nbytes))
        return self.mapped(offset, nbytes)

    def mapped(self, offset: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` of the file at ``offset`` (inside the units' region, given out by
        :meth:`unit_view` before), as a uint8 tensor on the mapping (to read them)."""
        start = offset - self._start
        assert self._tensor is not None, "mapped() before unit_view()"
        return self._tensor[start : start + nbytes]

    def finish(self, fsync: bool, size: int) -> None:
        self._tensor = None  # the mapping stays kept, for the next save of this file
        super().finish(fsync, size)

    def close(self) -> None:
        self._tensor = None
        super().close()
