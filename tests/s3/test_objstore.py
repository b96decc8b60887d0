"""Checkpoints on a real S3-compatible server (SeaweedFS, started by conftest.py): round trips,
the commit marker, retention and overwrite, typed errors for bad credentials and buckets, the
server dying in the middle of a save, the training process killed in the middle of a save, and
the tools on s3:// paths."""

import os
import signal
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import datastates
from datastates import CheckpointConfig, Checkpointer
from datastates.commit import retention
from datastates.errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CorruptCheckpointError,
    StorageAccessError,
    StorageError,
)

import zygote
from server import list_multipart_uploads, storage_options

# slow: object-store saves with processes and servers killed mid-save, ranks, the CLI
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def key_of(url: str) -> str:
    return url.split("/", 3)[3]


def make_state(seed=0, width=1024):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def objects_under(server, url):
    client = server.client()
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix=key_of(url) + "/"
    )
    return sorted(o["Key"][len(key_of(url)) + 1 :] for p in pages for o in p.get("Contents", []))


# chunk sizes: big units uploaded straight from the cache (8 MiB), small units grouped into
# parts (64 KiB), and a state small enough to be one PUT
@pytest.mark.parametrize("chunk,width", [(8 * MiB, 1024), (64 << 10, 512), (64 << 10, 64)])
def test_round_trip_is_bit_exact(s3_server, s3_root, chunk, width):
    model, opt = make_state(width=width)
    config = CheckpointConfig(chunk_bytes=chunk, host_cache_bytes=max(4 * chunk, 1 * MiB))
    with Checkpointer(s3_root, config, storage_options=storage_options(s3_server)) as ckpt:
        ckpt.save({"model": model, "opt": opt, "epoch": 3, "note": ["a", 1.5]}, step=7).wait()
        loaded = ckpt.load()
        assert same(loaded["model"], model.state_dict())
        assert loaded["epoch"] == 3 and loaded["note"] == ["a", 1.5]
        model2, opt2 = make_state(seed=1, width=width)
        state = {"model": model2, "opt": opt2, "epoch": 0, "note": ["b", 0.0]}
        assert ckpt.restore(state).step == 7
        assert same(model2.state_dict(), model.state_dict())
        assert state["epoch"] == 3
        assert opt2.state_dict()["state"][0]["exp_avg"].equal(
            opt.state_dict()["state"][0]["exp_avg"]
        )
        assert (
            ckpt.storage._read(
                None,
                None,
                True,
                False,
                (),
                None,
                "strict",
                "verify",
                None,
                [],
                lambda reader: reader.verify_all(),
            )
            == ckpt.latest().nbytes
        )
    files = objects_under(s3_server, s3_root)
    data_dirs = {f.split("/")[1] for f in files if f.startswith("step-0000000007/.data.")}
    assert len(data_dirs) == 1
    assert f"step-0000000007/{next(iter(data_dirs))}/rank-00000.dsf" in files
    assert "step-0000000007/manifest.json" in files and "latest" in files
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []


def test_retention_and_overwrite(s3_server, s3_root):
    model, opt = make_state(width=256)
    config = CheckpointConfig(chunk_bytes=64 << 10, host_cache_bytes=1 * MiB, keep_last=2)
    with Checkpointer(s3_root, config, storage_options=storage_options(s3_server)) as ckpt:
        for step in range(4):
            with torch.no_grad():
                model[0].weight.fill_(step)
            ckpt.save({"model": model}, step=step).wait()
        assert [i.step for i in ckpt.list()] == [2, 3]
        assert ckpt.load(step=2)["model"]["0.weight"].eq(2).all()
        with torch.no_grad():
            model[0].weight.fill_(10)
        ckpt.save({"model": model}, tag="best").wait()
        first_data = {
            f.split("/")[1]
            for f in objects_under(s3_server, s3_root)
            if f.startswith("best/.data.")
        }
        with pytest.raises(CheckpointExistsError):
            ckpt.save({"model": model}, tag="best").wait()
        # the refused save's uploaded data is removed, the committed one untouched
        assert {
            f.split("/")[1]
            for f in objects_under(s3_server, s3_root)
            if f.startswith("best/.data.")
        } == first_data
        with torch.no_grad():
            model[0].weight.fill_(11)
        ckpt.save({"model": model}, tag="best", overwrite=True).wait()
        assert ckpt.load(tag="best")["model"]["0.weight"].eq(11).all()
        best = [f for f in objects_under(s3_server, s3_root) if f.startswith("best/")]
        data = {f.split("/")[1] for f in best if f.startswith("best/.data.")}
        assert len(data) == 1 and not data & first_data  # the replaced data is gone
        assert ckpt.latest().name == "best"
        assert [i.name for i in ckpt.list()] == ["step-0000000003", "best"]
    # deleted checkpoints left no objects behind
    assert {f.split("/")[0] for f in objects_under(s3_server, s3_root)} == {
        "step-0000000003",
        "best",
        "latest",
    }


