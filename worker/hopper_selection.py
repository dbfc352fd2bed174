"""The Hopper selection as data: which variant each shape class runs, measured on an H200 (the
head-dim-96 tile's classes on an H100).

A key is :func:`worker.hopper.shape_class` of a spec: (tile head dim, causal?, size), where size
is "tiny" (fewer 128-row query tiles x heads x batch than the H200's 132 SMs), "small" (fewer
than two waves of them, or at most 256 keys) or "large". A value names one variant, or several
in order of preference: the first that takes the spec (``Variant.takes``: its key length fits,
its launch is small enough) is the pick.

Each entry's comment names the results row that justifies it: a shape of
``benchmarks/results/hopper_kernel.md`` (the kernel against SDPA and the other variants: the
``main`` and ``balance`` shape sets of ``benchmarks/hopper_kernel.py run --shapes``, measured
2026-12-01 with the shipped code; ``grid64`` and ``grid96``: ``hopper_kernel_grid64.md``,
``hopper_kernel_grid96.md``) or of ``benchmarks/results/attention_bench.md`` (the compiled
module against SDPA). A class with no row there says so, with the figure it was chosen on and
the commit that measured it.

The SM80-class kernel runs at 0.22-0.50x the chosen Hopper kernel at every row of
``attention_bench.md`` it takes (it takes no GQA), so no class maps to it; it stays the kernel
for what ``supports()`` rejects and for other archs. This module imports nothing of ours:
``worker.hopper`` imports it.
"""

from __future__ import annotations

#: (tile head dim, causal?, "tiny" | "small" | "large")
ShapeClass = tuple[int, bool, str]
#: one variant name, or names in order of preference
Choice = str | tuple[str, ...]

#: sliding-window attention (causal, ``window_size=W``) by tile head dim: the variants built with
#: a window (``Variant.window``) skip the key tiles outside it. The one variant that takes a
#: window, the causal pick at head dims 32, 96 and 128: attention_grid.md's windows 1.12-1.23x
#: FlexAttention (H100), no other variant measured with one. No variant at head dim 256 takes
#: one (``supports()`` refuses it; the site keeps the masked SM80-class path).
WINDOW_SELECTION: dict[int, Choice] = {
    32: "pingpongk_128x128",
    64: "pingpongk_128x128",
    96: "pingpongk_128x128",
    128: "pingpongk_128x128",
}

