"""The local (POSIX) store and its rename publisher pass the shipped StoreConformance suite."""

from __future__ import annotations

from datastates.testing import StoreConformance


class TestLocalStore(StoreConformance):
    def make_root(self, tmp_path):
        return str(tmp_path / "root"), None
