"""The content-addressed store: names are sha256, writes are atomic and idempotent."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from service.storage import LocalStore, Store


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


def test_put_bytes_is_named_by_sha256_and_readable(store: LocalStore) -> None:
    data = b"stacked attention" * 1000
    sha = store.put_bytes(data)
    assert sha == hashlib.sha256(data).hexdigest()
    assert store.exists(sha) and store.size(sha) == len(data)
    with store.open(sha) as f:
        assert f.read() == data
    path = store.local_path(sha)
    assert path is not None and path.read_bytes() == data


def test_put_file_matches_put_bytes(store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "lib.so"
    src.write_bytes(bytes(range(256)) * 9000)  # several read chunks
    sha = store.put_file(src)
    assert sha == hashlib.sha256(src.read_bytes()).hexdigest()
    assert store.put_bytes(src.read_bytes()) == sha


def test_writes_are_idempotent_and_leave_no_temporaries(store: LocalStore) -> None:
    shas = set()

    def put() -> None:
        shas.add(store.put_bytes(b"same content, delivered twice"))

    threads = [threading.Thread(target=put) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(shas) == 1
    assert list((store.root / "tmp").iterdir()) == []
    objects = [p for p in store.root.rglob("*") if p.is_file()]
    assert len(objects) == 1


def test_unknown_and_malformed_names(store: LocalStore) -> None:
    assert not store.exists("0" * 64)
    assert not store.exists("../../etc/passwd")
    assert store.local_path("0" * 64) is None
    with pytest.raises(FileNotFoundError):
        store.open("0" * 64)
    with pytest.raises(ValueError):
        store.open("../../etc/passwd")


def test_local_store_satisfies_the_protocol(store: LocalStore) -> None:
    s: Store = store  # a type check as much as a test: mypy verifies the structural match
    assert s.put_bytes(b"x") == hashlib.sha256(b"x").hexdigest()