SELECTION: dict[ShapeClass, Choice] = {
    # hopper_kernel.md b8_s2048_n16_h32: 264 TFLOP/s, 1.14x SDPA's fastest
    (32, False, "large"): "overlap_128x128",
    # hopper_kernel.md b1_s4096_n16_h32_causal: 75.6 us vs ping-pong 110.9 (b8_s2048: level)
    (32, True, "large"): "pingpongk_128x128",
    # no current row; B16 S256 N16: 16.0 us vs ping-pong 16.6, 9 of 9 rounds (2b192ab)
    (32, False, "small"): ("pingpongq_128x128", "pingpong_128x128"),
    # no current row; B16 S256 N16 causal: 15.3 us vs ping-pong 15.8, 9 of 9 rounds (2b192ab)
    (32, True, "small"): ("pingpongq_128x128", "pingpongk_128x128"),
    # unmeasured: no benchmark shape falls in this class (GQA: ping-pong, see below)
    (32, False, "tiny"): ("tma_64x128", "pingpong_128x128"),
    # unmeasured; coop_128x64 lost by 23-35% at every head-dim-32 shape measured (1738cde)
    (32, True, "tiny"): "pingpong_128x128",
    # hopper_kernel.md b2_s8192_n16_h64: 500 TFLOP/s, 1.095x SDPA's fastest; at medium lengths
    # cuDNN leads (attention_grid.md: 0.88-0.99x at 6 shapes), and hopper_kernel_grid64.md has
    # no variant ahead of cuDNN there. Where 192-row blocks leave more than 5% of the rows
    # empty (S 512, 1024: overlap3's offered_row_waste), pingpong_128x128: 4% faster at B16 S512
    # N16 (hopper_kernel_grid64.md), still 0.90x cuDNN
    (64, False, "large"): ("overlap3_192x128", "pingpong_128x128"),
    # hopper_kernel.md b8_s2048_n16_h64_causal 1.07x SDPA; 12 large causal h64 rows 1.02-1.24x
    (64, True, "large"): "overlap3kls_192x128",
    # hopper_kernel.md b32_s128_n12_h64_bert (shortw 1.10x), b32_s256_n16_h64_gqa4 (shortwot 1.06x)
    (64, False, "small"): ("shortw_64x128", "shortwot_64x256", "pingpong_128x128"),
    # hopper_kernel.md b1_s2048_n16_h64_causal: pingpongk 27.6 us vs overlap3kls 30.8, ping-pong 37
    (64, True, "small"): ("shortw_64x128", "shortwot_64x256", "pingpongk_128x128"),
    # hopper_kernel.md b4_s128_n12_h64: shortwo_64x128 1.425x SDPA's fastest
    (64, False, "tiny"): ("shortwo_64x128", "shortwot_64x256", "tma_64x128", "pingpong_128x128"),
    # no current row; B4 S128 N12 causal: shortwo_64x128 3.51 us vs shortw 3.60, 9 of 9 (9466ce9)
    (64, True, "tiny"): ("shortwo_64x128", "shortwot_64x256", "pingpong_128x128"),
    # head dims 72-96 run in the 96 tile; the 128 tile's choices, measured at the attention
    # grid's 16 head-dim-80/96 shapes (hopper_kernel_grid96.md, H100: 1.03-1.38x SDPA's fastest;
    # the 96 tile 3-16% faster than the 128 tile at all 11 shapes timed in both).
    # b2_s4096_q10_kv2_h96_bf16 1.104x, b1_s8192_q16_kv1_h80 1.094x
    (96, False, "large"): "overlap_128x128",
    # b1_s8192_n16_h96_causal 1.229x, b1_s4096_q32_kv8_h80_causal 1.244x
    (96, True, "large"): "pingpongk_128x128",
    # b32_s256_q12_kv1_h96 1.059x (pingpongq 29.4 us in the 96 tile, 30.9 in the 128)
    (96, False, "small"): ("pingpongq_128x128", "pingpong_128x128"),
    # b64_s197_q12_kv1_h96_causal 1.108x
    (96, True, "small"): ("pingpongq_128x128", "pingpongk_128x128"),
    # b1_s512_n16_h96_bf16: tma1 9.9 us vs ping-pong 10.3, 1.121x; GQA
    # b8_s128_q12_kv3_h80_bf16: ping-pong 1.035x
    (96, False, "tiny"): ("tma1_64x128", "pingpong_128x128"),
    # b1_s1024_n8_h80_causal: tma1 14.9 us vs ping-pong 15.5, 1.221x; GQA
    # b8_s128_q12_kv1_h96_causal_bf16: ping-pong 1.028x
    (96, True, "tiny"): ("tma1_64x128", "pingpong_128x128"),
    # hopper_kernel.md b8_s2048_n16_h128, b4_s4096_n32_h128, its _gqa and _bf16: 1.03x each
    (128, False, "large"): "overlap_128x128",
    # hopper_kernel.md b1_s4096_n16_h128_causal: 123.3 us vs ping-pong 162.3; b8_s2048: 1.09x
    (128, True, "large"): "pingpongk_128x128",
    # no current row; B16 S256 N16: 24.4 us vs ping-pong 25.0, 9 of 9 rounds (2b192ab)
    (128, False, "small"): ("pingpongq_128x128", "pingpong_128x128"),
    # hopper_kernel.md b1_s2048_n16_h128_causal: pingpongk 34.6 us vs ping-pong 45.0
    (128, True, "small"): ("pingpongq_128x128", "pingpongk_128x128"),
    # attention_bench.md b1_s512_n16_h128: 1.13x SDPA's fastest (vs ping-pong: 3425fc6); the
    # tma variants take no GQA (one launch per query head of a group: 0.30x in
    # attention_grid.md), so grouped sites take ping-pong
    (128, False, "tiny"): ("tma1_64x128", "pingpong_128x128"),
    # no current row; B1 S512 N16 causal: 10.5 us vs ping-pong 12.2 (3425fc6)
    (128, True, "tiny"): ("tma1_64x128", "pingpong_128x128"),
    # hopper_kernel.md b4_s2048_n8_h256: 728 TFLOP/s, 1.08x SDPA's fastest
    (256, False, "large"): "overlapoq_128x64",
    # no current row; B4 S2048 N8 causal: 124.6 us vs overlapc 141.8, 9 of 9 rounds (c866e95)
    (256, True, "large"): "overlapoq_128x64",
    # no current row; B16 S256 N8: 25.1 us vs overlapc 27.7, 9 of 9 rounds (c866e95)
    (256, False, "small"): "overlapoq_128x64",
    # no current row; B16 S256 N8 causal: 23.7 us vs overlapc 26.8, 9 of 9 rounds (c866e95)
    (256, True, "small"): "overlapoq_128x64",
    # no current row; B1 S1024 N8 (one partial wave): 25.5 us vs overlapoq 25.8 (c866e95)
    (256, False, "tiny"): "overlapc_128x64",
    # no current row; B1 S1024 N8 causal: 25.7 us vs overlapoq 26.2 (c866e95)
    (256, True, "tiny"): "overlapc_128x64",
}
