"""The S3 test server does what the object-storage backend relies on, checked on real requests.

Multipart uploads whose parts arrive out of order, ranged reads, rejected credentials, typed
missing-bucket errors, aborted uploads leaving nothing behind, and data surviving a SIGKILL.
"""

from __future__ import annotations

import os

import psutil
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from server import (
    ServerStartError,
    delete_prefix,
    list_multipart_uploads,
    split_s3_url,
    start_server,
    storage_options,
)

MIB = 1 << 20
DENIED = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId"}


def key_of(s3_root: str, name: str) -> str:
    """The object key of ``name`` under the ``s3://bucket/prefix`` root."""
    return split_s3_url(s3_root)[1] + "/" + name


def error_code(excinfo) -> str:
    return excinfo.value.response["Error"]["Code"]


def upload_parts(client, bucket: str, key: str, parts: dict, order) -> str:
    """Multipart upload of ``parts`` (number -> bytes) sent in ``order``; returns the upload id."""
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etags = {
        n: client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=parts[n]
        )["ETag"]
        for n in order
    }
    client.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(parts)]},
    )
    return upload_id


def test_multipart_parts_uploaded_out_of_order_complete_byte_identical(s3_server, s3_root):
    data = os.urandom(12 * MIB)
    parts = {1: data[: 5 * MIB], 2: data[5 * MIB : 10 * MIB], 3: data[10 * MIB :]}
    key = key_of(s3_root, "out-of-order.bin")
    client = s3_server.client()
    upload_parts(client, s3_server.bucket, key, parts, order=(3, 1, 2))
    got = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    assert len(got) == len(data)
    assert got == data
    assert list_multipart_uploads(s3_server, key) == []


def start_upload(client, bucket: str, key: str, parts: dict):
    """An upload of ``parts`` (number -> bytes), not completed; returns (upload id, etags)."""
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    return upload_id, {
        n: client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body)[
            "ETag"
        ]
        for n, body in parts.items()
    }


def complete(client, bucket: str, key: str, upload_id: str, listed) -> None:
    client.complete_multipart_upload(
        Bucket=bucket,
        Key=key,
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in listed]},
    )


def test_part_numbers_may_have_gaps_and_a_reupload_replaces_the_part(s3_server, s3_root):
    first, stale, second = os.urandom(5 * MIB), os.urandom(5 * MIB), os.urandom(MIB)
    key, client = key_of(s3_root, "gaps.bin"), s3_server.client()
    upload_id, _ = start_upload(client, s3_server.bucket, key, {2: stale})
    etags = {
        n: client.upload_part(
            Bucket=s3_server.bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body
        )["ETag"]
        for n, body in ((7, second), (2, first))
    }
    complete(client, s3_server.bucket, key, upload_id, sorted(etags.items()))
    assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == first + second


def test_a_part_below_5_mib_that_is_not_last_fails_completion(s3_server, s3_root):
    key, client = key_of(s3_root, "small-part.bin"), s3_server.client()
    upload_id, etags = start_upload(
        client, s3_server.bucket, key, {1: os.urandom(MIB), 2: os.urandom(MIB)}
    )
    with pytest.raises(ClientError) as excinfo:
        complete(client, s3_server.bucket, key, upload_id, sorted(etags.items()))
    assert error_code(excinfo) == "EntityTooSmall"
    # a failed completion leaves the upload in progress: whoever started it must abort it
    assert [u["UploadId"] for u in list_multipart_uploads(s3_server, key)] == [upload_id]


def test_completion_rejects_descending_lists_and_unknown_etags(s3_server, s3_root):
    key, client = key_of(s3_root, "bad-list.bin"), s3_server.client()
    upload_id, etags = start_upload(
        client, s3_server.bucket, key, {1: os.urandom(5 * MIB), 2: os.urandom(MIB)}
    )
    with pytest.raises(ClientError) as excinfo:
        complete(client, s3_server.bucket, key, upload_id, [(2, etags[2]), (1, etags[1])])
    assert error_code(excinfo) == "InvalidPartOrder"
    with pytest.raises(ClientError) as excinfo:
        complete(client, s3_server.bucket, key, upload_id, [(1, etags[1]), (2, etags[1])])
    assert error_code(excinfo) == "InvalidPart"
    with pytest.raises(ClientError) as excinfo:
        complete(client, s3_server.bucket, key, upload_id, [(1, etags[1]), (3, etags[2])])
    assert error_code(excinfo) == "InvalidPart"
    with pytest.raises(ClientError) as excinfo:
        client.head_object(Bucket=s3_server.bucket, Key=key)
    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_conditional_put_if_none_match_does_not_overwrite(s3_server, s3_root):
    key, client = key_of(s3_root, "once.bin"), s3_server.client()
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as excinfo:
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert error_code(excinfo) == "PreconditionFailed"
    assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"first"


