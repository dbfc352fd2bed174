"""Hopper (sm_90a) GEMMs: CUTLASS 3.x TMA + warp-specialized kernels with fused epilogues.

A *configuration* (element type, B's layout, tile, cluster, schedule, tile scheduler,
activation) is one CUTLASS instantiation compiled once into an object that exports a
``LaunchFn`` (``kernels/gemm_api.h``); the problem size is run-time data, so a handful of
configurations serve every GEMM of every model. Each site gets a few lines of TVM-FFI glue
(``kernels/gemm_tvm.cuh``) with its operand checks, linked with the configuration it calls.

The epilogue is CUTLASS's visitor tree ``act(acc + beta * C + bias)`` (``LinCombPerColBiasEltAct``):
a null bias reads as zeros and ``beta = 0`` never loads C, so one configuration per activation
serves bias, no bias, a residual or neither. The paired SwiGLU (``GemmSpec.paired_glu``) has an
epilogue of its own (``kernels_glu/gemm_sm90_glu.cuh``): gate and up projections as one GEMM on
interleaved weights, ``silu(gate) * up`` paired in registers, half the GEMM's width written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from worker import gemm_sites
from worker.gemm import SWIGLU, GemmSpec
from worker.gemm_sites import (  # noqa: F401 (EPILOGUE_VARIANTS, SILU_GATE: re-exported)
    EPILOGUE_VARIANTS,
    GLU_KERNELS_DIR,
    SILU_GATE,
    variant_configs,
    variant_spec,
)
from worker.kernel_source import KernelSource
from worker.nvcc import headers_digest

FAMILY = "cutlass_gemm_sm90"
KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"

#: float32 operands: the collective builder runs them as TF32 (``tfloat32_t`` MMA)
_CUTLASS_TYPE = {
    "float16": "cutlass::half_t",
    "bfloat16": "cutlass::bfloat16_t",
    "float32": "float",
}
_ACT = {
    "none": "cutlass::epilogue::thread::Identity",
    "relu": "cutlass::epilogue::thread::ReLu",
    "gelu": "cutlass::epilogue::thread::GELU",
    "gelu_tanh": "cutlass::epilogue::thread::GELU_taylor",
    "silu": "cutlass::epilogue::thread::SiLu",
}


@dataclass(frozen=True)
class Tile:
    """One tile configuration: CTA tile, cluster, mainloop schedule and tile scheduler."""

    name: str
    m: int
    n: int
    k: int
    cluster_m: int
    cluster_n: int
    schedule: str  # "Cooperative" | "Pingpong"
    scheduler: str  # "persistent" | "streamk"
    #: the scheduler's tile swizzle, a run-time argument (1: none)
    swizzle: int = 1

    @property
    def words(self) -> str:
        sched = "stream-K" if self.scheduler == "streamk" else "persistent"
        swz = f", swizzle {self.swizzle}" if self.swizzle > 1 else ""
        return (
            f"{self.m}x{self.n}x{self.k} tile, cluster {self.cluster_m}x{self.cluster_n}, "
            f"{self.schedule.lower()} warp specialization, {sched} scheduler{swz}"
        )


_SCHEDULER = {
    "persistent": "cutlass::gemm::PersistentScheduler",
    "streamk": "cutlass::gemm::StreamKScheduler",
}


def _tiles() -> list[Tile]:
    base = [
        Tile("pingpong_128x128", 128, 128, 64, 2, 1, "Pingpong", "persistent"),
        Tile("pingpong_128x128_c1x2", 128, 128, 64, 1, 2, "Pingpong", "persistent"),
        Tile("pingpong_64x256", 64, 256, 64, 2, 1, "Pingpong", "persistent"),
        Tile("coop_128x128", 128, 128, 64, 2, 1, "Cooperative", "persistent"),
        Tile("coop_128x256", 128, 256, 64, 2, 1, "Cooperative", "persistent"),
        Tile("coop_128x256_c1x2", 128, 256, 64, 1, 2, "Cooperative", "persistent"),
        Tile("coop_256x128_c1x2", 256, 128, 64, 1, 2, "Cooperative", "persistent"),
        # N = 192: 768-wide layers (BERT-base, GPT-2 small) in 4 column tiles, one wave at M 4096
        Tile("pingpong_128x192", 128, 192, 64, 2, 1, "Pingpong", "persistent"),
        Tile("coop_128x192", 128, 192, 64, 2, 1, "Cooperative", "persistent"),
        Tile("coop_128x192_c1x2", 128, 192, 64, 1, 2, "Cooperative", "persistent"),
        # stream-K (CUTLASS's heuristic: data-parallel, split-K or stream-K per problem, at run
        # time); the ping-pong kernel has no stream-K scheduler
        Tile("coop_128x128_streamk", 128, 128, 64, 2, 1, "Cooperative", "streamk"),
        Tile("coop_128x256_streamk", 128, 256, 64, 2, 1, "Cooperative", "streamk"),
        Tile("coop_256x128_c1x2_streamk", 256, 128, 64, 1, 2, "Cooperative", "streamk"),
    ]
    out = []
    for t in base:
        out.append(t)
        out.append(replace(t, name=f"{t.name}_swz8", swizzle=8))
    return out


#: every tile configuration the selector may pick (each with and without an 8-tile swizzle;
#: the candidates benchmarks/gemm_bench.py measures against cuBLAS)
TILES: dict[str, Tile] = {t.name: t for t in _tiles()}


def config_type(spec: GemmSpec, tile: Tile) -> str:
    """The C++ ``Config<...>`` of ``tile`` for ``spec``: everything the CUTLASS instantiation
    depends on (the problem size is not part of it). A float32 (TF32) configuration takes half
    the tile's K: the same bytes per shared-memory stage as its 16-bit twin."""
    tile_k = tile.k // 2 if spec.dtype == "float32" else tile.k
    if spec.has_gate:
        act = "stackfuse::gemm::SiLuGate"
    elif spec.paired_glu:
        act = "stackfuse::gemm::SwiGluPaired"
    else:
        act = _ACT[spec.activation]
    return (
        f"stackfuse::gemm::Config<{_CUTLASS_TYPE[spec.dtype]}, "
        f"{'true' if spec.b_kmajor else 'false'}, {tile.m}, {tile.n}, {tile_k}, "
        f"{tile.cluster_m}, {tile.cluster_n}, stackfuse::gemm::{tile.schedule}, "
        f"{_SCHEDULER[tile.scheduler]}, "
        f"{act}, "
        f"{'true' if spec.c_operand >= 0 else 'false'}>"
    )


