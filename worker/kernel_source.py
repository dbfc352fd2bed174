"""What a kernel renderer hands the object cache, and what the cache hands back.

Every family (SM80-class FMHA, Hopper FMHA, Hopper GEMM) renders :class:`KernelSource` values;
:mod:`worker.nvcc` compiles them into :class:`CompiledKernel` objects. No TVM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class KernelSource:
    """One generated translation unit exporting ``symbol`` through the TVM-FFI ABI:

    ``symbol(operand_0, ..., operand_{n-1}, out)``, every argument a ``DLTensor*``; the stream is
    ``TVMFFIEnvGetStream(kDLCUDA, device_id)``; scratch memory comes from
    ``TVMBackendAllocWorkspace``; every launch is checked with ``cudaGetLastError``.
    """

    symbol: str
    source: str
    family: str
    #: extra nvcc flags beyond the common ones (arch flags included: -gencode ...)
    flags: tuple[str, ...] = ()
    config: dict[str, int | bool | str] = field(default_factory=dict)
    workspace_bytes: int | str = 0
    #: units this one calls into, compiled (and cached) apart and linked with it: the Hopper
    #: glue of one site needs its configuration's CUTLASS kernel, which other sites share
    needs: tuple[KernelSource, ...] = ()


@dataclass(frozen=True)
class CompiledKernel:
    symbol: str
    object_path: Path
    cache_key: str
    #: True when this object and every one it needs came from the cache
    cache_hit: bool
    #: wall seconds for this object and the ones it needs
    seconds: float
    #: the objects of ``KernelSource.needs`` (to link along), in order, without repeats
    needs: tuple[Path, ...] = ()

    @property
    def objects(self) -> tuple[Path, ...]:
        """Every object the link needs for this kernel: its own, then what it calls."""
        return (self.object_path, *self.needs)
