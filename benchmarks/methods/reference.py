"""The machine's limit for a checkpoint of the tensor bytes, as a method beside the others.

``ref_copy_direct``: one buffer the size of the state, allocated and touched once in ``setup`` and
reused by every save; ``save()`` copies every tensor into it with ``Tensor.copy_`` (the caller is
blocked for that copy only), then two threads write it with ``O_DIRECT`` (buffered where the file
system refuses it) in 16 MiB requests, ``fsync`` the file and the directory. No format, no
checksums, no Python objects: what any checkpointing method pays at least on this machine.
It does not load (nothing to compare a format-less blob with).
"""

from __future__ import annotations

import mmap
import os
import threading

import torch

from ..common import fsync_path, now
from ..states import TrainState
from .base import Checkpoint, Method, Pending

CHUNK = 16 << 20
ALIGN = 4096


class CopyDirect(Method):
    name = "ref_copy_direct"
    label = "copy into a reused buffer + 2 O_DIRECT writers (the machine's limit)"
    kind = "sync"
    scopes = ("full", "model")
    supports_load = False
    max_in_flight = 1
    held_factor = 1.0
    transient_factor = 0.05
    writers = 2

    def __init__(self, options: dict | None = None):
        super().__init__(options)
        self._map: mmap.mmap | None = None
        self._buf: torch.Tensor | None = None

    def setup(self, root, state: TrainState) -> None:
        super().setup(root, state)
        self.close()
        size = _aligned(
            sum(_aligned(t.numel() * t.element_size(), 64) for t in state.tensors()), CHUNK
        )
        self._map = mmap.mmap(-1, max(size, CHUNK))  # page aligned: O_DIRECT-ready
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        self._buf.fill_(0)  # touched once, reused after

    def save(self, state: TrainState, step: int) -> Pending:
        t0 = now()
        end = 0
        for t in state.tensors():
            n = t.numel() * t.element_size()
            self._buf[end : end + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
            end = _aligned(end + n, 64)
        path = self.root / f"{state.scope}-step-{step:06d}.bin"
        errors: list[BaseException] = []
        worker = threading.Thread(
            target=self._write, args=(path, _aligned(end, ALIGN), errors), name="ref-writer"
        )
        worker.start()

        def commit() -> None:
            worker.join()
            if errors:
                raise errors[0]

        return Pending(t0, Checkpoint(step, [path]), commit_fn=commit)

    def _write(self, path, nbytes: int, errors: list) -> None:
        try:
            direct = getattr(os, "O_DIRECT", 0)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
            except OSError:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            view = memoryview(self._map)
            try:

                def writer(first: int) -> None:
                    try:
                        for off in range(first * CHUNK, nbytes, self.writers * CHUNK):
                            os.pwrite(fd, view[off : min(off + CHUNK, nbytes)], off)
                    except BaseException as e:  # noqa: BLE001 - reported by commit()
                        errors.append(e)

                threads = [threading.Thread(target=writer, args=(i,)) for i in range(self.writers)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                os.fsync(fd)
            finally:
                view.release()
                os.close(fd)
            fsync_path(self.root)
        except BaseException as e:  # noqa: BLE001 - reported by commit()
            errors.append(e)

    def close(self) -> None:
        self._buf = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exported: freed with the last reference
                pass
            self._map = None


def _aligned(n: int, a: int) -> int:
    return (n + a - 1) // a * a
