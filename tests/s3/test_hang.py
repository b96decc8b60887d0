"""An object store that accepts connections and never answers (the real SeaweedFS server stopped
with SIGSTOP): building a Checkpointer, a save in flight (its uploads, and its capture held up
by a full host cache) and a restore each end with a typed error instead of hanging; nothing is
committed, the training process goes on, and once the server answers again the previous
checkpoint restores bit-exactly and no multipart upload of the failed save is left.

Every call that could hang runs on a thread joined with a generous limit: the limit only tells
a hang from an answer, it measures no speed."""

import threading

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer
from datastates.errors import CommitTimeoutError, ConfigError, StorageError

from server import list_multipart_uploads, storage_options
from test_objstore import key_of, make_state, objects_under, same

MiB = 1 << 20
HANG_LIMIT_S = 180.0  # far above every bound below: reaching it means the call hung
#: Fail fast: a request to the stopped server fails after about 2 x 2 s.
FAST = {"connect_timeout": 1, "read_timeout": 2, "max_attempts": 2}
#: Requests that outlast the commit deadline (a stalled send or reply fails after 2 x 10 s,
#: against commit_timeout_s=6).
PATIENT = {"connect_timeout": 10, "read_timeout": 10, "max_attempts": 2}

# slow: each test waits out a deadline against a hung server
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:datastates.*could (still )?not be removed:RuntimeWarning"),
]


def outcome_of(fn):
    """Run ``fn`` on a thread; its result or the exception it raised. Fails the test if it has
    not returned within HANG_LIMIT_S."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # the outcome under test
            box["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_LIMIT_S)
    assert not thread.is_alive(), f"still blocked after {HANG_LIMIT_S:g} s: it hangs"
    return box["value"]


def pause_after_first_part(server, ckpt):
    """Stop the server right after the first part upload of ``ckpt`` is acknowledged."""

    def pause(**_):
        if not paused:
            paused.append(True)
            server.pause()

    paused: list[bool] = []
    ckpt.store.client.meta.events.register("after-call.s3.UploadPart", pause)
    return paused


def tensors(seed: int, count: int, numel: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(numel, generator=gen) for i in range(count)}


def test_default_request_limits_fail_in_seconds(s3_server, s3_root):
    """Without options a request stalls at most 5 s connecting or sending, 10 s waiting for the
    reply, and is tried 3 times; each limit can be set in storage_options, and is validated."""
    with Checkpointer(s3_root, storage_options=storage_options(s3_server)) as ckpt:
        config = ckpt.store.client.meta.config
        assert (config.connect_timeout, config.read_timeout) == (5.0, 10.0)
        assert config.retries["total_max_attempts"] == 3
    with Checkpointer(s3_root, storage_options={**storage_options(s3_server), **FAST}) as ckpt:
        config = ckpt.store.client.meta.config
        assert (config.connect_timeout, config.read_timeout) == (1, 2)
        assert config.retries["total_max_attempts"] == 2
    for bad in (
        {"read_timeout": 0},
        {"connect_timeout": "5"},
        {"read_timeout": True},
        {"max_attempts": 0},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            Checkpointer(s3_root, storage_options={**storage_options(s3_server), **bad})


def test_building_a_checkpointer_on_a_hung_server_fails(s3_server, s3_root):
    with s3_server.paused():
        error = outcome_of(
            lambda: Checkpointer(s3_root, storage_options={**storage_options(s3_server), **FAST})
        )
    assert isinstance(error, StorageError), error
    assert "checking bucket" in str(error) and "read_timeout=2" in str(error)
    with Checkpointer(s3_root, storage_options={**storage_options(s3_server), **FAST}) as ckpt:
        assert ckpt.list() == []  # the server answers again: nothing was left in the way


def test_a_save_whose_upload_hangs_fails_at_its_deadline(s3_server, s3_root):
    """The server stops after the first part of step 2: its wait() raises CommitTimeoutError
    (the deadline of 6 s passes before a request could time out), nothing is committed, the
    same Checkpointer saves again once the server is back, its upload is aborted while the
    process lives, its data removed, and step 1 restores bit-exactly."""
    options = {**storage_options(s3_server), **PATIENT}
    model, _ = make_state(width=1024)  # 16 MiB: parts 2 and 3 go out during the save
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(s3_root, storage_options=options) as ckpt:
        ckpt.save({"model": model}, step=1).wait()
    config = CheckpointConfig(chunk_bytes=64 << 10, host_cache_bytes=32 * MiB, commit_timeout_s=6)
    ckpt = Checkpointer(s3_root, config, storage_options=options)
    try:
        with torch.no_grad():
            model[0].weight.add_(1.0)
        paused = pause_after_first_part(s3_server, ckpt)
        try:
            handle = ckpt.save({"model": model}, step=2)
            error = outcome_of(handle.wait)
            assert paused == [True]  # the server was stopped while the save was in flight
        finally:
            s3_server.resume()
        assert isinstance(error, CommitTimeoutError), repr(error)
        assert "nothing was committed" in str(error)
        assert [i.step for i in ckpt.list()] == [1]
        ckpt.save({"x": torch.arange(5.0)}, tag="after", step=3).wait()  # the pipeline lives on
    finally:
        outcome_of(ckpt.close)
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []
    assert not [f for f in objects_under(s3_server, s3_root) if f.startswith("step-0000000002")]
    with Checkpointer(s3_root, storage_options=options) as ckpt:
        assert [i.name for i in ckpt.list()] == ["step-0000000001", "after"]
        assert same(ckpt.load(step=1)["model"], reference)


def test_a_save_held_up_by_a_full_host_cache_returns_at_its_deadline(s3_server, s3_root):
    """The server stops while a state four times the host cache streams through it: the
    uploads hold every cache slot, so save() itself waits (backpressure) — until the deadline,
    when the save fails with CommitTimeoutError, nothing is committed, and its upload is
    aborted once the server answers again."""
    options = {**storage_options(s3_server), **PATIENT}
    config = CheckpointConfig(chunk_bytes=8 * MiB, host_cache_bytes=16 * MiB, commit_timeout_s=6)
    state = tensors(seed=0, count=8, numel=2 * MiB)  # 64 MiB of eager tensors
    ckpt = Checkpointer(s3_root, config, storage_options=options)
    try:
        paused = pause_after_first_part(s3_server, ckpt)
        try:
            handle = outcome_of(lambda: ckpt.save(state, step=1))
            error = outcome_of(handle.wait)
            assert paused == [True]
        finally:
            s3_server.resume()
        assert isinstance(error, CommitTimeoutError), repr(error)
        assert ckpt.list() == []
    finally:
        outcome_of(ckpt.close)
    assert list_multipart_uploads(s3_server, key_of(s3_root)) == []
    assert [f for f in objects_under(s3_server, s3_root) if f.endswith(".dsf")] == []


def test_a_restore_from_a_hung_server_fails_and_changes_nothing(s3_server, s3_root):
    model, _ = make_state(seed=1, width=64)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(s3_root, storage_options={**storage_options(s3_server), **FAST}) as ckpt:
        ckpt.save({"model": model}, step=1).wait()
        live, _ = make_state(seed=2, width=64)
        before = {k: v.clone() for k, v in live.state_dict().items()}
        with s3_server.paused():
            error = outcome_of(lambda: ckpt.restore({"model": live}))
        assert isinstance(error, StorageError), repr(error)
        assert "read_timeout=2" in str(error)
        assert same(live.state_dict(), before)  # nothing was applied
        assert ckpt.restore({"model": live}).step == 1
        assert same(live.state_dict(), reference)