def test_a_deletion_leaves_the_data_another_save_of_the_name_is_uploading(s3_server, s3_root):
    """``delete()`` removes the manifest and the data directory it names, not the prefix: the
    data directory of a save of the same name in flight in another process survives, so that
    save's commit publishes a checkpoint whose data is there (before: a checkpoint listed with
    no data)."""
    client, prefix = s3_server.client(), key_of(s3_root)
    options = storage_options(s3_server)
    with Checkpointer(s3_root, CheckpointConfig(), storage_options=options) as ckpt:
        ckpt.save({"w": torch.ones(8)}, tag="x").wait()
        named = {
            f.split("/")[1]
            for f in objects_under(s3_server, s3_root)
            if f.startswith("x/") and "/.data." in "/" + f
        }
        in_flight = f"{prefix}/x/.data.0123456789abcdef-42/rank-00000.dsf"
        client.put_object(Bucket=s3_server.bucket, Key=in_flight, Body=b"uploading")
        ckpt.delete(tag="x")
        assert ckpt.list() == []
    left = [f for f in objects_under(s3_server, s3_root) if f.startswith("x/")]
    assert left == ["x/.data.0123456789abcdef-42/rank-00000.dsf"] and len(named) == 1


def test_commits_read_only_new_or_replaced_manifests(s3_server, s3_root, monkeypatch):
    """Each commit lists the root once (ETags) and GETs only manifests it has not seen; another
    writer's commits are numbered after and counted by retention; a replaced one is re-read."""
    options = storage_options(s3_server)
    small = dict(chunk_bytes=64 << 10, host_cache_bytes=1 * MiB)
    read: list[str] = []
    with (
        Checkpointer(
            s3_root, CheckpointConfig(keep_last=2, **small), storage_options=options
        ) as ck1,
        Checkpointer(s3_root, CheckpointConfig(**small), storage_options=options) as ck2,
    ):
        for ck in (ck1, ck2):

            def counting(path, original=ck.store.read_bytes, **kwargs):
                if path.endswith("/manifest.json"):
                    read.append(path.rsplit("/", 2)[-2])
                return original(path, **kwargs)

            monkeypatch.setattr(ck.store, "read_bytes", counting)

        def save(ck, value, name, **kwargs):
            info = ck.save({"x": torch.full((4,), float(value))}, **kwargs).wait(60)
            others = sorted(n for n in read if n != name)  # its own GET is the overwrite check
            read.clear()
            return info, others

        info, others = save(ck1, 1, "step-0000000001", step=1)
        assert (info.seq, others) == (1, [])
        info, others = save(ck1, 2, "step-0000000002", step=2)
        assert (info.seq, others) == (2, [])
        info, others = save(ck2, 3, "best", tag="best", step=3)
        assert (info.seq, others) == (3, ["step-0000000001", "step-0000000002"])
        info, others = save(ck1, 4, "step-0000000004", step=4)
        # the PUT's ETag stamps its own manifests; retention (keep_last=2) reads the manifests
        # of the two it deletes, for the data directory each names
        assert (info.seq, others) == (4, ["best", "step-0000000001", "step-0000000002"])
        assert [(i.name, i.seq) for i in ck1.list()] == [("best", 3), ("step-0000000004", 4)]
        info, others = save(ck2, 5, "best", tag="best", step=5, overwrite=True)
        assert (info.seq, others) == (5, ["step-0000000004"])
        assert [(i.name, i.seq, i.step) for i in ck1.list()] == [
            ("step-0000000004", 4, 4),
            ("best", 5, 5),
        ]
        assert read == ["best"]


