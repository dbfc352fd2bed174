"""Fixtures for compiler-core tests: one kernel cache for the whole session.

nvcc costs ~10 s per attention config on 2 cores; every test that compiles shares this cache
(and so does anything else honouring STACKFUSE_KERNEL_CACHE_DIR), so CI pays once per config.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.settings import Settings


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = os.environ.get("STACKFUSE_KERNEL_CACHE_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("kernels")


@pytest.fixture
def kernel_settings(kernel_cache_dir: Path, tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", kernel_cache_dir=kernel_cache_dir)