def test_ranged_get_returns_exactly_the_requested_bytes(s3_server, s3_root):
    data = os.urandom(3 * MIB + 17)
    key = key_of(s3_root, "ranged.bin")
    client = s3_server.client()
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=data)
    for first, last in [(0, 0), (MIB - 1, MIB), (2 * MIB + 5, len(data) - 1), (123, 4567)]:
        body = client.get_object(Bucket=s3_server.bucket, Key=key, Range=f"bytes={first}-{last}")[
            "Body"
        ].read()
        assert body == data[first : last + 1]


def test_wrong_secret_key_is_rejected_with_an_access_error(s3_server, s3_root):
    key = key_of(s3_root, "secret.bin")
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=key, Body=b"payload")
    bad = s3_server.client(aws_secret_access_key="not-the-secret")
    with pytest.raises(ClientError) as excinfo:
        bad.get_object(Bucket=s3_server.bucket, Key=key)
    assert error_code(excinfo) in DENIED
    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(ClientError) as excinfo:
        bad.put_object(Bucket=s3_server.bucket, Key=key, Body=b"overwritten")
    assert error_code(excinfo) in DENIED
    assert (
        s3_server.client().get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"payload"
    )


def test_unknown_access_key_is_rejected(s3_server, s3_root):
    bad = s3_server.client(aws_access_key_id="NOSUCHKEY0000000")
    with pytest.raises(ClientError) as excinfo:
        bad.put_object(Bucket=s3_server.bucket, Key=key_of(s3_root, "x"), Body=b"x")
    assert error_code(excinfo) in DENIED


def test_anonymous_requests_are_rejected_and_write_nothing(s3_server, s3_root):
    key = key_of(s3_root, "anon.bin")
    anonymous = s3_server.client(
        aws_access_key_id=None,
        aws_secret_access_key=None,
        config=Config(signature_version=UNSIGNED),
    )
    with pytest.raises(ClientError) as excinfo:
        anonymous.put_object(Bucket=s3_server.bucket, Key=key, Body=b"anon")
    assert error_code(excinfo) == "AccessDenied"
    with pytest.raises(ClientError) as excinfo:
        anonymous.list_objects_v2(Bucket=s3_server.bucket)
    assert error_code(excinfo) == "AccessDenied"
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=key)
    assert listed.get("Contents", []) == []


def test_missing_bucket_raises_no_such_bucket_and_is_not_created(s3_server):
    client = s3_server.client()
    with pytest.raises(ClientError) as excinfo:
        client.get_object(Bucket="no-such-bucket", Key="k")
    assert error_code(excinfo) == "NoSuchBucket"
    with pytest.raises(ClientError) as excinfo:
        client.put_object(Bucket="no-such-bucket", Key="k", Body=b"x")
    assert error_code(excinfo) == "NoSuchBucket"
    with pytest.raises(ClientError) as excinfo:
        client.create_multipart_upload(Bucket="no-such-bucket", Key="k")
    assert error_code(excinfo) == "NoSuchBucket"
    assert "no-such-bucket" not in [b["Name"] for b in client.list_buckets()["Buckets"]]


def test_aborted_multipart_upload_leaves_no_upload_and_no_object(s3_server, s3_root):
    key = key_of(s3_root, "aborted.bin")
    client = s3_server.client()
    upload_id = client.create_multipart_upload(Bucket=s3_server.bucket, Key=key)["UploadId"]
    client.upload_part(
        Bucket=s3_server.bucket, Key=key, UploadId=upload_id, PartNumber=2, Body=os.urandom(MIB)
    )
    listed = list_multipart_uploads(s3_server, key_of(s3_root, ""))
    assert [(u["Key"], u["UploadId"]) for u in listed] == [(key, upload_id)]
    client.abort_multipart_upload(Bucket=s3_server.bucket, Key=key, UploadId=upload_id)
    assert list_multipart_uploads(s3_server, key_of(s3_root, "")) == []
    with pytest.raises(ClientError) as excinfo:
        client.head_object(Bucket=s3_server.bucket, Key=key)
    assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_delete_prefix_removes_objects_and_uploads_only_under_the_prefix(s3_server, s3_root):
    client = s3_server.client()
    inside, outside = key_of(s3_root, "a/b.bin"), key_of(s3_root + "-sibling", "c.bin")
    for key in (inside, outside):
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"x")
    client.create_multipart_upload(Bucket=s3_server.bucket, Key=key_of(s3_root, "pending"))
    assert delete_prefix(s3_server, key_of(s3_root, "")) == 1
    assert list_multipart_uploads(s3_server, key_of(s3_root, "")) == []
    assert client.get_object(Bucket=s3_server.bucket, Key=outside)["Body"].read() == b"x"
    assert delete_prefix(s3_server, key_of(s3_root + "-sibling", "")) == 1