def test_cleanup_reads_only_the_manifests_of_checkpoints_with_leftovers(
    s3_server, s3_root, monkeypatch
):
    """Tidying up (each Checkpointer does it at construction): a committed checkpoint with its one
    data directory costs no manifest read; a leftover data directory beside a committed one (a
    crashed overwrite) is removed after reading that checkpoint's manifest, and the directory the
    manifest names is kept; a data directory without a manifest (a crashed first save) is
    removed. The next Checkpointer is not tripped by the empty prefix a server may go on listing
    where a removed directory was (SeaweedFS does), and every checkpoint still loads bit-exact."""
    from datastates.storage import open_store

    options = storage_options(s3_server)
    small = CheckpointConfig(chunk_bytes=64 << 10, host_cache_bytes=1 * MiB)
    with Checkpointer(s3_root, small, storage_options=options) as ck:
        for step in (1, 2, 3):
            ck.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    client = s3_server.client()
    for name in ("step-0000000002", "step-0000000009"):
        client.put_object(
            Bucket=s3_server.bucket,
            Body=b"partial",
            Key=f"{key_of(s3_root)}/{name}/.data.0123456789abcdef-1/rank-00000.dsf",
        )
    store = open_store(s3_root, options)
    read: list[str] = []

    def counting(path, original=store.read_bytes, **kwargs):
        read.append(path.rsplit("/", 2)[-2])
        return original(path, **kwargs)

    monkeypatch.setattr(store, "read_bytes", counting)
    removed = retention.clean_stale(s3_root, 1e-6, store)
    assert sorted(removed) == [
        "step-0000000002/.data.0123456789abcdef-1",
        "step-0000000009/.data.0123456789abcdef-1",
    ]
    assert read == ["step-0000000002"]
    assert not [f for f in objects_under(s3_server, s3_root) if "crashed" in f]
    with Checkpointer(s3_root, small, storage_options=options) as ck:
        assert [i.step for i in ck.list()] == [1, 2, 3]
        for step in (1, 2, 3):
            assert torch.equal(ck.load(step=step)["x"], torch.full((4,), float(step)))


def test_a_name_committed_meanwhile_by_another_writer_is_refused(s3_server, s3_root):
    """Two writers commit the same step without overwrite, the first one in the window between
    the second's check for an existing manifest and its manifest PUT: the server refuses the
    second's conditional PUT, its handle raises CheckpointExistsError, its data is removed, and
    the first checkpoint is intact."""
    model1, _ = make_state(seed=1, width=64)
    model2, _ = make_state(seed=2, width=64)
    options = storage_options(s3_server)
    with (
        Checkpointer(s3_root, storage_options=options) as first,
        Checkpointer(s3_root, storage_options=options) as second,
    ):
        raced = []

        def commit_first_now(params, **_):
            if params.get("Key", "").endswith("/manifest.json") and not raced:
                raced.append(True)
                first.save({"model": model1}, step=1).wait()

        second.store.client.meta.events.register(
            "before-parameter-build.s3.PutObject", commit_first_now
        )
        with pytest.raises(CheckpointExistsError, match="another writer"):
            second.save({"model": model2}, step=1).wait()
        assert raced == [True]
        assert same(first.load(step=1)["model"], model1.state_dict())
    shards = [f for f in objects_under(s3_server, s3_root) if f.endswith(".dsf")]
    assert len(shards) == 1  # the refused save's data was removed


def test_wrong_credentials_and_missing_bucket_fail_at_construction(s3_server, s3_root):
    bad = {**storage_options(s3_server), "aws_secret_access_key": "wrong"}
    with pytest.raises(StorageAccessError, match="s3://"):
        Checkpointer(s3_root, storage_options=bad)
    with pytest.raises(BucketNotFoundError, match="no-such-bucket"):
        Checkpointer("s3://no-such-bucket/run", storage_options=storage_options(s3_server))
    with pytest.raises(datastates.ConfigError, match="unknown storage_options"):
        Checkpointer(s3_root, storage_options={**storage_options(s3_server), "endpoint": "x"})
    with pytest.raises(datastates.ConfigError, match="max_attempts"):
        Checkpointer(s3_root, storage_options={**storage_options(s3_server), "max_attempts": 0})


def test_a_damaged_shard_is_detected(s3_server, s3_root):
    model, _ = make_state(width=256)
    config = CheckpointConfig(chunk_bytes=64 << 10, host_cache_bytes=1 * MiB)
    with Checkpointer(s3_root, config, storage_options=storage_options(s3_server)) as ckpt:
        ckpt.save({"model": model}, step=1).wait()
        shard = next(f for f in objects_under(s3_server, s3_root) if f.endswith(".dsf"))
        client = s3_server.client()
        key = f"{key_of(s3_root)}/{shard}"
        data = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
        data[8192 + 100] ^= 0x01
        client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(data))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            ckpt.load()


