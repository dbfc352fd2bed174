"""Which GEMM configuration family builds for an arch: :mod:`worker.gemm_sm90` (CUTLASS 3 Hopper)
on sm_90, :mod:`worker.gemm_sm80` (CUTLASS 2.x) on sm_80/86/89; elsewhere every matmul stays in
TVM."""

from __future__ import annotations

from types import ModuleType

from worker import gemm_sm80, gemm_sm90
from worker.gemm import GemmSpec
from worker.kernel_source import KernelSource


def family_for(arch: str) -> ModuleType | None:
    """The configuration family that builds GEMMs for ``arch`` (None: every matmul stays in
    TVM there)."""
    base = arch.rstrip("a")
    if base == "sm_90":
        return gemm_sm90
    if base in gemm_sm80.ARCHS:
        return gemm_sm80
    return None


def families() -> tuple[str, ...]:
    return (gemm_sm90.FAMILY, gemm_sm80.FAMILY)


def select_kernel(spec: GemmSpec, arch: str) -> tuple[KernelSource, str]:
    """(glue KernelSource, reason) for one GEMM site on ``arch``."""
    fam = family_for(arch)
    if fam is None:
        raise ValueError(f"no CUTLASS GEMM family builds for {arch}")
    return fam.select_kernel(spec, arch)