def test_server_listens_only_on_loopback_on_its_own_ports(s3_server):
    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(s3_server.pid).net_connections()
        if c.status == psutil.CONN_LISTEN
    }
    assert {ip for ip, _ in listening} == {"127.0.0.1"}
    assert {port for _, port in listening} == set(s3_server.ports.values())
    assert s3_server.endpoint == f"http://127.0.0.1:{s3_server.ports['s3.port']}"


def test_split_s3_url_returns_bucket_and_key_and_rejects_other_urls(s3_root):
    assert split_s3_url("s3://ckpt/a/b.bin") == ("ckpt", "a/b.bin")
    assert split_s3_url(s3_root)[0] == "ckpt"
    for bad in ("ckpt/a", "s3://ckpt", "s3://ckpt/", "file:///x"):
        with pytest.raises(ValueError, match="expected s3://"):
            split_s3_url(bad)


def test_storage_options_name_the_endpoint_and_identity(s3_server, s3_storage_options):
    assert (
        s3_storage_options
        == storage_options(s3_server)
        == {
            "endpoint_url": s3_server.endpoint,
            "aws_access_key_id": s3_server.access_key,
            "aws_secret_access_key": s3_server.secret_key,
            "region_name": "us-east-1",
        }
    )


@pytest.mark.slow
def test_kill_and_restart_keep_committed_objects(s3_server, s3_root):
    client = s3_server.client()
    small, large = os.urandom(1000), os.urandom(7 * MIB)
    client.put_object(Bucket=s3_server.bucket, Key=key_of(s3_root, "small"), Body=small)
    upload_parts(
        client,
        s3_server.bucket,
        key_of(s3_root, "large"),
        {1: large[: 5 * MIB], 2: large[5 * MIB :]},
        order=(2, 1),
    )
    old_pid, endpoint = s3_server.pid, s3_server.endpoint
    s3_server.kill()
    assert s3_server.pid is None
    assert (
        not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
    )
    s3_server.restart()
    assert s3_server.pid not in (None, old_pid)
    assert s3_server.endpoint == endpoint
    client = s3_server.client()
    assert (
        client.get_object(Bucket=s3_server.bucket, Key=key_of(s3_root, "small"))["Body"].read()
        == small
    )
    assert (
        client.get_object(Bucket=s3_server.bucket, Key=key_of(s3_root, "large"))["Body"].read()
        == large
    )


def test_a_server_that_cannot_start_raises_with_its_log_tail(tmp_path):
    with pytest.raises(ServerStartError) as excinfo:
        start_server(tmp_path, extra_args=["-no.such.flag=1"])
    message, log = str(excinfo.value), (tmp_path / "weed.log").read_text()
    assert "weed exited with code" in message
    assert str(tmp_path / "weed.log") in message
    assert "no.such.flag" in log
    assert message.endswith(log[-200:])
    assert not list(tmp_path.glob("data/*.dat"))


@pytest.mark.slow
def test_an_upload_in_progress_at_a_kill_is_listed_after_restart_and_can_be_aborted(
    s3_server, s3_root
):
    key, client = key_of(s3_root, "pending.bin"), s3_server.client()
    upload_id, _ = start_upload(client, s3_server.bucket, key, {3: os.urandom(5 * MIB)})
    s3_server.kill()
    s3_server.restart()
    client = s3_server.client()
    assert [(u["Key"], u["UploadId"]) for u in list_multipart_uploads(s3_server, key)] == [
        (key, upload_id)
    ]
    parts = client.list_parts(Bucket=s3_server.bucket, Key=key, UploadId=upload_id)["Parts"]
    assert [(p["PartNumber"], p["Size"]) for p in parts] == [(3, 5 * MIB)]
    client.abort_multipart_upload(Bucket=s3_server.bucket, Key=key, UploadId=upload_id)
    assert list_multipart_uploads(s3_server, key) == []
