"""The host cache: one buffer allocated once (pinned on CUDA), cut into slots, reused forever.

Slots give backpressure: ``acquire`` blocks while every slot holds data not yet written. Copies
into a slot run on a dedicated CUDA stream ordered after the compute stream (see ``DeviceCopier``);
on the CPU the same code copies CPU tensors (the training state keeps changing, so a copy is needed).
"""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
import queue
import threading
import time

import torch

from .format import UNIT_ALIGN
from .storage import buffer_of


_SPLIT_BYTES = 8 << 20  # pieces at least this large are copied by two threads


class HostCache:
    """``nslots`` slots of ``slot_bytes`` each, 4096-aligned. Allocated and touched by a background
    thread started in the constructor, so the first save does not pay for page faults."""

    def __init__(self, total_bytes: int, slot_bytes: int, pin: bool):
        self.slot_bytes = slot_bytes
        self.nslots = max(2, total_bytes // slot_bytes)
        self.pinned = pin
        self._free: queue.Queue[int] = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._buffer: torch.Tensor | None = None
        threading.Thread(target=self._allocate, name="datastates-cache-alloc", daemon=True).start()

    def _allocate(self) -> None:
        try:
            total = self.nslots * self.slot_bytes
            raw = torch.empty(total + UNIT_ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
            start = (-raw.data_ptr()) % UNIT_ALIGN
            self._buffer = raw[start:start + total]
            ctypes.memset(self._buffer.data_ptr(), 0, total)  # fault every page in now, once
            for slot in range(self.nslots):
                self._free.put(slot)
        except BaseException as exc:  # reported on the first acquire
            self._error = exc
        finally:
            self._ready.set()

    def acquire(self, cancelled: threading.Event, timeout: float | None = None) -> int:
        """Block until a slot is free; -1 if ``cancelled`` is set meanwhile, -2 after ``timeout``."""
        self._ready.wait()
        if self._error is not None:
            raise MemoryError(f"could not allocate the host cache of "
                              f"{self.nslots * self.slot_bytes} bytes: {self._error}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._free.get(timeout=0.05 if deadline is None else
                                      max(0.0, min(0.05, deadline - time.monotonic())))
            except queue.Empty:
                if cancelled.is_set():
                    return -1
                if deadline is not None and time.monotonic() >= deadline:
                    return -2

    def try_acquire(self) -> int:
        """A free slot, or -1 at once if none is free (or the cache is not allocated yet)."""
        if not self._ready.is_set() or self._error is not None:
            return -1
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return -1

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def tensor(self, slot: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self._buffer[start:start + self.slot_bytes]

    def view(self, slot: int) -> memoryview:
        return buffer_of(self.tensor(slot))

    @property
    def nbytes(self) -> int:
        return self.nslots * self.slot_bytes

    def close(self) -> None:
        self._ready.wait()
        self._buffer = None


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat uint8 tensor (row-major), copying only if non-contiguous."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    t = t.reshape(-1)
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class DeviceCopier:
    """Copies item bytes into cache slots. With CUDA items, copies run on one side stream that
    first waits on an event recorded on the compute stream inside ``save()``."""

    def __init__(self):
        self._stream = None
        self._pool: ThreadPoolExecutor | None = None

    def _helper(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="datastates-copy")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def record_ready(self, tensors) -> object | None:
        """Called in ``save()`` on the training thread: mark the point the copies must follow."""
        devices = {t.device for t in tensors if t.is_cuda}
        if not devices:
            return None
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append((device, event))
        return events

    def begin(self, ready) -> None:
        if ready is None:
            return
        for device, event in ready:
            self._stream_for(device).wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy flat uint8 ``src`` into the cache view ``dst`` (same length)."""
        if src.is_cuda:
            with torch.cuda.stream(self._stream_for(src.device)):
                dst.copy_(src, non_blocking=True)
        elif src.device.type != "cpu":  # other devices (meta raises here): torch's own copy
            dst.copy_(src)
        elif src.numel():
            # Plain memcpy without the GIL: torch's copy_ would start an OpenMP team from this
            # background thread, whose spinning threads collapse (10x) when the training thread
            # keeps the cores busy. Large pieces are split with one helper thread.
            n, d, s = src.numel(), dst.data_ptr(), src.data_ptr()
            if n < _SPLIT_BYTES:
                ctypes.memmove(d, s, n)
                return
            half = n // 2
            helper = self._helper().submit(ctypes.memmove, d + half, s + half, n - half)
            ctypes.memmove(d, s, half)
            helper.result()

    def flat(self, src: torch.Tensor) -> torch.Tensor:
        if src.is_cuda:
            with torch.cuda.stream(self._stream_for(src.device)):
                return flat_bytes(src)
        return flat_bytes(src)

    def fence(self, tensors) -> object | None:
        """An event after every copy issued so far (None when all copies were synchronous)."""
        if self._stream is None or not any(t.is_cuda for t in tensors):
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _stream_for(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream
