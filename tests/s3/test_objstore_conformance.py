"""The object store (against the real SeaweedFS server the suite starts) and its manifest
publisher pass the shipped StoreConformance suite."""

from __future__ import annotations

import pytest

from datastates.testing import StoreConformance

# slow: the whole StoreConformance suite against a real object store
pytestmark = pytest.mark.slow


class TestS3Store(StoreConformance):
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_root, s3_storage_options):
        self.root, self.options = s3_root, s3_storage_options

    def make_root(self, tmp_path):
        return self.root, dict(self.options)


def test_a_manifest_get_that_fails_hides_nothing_and_reuses_no_number(
    s3_server, s3_root, s3_storage_options
):
    """The server hangs at each GET of the newest manifest (it is stopped as that request is
    built; one try of at most a second), and only then: latest() raises StorageError instead of
    returning the older checkpoint, a commit raises CommitError instead of reusing that
    checkpoint's number, and once the server answers again the same Checkpointer sees it and
    commits seq 3."""
    import torch

    from datastates import CheckpointConfig, Checkpointer
    from datastates.format import codec as fmt
    from datastates.errors import CommitError, StorageError

    config = CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16)
    with Checkpointer(s3_root, config, storage_options=s3_storage_options) as writer:
        for step in (1, 2):
            writer.save({"x": torch.full((4,), float(step))}, step=step).wait(60)
    quick = {**s3_storage_options, "read_timeout": 1.0, "max_attempts": 1}
    with Checkpointer(s3_root, config, storage_options=quick) as ck:
        newest, hanging = f"{fmt.step_name(2)}/{fmt.MANIFEST}", [True]

        def hang(params, **_):
            if hanging[0] and params.get("Key", "").endswith(newest):
                s3_server.pause()

        ck.store.client.meta.events.register("before-parameter-build.s3.GetObject", hang)
        try:
            with pytest.raises(StorageError, match=fmt.step_name(2)):
                ck.latest()
            s3_server.resume()
            with pytest.raises(CommitError, match="commit number"):
                ck.save({"x": torch.full((4,), 3.0)}, step=3).wait(60)
        finally:
            hanging[0] = False
            s3_server.resume()
            ck.store.client.meta.events.unregister("before-parameter-build.s3.GetObject", hang)
        assert ck.latest().name == fmt.step_name(2)
        assert ck.save({"x": torch.full((4,), 3.0)}, step=3).wait(60).seq == 3
        assert [(i.name, i.seq) for i in ck.list()] == [(fmt.step_name(s), s) for s in (1, 2, 3)]
