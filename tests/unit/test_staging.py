"""DeviceCopier bookkeeping: one side stream and one fence per CUDA device (no GPU needed: the
CUDA calls go through an injected fake that records them)."""

from __future__ import annotations

import contextlib

import torch

from datastates.save.staging import DeviceCopier


class FakeStream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_event(self, event):
        self.waited.append(event)


class FakeEvent:
    def __init__(self, log):
        self.log, self.stream = log, None

    def record(self, stream):
        self.stream = stream

    def synchronize(self):
        self.log.append(("sync", self.stream.name))


class FakeCuda:
    """Records what the copier asks of CUDA; ``current`` is the stream a copy would run on."""

    def __init__(self):
        self.created, self.log, self.current = [], [], None
        self.compute = {}

    def stream(self, device):
        s = FakeStream(f"side:{device.index}")
        self.created.append(s)
        return s

    def event(self):
        return FakeEvent(self.log)

    def current_stream(self, device):
        return self.compute.setdefault(device, FakeStream(f"compute:{device.index}"))

    @contextlib.contextmanager
    def use(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


class FakeCudaTensor:
    is_cuda = True

    def __init__(self, index):
        self.device = torch.device("cuda", index)


class RecordingDst:
    def __init__(self, cuda):
        self.cuda, self.streams = cuda, []

    def copy_(self, src, non_blocking=False):
        assert non_blocking
        self.streams.append(self.cuda.current.name)


def test_one_side_stream_and_one_fence_per_device():
    cuda = FakeCuda()
    copier = DeviceCopier(cuda)
    t0, t1 = FakeCudaTensor(0), FakeCudaTensor(1)
    ready = copier.record_ready([t1, t0, torch.zeros(2)])
    assert [(d.index, e.stream.name) for d, e in ready] == [(0, "compute:0"), (1, "compute:1")]

    copier.begin(ready)
    side = {s.name: s for s in cuda.created}
    assert sorted(side) == ["side:0", "side:1"]
    assert side["side:0"].waited == [ready[0][1]] and side["side:1"].waited == [ready[1][1]]

    dst = RecordingDst(cuda)
    copier.copy(dst, t1)
    copier.copy(dst, t0)
    copier.copy(dst, t1)
    assert dst.streams == ["side:1", "side:0", "side:1"]  # each copy on its own device's stream

    fence = copier.fence()
    assert sorted(e.stream.name for e in fence.events) == ["side:0", "side:1"]
    fence.synchronize()
    assert sorted(cuda.log) == [("sync", "side:0"), ("sync", "side:1")]
    assert copier.fence() is None  # nothing issued since

    copier.copy(dst, t1)  # a later unit only from cuda:1: fenced on cuda:1 only
    assert [e.stream.name for e in copier.fence().events] == ["side:1"]
    assert len(cuda.created) == 2  # streams are created once per device and reused


def test_cpu_only_needs_no_cuda():
    class NoCuda:
        def __getattr__(self, name):
            raise AssertionError(f"CUDA call {name} on a CPU-only save")

    copier = DeviceCopier(NoCuda())
    src = torch.arange(20_000_000 // 4, dtype=torch.float32)  # above the two-thread split
    dst = torch.empty(src.numel() * 4, dtype=torch.uint8)
    assert copier.record_ready([src]) is None
    copier.begin(None)
    copier.copy(dst, copier.flat(src))
    assert copier.fence() is None
    assert torch.equal(dst.view(torch.float32), src)
    copier.close()


def test_cpu_copies_of_any_size_share_two_threads_and_land_by_the_fence():
    """Many pieces, small and large, below and above the split: the bytes are cut between the
    capture thread and the helper anywhere (inside a piece too); every byte lands by the fence,
    nothing is written outside the destinations, and cancel() forgets what was not run."""
    from datastates.save import staging

    gen = torch.Generator().manual_seed(0)
    sizes = [1, 4095, 4 << 20, 3, 9 << 20, 0, 4 << 20, 12345, 4 << 20]
    total = sum(sizes)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(total + 2, dtype=torch.uint8)  # one guard byte on each side
    copier = DeviceCopier()
    pos = 0
    for n in sizes:
        copier.copy(dst[1 + pos : 1 + pos + n], src[pos : pos + n])
        pos += n
    assert total >= staging._SPLIT_BYTES
    assert torch.count_nonzero(dst) == 0  # nothing runs before the fence
    assert copier.fence() is None
    assert torch.equal(dst[1:-1], src)
    assert dst[0] == 0 and dst[-1] == 0

    small = torch.full((100,), 7, dtype=torch.uint8)
    target = torch.zeros(100, dtype=torch.uint8)
    copier.copy(target, small)
    copier.cancel()
    copier.fence()
    assert torch.count_nonzero(target) == 0
    copier.close()