@pytest.mark.filterwarnings("ignore:datastates.*could not be removed:RuntimeWarning")
def test_server_killed_during_a_save(s3_server, s3_root):
    """The server dies after the first part of a save is acknowledged: the handle raises a
    typed error, nothing new is listed, the previous checkpoint is intact, and once the server
    is back the same process aborts the failed save's upload (at close, the latest) and removes
    its data."""
    model, opt = make_state(width=1024)
    options = {**storage_options(s3_server), "max_attempts": 2}
    config = CheckpointConfig(chunk_bytes=8 * MiB, host_cache_bytes=32 * MiB, commit_timeout_s=60)
    with Checkpointer(s3_root, config, storage_options=options) as ckpt:
        ckpt.save({"model": model, "opt": opt}, step=1).wait()
        reference = {k: v.clone() for k, v in model.state_dict().items()}

        def kill_once(**_):
            if s3_server.pid is not None:
                s3_server.kill()

        ckpt.store.client.meta.events.register("after-call.s3.UploadPart", kill_once)
        handle = ckpt.save({"model": model, "opt": opt}, step=2)
        with pytest.raises(StorageError):
            handle.wait()
        ckpt.store.client.meta.events.unregister("after-call.s3.UploadPart", kill_once)
        s3_server.restart()
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []
    with Checkpointer(
        s3_root, config.replace(stale_tmp_age_s=1e-6), storage_options=storage_options(s3_server)
    ) as ckpt:
        assert [i.step for i in ckpt.list()] == [1]
        assert same(ckpt.load()["model"], reference)
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []
    assert not [
        f
        for f in objects_under(s3_server, s3_root)
        if f.startswith("step-0000000002") and f.endswith(".dsf")
    ]


def _drop_uploads(ckpt, times):
    """Make the next ``times`` UploadPart requests of ``ckpt``'s client fail as a dropped
    connection (before they are sent); the server itself keeps running."""
    from botocore.exceptions import ConnectionClosedError

    left = [times]

    def drop(request, **_):
        if left[0] > 0:
            left[0] -= 1
            raise ConnectionClosedError(endpoint_url=request.url)

    ckpt.store.client.meta.events.register("before-send.s3.UploadPart", drop)
    return left


def test_a_dropped_part_is_retried(s3_server, s3_root):
    model, opt = make_state(width=1024)
    config = CheckpointConfig(chunk_bytes=8 * MiB, host_cache_bytes=32 * MiB)
    with Checkpointer(s3_root, config, storage_options=storage_options(s3_server)) as ckpt:
        left = _drop_uploads(ckpt, 2)
        ckpt.save({"model": model, "opt": opt}, step=1).wait()
        assert left == [0]  # both drops happened, and the save committed anyway
        assert same(ckpt.load()["model"], model.state_dict())
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []


def test_a_failed_save_aborts_its_upload(s3_server, s3_root):
    """Retries exhausted: the save fails with StorageError, its multipart upload is aborted at
    once (no part left on the server), its data is removed, nothing is listed."""
    model, opt = make_state(width=1024)
    config = CheckpointConfig(chunk_bytes=8 * MiB, host_cache_bytes=32 * MiB)
    options = {**storage_options(s3_server), "max_attempts": 1}
    with Checkpointer(s3_root, config, storage_options=options) as ckpt:
        _drop_uploads(ckpt, 1)
        with pytest.raises(StorageError, match="UploadPart"):
            ckpt.save({"model": model, "opt": opt}, step=1).wait()
        assert ckpt.list() == []
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []
    assert [f for f in objects_under(s3_server, s3_root) if f.endswith(".dsf")] == []


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    import datastates
    sys.path[:0] = [{here!r}, {tests!r}]  # test_objstore, and the zygote it imports
    from test_objstore import make_state
    root, options = sys.argv[1], eval(sys.argv[2])
    model, opt = make_state(width=1024)
    config = datastates.CheckpointConfig(chunk_bytes=8 << 20, host_cache_bytes=32 << 20)
    ckpt = datastates.Checkpointer(root, config, storage_options=options)
    ckpt.save({{"model": model, "opt": opt}}, step=1).wait()
    ckpt.store.client.meta.events.register(
        "after-call.s3.UploadPart", lambda **_: os.kill(os.getpid(), signal.SIGKILL))
    ckpt.save({{"model": model, "opt": opt}}, step=2).wait()
    print("not reached")
