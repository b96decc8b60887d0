"""The keeper: one process per node that owns a job's memory tier and outlives its trainers.

It holds the memory directory's lock for its whole life (``place.py``), listens on its socket
for the trainer's rank 0 and serves, one request at a time, JSON lines:

- ``{"op": "attach", "pid": P}``: a trainer starts using the memory (answered once any write to
  storage in progress is done, so a restarted trainer never lists storage while the keeper
  commits into it); refused while another trainer is attached (one trainer per job's memory:
  two would recycle each other's shard files);
- ``{"op": "detach"}``: it stops (``Checkpointer.close()``); ``{"op": "stop"}`` as well, and the
  keeper then ends at once;
- ``{"op": "persist", "name": N, "overwrite": B}``: the attached trainer hands on its memory
  checkpoint ``N``, due for storage (``handoff.py``): written there now, answered when committed
  (the trainer commits nothing to storage meanwhile); a checkpoint ``N`` in storage is replaced
  only if ``B``, else the answer is an error (CheckpointExistsError);
- ``{"op": "persist"}``: write the newest memory checkpoint to storage now (``persist.py``),
  refused while a trainer is attached (its own saves to storage would race the commit);
- ``{"op": "status"}``: pid, trainers attached, memory checkpoints.

A connection of an attached trainer that closes without ``detach`` is a dead trainer. When the
last attached trainer is gone (dead or detached), the keeper checks every byte of the newest
memory checkpoint and marks it checked (``marks.py``: the restarted trainer's restore then copies
it without checksumming again), writes it to storage if storage lacks that step
(``persist_on_exit``), then waits ``idle_timeout_s`` for a
trainer to attach again. SIGTERM or SIGINT: it waits up to ``grace_s`` for attached trainers to
detach, persists the same way, and ends. Ending, it removes the memory directory (the memory
checkpoints, their marks, the spare shard files, the lock) and nothing else; if a trainer is
still attached (the grace ran out), it leaves the directory to that trainer, whose ``close()``
persists and removes it. It imports no CUDA state: it only copies files.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import time

from ..commit.publish import publisher_for
from ..commit.round import new_run_id
from ..config import CheckpointConfig
from ..storage import LOCAL
from ..errors import KeeperError
from ..storage.posix import remove_tree
from . import marks, nodes, place
from .options import MemoryTier
from .persist import persist_newest
from .recycle import SPARE

log = logging.getLogger("datastates")

_MAX_LINE = 1 << 16


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""
        self.pid: int | None = None  # set by attach
        self.detached = False
        self.request_id = None  # of the request being answered


class Keeper:
    """Serve one job's memory tier until it is stopped or idle (``run``)."""

    def __init__(self, storage_dir: str, tier: MemoryTier, config: CheckpointConfig):
        self.storage = os.path.abspath(storage_dir)
        self.tier, self.config = tier, config
        self.memdir = place.memory_dir(tier.root, self.storage)
        self.ckpt = os.path.join(self.memdir, place.CKPT)
        self.run_id = new_run_id()
        self._conns: dict[int, _Conn] = {}
        self._stopping = False
        self._term_at: float | None = None
        self._idle_since: float | None = time.monotonic()
        self._sel = selectors.DefaultSelector()

    # ------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Serve until stopped or idle; 0 also when another keeper already serves this job."""
        place.ensure_private_dir(self.memdir)
        lock = place.open_lock(self.memdir)
        if not place.take_lock(lock):
            log.info("keeper: another keeper serves %s; exiting", self.memdir)
            os.close(lock)
            return 0
        log.info("keeper %d: serving %s for %s", os.getpid(), self.memdir, self.storage)
        if os.path.isdir(self.ckpt):  # what a trainer that died mid-save left
            publisher_for(LOCAL).clean_stale(self.ckpt, self.config.stale_tmp_age_s)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(place.socket_address(self.memdir))
            server.listen(16)
            self._sel.register(server, selectors.EVENT_READ, "accept")
            self._sel.register(wake_r, selectors.EVENT_READ, "signal")
            previous = {
                s: signal.signal(s, lambda *_: _wake(wake_w))
                for s in (signal.SIGTERM, signal.SIGINT)
            }
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the trainer's terminal closing
            try:
                self._serve(server, wake_r)
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)
            self._finish()
        finally:
            server.close()
            for conn in self._conns.values():
                conn.sock.close()
            os.close(wake_r)
            os.close(wake_w)
            self._sel.close()
            os.close(lock)  # after the memory is removed: a new keeper never sees it half gone
        return 0

    def _serve(self, server: socket.socket, wake_r: int) -> None:
        while not self._stopping:
            for key, _ in self._sel.select(self._timeout()):
                if key.data == "accept":
                    self._accept(server)
                elif key.data == "signal":
                    os.read(wake_r, 64)
                    if self._term_at is None:
                        log.info(
                            "keeper: SIGTERM/SIGINT; waiting up to %.0f s for %d trainer(s)"
                            " to detach",
                            self.tier.grace_s,
                            self._attached(),
                        )
                        self._term_at = time.monotonic()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if self._term_at is not None and (
                not self._attached() or now - self._term_at >= self.tier.grace_s
            ):
                self._stopping = True
            if (
                self._idle_since is not None
                and not self._attached()
                and now - self._idle_since >= self.tier.idle_timeout_s
            ):
                log.info("keeper: no trainer for %.0f s; ending", self.tier.idle_timeout_s)
                self._stopping = True

    def _timeout(self) -> float:
        waits = [self.tier.idle_timeout_s]
        if self._idle_since is not None:
            waits.append(self.tier.idle_timeout_s - (time.monotonic() - self._idle_since))
        if self._term_at is not None:
            waits.append(self.tier.grace_s - (time.monotonic() - self._term_at))
        return max(0.0, min(waits))

    def _finish(self) -> None:
        if self.tier.persist_on_exit and not self._persist("ending")["ok"]:
            log.error(
                "keeper %d: the memory in %s is kept (storage lacks its newest step); a "
                "trainer or keeper started for %s writes it there",
                os.getpid(),
                self.memdir,
                self.storage,
            )
            return
        if self._attached():  # the grace ran out: a trainer still saves into the memory
            log.warning(
                "keeper %d: ending with %d trainer(s) attached; the memory directory is "
                "left to them (their close() writes it to storage and removes it)",
                os.getpid(),
                self._attached(),
            )
            return
        self._remove_memory()
        log.info("keeper %d: memory removed, exiting", os.getpid())

    def _remove_memory(self) -> list[str]:
        """Remove what a keeper and its trainers write into the memory directory (the memory
        checkpoints, the spare shard files, the marks, the record of ranks, the lock), then the
        directory if nothing else is left in it; the paths removed. Called holding the lock."""
        removed = []
        for name in (place.CKPT, SPARE, marks.MARKS, nodes.NODE_FILE, place.LOCK):
            path = os.path.join(self.memdir, name)
            if not os.path.lexists(path):
                continue
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    remove_tree(path)
                else:
                    os.unlink(path)
                removed.append(path)
            except OSError as exc:
                log.warning("keeper: could not remove %s: %s", path, exc)
        try:
            os.rmdir(self.memdir)
            removed.append(self.memdir)
        except OSError as exc:
            log.warning(
                "keeper: the memory directory %s is left (%s): it holds %s, which no keeper wrote",
                self.memdir,
                exc.strerror or exc,
                sorted(os.listdir(self.memdir)) if os.path.isdir(self.memdir) else [],
            )
        return removed

    def remove_left(self) -> dict:
        """``datastates keeper DIR --stop`` when no keeper serves the memory directory: what a
        keeper that was killed (SIGKILL) left. Under the keeper's lock (no keeper starts
        meanwhile): the newest memory checkpoint is written to storage first, as a keeper
        ending writes it (``persist_on_exit``), then the memory is removed as a keeper ending
        removes it (``_remove_memory``). KeeperError, nothing removed, when the directory is
        not this user's private one, a keeper holds the lock, a process still maps its files
        (a trainer whose keeper died: its ``close()`` writes and removes it), or the write to
        storage fails. Returns ``{"ok", "memory", "persisted", "removed"}``."""
        place.check_private_dir(self.memdir)
        had_lock = os.path.lexists(os.path.join(self.memdir, place.LOCK))
        lock = place.open_lock(self.memdir)
        try:
            if not place.take_lock(lock):
                raise KeeperError(
                    f"a keeper holds the lock of {self.memdir} but does not "
                    "answer (stopped or hung); nothing removed"
                )
            users = place.mapped_by(self.memdir)
            if users:
                raise KeeperError(
                    f"process(es) {users} map files of {self.memdir} (a trainer "
                    "whose keeper is gone: its close() writes the memory to "
                    "storage and removes it); nothing removed"
                )
            persisted = None
            if self.tier.persist_on_exit:
                reply = self._persist("stopped without a keeper")
                if not reply["ok"]:
                    raise KeeperError(
                        f"the newest memory checkpoint of {self.memdir} could not "
                        f"be written to {self.storage} ({reply['error']}); the "
                        "memory is kept, nothing removed"
                    )
                persisted = reply["persisted"]
            removed = [
                p
                for p in self._remove_memory()
                if had_lock or p != os.path.join(self.memdir, place.LOCK)
            ]
        finally:
            os.close(lock)
        log.info("keeper: memory of %s removed without a keeper: %s", self.storage, removed)
        return {"ok": True, "memory": self.memdir, "persisted": persisted, "removed": removed}

    # ------------------------------------------------------------ connections
    def _attached(self) -> int:
        return sum(1 for c in self._conns.values() if c.pid is not None and not c.detached)

    def _other_trainer(self, asking: _Conn) -> int | None:
        """The pid of a trainer other than ``asking`` that is attached, or None. A connection
        already closed by its end (a trainer that died, whose end of file waits in the same
        round of events) is handled as gone first."""
        for conn in list(self._conns.values()):
            if conn is asking or conn.pid is None or conn.detached:
                continue
            try:
                closed = conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                self._gone(conn)
            else:
                return conn.pid
        return None

    def _accept(self, server: socket.socket) -> None:
        sock, _ = server.accept()
        uid = place.peer_uid(sock)
        if uid != os.getuid():
            log.warning("keeper: refused a connection of uid %d", uid)
            sock.close()
            return
        self._conns[sock.fileno()] = _Conn(sock)
        self._sel.register(sock, selectors.EVENT_READ, self._conns[sock.fileno()])

    def _read(self, conn: _Conn) -> None:
        if self._conns.get(conn.sock.fileno()) is not conn:  # gone earlier in this round
            return
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._gone(conn)
            return
        conn.buffer += data
        while b"\n" in conn.buffer:
            line, conn.buffer = conn.buffer.split(b"\n", 1)
            self._answer(conn, line)
        if len(conn.buffer) > _MAX_LINE:
            log.warning("keeper: a request over %d bytes; closing that connection", _MAX_LINE)
            self._gone(conn)

    def _gone(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        del self._conns[conn.sock.fileno()]
        conn.sock.close()
        if conn.pid is not None and not conn.detached:
            log.warning("keeper: trainer %d ended without detaching", conn.pid)
            self._last_left("trainer %d died" % conn.pid)

    def _last_left(self, why: str) -> None:
        if self._attached():
            return
        # While the trainer restarts: check the newest memory checkpoint once, so its restore
        # copies without checksumming again (marks.py), and the copy to storage need not either.
        checked = marks.verify_newest(self.memdir, self.ckpt, self.storage)
        if checked is not None:
            log.info("keeper (%s): %s checked", why, checked.name)
        if self.tier.persist_on_exit:
            self._persist(why)
        self._idle_since = time.monotonic()

    def _answer(self, conn: _Conn, line: bytes) -> None:
        conn.request_id = None
        try:
            request = json.loads(line)
            op = request["op"]
        except (ValueError, KeyError, TypeError):
            self._send(conn, {"ok": False, "error": f"not a request: {line[:200]!r}"})
            return
        conn.request_id = request.get("id")  # repeated in the answer (link.py)
        if op == "attach":
            if self._term_at is not None:
                self._send(conn, {"ok": False, "error": "the keeper is ending (SIGTERM)"})
                return
            other = self._other_trainer(conn)
            if other is not None:  # two trainers would recycle each other's shard files
                self._send(
                    conn,
                    {
                        "ok": False,
                        "error": (
                            f"trainer pid {other} is attached to {self.memdir} and still runs; a "
                            "second trainer of the job (pid "
                            f"{int(request.get('pid', 0))}) is refused: end pid {other} first (its "
                            "close() detaches; if it died, the keeper notices at once)"
                        ),
                    },
                )
                log.warning(
                    "keeper: refused trainer %s: trainer %d is attached", request.get("pid"), other
                )
                return
            conn.pid, conn.detached = int(request.get("pid", 0)), False
            self._idle_since = None
            log.info("keeper: trainer %d attached", conn.pid)
            self._send(conn, {"ok": True, "pid": os.getpid(), "memory": self.memdir})
        elif op in ("detach", "stop"):
            was = conn.pid is not None and not conn.detached
            conn.detached = True
            self._send(conn, {"ok": True})
            if op == "stop":
                self._stopping = True
            elif was:
                self._last_left(f"trainer {conn.pid} detached")
        elif op == "persist" and request.get("name") is not None:
            # An attached trainer hands on a save due for storage (handoff.py); it holds back
            # its own commits to storage until this answer, so the two never overlap.
            if conn.pid is None or conn.detached:
                self._send(
                    conn,
                    {"ok": False, "error": "only an attached trainer hands on its checkpoints"},
                )
            else:
                self._send(
                    conn,
                    self._persist(
                        f"trainer {conn.pid}",
                        str(request["name"]),
                        request.get("overwrite") is True,
                    ),
                )
        elif op == "persist":  # never beside an attached trainer's own commits to storage
            self._send(
                conn,
                {
                    "ok": False,
                    "error": f"{self._attached()} trainer(s) attached: "
                    "they write to storage themselves (save(persist=True))",
                }
                if self._attached()
                else self._persist("asked"),
            )
        elif op == "status":
            self._send(
                conn,
                {
                    "ok": True,
                    "pid": os.getpid(),
                    "attached": self._attached(),
                    "memory": self.memdir,
                    "storage": self.storage,
                },
            )
        else:
            self._send(conn, {"ok": False, "error": f"unknown op {op!r}"})

    def _send(self, conn: _Conn, reply: dict) -> None:
        if conn.request_id is not None:
            reply = dict(reply, id=conn.request_id)
        try:
            conn.sock.sendall(json.dumps(reply).encode() + b"\n")
        except OSError as exc:
            log.info("keeper: could not answer a trainer: %s", exc)

    def _persist(self, why: str, name: str | None = None, overwrite: bool = False) -> dict:
        part = nodes.part_only(self.memdir)
        if part is not None:  # the trainers wrote storage themselves (nodes.py)
            log.info("keeper (%s): the memory is not written to storage: %s", why, part)
            return {"ok": True, "persisted": None}
        try:
            info = persist_newest(
                self.ckpt,
                self.storage,
                self.config,
                self.run_id,
                checked=lambda info: marks.holds(self.memdir, info),
                name=name,
                overwrite=overwrite,
            )
        except Exception as exc:  # noqa: BLE001 - logged and answered; the keeper keeps serving
            log.error(
                "keeper (%s): writing the newest memory checkpoint to %s failed: %r",
                why,
                self.storage,
                exc,
            )
            return {"ok": False, "error": repr(exc)}
        if info is None:
            log.info("keeper (%s): storage already holds the newest step", why)
            return {"ok": True, "persisted": None}
        log.info("keeper (%s): committed %s to %s", why, info.name, self.storage)
        return {"ok": True, "persisted": info.name}


def _wake(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except OSError:
        pass


def main(storage_dir: str, tier: MemoryTier, config: CheckpointConfig, log_path: str) -> int:
    """The ``datastates keeper`` command: serve in the foreground, logging to ``log_path``
    (a trainer that spawns a keeper runs this in a session of its own)."""
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return Keeper(storage_dir, tier, config).run()
    except Exception:
        log.exception("keeper: failed")
        return 1
    finally:
        log.removeHandler(handler)
        handler.close()
