"""Which Hopper GEMM tile configuration runs each shape class: data, from H200 measurements.

A shape class is (rows, N, K): rows = M (the folded batch x sequence) in three bands, N narrow
(<= 1024) or wide, K shallow (<= 1024) or deep. A symbolic M counts as large (serving
batches). Each entry names the tile (``worker.gemm_sm90.TILES``) and the rows of
``benchmarks/results/gemm_bench.md`` (``python -m benchmarks.gemm_bench run``, every tile at
every shape, bias epilogue, both weight layouts) that justify it: the tile with the best
geometric mean against cuBLAS over the class's rows.
"""

from __future__ import annotations

from worker.gemm import GemmSpec

#: (rows band, N band, K band) -> (tile name, why)
SELECTION: dict[tuple[str, str, str], tuple[str, str]] = {
    ("small", "narrow", "shallow"): ("coop_128x192_c1x2", "no row; as small/wide/shallow"),
    # every tile is within 0.58-0.62x of cuBLAS's split-K here (32 output tiles on 132 SMs)
    ("small", "narrow", "deep"): ("pingpong_128x128_c1x2", "grid_m512_n1024_k4096"),
    ("small", "wide", "shallow"): ("coop_128x192_c1x2", "grid_m512_n4096_k1024"),
    ("small", "wide", "deep"): ("coop_256x128_c1x2", "grid_m512_n8192_k8192"),
    ("medium", "narrow", "shallow"): ("pingpong_128x192", "bert_proj"),
    ("medium", "narrow", "deep"): ("coop_128x192_c1x2", "bert_fc2"),
    ("medium", "wide", "shallow"): ("pingpong_128x192", "bert_qkv, bert_fc"),
    ("medium", "wide", "deep"): (
        "pingpong_128x128_c1x2",
        "llama_qkv, llama_o, llama_up, llama_down",
    ),
    ("large", "narrow", "shallow"): ("pingpong_128x128_c1x2", "gpt2_proj"),
    ("large", "narrow", "deep"): ("pingpong_128x128_c1x2", "gpt2_fc2, grid_m16384_n1024_k4096"),
    ("large", "wide", "shallow"): (
        "pingpong_128x192",
        "gpt2_qkv, gpt2_fc, grid_m16384_n4096_k1024",
    ),
    ("large", "wide", "deep"): ("coop_128x256_swz8", "grid_m16384_n8192_k8192"),
}


def shape_class(spec: GemmSpec) -> tuple[str, str, str]:
    m = spec.m if isinstance(spec.m, int) else 1 << 20
    m *= spec.batch if isinstance(spec.batch, int) else 1
    rows = "small" if m <= 1024 else "medium" if m <= 4096 else "large"
    return rows, "narrow" if spec.n <= 1024 else "wide", "shallow" if spec.k <= 1024 else "deep"


def pick(spec: GemmSpec) -> tuple[str, str]:
    """(tile name, the reason the report gives)."""
    rows, cols, depth = shape_class(spec)
    name, why = SELECTION[(rows, cols, depth)]
    return name, (
        f"the H200-measured pick for {rows} M, {cols} N, {depth} K "
        f"(benchmarks/results/gemm_bench.md: {why})"
    )
