"""Every variant's library against an independent PyTorch reference, on a real GPU.

Skipped where there is no GPU (CI). On a GPU host with the full toolchain the cases are built
first; with a runtime-only TVM (our H200 runs) point STACKFUSE_GPU_CASES at libraries built by
``python -m benchmarks.gpu_cases build DIR``. Results of the H200 run are committed in
benchmarks/results/gpu_numerics.json.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker.toolchain import has_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU with a driver"),
]


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get("STACKFUSE_GPU_CASES")
    if prebuilt:
        return Path(prebuilt)
    from benchmarks.gpu_cases import build

    out = tmp_path_factory.mktemp("gpu-cases")
    build(out)
    return out


def test_every_case_matches_the_reference(cases_dir: Path) -> None:
    pytest.importorskip("torch")
    from benchmarks.gpu_cases import CASES, check

    results = check(cases_dir)
    assert len(results) == len(CASES)
    failed = [r for r in results if not r.get("passed")]
    assert not failed, failed
