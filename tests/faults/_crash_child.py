"""Child process of the crash tests (run as a script, never collected by pytest).

    python _crash_child.py DIR MODE N KEEP_LAST

It commits step 1 of ``make_state(1)``, then installs the kill point MODE/N (see ``_install``) and
saves the second checkpoint: step 2 of ``make_state(2)``, or, with MODE ``overwrite-*``, step 1
again with ``make_state(2)`` and ``overwrite=True``. At the kill point the process sends itself
SIGKILL, so nothing after it runs: no ``finally``, no ``atexit``, no flush. Reaching the end means
the kill point was never hit; the parent tells by the exit status.

Markers on stdout (one per line, flushed): ``COMMITTED 1`` after the first checkpoint,
``SAVING`` once the second ``save()`` returned, ``PAUSED`` when a ``gate`` kill point blocks (the
parent then kills it from outside), ``COMMITTED 2`` at the end.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

# The big state is 6 MiB of tensors (97 data writes of 64 KiB units); the small one ~4 MiB.
BIG_FLOATS = 3 << 19
SMALL_FLOATS = 1 << 20


def make_state(seed: int, big: bool = True) -> dict:
    """A deterministic state: the same seed gives the same bytes in every process."""
    g = torch.Generator().manual_seed(seed)
    n = BIG_FLOATS if big else SMALL_FLOATS
    return {
        "model": {
            "w": torch.randn(n, generator=g),
            "b": torch.randn(257, 3, generator=g).to(torch.float64),
        },
        "ints": torch.randint(-1000, 1000, (4097,), generator=g, dtype=torch.int64),
        # A dict with a tuple key is not JSON: an object blob, written by the commit thread.
        "extra": {(seed, "seed"): [seed, seed * 2], (0, "n"): n},
        "step": seed,
    }


def config(keep_last: int | None):
    import datastates

    # A small host cache: the state streams through 64 KiB units (about a hundred writes, with
    # backpressure), so there are many points at which to die.
    return datastates.CheckpointConfig(
        host_cache_bytes=256 << 10, chunk_bytes=64 << 10, keep_last=keep_last, writer_threads=2
    )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def marker(text: str) -> None:
    """One line on stdout in one write(2): markers come from several threads, and sys.stdout
    (a TextIOWrapper) may lose a line written concurrently from two threads."""
    os.write(1, (text + "\n").encode())


def _install(mode: str, n: int) -> None:
    """Arrange for SIGKILL at the n-th (1-based) occurrence of the event named by ``mode``.

    - ``pwrite``: before the n-th data write of the shard (any thread; ``storage.pwrite_all``);
    - ``torn``: in the n-th write, after only its first half reached the file;
    - ``commitwrite``: before the n-th write of the commit thread (1 object blob, 2 index,
      3 header, 4 manifest.json.tmp, 5 latest.tmp);
    - ``fsync``: before the n-th ``os.fsync`` (1 the shard file, 2 manifest.json.tmp, 3 the
      checkpoint directory, 4 the root after the rename...);
    - ``ftruncate``: before the shard file is cut to size;
    - ``rename-before`` / ``rename-after``: before / right after the n-th ``os.rename``
      (1: .tmp -> final; with keep_last 1, 2: step 1 -> .trash; when overwriting, 1: old -> .old
      and 2: .tmp -> final);
    - ``replace-latest``: before ``latest.tmp`` is renamed over ``latest``;
    - ``set-latest``: before ``commit.set_latest`` (the checkpoint is renamed into place);
    - ``claim``: the new ``.tmp`` directory made, before its shard file is opened;
    - ``gate``: at the n-th data write, print ``PAUSED`` and block until killed from outside;
    - ``fill``: in the capture of the n-th unit, once half of its bytes reached their place (the
      cache slot, or the shard file itself when the memory tier captures in place);
    - ``none`` / ``external``: no kill point.
    """
    import datastates.commit.review
    import datastates.storage.posix

    count = [0]
    lock = threading.Lock()

    def hit() -> bool:
        with lock:
            count[0] += 1
            return count[0] == n

    real_pwrite = datastates.storage.posix.pwrite_all
    if mode in ("pwrite", "torn", "commitwrite", "gate"):

        def pwrite_all(fd, data, offset):
            if mode == "commitwrite" and threading.current_thread().name != "datastates-commit":
                return real_pwrite(fd, data, offset)
            if hit():
                if mode == "torn":
                    view = memoryview(data).cast("B")
                    try:  # half of a 64 KiB unit is still aligned for O_DIRECT
                        os.pwrite(fd, view[: max(1, view.nbytes // 2)], offset)
                        os.fsync(fd)
                    except OSError:
                        pass
                elif mode == "gate":
                    marker("PAUSED")
                    threading.Event().wait()  # until the parent's SIGKILL
                _die()
            return real_pwrite(fd, data, offset)

        datastates.storage.posix.pwrite_all = pwrite_all
    elif mode == "fsync":
        real_fsync = os.fsync

        def fsync(fd):
            if hit():
                _die()
            return real_fsync(fd)

        os.fsync = fsync
    elif mode == "ftruncate":
        real_ftruncate = os.ftruncate

        def ftruncate(fd, size):
            if hit():
                _die()
            return real_ftruncate(fd, size)

        os.ftruncate = ftruncate
    elif mode in ("rename-before", "rename-after"):
        real_rename, real_exchange = os.rename, datastates.storage.posix.exchange

        def renaming(real):  # an exchange of two names (an overwrite) counts as a rename
            def rename(src, dst, *a, **k):
                if mode == "rename-before" and hit():
                    _die()
                done = real(src, dst, *a, **k)
                if mode == "rename-after" and hit():
                    _die()
                return done

            return rename

        os.rename = renaming(real_rename)
        datastates.storage.posix.exchange = renaming(real_exchange)
    elif mode == "replace-latest":
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            if os.path.basename(os.fspath(dst)) == "latest" and hit():
                _die()
            return real_replace(src, dst, *a, **k)

        os.replace = replace
    elif mode == "set-latest":
        publisher = datastates.commit.publish.RenamePublisher  # what a local root commits with
        real_write_latest = publisher.write_latest

        def write_latest(self, *a, **k):
            if hit():
                _die()
            return real_write_latest(self, *a, **k)

        publisher.write_latest = write_latest
    elif mode == "claim":
        real_writer = datastates.storage.posix.ShardWriter  # what the local store opens

        def shard_writer(*a, **k):
            if hit():
                _die()
            return real_writer(*a, **k)

        datastates.storage.posix.ShardWriter = shard_writer
    elif mode == "fill":
        import datastates.save.pipeline as pipeline

        real_fill = pipeline.Pipeline._fill

        def fill(self, job, unit, dst, *a, **k):
            if not hit():
                return real_fill(self, job, unit, dst, *a, **k)
            real_fill(self, job, unit, dst, *a, **k)
            half = dst.numel() // 2
            dst[half:].fill_(0xA5)  # the second half not copied yet: stale bytes
            _die()

        pipeline.Pipeline._fill = fill
    elif mode not in ("none", "external"):
        raise SystemExit(f"unknown mode {mode!r}")


def main() -> None:
    import datastates

    directory, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    keep_last = int(sys.argv[4]) or None
    overwrite = mode.startswith("overwrite-")
    if overwrite:
        mode = mode[len("overwrite-") :]
    if mode.startswith("split-"):  # every manifest split into a head and a part
        from datastates.format import codec

        codec.SPLIT_BYTES = 1
        mode = mode[len("split-") :]
    ck = datastates.Checkpointer(directory, config(keep_last))
    ck.save(make_state(1), step=1).wait()
    marker("COMMITTED 1")
    _install(mode, n)
    second = make_state(2)
    handle = ck.save(second, step=1 if overwrite else 2, overwrite=overwrite)
    marker("SAVING")
    handle.wait()
    ck.close()
    marker("COMMITTED 2")


if __name__ == "__main__":
    main()
