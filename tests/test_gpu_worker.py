"""benchmarks/gpu_worker.py and what it rests on: GPU pinning of `stackfuse worker --count N`,
the validation job for a library built elsewhere, and the service half of the GPU check, run
here without a GPU (validation then says why it did not run). The GPU half is marked ``gpu``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import gpu_worker
from worker import tasks, validate
from worker.toolchain import has_gpu

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


# --- GPU ids and pinning ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("visible", "ids"),
    [
        ("0", ["0"]),
        ("2,3", ["2", "3"]),
        (" 1 , 0 ", ["1", "0"]),
        ("GPU-aa,GPU-bb", ["GPU-aa", "GPU-bb"]),
        ("0,-1,2", ["0"]),  # CUDA stops at the first invalid entry
        ("-1", []),
        ("", []),
    ],
)
def test_gpu_ids_follow_cuda_visible_devices(visible: str, ids: list[str]) -> None:
    assert tasks.gpu_ids({"CUDA_VISIBLE_DEVICES": visible}) == ids


def test_gpu_ids_ask_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-0f1e)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-2d3c)\n"
        "  MIG 1g.18gb Device 0: (UUID: MIG-aa)\n"
    )
    monkeypatch.setattr(tasks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        tasks.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing, stderr=""),
    )
    assert tasks.gpu_ids({}) == ["0", "1"]
    monkeypatch.setattr(tasks.shutil, "which", lambda name: None)
    assert tasks.gpu_ids({}) == []


def test_worker_env_pins_one_gpu_per_worker_round_robin() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "4,6"}
    pinned = [tasks.worker_env(i, ["4", "6"], base)["CUDA_VISIBLE_DEVICES"] for i in range(3)]
    assert pinned == ["4", "6", "4"]
    assert tasks.worker_env(0, [], {"PATH": "/bin"}) == {"PATH": "/bin"}
    assert base["CUDA_VISIBLE_DEVICES"] == "4,6"  # the parent's environment is left alone


@needs_redis
@pytest.mark.slow
def test_worker_count_starts_one_pinned_worker_per_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stackfuse worker --count 3` under CUDA_VISIBLE_DEVICES=5,7: three real RQ workers,
    each process running with one GPU of the two (read from /proc, as the GPU check does)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    services = gpu_worker.Services(tmp_path / "run", tmp_path, workers=3)
    try:
        services.start()
        seen = sorted(w["cuda_visible_devices"] for w in services.worker_pids().values())
    finally:
        services.stop()
    assert seen == ["5", "5", "7"]


# --- validation inputs ------------------------------------------------------------------------
def test_random_inputs_keep_ids_in_range_and_weights_scaled() -> None:
    rng = np.random.default_rng(0)
    ids = validate._random_input({"shape": [4, "s"], "dtype": "int64"}, rng)
    assert ids.shape == (4, 2) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < validate.INT_HIGH
    weight = validate._random_input({"shape": [1024, 256], "dtype": "float32", "weight": True}, rng)
    assert 0.04 < float(weight.std()) < 0.08  # 1 / sqrt(256)
    act = validate._random_input({"shape": [64, 64], "dtype": "float16"}, rng)
    assert act.dtype == np.float16 and 0.4 < float(act.astype(np.float32).std()) < 0.6


# --- prepare, and the service half of check ---------------------------------------------------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small case built as the device run's ``prepare`` builds it (nvcc: one kernel)."""
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    out = tmp_path_factory.mktemp("gpu-worker")
    gpu_worker.prepare(out, ["split_fp16_epilogue"])
    return out


@pytest.mark.nvcc
@pytest.mark.slow
def test_prepare_writes_both_libraries_redis_and_a_manifest(prepared: Path) -> None:
    manifest = json.loads((prepared / gpu_worker.MANIFEST).read_text())
    assert [c["name"] for c in manifest["cases"]] == ["split_fp16_epilogue"]
    case_dir = prepared / manifest["cases"][0]["dir"]
    for name in ("module.json", "model.so", "reference.so", "report.json", "signature.json"):
        assert (case_dir / name).stat().st_size > 0, name
    report = json.loads((case_dir / "report.json").read_text())
    assert report["summary"]["fused_stacked"] == 1
    assert report["validation"]["status"] == "not_run"  # no GPU here: the device fills it
    signature = json.loads((case_dir / "signature.json").read_text())
    assert signature[0]["dtype"] == "float16"
    with tarfile.open(prepared / gpu_worker.REDIS_TARBALL) as tar:
        names = tar.getnames()
    assert "redis/redis-server" in names
    libs = set(names) - {"redis", "redis/redis-server", "redis/lib"}
    assert libs and all(n.startswith("redis/lib/lib") for n in libs)
    assert manifest["redis"]["version"].startswith("Redis server")


@pytest.mark.nvcc
@pytest.mark.slow
def test_check_runs_the_service_half_without_a_gpu(prepared: Path, tmp_path: Path) -> None:
    """Redis (the carried binary), `stackfuse api`, two `stackfuse worker`s: the validation
    job succeeds over HTTP, its library downloads intact, and its report says validation did
    not run for want of a GPU; check() itself fails here, as it must without one."""
    if has_gpu():
        pytest.skip("a GPU is present: test_check_on_the_gpu covers it")
    out = tmp_path / "out"
    assert gpu_worker.check(prepared, out, workers=2) == 1
    doc: dict[str, Any] = json.loads((out / "gpu_worker.json").read_text())
    (row,) = doc["jobs"]
    assert row["status"] == "succeeded", doc["log_tails"]
    assert row["download_matches"] is True and row["artifact_http"] == 200
    assert row["validation"]["status"] == "not_run"
    assert "no GPU" in row["validation"]["reason"]
    assert gpu_worker.job_passed(row, need_gpu=False)
    assert not row["passed"]
    assert len(doc["worker_processes"]) == 2
    assert row["record"]["worker_pid"] and int(row["record"]["attempts"]) == 1
    assert "validate" in row["timings"]
    assert (out / "gpu_worker.md").read_text().startswith("# The GPU worker end to end")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU with a driver")
@pytest.mark.skipif(
    not os.environ.get("STACKFUSE_GPU_WORKER_DIR"),
    reason="set STACKFUSE_GPU_WORKER_DIR to a `prepare`d directory",
)
def test_check_on_the_gpu(tmp_path: Path) -> None:
    src = Path(os.environ["STACKFUSE_GPU_WORKER_DIR"])
    assert gpu_worker.check(src, tmp_path) == 0
