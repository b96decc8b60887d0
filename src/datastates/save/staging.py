"""The host cache: one buffer allocated once (pinned on CUDA), cut into slots, reused forever.

Slots give backpressure: ``acquire`` blocks while every slot holds data not yet written. Copies
into a slot run on a side CUDA stream per device, ordered after that device's compute stream
(see ``DeviceCopier``);
on the CPU the same code copies CPU tensors (the training state keeps changing, so a copy is needed).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
import queue
import threading
import time

import torch

from ..format.codec import UNIT_ALIGN, tensor_bytes
from ..storage.posix import buffer_of


_SPLIT_BYTES = 8 << 20  # a fence with at least this many CPU bytes to copy uses two threads


class HostCache:
    """Slots of ``slot_bytes`` each, 4096-aligned, allocated once and reused by every save.

    Nothing is allocated until the first save calls :meth:`reserve` with its size: the cache is
    then sized to that state plus one slot, at most ``limit_bytes`` (and at least two slots), and
    allocated and touched by a background thread. A Checkpointer that only restores or lists
    allocates nothing; a later, larger state streams through the cache with backpressure."""

    def __init__(self, limit_bytes: int, slot_bytes: int, pin: bool):
        self.limit_bytes = limit_bytes
        self.slot_bytes = slot_bytes
        self.nslots = 0
        self.pinned = pin
        self._free: queue.Queue[int] = queue.Queue()
        self._ready = threading.Event()
        self._started = False
        self._start_lock = threading.Lock()
        self._error: BaseException | None = None
        self._buffer: torch.Tensor | None = None

    def reserve(self, needed_bytes: int) -> None:
        """Size and start allocating the cache for a first save of ``needed_bytes`` (training
        thread, inside ``save()``; later calls do nothing)."""
        with self._start_lock:
            if self._started:
                return
            self._started = True
            wanted = -(-needed_bytes // self.slot_bytes) + 1
            self.nslots = max(2, min(self.limit_bytes // self.slot_bytes, wanted))
        threading.Thread(target=self._allocate, name="datastates-cache-alloc", daemon=True).start()

    def _allocate(self) -> None:
        try:
            total = self.nslots * self.slot_bytes
            raw = torch.empty(total + UNIT_ALIGN, dtype=torch.uint8, pin_memory=self.pinned)
            start = (-raw.data_ptr()) % UNIT_ALIGN
            self._buffer = raw[start : start + total]
            ctypes.memset(self._buffer.data_ptr(), 0, total)  # fault every page in now, once
            for slot in range(self.nslots):
                self._free.put(slot)
        except BaseException as exc:  # reported on the first acquire
            self._error = exc
        finally:
            self._ready.set()

    def acquire(self, cancelled: threading.Event, timeout: float | None = None) -> int | None:
        """Block until a slot is free and return it; None if ``cancelled`` is set meanwhile or
        ``timeout`` passes first (``cancelled.is_set()`` tells which)."""
        self.reserve(self.limit_bytes)  # normally done by the first save already
        self._ready.wait()
        if self._error is not None:
            raise MemoryError(
                f"could not allocate the host cache of "
                f"{self.nslots * self.slot_bytes} bytes: {self._error}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._free.get(
                    timeout=0.05
                    if deadline is None
                    else max(0.0, min(0.05, deadline - time.monotonic()))
                )
            except queue.Empty:
                if cancelled.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    return None

    def try_acquire(self) -> int | None:
        """A free slot, or None at once if none is free (or the cache is not allocated yet)."""
        if not self._ready.is_set() or self._error is not None:
            return None
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def tensor(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` of the cache, once it is allocated (a slot is acquired only then);
        RuntimeError after :meth:`close`."""
        buffer = self._buffer
        if buffer is None:
            raise RuntimeError("the host cache is not allocated (it was closed)")
        start = slot * self.slot_bytes
        return buffer[start : start + self.slot_bytes]

    def view(self, slot: int) -> memoryview:
        return buffer_of(self.tensor(slot))

    @property
    def nbytes(self) -> int:
        return self.nslots * self.slot_bytes

    def close(self) -> None:
        if self._started:
            self._ready.wait()
        self._buffer = None


class CudaStreams:
    """The few CUDA calls the copier makes, in one place (a test substitutes a fake)."""

    def stream(self, device: torch.device):
        return torch.cuda.Stream(device=device)

    def event(self):
        return torch.cuda.Event()

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def use(self, stream):
        """Context manager making ``stream`` current (on its own device)."""
        return torch.cuda.stream(stream)


class Fence:
    """Events recorded on the side streams of every device with copies in flight."""

    __slots__ = ("events",)

    def __init__(self, events: list):
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


def _memmove_all(copies: list[tuple[int, int, int]]) -> None:
    for d, s, n in copies:
        ctypes.memmove(d, s, n)


def zero_bytes(address: int, nbytes: int) -> None:
    """Zero ``nbytes`` of host memory at ``address`` (a cache slot's padding), now."""
    ctypes.memset(address, 0, nbytes)