""")


def test_training_process_killed_during_a_save(s3_server, s3_root, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE.format(here=HERE, tests=os.path.dirname(HERE)))
    proc = zygote.run(
        [sys.executable, str(script), s3_root, repr(storage_options(s3_server))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert list_multipart_uploads(s3_server, key_of(s3_root))
    # the writer is dead; an object store has no locks to tell it, so its data and uploads go
    # by age: the next Checkpointer whose stale_tmp_age_s they exceed cleans up
    with Checkpointer(
        s3_root, CheckpointConfig(stale_tmp_age_s=1e-6), storage_options=storage_options(s3_server)
    ) as ckpt:
        assert [i.step for i in ckpt.list()] == [1]
        model, _ = make_state(width=1024)
        assert same(ckpt.load()["model"], model.state_dict())
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []
    leftovers = [f for f in objects_under(s3_server, s3_root) if f.startswith("step-0000000002")]
    assert leftovers == []


def _two_ranks(rank, world, root, options):
    import torch.distributed as dist

    torch.manual_seed(rank)
    shard = torch.randn(1000 + rank) * (rank + 1)
    shared = torch.arange(4096, dtype=torch.float32)
    config = CheckpointConfig(chunk_bytes=64 << 10, host_cache_bytes=1 * MiB)
    with Checkpointer(root, config, storage_options=options) as ckpt:
        ckpt.save(
            {"mine": shard, "shared": shared, "rank": rank}, step=5, replicated=["shared"]
        ).wait()
        dist.barrier()
        out = ckpt.load()
        return (
            torch.equal(out["mine"], shard)
            and torch.equal(out["shared"], shared)
            and out["rank"] == rank,
            [i.step for i in ckpt.list()],
        )


def test_two_ranks_round_trip(s3_server, s3_root):
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "dist"))
    from launcher import run_ranks

    results = run_ranks(2, _two_ranks, s3_root, storage_options(s3_server), timeout=120)
    assert results == {0: (True, [5]), 1: (True, [5])}
    with Checkpointer(s3_root, storage_options=storage_options(s3_server)) as ckpt:
        assert ckpt.latest().world_size == 2


def test_cli_on_an_s3_path(s3_server, s3_root, tmp_path):
    model, _ = make_state(width=64)
    with Checkpointer(s3_root, storage_options=storage_options(s3_server)) as ckpt:
        ckpt.save({"model": model}, step=3).wait()
    opts = storage_options(s3_server)
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": opts["endpoint_url"],
        "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"],
        "AWS_DEFAULT_REGION": opts["region_name"],
    }

    def cli(*args):  # ``python -m datastates``, forked from the session's zygote
        return zygote.run(
            [sys.executable, "-m", "datastates", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    listed = cli("list", s3_root)
    assert listed.returncode == 0 and "step-0000000003" in listed.stdout, listed.stderr
    verified = cli("verify", s3_root)
    assert verified.returncode == 0 and "all OK" in verified.stdout, verified.stderr
    inspected = cli("inspect", "--json", s3_root)
    assert inspected.returncode == 0 and '"0.weight"' not in inspected.stdout
    assert '"model/0.weight"' in inspected.stdout
    assert cli("list", s3_root + "-nothing").returncode == 3
    exported = cli("export", s3_root, "--to", "torch", str(tmp_path / "out.pt"))
    assert exported.returncode == 1 and "local" in exported.stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_scan_never_lists_the_keys_inside_the_checkpoints(s3_server, s3_root):
    """Listing the committed checkpoints costs a listing of the names under the root (with a
    delimiter) and a HEAD per checkpoint: never a listing of every shard file of every
    checkpoint, whose number grows with the world size. Objects planted inside a checkpoint's
    prefix are not listed."""
    with Checkpointer(
        s3_root, CheckpointConfig(), storage_options=storage_options(s3_server)
    ) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"w": torch.full((4,), float(step))}, step=step).wait()
        client = s3_server.client()
        for i in range(30):  # as if many ranks had written into step 1
            client.put_object(
                Bucket=s3_server.bucket,
                Body=b"x",
                Key=f"{key_of(s3_root)}/step-0000000001/extra-{i}",
            )
        calls = []
        ckpt.store.client.meta.events.register(
            "before-parameter-build.s3.*",
            lambda model, params, **_: calls.append((model.name, dict(params))),
        )
        assert [i.step for i in ckpt.list()] == [1, 2, 3]
        lists = [p for name, p in calls if name == "ListObjectsV2"]
        # a delimited listing of the names, or the one-key probe of whether the root exists
        assert lists and all(p.get("Delimiter") == "/" or p.get("MaxKeys") == 1 for p in lists), (
            calls
        )
        heads = [p["Key"] for name, p in calls if name == "HeadObject"]
        assert sorted(k.rsplit("/", 2)[-2] for k in heads) == [
            "step-0000000001",
            "step-0000000002",
            "step-0000000003",
        ]
