"""S3-compatible object storage (AWS S3, MinIO, SeaweedFS, Ceph RGW...) through ``boto3``.

Chosen over ``s3fs`` and ``obstore`` because a shard file is uploaded as a multipart upload whose
parts are numbered explicitly: the data units stream out as parts while the capture is running, and
part 1 — the header, known only at the end — is uploaded last (docs/storage.md; the client
comparison is in docs/benchmarks.md). ``pip install datastates[s3]``.

Paths are URLs ``s3://bucket/key/...``. The endpoint and credentials come from ``storage_options``
(``endpoint_url``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``,
``region_name``, ``addressing_style``) or from the standard AWS environment variables and files;
never from a checkpoint. How long a request may take is bounded by ``storage_options`` too
(:data:`DEFAULT_LIMITS`): ``connect_timeout`` (seconds to connect, and the longest a send may
stall), ``read_timeout`` (the longest the reply may stall) and ``max_attempts`` (tries per request,
the first included). A service that accepts connections and never answers therefore fails a
request after about ``max_attempts * read_timeout`` seconds instead of hanging.
"""

from __future__ import annotations

import bisect
import io
import threading
from typing import Any, Mapping

from ..errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    StorageAccessError,
    StorageError,
)
from .store import ReadFile, Store, url_join

MIN_PART = 5 << 20  # S3: every part but the last is at least 5 MiB ...
MAX_PARTS = 10_000  # ... and an upload has at most 10,000 parts
MAX_COPY = 5 << 30  # S3: one CopyObject copies at most 5 GiB; a larger object goes by parts
_COPY_PART = 1 << 30  # ... of this size (more if 10,000 of them are too few)
_DELETE_BATCH = 1000  # keys per DeleteObjects request
#: The request limits ``storage_options`` may change. A healthy server answers a 64 MiB part within
#: half a second of its last byte (measured on the test server, docs/storage.md): 10 s leaves a 20x
#: margin for a loaded one while a hung server fails a request in about 30 s, and every send is a 16 KiB block, so a slow link is never a timeout.
DEFAULT_LIMITS = {"connect_timeout": 5.0, "read_timeout": 10.0, "max_attempts": 3}
# what storage_options takes: the first five go to the boto3 client as they are
_OPTION_KEYS = (
    "endpoint_url",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "region_name",
    "addressing_style",
    *DEFAULT_LIMITS,
)
_ACCESS_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "403",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
}
_MISSING_CODES = {"NoSuchKey", "NoSuchUpload", "404", "NotFound"}


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ("bucket", "a/b")."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r}: expected s3://BUCKET/PREFIX")
    return bucket, key.strip("/")


def storage_error(exc: BaseException, what: str, path: str) -> OSError:
    """A client failure as a typed error naming the request and the path."""
    try:
        from botocore.exceptions import ClientError
    except ImportError:  # pragma: no cover - the module is unusable without botocore anyway
        ClientError = ()  # type: ignore[assignment]
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text = f"{path}: {what} failed: {code or status} ({err.get('Message', '')})"
        if code == "NoSuchBucket":
            return BucketNotFoundError(text)
        if code == "PreconditionFailed" or status == 412:
            return FileExistsError(17, text)
        if code in _MISSING_CODES or status == 404:
            return FileNotFoundError(2, text)
        if code in _ACCESS_CODES or status == 403:
            return StorageAccessError(text)
        return StorageError(text)
    return StorageError(f"{path}: {what} failed: {type(exc).__name__}: {exc}")


def request_limits(options: Mapping[str, Any]) -> dict[str, Any]:
    """The request limits of ``storage_options`` (defaults: :data:`DEFAULT_LIMITS`), validated:
    timeouts are numbers > 0 (seconds), ``max_attempts`` an int >= 1. Raises ConfigError."""
    limits = {name: options.get(name, default) for name, default in DEFAULT_LIMITS.items()}
    for name in ("connect_timeout", "read_timeout"):
        value = limits[name]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(
                f"storage_options[{name!r}]: expected a number of seconds > 0, found {value!r}"
            )
    attempts = limits["max_attempts"]
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        raise ConfigError(
            f"storage_options['max_attempts']: expected an int >= 1 (tries "
            f"per request, the first included), found {attempts!r}"
        )
    return limits