class DeviceCopier:
    """Copies item bytes into cache slots.

    CUDA: one side stream per device, created on first use and reused. In ``save()`` (training
    thread) ``record_ready`` records an event on the current stream of every device holding a
    tensor to capture; ``begin`` (capture thread) makes each device's side stream wait for its
    event, so no kernel in flight is raced. A copy from ``cuda:i`` runs on ``cuda:i``'s side
    stream, and ``fence`` records one event per device that had copies since the last fence: the
    slot is handed to a writer only after all of them completed.

    CPU: copies are collected and run at the fence, by this thread and one helper sharing the
    bytes evenly, so pieces of any size (a state dict of 4 MiB matrices) copy on two cores.
    """

    def __init__(self, cuda: CudaStreams | None = None):
        self._cuda = cuda or CudaStreams()
        self._streams: dict[torch.device, object] = {}
        self._dirty: set[torch.device] = set()  # devices with copies issued since the last fence
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[int, int, int]] = []  # CPU copies (dst, src, bytes) not run yet
        self._pending_bytes = 0

    def _helper(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="datastates-copy")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def record_ready(self, tensors) -> list | None:
        """Called in ``save()`` on the training thread: mark, per device, the point the copies
        must follow. None when no tensor is on a CUDA device."""
        devices = {t.device for t in tensors if t.is_cuda}
        if not devices:
            return None
        events = []
        for device in sorted(devices, key=lambda d: d.index or 0):
            event = self._cuda.event()
            event.record(self._cuda.current_stream(device))
            events.append((device, event))
        return events

    def begin(self, ready) -> None:
        """Capture thread, before a job's first copy: order each device's side stream after its
        compute stream."""
        for device, event in ready or ():
            self._stream_for(device).wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy flat uint8 ``src`` into the cache view ``dst`` (same length). The copy is done
        when the next :meth:`fence` returns (a CPU copy runs only then): the caller keeps ``src``
        and ``dst`` alive, and ``src`` unchanged, until that fence."""
        if src.is_cuda:
            with self._cuda.use(self._stream_for(src.device)):
                dst.copy_(src, non_blocking=True)
            self._dirty.add(src.device)
        elif src.device.type != "cpu":  # other devices (meta raises here): torch's own copy
            dst.copy_(src)
        elif src.numel():
            # Plain memcpy without the GIL, at the next fence: torch's copy_ would start an
            # OpenMP team from this background thread, whose spinning threads collapse (10x) when
            # the training thread keeps the cores busy.
            self._pending.append((dst.data_ptr(), src.data_ptr(), src.numel()))
            self._pending_bytes += src.numel()

    def copy_addresses(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy, for each (``dst``, ``src``, ``nbytes``), the bytes at the CPU address ``src``
        (a ``plain_cpu`` tensor's) to the cache address ``dst``, at the next :meth:`fence`, as
        :meth:`copy` does: the caller keeps both alive, and ``src`` unchanged, until then. A
        copy continuing the previous one on both sides extends it (views of one buffer, laid
        out back to back, are copied at once)."""
        pending = self._pending
        for dst, src, nbytes in copies:
            if pending:
                d, s, n = pending[-1]
                if d + n == dst and s + n == src:
                    pending[-1] = (d, s, n + nbytes)
                    self._pending_bytes += nbytes
                    continue
            pending.append((dst, src, nbytes))
            self._pending_bytes += nbytes

    def cancel(self) -> None:
        """Forget the CPU copies not run yet (the capture of their unit failed)."""
        self._pending, self._pending_bytes = [], 0

    def _flush(self) -> None:
        """Run the CPU copies issued since the last fence: in this thread, and, from
        ``_SPLIT_BYTES`` on, half of the bytes (cut anywhere, pieces of any size) in a helper."""
        pending, total = self._pending, self._pending_bytes
        if not pending:
            return
        self._pending, self._pending_bytes = [], 0
        if total < _SPLIT_BYTES:
            _memmove_all(pending)
            return
        mine, theirs, budget = [], [], total // 2
        for d, s, n in pending:
            take = min(n, budget)
            if take:
                mine.append((d, s, take))
                budget -= take
            if take < n:
                theirs.append((d + take, s + take, n - take))
        helper = self._helper().submit(_memmove_all, theirs)
        try:
            _memmove_all(mine)
        finally:
            helper.result()

    def flat(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` as flat bytes; a non-contiguous CUDA tensor is compacted on its side stream."""
        if src.is_cuda:
            with self._cuda.use(self._stream_for(src.device)):
                return tensor_bytes(src)
        return tensor_bytes(src)

    def fence(self) -> Fence | None:
        """Events after every copy issued so far, one per device that had copies since the last
        fence (None when all copies were synchronous). The CPU copies issued since the last fence
        are done when it returns."""
        self._flush()
        if not self._dirty:
            return None
        events = []
        for device in sorted(self._dirty, key=lambda d: d.index or 0):
            event = self._cuda.event()
            event.record(self._streams[device])
            events.append(event)
        self._dirty.clear()
        return Fence(events)

    def _stream_for(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self._cuda.stream(device)
        return stream
