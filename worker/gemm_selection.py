"""Which Hopper GEMM tile configuration runs each shape class: data, from H200 measurements.

A shape class is (rows, N, K): rows = M (the folded batch x sequence) in three bands, N narrow
(<= 1024), mid (<= 2048) or wide, K shallow (<= 1024) or deep. A symbolic M counts as large
(serving batches). Each entry names the tile (``worker.gemm_sm90.TILES``) and the rows that
justify it: the tile with the best geometric mean against cuBLAS over the class's rows, from
``benchmarks/results/gemm_tiles*.md`` (every tile, bias epilogue, both weight layouts) and
``benchmarks/results/gemm_bench.md`` (each model GEMM with its own epilogue and layout, five
tiles). One epilogue changes the pick: an erf GELU after a shallow K (``EPILOGUE_PICKS``).
TF32 (float32) GEMMs take the same tiles at half their K (``gemm_bench_tf32.md``).
"""

from __future__ import annotations

from worker.gemm import GemmSpec

#: (rows band, N band, K band) -> (tile name, why)
SELECTION: dict[tuple[str, str, str], tuple[str, str]] = {
    ("small", "narrow", "shallow"): ("coop_128x192_c1x2", "no row; as small/wide/shallow"),
    # every tile is within 0.58-0.62x of cuBLAS's split-K here (32 output tiles on 132 SMs)
    ("small", "narrow", "deep"): ("pingpong_128x128_c1x2", "grid_m512_n1024_k4096"),
    ("small", "mid", "shallow"): ("coop_128x192_c1x2", "no row; as small/wide/shallow"),
    ("small", "mid", "deep"): ("coop_256x128_c1x2", "no row; as small/wide/deep"),
    ("small", "wide", "shallow"): ("coop_128x192_c1x2", "grid_m512_n4096_k1024"),
    ("small", "wide", "deep"): ("coop_256x128_c1x2", "grid_m512_n8192_k8192"),
    ("medium", "narrow", "shallow"): ("pingpong_128x192", "bert_proj"),
    ("medium", "narrow", "deep"): ("coop_128x192_c1x2", "bert_fc2"),
    ("medium", "mid", "shallow"): ("pingpong_128x192", "no row; as medium/wide/shallow"),
    # N = 2048 is 8 columns of 256: 128 tiles at M = 2048, one wave on 132 SMs
    ("medium", "mid", "deep"): ("coop_128x256_c1x2", "llama_o, llama_down"),
    ("medium", "wide", "shallow"): ("pingpong_128x192", "bert_qkv"),
    ("medium", "wide", "deep"): ("pingpong_128x192", "llama_qkv, llama_gate, llama_up"),
    ("large", "narrow", "shallow"): ("pingpong_128x128_c1x2", "gpt2_proj"),
    ("large", "narrow", "deep"): ("pingpong_128x128_c1x2", "gpt2_fc2, grid_m16384_n1024_k4096"),
    ("large", "mid", "shallow"): ("pingpong_128x192", "no row; as large/wide/shallow"),
    ("large", "mid", "deep"): ("coop_128x256_swz8", "no row; as large/wide/deep"),
    ("large", "wide", "shallow"): (
        "pingpong_128x192",
        "gpt2_qkv, gpt2_fc, grid_m16384_n4096_k1024",
    ),
    ("large", "wide", "deep"): ("coop_128x256_swz8", "grid_m16384_n8192_k8192"),
}

#: (activation, rows band, K band) -> (tile name, why), consulted before SELECTION. The erf
#: GELU costs more than a 768-deep mainloop: a ping-pong warp group's epilogue then outlasts its
#: partner's mainloop, while the cooperative kernel splits each tile's epilogue over both
#: (bert_fc: 1.12x cuBLAS + GELU on coop_256x128_c1x2, 0.94x on pingpong_128x192)
EPILOGUE_PICKS: dict[tuple[str, str, str], tuple[str, str]] = {
    ("gelu", "medium", "shallow"): ("coop_256x128_c1x2", "bert_fc"),
}


#: rows band -> (tile name, why) for a paired SwiGLU (gate and up projections as one GEMM of
#: N = 2I). Llama-style 2048 x 11264 x 2048 is 1408 tiles of 128x128, 10.7 waves on 132 SMs (97%
#: of the last full), against 704 of 128x256 or 944 of 128x192 (89%); and the ping-pong kernel
#: runs one warp group's epilogue (a register-to-global store) while the other's mainloop runs.
#: Measured on an H100 (benchmarks/results/gemm_bench_glu.md): 600/570 TFLOP/s, where
#: coop_128x256 and pingpong_128x192 reach 545-563. Only that medium-M row is measured; the other
#: bands take the same tile.
PAIRED_PICKS: dict[str, tuple[str, str]] = {
    "small": ("pingpong_128x128_c1x2", "no row; as medium"),
    "medium": ("pingpong_128x128_c1x2", "llama_gate_up"),
    "large": ("pingpong_128x128_c1x2", "no row; as medium"),
}


def shape_class(spec: GemmSpec) -> tuple[str, str, str]:
    m = spec.m if isinstance(spec.m, int) else 1 << 20
    m *= spec.batch if isinstance(spec.batch, int) else 1
    rows = "small" if m <= 1024 else "medium" if m <= 4096 else "large"
    cols = "narrow" if spec.n <= 1024 else "mid" if spec.n <= 2048 else "wide"
    return rows, cols, "shallow" if spec.k <= 1024 else "deep"


def pick(spec: GemmSpec) -> tuple[str, str]:
    """(tile name, the reason the report gives)."""
    rows, cols, depth = shape_class(spec)
    if spec.paired_glu:
        name, why = PAIRED_PICKS[rows]
        return name, (
            f"the paired SwiGLU's pick for {rows} M "
            f"(H100, benchmarks/results/gemm_bench_glu.md: {why})"
        )
    by_epilogue = EPILOGUE_PICKS.get((spec.activation, rows, depth))
    if by_epilogue is not None:
        name, why = by_epilogue
        return name, (
            f"the H200-measured pick for a {spec.activation} epilogue after {depth} K, {rows} M "
            f"(benchmarks/results/gemm_bench.md: {why})"
        )
    name, why = SELECTION[(rows, cols, depth)]
    return name, (
        f"the H200-measured pick for {rows} M, {cols} N, {depth} K "
        f"(benchmarks/results/gemm_bench.md: {why})"
    )