def _is_timeout(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, (ConnectTimeoutError, ReadTimeoutError, TimeoutError))


#: ``file_stamps``: HEADs in flight at once, and the number of entries past which one listing
#: of every key may be cheaper than a HEAD per entry: it is while an entry holds fewer than
#: ``_STAMP_KEYS`` keys (a listing page of 1,000 keys costs one round trip, as a round of
#: ``_STAMP_HEADS`` HEADs does; an entry holds a key per rank's shard file).
_STAMP_HEADS, _STAMP_LISTING = 8, 64
_STAMP_KEYS = 1000 // _STAMP_HEADS
_NO_FILE = object()


class S3Store(Store):
    """One bucket of an S3-compatible service. Thread-safe (one boto3 client, shared).

    ``limits`` are the request limits the client was built with (:func:`request_limits`); a
    request that timed out names them in its error."""

    renames = False

    def __init__(
        self, bucket: str, client: Any, endpoint: str, limits: Mapping[str, Any] | None = None
    ):
        self.bucket, self.client, self.endpoint = bucket, client, endpoint
        self.limits = dict(limits or DEFAULT_LIMITS)

    @classmethod
    def for_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> "S3Store":
        """A store for the bucket of ``url``; checks at once that the bucket exists and that the
        credentials are accepted (BucketNotFoundError, StorageAccessError, StorageError)."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ImportError(
                f"{url}: object storage needs boto3 (pip install 'datastates[s3]')"
            ) from None
        options = dict(storage_options or {})
        unknown = sorted(set(options) - set(_OPTION_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown storage_options {unknown}; expected some of {list(_OPTION_KEYS)}"
            )
        bucket, _ = split_url(url)
        limits = request_limits(options)
        for name in DEFAULT_LIMITS:
            options.pop(name, None)
        config = Config(
            retries={"total_max_attempts": limits["max_attempts"], "mode": "standard"},
            connect_timeout=limits["connect_timeout"],
            read_timeout=limits["read_timeout"],
            max_pool_connections=32,
            s3={"addressing_style": options.pop("addressing_style", "auto")},
            # every byte already carries datastates' own CRC-32 (checked on read)
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        client = boto3.session.Session().client("s3", config=config, **options)
        store = cls(bucket, client, client.meta.endpoint_url, limits)
        store._check_bucket(url)
        return store

    def _check_bucket(self, url: str) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            error = self.error(exc, f"checking bucket {self.bucket!r} at {self.endpoint}", url)
            if isinstance(error, FileNotFoundError) and not isinstance(error, BucketNotFoundError):
                error = BucketNotFoundError(
                    f"{url}: bucket {self.bucket!r} does not exist at {self.endpoint}"
                )
            raise error from None

    def key(self, path: str) -> str:
        bucket, key = split_url(path)
        if bucket != self.bucket:
            raise ValueError(f"{path!r} is not in bucket {self.bucket!r}")
        return key

    def join(self, *parts: str) -> str:
        return url_join(*parts)

    def error(self, exc: BaseException, what: str, path: str) -> OSError:
        """:func:`storage_error`; a timeout also names the limits that ran out."""
        if not _is_timeout(exc):
            return storage_error(exc, what, path)
        limits = self.limits
        return StorageError(
            f"{path}: {what} failed: {type(exc).__name__}: {exc} (no answer "
            f"within connect_timeout={limits['connect_timeout']:g} s / "
            f"read_timeout={limits['read_timeout']:g} s, "
            f"{limits['max_attempts']} tries; see storage_options)"
        )

    def _call(self, what: str, path: str, fn, **kwargs):
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            raise self.error(exc, what, path) from None

    # ---- whole objects
    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        response = self._call("GET", path, self.client.get_object, Key=self.key(path))
        if max_bytes is not None and response.get("ContentLength", 0) > max_bytes:
            response["Body"].close()
            raise CorruptCheckpointError(
                f"{path}: {response['ContentLength']} bytes, more than "
                f"the format's limit of {max_bytes} bytes for this file"
            )
        try:
            if max_bytes is None:
                return response["Body"].read()
            data = response["Body"].read(max_bytes + 1)  # a reply without a length is bounded too
        except Exception as exc:
            raise self.error(exc, "GET (body)", path) from None
        if len(data) > max_bytes:
            response["Body"].close()
            raise CorruptCheckpointError(
                f"{path}: more than the format's limit of {max_bytes} bytes for this file"
            )
        return data

    def write_atomic(self, path: str, data: bytes | bytearray, fsync: bool) -> Any:
        """One PUT; returns the object's ETag (the stamp :meth:`file_stamps` lists)."""
        reply = self._call(
            "PUT",
            path,
            self.client.put_object,
            Key=self.key(path),
            Body=ViewReader(memoryview(data)),
        )
        return reply.get("ETag")

    def write_new(self, path: str, data: bytes, fsync: bool) -> Any:
        """A conditional PUT (``If-None-Match: *``): the service refuses it if the key exists
        (412, FileExistsError). A service that ignores the condition overwrites (docs/storage.md)."""
        reply = self._call(
            "PUT (if absent)",
            path,
            self.client.put_object,
            Key=self.key(path),
            Body=ViewReader(memoryview(data)),
            IfNoneMatch="*",
        )
        return reply.get("ETag")

    def remove(self, path: str) -> None:
        self._call("DELETE", path, self.client.delete_object, Key=self.key(path))

    def isfile(self, path: str) -> bool:
        try:
            self._head(path)
        except FileNotFoundError:
            return False
        return True

    def _head(self, path: str) -> dict:
        return self._call("HEAD", path, self.client.head_object, Key=self.key(path))

    # ---- prefixes
    def _prefix(self, path: str) -> str:
        key = self.key(path)
        return f"{key}/" if key else ""

    def _pages(self, path: str, **kwargs):
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            yield from paginator.paginate(Bucket=self.bucket, Prefix=self._prefix(path), **kwargs)
        except Exception as exc:
            raise self.error(exc, "LIST", path) from None

    def isdir(self, path: str) -> bool:
        for page in self._pages(path, MaxKeys=1):
            return bool(page.get("KeyCount", 0))
        return False

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path``; an empty prefix is an empty directory (object stores
        have no directories to be missing)."""
        prefix, names = self._prefix(path), []
        for page in self._pages(path, Delimiter="/"):
            names += [
                p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", [])
            ]
            names += [o["Key"][len(prefix) :] for o in page.get("Contents", [])]
        return names

    def file_stamps(self, path: str, file_name: str) -> dict[str, Any]:
        """Stamp: the ETag of ``E/file_name`` (a replaced object has a new ETag unless its bytes
        are the same). An empty prefix gives {}. The cost does not grow with what lies inside
        the entries (every rank's shard file of every checkpoint): one listing of the names
        directly under ``path`` (with a delimiter; names starting with "." are no checkpoints
        and are left out), then a HEAD of each ``E/file_name``,
        ``_STAMP_HEADS`` at a time. Past ``_STAMP_LISTING`` names, one listing of every key
        under ``path`` costs fewer round trips when the entries hold few keys (few ranks), and
        is used instead: one page of the last entry's keys tells (``_STAMP_KEYS``)."""
        prefix = self._prefix(path)
        names = [
            p["Prefix"][len(prefix) :].rstrip("/")
            for page in self._pages(path, Delimiter="/")
            for p in page.get("CommonPrefixes", [])
        ]
        names = [n for n in names if n and not n.startswith(".")]
        if (
            len(names) > _STAMP_LISTING
            and self._count_keys(self.join(path, names[-1]), _STAMP_KEYS) < _STAMP_KEYS
        ):
            return self._stamps_by_listing(path, file_name)
        from concurrent.futures import ThreadPoolExecutor

        def stamp(name: str):
            try:
                return name, self._head(self.join(path, name, file_name)).get("ETag")
            except FileNotFoundError:  # no such file (an entry without one, or a plain object)
                return name, _NO_FILE

        with ThreadPoolExecutor(min(_STAMP_HEADS, max(1, len(names)))) as pool:
            return {n: etag for n, etag in pool.map(stamp, names) if etag is not _NO_FILE}

    def _count_keys(self, path: str, limit: int) -> int:
        """The keys under ``path``, counted up to ``limit`` (one request)."""
        for page in self._pages(path, MaxKeys=limit):
            return int(page.get("KeyCount", len(page.get("Contents", []))))
        return 0

    def _stamps_by_listing(self, path: str, file_name: str) -> dict[str, Any]:
        prefix, out = self._prefix(path), {}
        for obj in self._objects(path):
            name, sep, rest = obj["Key"][len(prefix) :].partition("/")
            if sep and rest == file_name and name and not name.startswith("."):
                out[name] = obj.get("ETag")
        return out

    def _objects(self, path: str) -> list[dict]:
        return [o for page in self._pages(path) for o in page.get("Contents", [])]

    def mtime(self, path: str) -> float:
        objects = self._objects(path)
        if objects:
            return max(o["LastModified"].timestamp() for o in objects)
        return self._head(path)["LastModified"].timestamp()

    def makedirs(self, path: str, fsync: bool) -> None:
        pass  # prefixes exist as soon as an object is written below them

    def remove_tree(self, path: str) -> None:
        keys = [o["Key"] for o in self._objects(path)]
        failed = []
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start : start + _DELETE_BATCH]]
            reply = self._call(
                "DELETE (batch)",
                path,
                self.client.delete_objects,
                Delete={"Objects": batch, "Quiet": True},
            )
            failed += reply.get("Errors", [])
        if failed:
            first = failed[0]
            raise StorageError(
                f"could not delete s3://{self.bucket}/{first.get('Key')} while "
                f"deleting {path}: {first.get('Code')} {first.get('Message', '')} "
                f"({len(failed)} error(s))"
            )

    def copy(self, src: str, dst: str) -> None:
        """A copy made by the service (CopyObject; above :data:`MAX_COPY`, a multipart upload of
        UploadPartCopy ranges, aborted if a part fails): no byte passes through this process."""
        source = {"Bucket": self.bucket, "Key": self.key(src)}
        size = self._head(src)["ContentLength"]
        if size <= MAX_COPY:
            self._call("COPY", dst, self.client.copy_object, Key=self.key(dst), CopySource=source)
            return
        key, part = self.key(dst), max(_COPY_PART, -(-size // MAX_PARTS))
        upload_id = self._call(
            "CreateMultipartUpload (copy)", dst, self.client.create_multipart_upload, Key=key
        )["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, size, part), 1):
                reply = self._call(
                    "UploadPartCopy",
                    dst,
                    self.client.upload_part_copy,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceRange=f"bytes={start}-{min(start + part, size) - 1}",
                )
                parts.append({"PartNumber": number, "ETag": reply["CopyPartResult"]["ETag"]})
            self._call(
                "CompleteMultipartUpload (copy)",
                dst,
                self.client.complete_multipart_upload,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            try:
                self._call(
                    "AbortMultipartUpload",
                    dst,
                    self.client.abort_multipart_upload,
                    Key=key,
                    UploadId=upload_id,
                )
            except OSError:
                pass  # left to cleanup_uploads
            raise

    # ---- shard files
    def open_read(self, path: str) -> ReadFile:
        return S3ReadFile(self, path, self._head(path)["ContentLength"])

    def shard_writer(self, path: str, io_mode: str, layout: Any) -> "S3ShardWriter":
        return S3ShardWriter(self, path, layout)

    def cleanup_uploads(self, root: str, is_stale) -> list[str]:
        aborted = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            pages = list(paginator.paginate(Bucket=self.bucket, Prefix=self._prefix(root)))
        except Exception as exc:
            raise self.error(exc, "LIST uploads", root) from None
        prefix = self._prefix(root)
        for page in pages:
            for upload in page.get("Uploads", []):
                if is_stale(upload["Key"][len(prefix) :], upload["Initiated"].timestamp()):
                    path = f"s3://{self.bucket}/{upload['Key']}"
                    self._call(
                        "ABORT upload",
                        path,
                        self.client.abort_multipart_upload,
                        Key=upload["Key"],
                        UploadId=upload["UploadId"],
                    )
                    aborted.append(upload["Key"])
        return aborted


class S3ReadFile(ReadFile):
    """Ranged GETs straight into the caller's buffers (one request per ``read_into``)."""

    step_bytes = 8 << 20  # a request costs a round trip: fewer, larger ones

    def __init__(self, store: S3Store, path: str, size: int):
        self.store, self.path, self.size = store, path, size
        self._key = store.key(path)

    def read_into(self, views: list[memoryview], offset: int) -> None:
        views = [v for v in views if v.nbytes]
        total = sum(v.nbytes for v in views)
        if not total:
            return
        if offset + total > self.size:
            raise CorruptCheckpointError(
                f"{self.path}: unexpected end of file at offset "
                f"{self.size} (reading [{offset}, {offset + total}))"
            )
        try:
            reply = self.store._call(
                "GET range",
                self.path,
                self.store.client.get_object,
                Key=self._key,
                Range=f"bytes={offset}-{offset + total - 1}",
            )
        except FileNotFoundError:  # opened, then deleted: its checkpoint replaced or deleted
            raise CheckpointNotFoundError(
                f"{self.path}: the shard file was deleted while it "
                "was read (its checkpoint replaced or deleted "
                "meanwhile)"
            ) from None
        body = reply["Body"]
        raw = getattr(body, "_raw_stream", None)  # urllib3 response: readinto without a copy
        try:
            for view in views:
                while view.nbytes:
                    if raw is not None:
                        got = raw.readinto(view)
                    else:
                        chunk = body.read(view.nbytes)
                        got = len(chunk)
                        view[:got] = chunk
                    if not got:
                        raise CorruptCheckpointError(
                            f"{self.path}: the object ended early while "
                            f"reading [{offset}, {offset + total})"
                        )
                    view = view[got:]
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            raise self.store.error(exc, "GET range (body)", self.path) from None
        finally:
            body.close()


class ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview: a request body read in blocks (16 KiB, by
    the client) instead of one send of the whole buffer, so ``connect_timeout`` — the limit of
    each send — bounds a stall, never the time a large part takes on a slow link; re-read from
    the start if the client retries the request."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), len(self._view) - self._pos)
        buf[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


class _Part:
    """A byte range of the shard file uploaded as one part. ``units`` counts the cache units it
    holds; a part that is exactly one unit (``direct``) is uploaded from the cache slot."""

    def __init__(self, number: int, start: int, end: int | None, units: int, direct: bool):
        self.number, self.start, self.end = number, start, end
        self.units, self.direct = units, direct
        self.received = 0
        self.buf: bytearray | None = None


def plan_parts(layout: Any) -> list[_Part]:
    """Cut a shard file into upload parts: part 1 is the header and the first units (uploaded
    last, once the header is known); each unit of at least 5 MiB is a part of its own; smaller
    units are grouped until a part reaches 5 MiB; the last part (open-ended) holds what remains:
    the last small units, the objects and the index."""
    spans = []
    for i, unit in enumerate(layout.units):
        start = 0 if i == 0 else unit.file_offset
        spans.append((start, unit.end))
    parts: list[_Part] = []
    start, count = 0, 0
    for span_start, span_end in spans:
        count += 1
        if span_end - start >= MIN_PART:
            direct = bool(parts) and count == 1
            parts.append(_Part(len(parts) + 1, start, span_end, count, direct))
            start, count = span_end, 0
    parts.append(_Part(len(parts) + 1, start, None, count, False))
    if len(parts) > MAX_PARTS:
        raise ConfigError(
            f"a shard of {layout.index_offset} bytes in units of "
            f"{layout.units[0].nbytes} bytes needs {len(parts)} upload parts; S3 "
            f"allows {MAX_PARTS}: raise chunk_bytes"
        )
    return parts


class S3ShardWriter:
    """Writes one shard file as a multipart upload (see :func:`plan_parts`).

    ``write`` may be called from several threads at once, each call holding the bytes of one
    unit, one object, the index or the header. A unit that is a part of its own is uploaded at once
    from the caller's buffer; other bytes are copied into their part's buffer, uploaded when the
    part is complete (part 1 and the last part at ``finish``). A file of one part is a single PUT.
    ``close`` without a successful ``finish`` aborts the upload, so no part outlives a failed save.
    ``cancel`` (any thread) makes every later request of this writer fail at once, unsent.
    """

    def __init__(self, store: S3Store, path: str, layout: Any):
        self.store, self.path, self.key = store, path, store.key(path)
        self.parts = plan_parts(layout)
        self._starts = [p.start for p in self.parts]
        self._lock = threading.Lock()
        self._upload_id: str | None = None
        self._etags: dict[int, str] = {}
        self._completed = False
        self._cancelled = False

    def write(self, data: memoryview, offset: int, padded: memoryview | None = None) -> None:
        part = self.parts[bisect.bisect_right(self._starts, offset) - 1]
        body = padded if padded is not None else data
        if (
            part.direct
            and offset == part.start
            and part.end is not None
            and body.nbytes == part.end - part.start
        ):
            self._upload(part, ViewReader(body))  # straight from the cache slot
            return
        with self._lock:
            size = offset + body.nbytes - part.start
            if part.buf is None:
                part.buf = bytearray(part.end - part.start if part.end is not None else size)
            elif len(part.buf) < size:
                part.buf.extend(bytes(size - len(part.buf)))
            part.buf[offset - part.start : size] = body
            part.received += 1  # parts after the first receive only whole units
            ready = part.end is not None and part.number > 1 and part.received == part.units
        if ready:
            self._upload(part, part.buf)
            part.buf = None

    def cancel(self) -> None:
        """Send no more requests for this file (the save failed or passed its deadline): a later
        ``write`` or ``finish`` that needs one raises StorageError. Requests already sent run to
        their end (bounded by the client's timeouts). ``close`` still aborts the upload."""
        self._cancelled = True

    def _check_cancelled(self, what: str) -> None:
        if self._cancelled:
            raise StorageError(
                f"{self.path}: {what} not sent: the save was cancelled (it failed "
                "or passed commit_timeout_s)"
            )

    def _ensure_upload(self) -> str:
        with self._lock:
            self._check_cancelled("CreateMultipartUpload")
            if self._upload_id is None:
                reply = self.store._call(
                    "CreateMultipartUpload",
                    self.path,
                    self.store.client.create_multipart_upload,
                    Key=self.key,
                )
                self._upload_id = reply["UploadId"]
            return self._upload_id

    def _upload(self, part: _Part, body: "bytearray | ViewReader") -> None:
        upload_id = self._ensure_upload()
        self._check_cancelled(f"UploadPart {part.number}")
        if not isinstance(body, ViewReader):
            body = ViewReader(memoryview(body))
        reply = self.store._call(
            f"UploadPart {part.number}",
            self.path,
            self.store.client.upload_part,
            Key=self.key,
            UploadId=upload_id,
            PartNumber=part.number,
            Body=body,
        )
        with self._lock:
            self._etags[part.number] = reply["ETag"]

    def finish(self, fsync: bool, size: int) -> None:
        """Upload part 1 and the last part (cut to ``size``), then complete the upload. Call it
        once every write has returned."""
        last = self.parts[-1]
        tail = last.buf or bytearray()
        del tail[size - last.start :]
        tail.extend(bytes(size - last.start - len(tail)))
        if len(self.parts) == 1:
            self._check_cancelled("PUT")
            self.store.write_atomic(self.path, tail, fsync)
            self._completed = True
            return
        first = self.parts[0]
        if first.buf is None:  # write() fills it, header first, before finish() is called
            raise StorageError(f"{self.path}: part 1 of the upload (the header) was never written")
        self._upload(first, first.buf)
        first.buf = None
        self._upload(last, tail)
        missing = [p.number for p in self.parts if p.number not in self._etags]
        if missing:
            raise StorageError(f"{self.path}: parts {missing} were never uploaded (writes missing)")
        self._check_cancelled("CompleteMultipartUpload")
        self.store._call(
            "CompleteMultipartUpload",
            self.path,
            self.store.client.complete_multipart_upload,
            Key=self.key,
            UploadId=self._upload_id,
            MultipartUpload={
                "Parts": [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]
            },
        )
        self._completed = True

    def close(self) -> None:
        """Abort the upload unless it completed. Idempotent, and retryable: if the service does
        not take the abort, StorageError is raised and a later ``close`` tries again (an upload
        the service no longer knows counts as aborted). Call it once no ``write`` or ``finish``
        of this writer is running, so that no part can land after the abort."""
        for part in self.parts:
            part.buf = None
        with self._lock:
            upload_id, completed = self._upload_id, self._completed
        if upload_id is None or completed:
            return
        try:
            self.store._call(
                "AbortMultipartUpload",
                self.path,
                self.store.client.abort_multipart_upload,
                Key=self.key,
                UploadId=upload_id,
            )
        except FileNotFoundError:
            pass  # NoSuchUpload: an earlier abort did reach the service
        with self._lock:
            self._upload_id = None
