"""The object store (against the real SeaweedFS server the suite starts) and its manifest
publisher pass the shipped StoreConformance suite."""
from __future__ import annotations

import pytest

from datastates.testing import StoreConformance


class TestS3Store(StoreConformance):
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_root, s3_storage_options):
        self.root, self.options = s3_root, s3_storage_options

    def make_root(self, tmp_path):
        return self.root, dict(self.options)
