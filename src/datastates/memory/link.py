"""Rank 0's connection to the keeper: find it (or start it), attach, notice when it is gone."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time

from ..config import CheckpointConfig
from ..errors import KeeperError, KeeperUnresponsiveError
from . import place
from .options import STORAGE_FIELDS, MemoryTier

log = logging.getLogger("datastates")

_RETRY_S = 0.05
_REPLY_TIMEOUT_S = 30.0


class KeeperLink:
    """An attached trainer's connection to the keeper of its memory directory. A thread reads
    the keeper's answers; when the connection ends the link is ``lost`` (a WARNING says so once)
    and every request raises KeeperError."""

    def __init__(self, sock: socket.socket, memdir: str):
        self.memdir = memdir
        self.keeper_pid: int | None = None
        self.lost = False
        self._sock = sock
        self._replies: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._count = 0
        self._closing = False
        self._reader = threading.Thread(
            target=self._read, name="datastates-keeper-link", daemon=True
        )
        self._reader.start()

    @classmethod
    def open(cls, storage_dir: str, tier: MemoryTier, config: CheckpointConfig) -> "KeeperLink":
        """Attach to the keeper of ``storage_dir``'s memory, starting one if none runs and
        ``tier.spawn`` (KeeperError if none answers within ``tier.start_timeout_s``)."""
        memdir = place.memory_dir(tier.root, storage_dir)
        place.ensure_private_dir(memdir)
        deadline = time.monotonic() + tier.start_timeout_s
        spawned: subprocess.Popen | None = None
        while True:
            sock = _connect(memdir)
            if sock is not None:
                break
            if not place.keeper_running(memdir):
                if not tier.spawn:
                    raise KeeperError(
                        f"no keeper serves the memory of {storage_dir} "
                        f"({memdir}); start one with `datastates keeper "
                        f"{storage_dir}`, or let the trainer start it "
                        "(MemoryTier(spawn=True))"
                    )
                if spawned is None or spawned.poll() is not None:
                    if spawned is not None and spawned.returncode != 0:
                        raise KeeperError(
                            f"the keeper started for {storage_dir} ended with "
                            f"status {spawned.returncode}; its log: "
                            f"{tier.log_path or place.default_log(storage_dir)}"
                        )
                    spawned = spawn(storage_dir, tier, config)
            if time.monotonic() > deadline:
                raise KeeperUnresponsiveError(
                    f"the keeper of {memdir} did not answer within {tier.start_timeout_s:g} s"
                )
            time.sleep(_RETRY_S)
        if spawned is not None:  # reaped when it ends (after this, poll() would not see it)
            threading.Thread(
                target=spawned.wait, name="datastates-keeper-reaper", daemon=True
            ).start()
        link = cls(sock, memdir)
        try:
            reply = link.request(
                {"op": "attach", "pid": os.getpid()}, max(1.0, deadline - time.monotonic())
            )
        except KeeperError:
            link.close(detach=False)  # a keeper that did not answer would not answer that
            raise
        link.keeper_pid = reply.get("pid")
        return link

    def wait_lost(self, timeout: float) -> bool:
        """Wait until the connection has ended (``lost``, or closed); whether it has."""
        self._reader.join(timeout)
        return not self._reader.is_alive()

    def hold(self, timeout: float) -> "threading.Lock":
        """Hold every request back (each waits, as behind a request in progress) until the
        returned lock is released: a pause of the hand-off's writes to storage. TimeoutError if
        a request in progress does not end within ``timeout``."""
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError(
                f"a request to the keeper of {self.memdir} did not end within {timeout:g} s"
            )
        return self._lock

    def request(self, message: dict, timeout: float | None = _REPLY_TIMEOUT_S) -> dict:
        """Send one request and return the keeper's answer; KeeperError if it refuses, is gone
        or does not answer within ``timeout`` (None: as long as it lives; a request in
        progress on another thread counts). Each request carries a number the answer repeats,
        so the late answer of a request that timed out is never taken for another's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise KeeperUnresponsiveError(
                f"the keeper of {self.memdir} did not answer "
                f"{message['op']!r}: still busy with an earlier "
                "request"
            )
        try:
            if self.lost:
                raise KeeperError(f"the keeper of {self.memdir} is gone")
            self._count += 1
            number = self._count
            try:
                self._sock.sendall(json.dumps(dict(message, id=number)).encode() + b"\n")
                while True:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    reply = self._replies.get(timeout=left)
                    if reply is None or reply.get("id") in (number, None):
                        break
            except queue.Empty:
                raise KeeperUnresponsiveError(
                    f"the keeper of {self.memdir} did not answer "
                    f"{message['op']!r} within {timeout:g} s"
                ) from None
            except OSError as exc:
                raise KeeperError(
                    f"the keeper of {self.memdir} did not answer {message['op']!r}: {exc}"
                ) from None
        finally:
            self._lock.release()
        if reply is None:
            raise KeeperError(
                f"the keeper of {self.memdir} ended before answering {message['op']!r}"
            )
        if not reply.get("ok"):
            raise KeeperError(
                f"the keeper of {self.memdir} refused {message['op']!r}: {reply.get('error')}"
            )
        return reply

    def close(self, stop: bool = False, detach: bool = True) -> None:
        """Detach (``stop``: and end the keeper now; ``detach`` False: only close the
        connection, which the keeper takes for a trainer that ended); idempotent, never
        raises."""
        if self._closing:
            return
        self._closing = True
        if not self.lost and detach:
            try:
                self.request({"op": "stop" if stop else "detach"}, 10.0)
            except KeeperError as exc:
                log.warning("datastates: detaching from the memory keeper failed: %s", exc)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=10.0)
        self._sock.close()

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    self._replies.put(json.loads(line))
                except ValueError:
                    self._replies.put({"ok": False, "error": f"bad answer {line[:200]!r}"})
        self.lost = True
        self._replies.put(None)
        if not self._closing:
            log.warning(
                "datastates: the memory keeper (pid %s) of %s is gone: training goes on "
                "and saves due for storage still go there, but memory checkpoints are no "
                "longer written to storage if this trainer dies",
                self.keeper_pid,
                self.memdir,
            )


def _connect(memdir: str) -> socket.socket | None:
    """A connection to the keeper of ``memdir``, or None when nothing listens yet. The abstract
    namespace has no permissions: a listener of another uid is refused (KeeperError)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(place.socket_address(memdir))
    except OSError:
        sock.close()
        return None
    uid = place.peer_uid(sock)
    if uid != os.getuid():
        sock.close()
        raise KeeperError(
            f"the keeper's socket of {memdir} is held by uid {uid}, not by this "
            f"user ({os.getuid()}); refusing to attach"
        )
    return sock


def spawn(storage_dir: str, tier: MemoryTier, config: CheckpointConfig) -> subprocess.Popen:
    """Start ``python -m datastates keeper`` for ``storage_dir`` in a session of its own (the
    launcher's signals to the trainer's process group do not reach it), with no GPU visible
    and its output in its log."""
    log_path = tier.log_path or place.default_log(storage_dir)
    options = dataclasses.asdict(tier)
    storage = {f: getattr(config, f) for f in STORAGE_FIELDS}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "datastates",
                "keeper",
                os.path.abspath(storage_dir),
                "--options",
                json.dumps(options),
                "--storage-config",
                json.dumps(storage),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            close_fds=True,
            start_new_session=True,
            env=env,
            cwd="/",
        )
    log.info(
        "datastates: started the memory keeper (pid %d) for %s; log: %s",
        proc.pid,
        storage_dir,
        log_path,
    )
    return proc