def include_dirs() -> list[Path]:
    from worker.toolchain import find_toolchain

    chain = find_toolchain()
    return [KERNELS_DIR, *chain.cutlass_includes]


def render_config(spec: GemmSpec, tile: Tile) -> KernelSource:
    """The translation unit of one configuration: the CUTLASS kernel and its launcher, exported
    as a ``LaunchFn`` named by a digest of the configuration, shared by every site and model
    that needs it (the expensive compile)."""
    cfg = config_type(spec, tile)
    symbol = "stackfuse_gcfg_" + hashlib.sha256(cfg.encode()).hexdigest()[:24]
    header = (
        f"// Generated by stackfuse worker.gemm_sm90 ({FAMILY} configuration). Type names only."
    )
    include, dirs = "gemm_sm90.cuh", include_dirs()
    if spec.paired_glu:  # its epilogue is in a header of its own, keyed here by its digest
        header += f"\n// {GLU_KERNELS_DIR.name} sha256 {headers_digest(GLU_KERNELS_DIR)}"
        include, dirs = "gemm_sm90_glu.cuh", [GLU_KERNELS_DIR, *dirs]
    source = f"""{header}
#include "{include}"

namespace stackfuse {{
namespace gemm {{

Status {symbol}(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error) {{
  return launch<{cfg}>(p, stream, cuda_error);
}}

}}  // namespace gemm
}}  // namespace stackfuse
"""
    return KernelSource(
        symbol=symbol,
        source=source,
        family=FAMILY,
        flags=(GENCODE, *(f"-I{p}" for p in dirs)),
        config={
            "tile": tile.name,
            "dtype": spec.dtype,
            "b_layout": "k_major" if spec.b_kmajor else "n_major",
            "activation": spec.activation,
            "source_c": spec.c_operand >= 0,
            **({"gate": True} if spec.has_gate else {}),
            **({"activation": SWIGLU, "paired_glu": True} if spec.paired_glu else {}),
            "type": cfg,
        },
    )


