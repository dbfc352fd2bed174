"""Settings: the paths every process must agree on."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.settings import Settings


def test_relative_paths_become_absolute_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nvcc runs in the kernel's shard directory: a relative cache path named a file that did not
    # exist there, and every cold compile under the default data dir failed
    monkeypatch.chdir(tmp_path)
    for name in ("STACKFUSE_DATA_DIR", "STACKFUSE_KERNEL_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STACKFUSE_DATA_DIR", "rel")
    s = Settings()
    assert s.data_dir == tmp_path / "rel"
    assert s.resolved_kernel_cache_dir() == tmp_path / "rel" / "kernels"
    monkeypatch.setenv("STACKFUSE_KERNEL_CACHE_DIR", "cache")
    monkeypatch.setenv("STACKFUSE_DATA_DIR", "~/d")
    s = Settings()
    assert s.resolved_kernel_cache_dir() == tmp_path / "cache"
    assert s.data_dir == Path.home() / "d"


def test_the_default_data_dir_is_per_user_not_per_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STACKFUSE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert Settings().data_dir == tmp_path / "xdg" / "stackfuse"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert Settings().data_dir == Path.home() / ".local" / "share" / "stackfuse"