def supports(spec: GemmSpec, arch: str) -> str | None:
    """Why no sm_90 GEMM configuration can run ``spec``, or None."""
    if arch.rstrip("a") != "sm_90":
        return f"target arch {arch} is not sm_90"
    if spec.paired_glu and (spec.dtype == "float32" or spec.n % 16 or spec.has_gate):
        return (
            f"a paired SwiGLU needs float16 or bfloat16 and N = 2I a multiple of 16 "
            f"({spec.dtype}, N = {spec.n})"
        )
    return gemm_sites.supports_site(spec)


def render(spec: GemmSpec, tile: Tile) -> KernelSource:
    """The TVM-FFI glue of one site, calling the configuration of ``tile``."""
    why = supports(spec, "sm_90")
    if why is not None:
        raise ValueError(why)
    return gemm_sites.render_site(
        spec,
        render_config(spec, tile),
        family=FAMILY,
        gencode=GENCODE,
        tile=tile.name,
        swizzle=tile.swizzle,
    )


# --------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------
def tile_counts(tile: Tile, m: int, n: int) -> int:
    return -(-m // tile.m) * -(-n // tile.n)


def select(spec: GemmSpec) -> tuple[Tile, str]:
    """The tile configuration for ``spec`` and why (shown in the report)."""
    from worker.gemm_selection import pick

    name, why = pick(spec)
    return TILES[name], why


def select_kernel(spec: GemmSpec, arch: str) -> tuple[KernelSource, str]:
    """(glue KernelSource, reason) for one GEMM site on ``arch``."""
    tile, why = select(spec)
    ks = render(spec, tile)
    epi = " + ".join(spec.epilogue()) or "no epilogue"
    if spec.paired_glu:
        epi = (
            f"silu(gate) * up, gate and up projections as one GEMM (N = {spec.n}, output "
            f"{spec.out_n} columns), columns paired in registers"
        )
    layout = "[N, K] read transposed" if spec.b_kmajor else "[K, N] as stored"
    tf32 = "TF32 (options.allow_tf32), " if spec.dtype == "float32" else ""
    reason = f"CUTLASS 3 Hopper GEMM ({tf32}{tile.words}; epilogue: {epi}; B {layout}): {why}"
    return ks, reason


def render_configuration(
    dtype: str, tile: str, b_kmajor: bool, activation: str, residual: bool
) -> KernelSource:
    """:func:`render_config` without a site (prebuild and the GEMM benchmark): see
    :func:`worker.gemm_sites.variant_spec`."""
    return render_config(variant_spec(dtype, b_kmajor, activation, residual), TILES[tile])


def selected_configs(dtypes: tuple[str, ...] = ("float16", "bfloat16")) -> list[KernelSource]:
    """Every configuration the selection can pick, one per C++ type: each selected tile, for
    both weight layouts, with each of EPILOGUE_VARIANTS but the paired SwiGLU, and the paired
    SwiGLU on its own picks (``PAIRED_PICKS``). What ``stackfuse prebuild`` compiles beside the
    attention configurations."""
    from worker.gemm_selection import EPILOGUE_PICKS, PAIRED_PICKS, SELECTION

    tiles = sorted({tile for tile, _ in [*SELECTION.values(), *EPILOGUE_PICKS.values()]})
    paired = sorted({tile for tile, _ in PAIRED_PICKS.values()})
    return [
        *variant_configs(tiles, dtypes, render_configuration),
        *variant_configs(paired, dtypes, render_configuration, variants=[(SWIGLU, False)]),
    ]
