"""worker.hopper: what the Hopper FMHA takes, which variants it offers, and what it renders.

The GPU numerics and timings live in benchmarks/hopper_kernel.py (results in
benchmarks/results/hopper_kernel.md); here: CPU logic, and one real nvcc compile for sm_90a.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from worker import hopper
from worker.attention import DYNAMIC, AttentionSpec, BiasSpec, TensorAccess, stacked_spec
from worker.nvcc import COMMON_FLAGS, compile_object, headers_digest, include_flags, nvcc_argv
from worker.selection import select_kernel
from worker.toolchain import find_toolchain


def stacked(
    dtype: str = "float16",
    batch: int | str = 8,
    seq: int | str = 2048,
    nq: int = 16,
    nkv: int = 16,
    h: int = 128,
    causal: str = "none",
    window: int | None = None,
) -> AttentionSpec:
    return stacked_spec(
        dtype=dtype,
        nq=nq,
        nkv=nkv,
        h=h,
        causal=causal,  # type: ignore[arg-type]
        batch=batch,
        seq=seq,
        window=window,
    )


# --- supports ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "90"])
def test_supports_stacked_fp16_on_hopper(arch: str) -> None:
    assert hopper.supports(stacked(), arch) is None


@pytest.mark.parametrize(
    "spec",
    [
        stacked(dtype="bfloat16"),
        stacked(h=64),
        stacked(h=32),
        stacked(h=256),
        stacked(h=96),
        stacked(h=72),
        stacked(causal="TopLeft"),
        stacked(causal="BottomRight"),
        stacked(nq=32, nkv=8),
        stacked(nq=16, nkv=1),
        stacked(batch=DYNAMIC, seq=DYNAMIC),
        stacked(seq=77),  # ragged query tiles: TMA clips them (checked on an H200)
    ],
)
def test_supports_variants_of_the_stacked_layout(spec: AttentionSpec) -> None:
    assert hopper.supports(spec, "sm_90") is None
    assert hopper.variants(spec)


@pytest.mark.parametrize(
    ("spec", "arch", "words"),
    [
        (stacked(), "sm_80", "sm_90"),
        (stacked(), "sm_100", "sm_90"),
        (stacked(dtype="float32"), "sm_90", "float32"),
        (dataclasses.replace(stacked(), head_dim_v=64), "sm_90", "head_dim_v 64"),
        (stacked(h=100), "sm_90", "head_dim 100"),
        (stacked(h=264), "sm_90", "head_dim 264"),
        (dataclasses.replace(stacked(nq=30, nkv=8), num_q_heads=30), "sm_90", "30 query heads"),
        (
            dataclasses.replace(stacked(), bias=BiasSpec(1, (1, 1, 1, 2048)), num_operands=2),
            "sm_90",
            "bias",
        ),
        (dataclasses.replace(stacked(), k=TensorAccess(0, 2052, 6144, 128)), "sm_90", "aligned"),
        (
            dataclasses.replace(stacked(causal="BottomRight"), seq_q=256, seq_kv=128),
            "sm_90",
            "no keys",
        ),
    ],
)
def test_supports_says_why_not(spec: AttentionSpec, arch: str, words: str) -> None:
    reason = hopper.supports(spec, arch)
    assert reason is not None and words in reason


# --- variants / selection ---------------------------------------------------------------------
def test_variants_by_head_dim() -> None:
    assert set(hopper.variants(stacked(h=128))) == {
        "overlap_128x128",
        "coop_128x128",
        "pingpong_128x128",
        "pingpongB_128x128",
        "pingpongk_128x128",
    }
    # offered for at most 256 keys (longer tiles lose up to 12%: commit 2b192ab)
    assert "pingpongq_128x128" in hopper.variants(stacked(seq=256, h=128))
    assert "tma_64x128" in hopper.variants(stacked(h=64))
    assert "pingpong3_192x128" in hopper.variants(stacked(h=64))
    # head dim 256: the persistent kernel with O in the Q stage, except for launches of less
    # than one wave of tiles (commit c866e95)
    assert hopper.variants(stacked(h=256)) == [
        "overlapoq_128x64",
        "overlapc_128x64",
        "coop_128x64",
    ]
    short256 = stacked(batch=16, seq=256, nq=8, nkv=8, h=256, causal="TopLeft")
    assert hopper.pick(short256) == "overlapoq_128x64"
    assert hopper.pick(stacked(batch=1, seq=1024, nq=8, nkv=8, h=256)) == "overlapc_128x64"
    oq = hopper.VARIANTS["overlapoq_128x64"].kind
    assert "O staged in the warpgroup's Q stage" in oq
    assert "our epilogue: one TMA store per warpgroup, in turn" in oq
    assert hopper.variants(stacked(h=112)) == hopper.variants(stacked(h=128))
    assert hopper.variants(stacked(h=264)) == []


def test_head_dims_72_to_96_run_in_the_96_tile() -> None:
    """Head dims 80 and 96 run in a tile of 96 columns, not zero-padded to 128: the products
    of Q K^T and P V are 75% (96) or 60% (80) of the 128 tile's."""
    tiles = {h: hopper.tile_head_dim(h) for h in (8, 32, 40, 64, 72, 80, 96, 104, 128, 256, 264)}
    assert tiles == {
        8: 32, 32: 32, 40: 64, 64: 64, 72: 96, 80: 96, 96: 96, 104: 128, 128: 128, 256: 256,
        264: None,
    }  # fmt: skip
    for h in (80, 96):
        spec = stacked(h=h)
        assert hopper.supports(spec, "sm_90a") is None
        ks = hopper.render(spec, "s", hopper.pick(spec) or "")
        assert ks.config["tile_head_dim"] == 96
        assert ", 128, 128, 96, " in ks.needs[0].config["type"]
        assert set(hopper.variants(spec)) <= set(hopper.variants(stacked(h=128)))


def test_192_row_blocks_are_offered_only_where_they_leave_few_rows_empty() -> None:
    """Long non-causal head dim 64 takes overlap3_192x128 unless its last 192-row block leaves
    more than 5% of the rows empty (S 512 and 1024: 64 of 576 and 128 of 1152), where the
    128-row ping-pong kernel takes the launch (4% faster at B16 S512 N16)."""
    for seq, pick in ((512, "pingpong_128x128"), (1024, "pingpong_128x128"),
                      (2048, "overlap3_192x128"), (4096, "overlap3_192x128"),
                      (8192, "overlap3_192x128"), (DYNAMIC, "overlap3_192x128")):  # fmt: skip
        spec = stacked(batch=16, seq=seq, h=64)
        assert hopper.shape_class(spec) == (64, False, "large")
        assert hopper.pick(spec) == pick, seq
    assert "leaves at most 5% of the rows empty" in hopper.VARIANTS["overlap3_192x128"].kind


def test_a_larger_tile_is_named_only_for_a_comparison() -> None:
    """``tile`` renders a head dim in a larger tile than its own (the kernel benchmark's A/B of
    the 96 and 128 tiles); a tile that cannot hold the head dim, or is no tile, is refused."""
    spec = stacked(h=96)
    own = hopper.render(spec, "s", "overlap_128x128")
    wide = hopper.render(spec, "s", "overlap_128x128", tile=128)
    assert wide.needs[0].config["type"] == hopper.config_type(stacked(h=128), "overlap_128x128")
    assert own.needs != wide.needs and wide.config["tile_head_dim"] == 128
    for bad in (64, 100):
        with pytest.raises(ValueError, match=f"tile head dim {bad} cannot hold head_dim 96"):
            hopper.render(spec, "s", "overlap_128x128", tile=bad)


def test_selection_pick_comes_first_and_is_valid() -> None:
    for spec in (
        stacked(),
        stacked(h=64),
        stacked(batch=32, seq=128, nq=12, nkv=12, h=64),
        stacked(causal="TopLeft"),
        stacked(h=32),
        stacked(h=256),
    ):
        names = hopper.variants(spec)
        pick = hopper.pick(spec)
        if pick != "sm80":
            assert names[0] == pick
        assert len(set(names)) == len(names)
        assert all(n in hopper.VARIANTS for n in names)


def test_selection_covers_every_shape_class() -> None:
    for tile in (32, 64, 96, 128, 256):
        for causal in (False, True):
            for size in ("tiny", "small", "large"):
                choice = hopper.SELECTION[(tile, causal, size)]
                prefs = (choice,) if isinstance(choice, str) else choice
                assert all(p in hopper._BY_HEAD_DIM[tile] for p in prefs)
                # a preference list ends in a variant that takes any key length and launch
                assert hopper.VARIANTS[prefs[-1]].max_seq_kv is None
                assert hopper.VARIANTS[prefs[-1]].max_ctas is None


def test_short_sequence_variant_only_where_every_key_fits() -> None:
    # our kernel holds every key in shared memory: offered only for a static Sk <= 128 / 256
    bert = stacked(batch=32, seq=128, nq=12, nkv=12, h=64)
    assert {"shortw_64x128", "shortw_64x256"} <= set(hopper.variants(bert))
    assert "shortw_64x128" not in hopper.variants(stacked(batch=2, seq=129, h=64))
    assert "shortw_64x256" in hopper.variants(stacked(batch=2, seq=256, h=64))
    assert "shortw_64x256" not in hopper.variants(stacked(h=64))  # 2048 keys
    assert "shortw_64x128" not in hopper.variants(stacked(seq=DYNAMIC, h=64))
    assert "shortw_64x128" not in hopper.variants(stacked(seq=128, h=128))
    with pytest.raises(ValueError, match="at most 128 keys"):
        hopper.render(stacked(seq=200, h=64), "s", "shortw_64x128")
    with pytest.raises(ValueError, match="at most 256 keys"):
        hopper.render(stacked(h=64), "s", "shortw_64x256")
    cfg = hopper.render_config(stacked(seq=128, h=64), "shortw_64x256").source
    assert "stackfuse::hopper::ShortSeq" in cfg and ", 64, 256, 64," in cfg
    assert hopper.VARIANTS["shortw_64x128"].kind.startswith("ours")
    assert "overlapping its own P V" in hopper.VARIANTS["shortwo_64x256"].kind
    assert "overlapping" not in hopper.VARIANTS["shortw_64x256"].kind
    piped = hopper.render_config(stacked(seq=256, h=64), "shortwo_64x256").source
    assert "stackfuse::hopper::ShortPipelined" in piped
    assert "ShortPipelined" not in cfg
    assert "ShortTma" not in piped
    by_tma = hopper.render_config(stacked(seq=256, h=64), "shortwot_64x256").source
    assert "stackfuse::hopper::ShortPipelined, stackfuse::hopper::ShortTma>" in by_tma
    assert "loaded by TMA" in hopper.VARIANTS["shortwot_64x256"].kind
    assert "TMA" not in hopper.VARIANTS["shortwo_64x256"].kind
    assert "softmax overlapped" in hopper.VARIANTS["overlap_128x128"].kind
    three = hopper.VARIANTS["overlap3_192x128"]
    assert "key tiles its rows see" in three.words(causal=True)
    assert "key tiles" not in three.words(causal=False)
    assert "key tiles" not in hopper.VARIANTS["overlap_128x128"].words(causal=True)
    assert "overlapped" not in hopper.VARIANTS["pingpong_128x128"].kind
    assert "rescaled only when" in hopper.VARIANTS["overlapc_128x64"].kind
    chunked = hopper.VARIANTS["overlap3k_192x128"]
    assert "heaviest first" in chunked.words(causal=True)
    assert "heaviest first" not in chunked.words(causal=False)
    assert "heaviest first" not in three.words(causal=True)
    assert "rescaled only when" not in hopper.VARIANTS["overlap_128x128"].kind
    # our epilogue out of turn, except where the overlapped ping-pong mainloop wants the
    # example's in turn (hopper_kernel_ws.cuh); the non-warp-specialized kernels have neither
    assert "out of turn" in hopper.VARIANTS["pingpong_128x128"].kind
    assert "out of turn" in hopper.VARIANTS["overlapc_128x64"].kind
    assert "out of turn" not in hopper.VARIANTS["overlap_128x128"].kind
    assert "out of turn" not in hopper.VARIANTS["tma1_64x128"].kind
    assert "out of turn" not in hopper.VARIANTS["shortw_64x128"].kind
    example = "stackfuse::hopper::ExampleEpilogue"
    for name in ("overlap_128x128", "overlap3_192x128", "overlap3k_192x128", "overlap3kl_192x128"):
        assert example in hopper.render_config(stacked(h=64), name).source
    assert example not in hopper.render_config(stacked(h=128), "pingpong_128x128").source
    # shifted query blocks need our epilogue (a static_assert says so too)
    shifted = hopper.render_config(stacked(h=64, causal="TopLeft"), "overlap3kls_192x128").source
    assert "stackfuse::hopper::ShiftRows" in shifted and example not in shifted
    ends = "query blocks end at the last row"
    assert ends in hopper.VARIANTS["overlap3kls_192x128"].words(causal=True)
    assert ends not in hopper.VARIANTS["overlap3kls_192x128"].words(causal=False)
    assert ends not in hopper.VARIANTS["overlap3kl_192x128"].words(causal=True)


def test_shape_classes_follow_the_measurements() -> None:
    # one wave or less of 128-row tiles: 64-row tiles (B4 S128 N12 H64 measured 1.33x faster)
    tiny = stacked(batch=4, seq=128, nq=12, nkv=12, h=64)
    assert hopper.shape_class(tiny) == (64, False, "tiny")
    # every key fits our short-sequence kernel (3.4 vs 4.2 us for tma_64x128, commit 02fc3b8), up
    # to 256 keys (4.4 vs 5.4 us); past that, 64-row TMA tiles. Within one wave its pipelined
    # version (four CTAs per SM: 3.28 vs 3.41 us, commit 9466ce9)
    assert hopper.variants(tiny)[0] == "shortwo_64x128"
    assert hopper.variants(stacked(batch=2, seq=100, nq=16, nkv=4, h=64))[0] == "shortwo_64x128"
    longer = stacked(batch=2, seq=256, nq=12, nkv=12, h=64)
    assert hopper.shape_class(longer) == (64, False, "tiny")
    # pipelined (4.12 vs 4.41 us unpipelined, 9466ce9), loaded by TMA (4.12 vs 4.16, a36b2fe)
    assert hopper.variants(longer)[0] == "shortwot_64x256"
    assert hopper.variants(stacked(batch=1, seq=300, nq=12, nkv=12, h=64))[0] == "tma_64x128"
    # causal too (3.6 vs 5.7 us for ping-pong; 5.4 vs 7.6 at 256 keys; commit cbf7a49); past
    # 256 keys, ping-pong
    tiny_causal = stacked(batch=4, seq=128, nq=12, nkv=12, h=64, causal="TopLeft")
    assert hopper.variants(tiny_causal)[0] == "shortwo_64x128"
    longer_causal = stacked(batch=2, seq=256, nq=12, nkv=12, h=64, causal="BottomRight")
    assert hopper.variants(longer_causal)[0] == "shortwot_64x256"
    longest_causal = stacked(batch=1, seq=300, nq=12, nkv=12, h=64, causal="BottomRight")
    assert hopper.variants(longest_causal)[0] == "pingpong_128x128"
    # a small causal launch past 256 keys: ping-pong in chunks of heads (27.6 us vs ping-pong
    # 37.0, overlap3kls_192x128 30.8: hopper_kernel.md, b1_s2048_n16_h64_causal)
    assert hopper.variants(stacked(batch=1, seq=2048, h=64, causal="TopLeft"))[0] == (
        "pingpongk_128x128"
    )
    # long sequences: the overlapped mainloop (FlashAttention-3's intra-warpgroup overlap) at
    # head dim 128 and with three warpgroups at 64 (1089 vs 1207 us, commit 7174178)
    assert hopper.variants(stacked(h=128))[0] == "overlap_128x128"
    # causal head dim 128: ping-pong with its epilogues out of turn (245.4 vs the overlapped
    # kernel's 255.5 us, commit 499bb57), its tiles in chunks of heads chosen on the host
    # (hopper_kernel.md: b1_s4096_n16_h128_causal 123.3 vs 162.3 us, b1_s2048_n16_h128_causal
    # 34.6 vs 45.0), small, large and dynamic launches alike
    assert hopper.variants(stacked(h=128, causal="TopLeft"))[0] == "pingpongk_128x128"
    prompt = stacked(batch=1, seq=2048, h=128, causal="TopLeft")
    assert hopper.shape_class(prompt) == (128, True, "small")
    assert hopper.variants(prompt)[0] == "pingpongk_128x128"
    dynamic = stacked(batch=DYNAMIC, seq=4096, h=128, causal="TopLeft")
    assert hopper.variants(dynamic)[0] == "pingpongk_128x128"
    assert "heaviest first" in hopper.VARIANTS["pingpongk_128x128"].words(causal=True)
    assert hopper.variants(stacked(batch=2, seq=8192, h=64))[0] == "overlap3_192x128"
    # and at head dim 32 (272.9 vs tma_64x128's 303.2 us, commit 7174178; cuDNN 303.1); causal
    # and short head-dim-32 launches take ping-pong, the cooperative kernel lost by 23-35%
    # (commit 1738cde)
    assert hopper.variants(stacked(h=32))[0] == "overlap_128x128"
    # in chunks of heads (75.6 vs 110.9 us: hopper_kernel.md, b1_s4096_n16_h32_causal)
    assert hopper.variants(stacked(h=32, causal="TopLeft"))[0] == "pingpongk_128x128"
    # head dim 128, one short sequence (B1 S512 N16: 64 tiles of 128 rows leave half the SMs
    # idle): 128 CTAs of 64 rows (10.4 vs 11.5 us, commit 3425fc6), but only in one wave (B2 S512:
    # 19.4 vs 12.5 us), and a dynamic batch counts as large
    one = stacked(batch=1, seq=512, h=128)
    assert hopper.shape_class(one) == (128, False, "tiny")
    assert hopper.variants(one)[0] == "tma1_64x128"
    assert hopper.variants(stacked(batch=1, seq=500, h=128, causal="BottomRight"))[0] == (
        "tma1_64x128"
    )
    two = stacked(batch=2, seq=512, h=128)
    assert hopper.shape_class(two) == (128, False, "tiny")
    assert hopper.pick(two) == "pingpong_128x128"
    assert "tma1_64x128" not in hopper.variants(two)
    assert "tma1_64x128" not in hopper.variants(stacked(batch=DYNAMIC, seq=512, h=128))
    assert "one wave" in hopper.VARIANTS["tma1_64x128"].kind
    # the tma kernels run a GQA group as one launch per query head of it, one after another
    # (0.30x SDPA's fastest at B1 S1024 GQA 8/2 and B1 S512 16/4: attention_grid.md): grouped
    # tiny launches take ping-pong, which reads a group in one launch, at every tile head dim
    for gqa in (
        stacked(batch=1, seq=1024, nq=8, nkv=2, h=128),
        stacked(batch=1, seq=512, nq=16, nkv=4, h=128, causal="BottomRight"),
        stacked(batch=1, seq=300, nq=12, nkv=3, h=64),
        stacked(batch=1, seq=300, nq=12, nkv=1, h=32),
    ):
        assert hopper.shape_class(gqa)[2] == "tiny"
        assert hopper.pick(gqa) == "pingpong_128x128"
        assert not any(n.startswith("tma") for n in hopper.variants(gqa))
    # short key ranges at head dims 32 and 128: ping-pong with the next tile's Q loaded ahead
    # (16.0 vs 16.6 us, 24.4 vs 25.0, causal 23.6 vs 24.8; commit 2b192ab), only up to 256 keys (B1
    # S1024 N32, a "small" launch too: 36.6 vs 32.1 us) and never for a dynamic key length
    assert hopper.variants(stacked(batch=16, seq=256, h=32))[0] == "pingpongq_128x128"
    assert hopper.variants(stacked(batch=16, seq=256, h=32, causal="TopLeft"))[0] == (
        "pingpongq_128x128"
    )
    llama = stacked(batch=1, seq=1024, nq=32, nkv=32, h=128)
    assert hopper.shape_class(llama) == (128, False, "small")
    assert hopper.pick(llama) == "pingpong_128x128"
    assert "pingpongq_128x128" not in hopper.variants(llama)
    assert "pingpongq_128x128" not in hopper.variants(stacked(batch=16, seq=DYNAMIC, h=128))
    assert "at most 256 keys" in hopper.VARIANTS["pingpongq_128x128"].kind
    # long causal head dim 64: three warpgroups, each computing only the key tiles its rows
    # see (195-198 vs ping-pong's 200-202 us, commit e95036c), their tiles handed out heaviest
    # first within chunks of heads (193.6-193.8 vs 197.4-200.7 us, 2fdf822), O rescaled lazily
    # (189.5-189.9 vs 191.1-191.5, 62e9b00), the query blocks aligned to the last row (177.4 vs
    # 179.6 us, 7 of 9 rounds; B4 S1024 35.3 vs 36.4, 9 of 9; c9a21ab)
    assert hopper.variants(stacked(seq=2048, h=64, causal="TopLeft"))[0] == "overlap3kls_192x128"
    # short prompts at head dim 128: ping-pong (its overlapped version lost there, commit
    # 7174178), with the next tile's Q loaded ahead (2b192ab)
    assert hopper.variants(stacked(batch=16, seq=256, nq=16, nkv=16, h=128))[0] == (
        "pingpongq_128x128"
    )
    assert hopper.variants(stacked(batch=16, seq=256, h=128, causal="TopLeft"))[0] == (
        "pingpongq_128x128"
    )
    # BERT-base: 384 CTAs but one key tile each: "small"; our kernel (9.5 vs 12.0 us, 02fc3b8)
    bert = stacked(batch=32, seq=128, nq=12, nkv=12, h=64)
    assert hopper.shape_class(bert) == (64, False, "small")
    assert hopper.variants(bert)[0] == "shortw_64x128"
    assert hopper.variants(stacked(batch=32, seq=128, h=64, causal="TopLeft"))[0] == (
        "shortw_64x128"
    )
    # causal at 129-256 keys: the 256-key kernel (14.4 vs ping-pong's 15.2 us, commit cbf7a49),
    # its exponentials overlapping its own P V (14.16 vs 14.27 us, 9466ce9), its tiles loaded by
    # TMA (14.05 vs 14.09, a36b2fe)
    assert hopper.variants(stacked(batch=16, seq=256, h=64, causal="TopLeft"))[0] == (
        "shortwot_64x256"
    )
    # 256 keys: our 256-key kernel, MHA (14.1 vs 15.5 us) and GQA (29.0 vs 32.9; 02fc3b8),
    # pipelined (13.76 vs 14.05, 28.44 vs 28.93; 9466ce9), loaded by TMA (13.59 vs 13.71, 26.81
    # vs 28.34; a36b2fe)
    assert hopper.variants(stacked(batch=16, seq=256, nq=12, nkv=12, h=64))[0] == "shortwot_64x256"
    assert hopper.variants(stacked(batch=32, seq=256, nq=16, nkv=4, h=64))[0] == "shortwot_64x256"
    assert hopper.variants(stacked(batch=32, seq=128, nq=16, nkv=4, h=64))[0] == "shortw_64x128"
    # GQA at long sequences: the overlapped ping-pong too (921 vs 932 us; causal 510 vs 530,
    # commit 7174178; the cooperative kernel lost to ping-pong, 954 vs 983 us, 2e55e3e)
    assert hopper.variants(stacked(nq=32, nkv=8))[0] == "overlap_128x128"
    assert hopper.variants(stacked(nq=32, nkv=32))[0] == "overlap_128x128"
    # causal GQA with the causal class: ping-pong (495.6 / 498.9 vs 488.4 / 505.4 us, commit
    # 499bb57), in chunks of heads (506.5 vs 520.2 us, bb53392)
    assert hopper.variants(stacked(nq=32, nkv=8, causal="TopLeft"))[0] == "pingpongk_128x128"
    # dynamic shapes count as large
    assert hopper.shape_class(stacked(batch="b", seq="s"))[2] == "large"


# --- render -----------------------------------------------------------------------------------
_ALLOWED_IDENTIFIERS = {
    # C++ and the TVM-FFI ABI
    "include",
    "tvm",
    "ffi",
    "container",
    "tensor",
    "h",
    "extra",
    "c_env_api",
    "function",
    "namespace",
    "using",
    "const",
    "void",
    "DLTensor",
    "TVM_FFI_DLL_EXPORT_TYPED_FUNC",
    "impl",
    "out",
    "ops",
    "f",
    # our wrapper and CUTLASS names the template uses
    "hopper_fmha_tvm",
    "cuh",
    "stackfuse",
    "hopper",
    "Cfg",
    "Config",
    "StackedSpec",
    "kSpec",
    "run_stacked",
    # the configuration's entry point (hopper_api.h's LaunchFn)
    "Status",
    "Problem",
    "p",
    "cudaStream_t",
    "stream",
    "cudaError_t",
    "cuda_error",
    "launch",
    "return",
    "hopper_fmha",
    "CausalMode",
    "kNone",
    "kTopLeft",
    "kBottomRight",
    "cutlass",
    "half_t",
    "bfloat16_t",
    "gemm",
    "KernelTma",
    "KernelTmaWarpSpecializedCooperative",
    "KernelTmaWarpSpecializedPingpong",
    # kernel options of the three-warpgroup variants
    "fmha",
    "kernel",
    "Option",
    "Tag",
    "kNumMmaWarpGroups",
    "kStagesQ",
    "kStagesKV",
    "cute",
    "Int",
    # the overlapped mainloop's options (hopper_overlap.cuh)
    "Overlap",
    "LazyRescale",
    # the causal tile order option, and query blocks aligned to the last row (hopper_fmha.cuh)
    "ChunkedOrder",
    "ShiftRows",
    # the example's epilogue in turn; ours in turn, O staged in the Q stage (hopper_kernel_ws.cuh)
    "ExampleEpilogue",
    "OwnEpilogueInTurn",
    "EpilogueInQ",
    # arguments that are no tensor (shape arguments TVM passes)
    "AnyView",
    "nullptr",
}


def _code_tokens(source: str) -> tuple[set[str], list[str]]:
    code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    idents = set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", code))
    numbers = re.findall(r"(?<![A-Za-z_0-9.])-?\d+(?:\.\d+)?(?:e-?\d+)?f?", code)
    return idents, numbers


@pytest.mark.parametrize(
    ("variant", "h"),
    [
        ("coop_128x128", 128),
        ("pingpong_128x128", 128),
        ("pingpong3_192x128", 64),
        ("overlap_128x128", 128),
        ("overlap3_192x128", 64),
        ("overlap3k_192x128", 64),
        ("overlap3kl_192x128", 64),
        ("overlap3kls_192x128", 64),
        ("tma_64x128", 64),
        ("coop_128x64", 256),
        ("overlapc_128x64", 256),
        ("pingpongq_128x128", 128),
        ("pingpongk_128x128", 128),
        ("overlapoq_128x64", 256),
    ],
)
@pytest.mark.parametrize("causal", ["none", "TopLeft", "BottomRight"])
def test_render_holds_only_numbers_and_the_symbol(variant: str, h: int, causal: str) -> None:
    spec = stacked(batch=DYNAMIC, seq=DYNAMIC, nq=32, nkv=8, h=h, causal=causal)
    ks = hopper.render(spec, "stackfuse_h0123abcd", variant)
    assert ks.family == "cutlass_fmha_hopper"
    assert ks.symbol == "stackfuse_h0123abcd"
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(stackfuse_h0123abcd, impl)" in ks.source
    (cfg,) = ks.needs  # the configuration: compiled apart, linked along
    assert re.fullmatch(r"stackfuse_hcfg_[0-9a-f]{24}", cfg.symbol)
    for src, own in (
        (ks.source, {"stackfuse_h0123abcd", "op0", cfg.symbol}),
        (cfg.source, {cfg.symbol}),
    ):
        idents, numbers = _code_tokens(src)
        assert idents - _ALLOWED_IDENTIFIERS == own
        assert '"' not in re.sub(r'#include "[a-z_./]+"', "", src)
        for n in numbers:
            float(n.rstrip("f"))  # every other token is a number


def test_one_configuration_object_serves_every_shape_of_it() -> None:
    """The CUTLASS instantiation depends on dtype, variant, tile and mask only: sites and
    models that differ in batch, length, heads or strides share its object (one ~45 s compile),
    and only their glue (seconds) is compiled per shape."""
    a = hopper.render(stacked(nq=32, nkv=8, h=128), "a", "pingpong_128x128")
    b = hopper.render(stacked(batch=2, seq=4096, nq=12, nkv=12, h=112), "b", "pingpong_128x128")
    assert a.source != b.source
    assert a.needs == b.needs
    causal = hopper.render(stacked(nq=32, nkv=8, h=128, causal="TopLeft"), "c", "pingpong_128x128")
    bf16 = hopper.render(stacked(dtype="bfloat16", h=128), "d", "pingpong_128x128")
    other = hopper.render(stacked(h=128), "e", "coop_128x128")
    symbols = {x.needs[0].symbol for x in (a, causal, bf16, other)}
    assert len(symbols) == 4
    # the glue includes no CUTLASS: its compile is small
    assert "hopper_fmha.cuh" not in a.source and "hopper_fmha.cuh" in a.needs[0].source
    glue = (hopper.KERNELS_DIR / "hopper_fmha_tvm.cuh").read_text()
    api = (hopper.KERNELS_DIR / "hopper_api.h").read_text()
    assert "cutlass" not in re.sub(r"//[^\n]*", "", glue + api)


def test_render_numbers_come_from_the_spec() -> None:
    spec = stacked(batch=4, seq=1024, nq=32, nkv=8, h=64)
    src = hopper.render(spec, "s", "pingpong3_192x128").source
    c = (32 + 16) * 64
    assert f"/*q=*/{{0, 0, {c}, 64}}" in src
    assert f"/*k=*/{{0, {32 * 64}, {c}, 64}}" in src
    assert f"/*v=*/{{0, {40 * 64}, {c}, 64}}" in src
    assert "/*batch=*/4, /*seq_q=*/1024, /*seq_kv=*/1024" in src
    assert "/*q_heads=*/32, /*kv_heads=*/8" in src
    cfg = hopper.render(spec, "s", "pingpong3_192x128").needs[0].source
    assert "cutlass::half_t, 192, 128, 64, cutlass::gemm::KernelTmaWarpSpecializedPingpong" in cfg
    assert "Tag::kNumMmaWarpGroups, cute::Int<3>" in cfg


def test_render_dynamic_dims_and_bf16() -> None:
    spec = stacked(dtype="bfloat16", batch=DYNAMIC, seq=DYNAMIC)
    ks = hopper.render(spec, "s", "coop_128x128")
    assert "/*batch=*/-1, /*seq_q=*/-1, /*seq_kv=*/-1" in ks.source
    assert "cutlass::bfloat16_t" in ks.needs[0].source
    assert "/*dtype_code=*/4" in ks.source
    assert isinstance(ks.workspace_bytes, str)
    fixed = hopper.render(stacked(), "s", "coop_128x128")
    assert fixed.workspace_bytes == 8 * 16 * 2048 * 4


def test_render_flags_target_sm90a_and_the_example() -> None:
    ks = hopper.render(stacked(), "s", "coop_128x128")
    cfg = ks.needs[0]
    assert "-gencode=arch=compute_90a,code=sm_90a" in cfg.flags
    assert any(f.endswith("88_hopper_fmha") for f in cfg.flags)
    assert any(f == f"-I{hopper.KERNELS_DIR}" for f in cfg.flags)
    assert any(f == f"-I{hopper.KERNELS_DIR}" for f in ks.flags)
    assert not any(f.endswith("88_hopper_fmha") for f in ks.flags)  # the glue needs no CUTLASS
    # flush-to-zero float math in the kernel's unit only (exp2f as one MUFU.EX2)
    assert "-ftz=true" in cfg.flags and "-ftz=true" not in ks.flags
    assert ks.config["variant"] == "coop_128x128"


@pytest.mark.parametrize("symbol", ["a-b", "1abc", "x;system", "", "a b", "x" * 200])
def test_render_rejects_a_symbol_that_is_no_identifier(symbol: str) -> None:
    with pytest.raises(ValueError):
        hopper.render(stacked(), symbol, "coop_128x128")


def test_render_rejects_unknown_variant_and_unsupported_spec() -> None:
    with pytest.raises(ValueError, match="variant"):
        hopper.render(stacked(), "s", "tma_64x128")
    with pytest.raises(ValueError, match="float32"):
        hopper.render(stacked(dtype="float32"), "s", "coop_128x128")


# --- nvcc -------------------------------------------------------------------------------------
@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "h", "causal", "window"),
    [
        ("overlap_128x128", 128, "none", None),
        ("pingpongq_128x128", 128, "none", None),
        ("shortw_64x128", 64, "none", None),
        ("overlapoq_128x64", 256, "none", None),
        ("overlap3kls_192x128", 64, "TopLeft", None),
        ("pingpongk_128x128", 128, "BottomRight", 100),
    ],
)
def test_nvcc_compiles_one_config_and_exports_the_symbol(
    variant: str, h: int, causal: str, window: int | None
) -> None:
    """One forward configuration for sm_90a through the service's cached nvcc: our
    warp-specialized kernel with our overlapped mainloop and the example's epilogue in turn (the
    pick for long sequences at head dim 128), with the example's mainloop and our epilogue out of
    turn and two Q stages per warpgroup and four K/V stages (short prompts; its shared memory is
    checked against the H200's 227 KB at compile time; pingpong_128x128 is this without the next
    tile's Q loaded ahead, and the window configuration below builds its mainloop), our
    short-sequence kernel, the persistent head-dim-256 kernel (64 KB of Q and five K/V stages,
    O staged in the Q stage: at the limit too), and the causal three-warpgroup kernel with its
    query blocks aligned to the last row (Q loaded and O stored from a shifted row), and the
    sliding-window configuration (worker/kernels_window: K/V loads from the window's first
    tile, the window read at run time; the glue passes its own)."""
    spec = stacked(batch=DYNAMIC, seq=DYNAMIC, h=h, causal=causal, window=window)
    ks = hopper.render(spec, "stackfuse_hopper_nvcc_test", variant)
    compiled = compile_object(ks)
    nm = shutil.which("nm")
    assert nm is not None

    def symbols(obj: Path) -> str:
        return subprocess.run([nm, "-C", str(obj)], capture_output=True, text=True).stdout

    (cfg_obj,) = compiled.needs
    glue = symbols(compiled.object_path)
    assert re.search(r"\bT __tvm_ffi_stackfuse_hopper_nvcc_test\b", glue)
    cfg = ks.needs[0].symbol
    assert re.search(rf"\bU stackfuse::hopper::{cfg}\(", glue)  # called, defined apart
    assert re.search(rf"\bT stackfuse::hopper::{cfg}\(", symbols(cfg_obj))


def _run_host_probe(tmp_path: Path, source: str, *more_includes: Path) -> str:
    """Compile ``source`` (host code over our Hopper headers) with the service's own nvcc flags
    and include dirs, link it as the benchmark links its library, run it: its stdout."""
    chain = find_toolchain()
    src, obj, exe = tmp_path / "probe.cu", tmp_path / "probe.o", tmp_path / "probe"
    src.write_text(source)
    ours = [f"-I{p}" for p in (*more_includes, *hopper.include_dirs())]
    nvcc = [str(chain.nvcc), *COMMON_FLAGS, hopper.GENCODE, *ours, *include_flags(chain)]
    subprocess.run([*nvcc, "-o", str(obj), str(src)], check=True, capture_output=True, timeout=600)
    link = ["g++", "-o", str(exe), str(obj), str(chain.cudart_static), "-lpthread", "-ldl", "-lrt"]
    subprocess.run(link, check=True, capture_output=True, timeout=120)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


_SCHEDULER_PROBE = r"""
#include "hopper_fmha.cuh"
#include <cstdio>
namespace hp = stackfuse::hopper;
using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
int main() {
  cutlass::KernelHardwareInfo hw;
  hw.sm_count = 132;
  using T128 = cute::Shape<cute::Int<128>, cute::Int<128>, cute::Int<128>>;
  using T192 = cute::Shape<cute::Int<192>, cute::Int<128>, cute::Int<64>>;
  // (heads, batch, Sq, Sk, D): 4096, 2048 and 100 tiles of 128 rows
  int const grids[][4] = {{32, 8, 2048, 128}, {16, 8, 2048, 128}, {10, 1, 1280, 128}};
  for (auto const& g : grids) {
    auto ps = cute::make_tuple(g[0], g[1], g[2], g[2], g[3]);
    auto p = hp::BalancedPersistentScheduler::to_underlying_arguments(ps, hw, Cluster{}, T128{});
    std::printf("grid %d %d\n", p.num_blocks, hp::BalancedPersistentScheduler::get_grid_shape(p).x);
  }
  // causal, 192-row tiles: B8 S2048 N16 (11 blocks x 128 heads), B4 S1000 N16 (6 x 64), B2
  // S2048 N16 (11 x 32, under three waves)
  int const orders[][3] = {{16, 8, 2048}, {16, 4, 1000}, {16, 2, 2048}};
  for (auto const& o : orders) {
    auto ps = cute::make_tuple(o[0], o[1], o[2], o[2], 64);
    auto p = hp::ChunkedSerpentineScheduler<>::to_underlying_arguments(ps, hw, Cluster{}, T192{});
    std::printf("chunk %d %d\n", p.num_blocks, p.chunk);
  }
  // the same with the query blocks aligned to the last row (ShiftRows): 64 and 128 rows before
  // row 0 (152 empty rows, in whole warpgroup tiles), none where the rows fill their blocks
  for (auto const& o : orders) {
    auto ps = cute::make_tuple(o[0], o[1], o[2], o[2], 64);
    using Shifted = hp::ChunkedSerpentineScheduler<192>;
    auto p = Shifted::to_underlying_arguments(ps, hw, Cluster{}, T192{});
    std::printf("shifted %d %d %d\n", hp::row_shift<192>(o[2]), p.num_blocks, p.chunk);
  }
  std::printf("shift %d %d %d\n", hp::row_shift<192>(192), hp::row_shift<192>(1),
              hp::row_shift<0>(1000));
  // causal, 128-row tiles at head dim 128 (pingpongk): B8 S2048 N16, where no chunk is kMinGain
  // ahead of one head per chunk, and B1 S4096 N16 (32 x 16), where one is
  int const o128[][3] = {{16, 8, 2048}, {16, 1, 4096}};
  for (auto const& o : o128) {
    auto ps = cute::make_tuple(o[0], o[1], o[2], o[2], 128);
    auto p = hp::ChunkedSerpentineScheduler<>::to_underlying_arguments(ps, hw, Cluster{}, T128{});
    std::printf("chunk %d %d\n", p.num_blocks, p.chunk);
  }
}
"""


@pytest.mark.nvcc
@pytest.mark.slow
def test_tile_schedulers_choose_grid_and_order_on_the_host(tmp_path: Path) -> None:
    """The persistent schedulers' host-side choices, from the header compiled into a host
    program (no GPU needed). Without a mask the grid shrinks only when the last round would hold
    at most a quarter of the SMs (4096 tiles: 128 CTAs of 32; 2048: 132, its last round holds
    68). The causal orders take the chunk of heads the cost model favours: 32 heads at B8 S2048
    N16 and B2 S2048 N16 (all of them: the search tries every chunk size), all 64 at B4 S1000
    N16, and at head dim 128 chunks of one head (each head heaviest first, as balanced as the
    plain order) where no larger chunk is kMinGain ahead (B8 S2048 N16) and 9 heads where one is
    (B1 S4096 N16: 77 tile steps for the busiest CTA instead of 104)."""
    out = _run_host_probe(tmp_path, _SCHEDULER_PROBE).split("\n")
    assert out[:3] == ["grid 4096 128", "grid 2048 132", "grid 100 100"]
    assert out[3:6] == ["chunk 1408 32", "chunk 384 64", "chunk 352 32"], out
    assert out[6:9] == ["shifted 64 1408 32", "shifted 128 384 64", "shifted 64 352 32"], out
    assert out[9:12] == ["shift 0 128 0", "chunk 2048 1", "chunk 512 9"], out


_WINDOW_TILES_PROBE = r"""
#include "hopper_window.cuh"
#include <cstdio>
namespace hp = stackfuse::hopper;
template <hp::CausalMode kMode>
void sweep(char const* name) {
  using Mask = hp::WindowMask<kMode, 128, 128>;
  int const seqs[][2] = {{1, 1}, {100, 100}, {128, 128}, {129, 129}, {700, 700}, {1000, 1000},
                         {4096, 4096}, {77, 300}, {300, 77}, {1024, 2048}, {2048, 1024}};
  int const windows[] = {1, 2, 64, 100, 127, 128, 129, 256, 1000, 4096, 8192};
  for (auto const& s : seqs) {
    for (int w : windows) {
      auto ps = cute::make_tuple(1, 1, s[0], s[1], 128, w);
      for (int m = 0; m * 128 < s[0]; ++m) {
        int first, end;
        Mask::tiles(m, ps, first, end);
        std::printf("%s %d %d %d %d %d %d\n", name, s[0], s[1], w, m, first, end);
      }
    }
  }
}
int main() {
  sweep<hp::CausalMode::kTopLeft>("TopLeft");
  sweep<hp::CausalMode::kBottomRight>("BottomRight");
}
"""


@pytest.mark.nvcc
@pytest.mark.slow
def test_window_key_tiles_cover_the_window_and_no_more(tmp_path: Path) -> None:
    """The window kernel's key-tile range per 128-row query block (``WindowMask::tiles``,
    compiled into a host program: no GPU needed), against the keys the block's rows see (key j
    from query i iff ``i + off - W < j <= i + off``, j < S_kv): every such key's tile is in the
    range, and the range is exactly those tiles, save that a block whose rows reach past S_q
    (the last) may keep the tiles of its rows past the end, and a block whose rows see no key
    at all keeps one tile (the mainloop needs one; the rows come out as zeros). Both alignments,
    W from one key to past both lengths, fewer and more keys than queries."""
    out = _run_host_probe(tmp_path, _WINDOW_TILES_PROBE, hopper.WINDOW_KERNELS_DIR).split()
    rows = [out[i : i + 7] for i in range(0, len(out), 7)]
    assert len(rows) > 500
    for mode, *nums in rows:
        sq, sk, w, m, first, end = map(int, nums)
        off = sk - sq if mode == "BottomRight" else 0
        seen = {
            j // 128
            for i in range(m * 128, min((m + 1) * 128, sq))
            for j in range(max(0, i + off - w + 1), min(sk, i + off + 1))
        }
        where = (mode, sq, sk, w, m, first, end)
        assert 0 <= first < end <= -(-sk // 128), where
        if not seen:  # no row of the block sees a key: one tile, all of it masked
            assert end - first == 1, where
            continue
        assert (first, end) == (min(seen), max(seen) + 1) or (
            (m + 1) * 128 > sq and first == min(seen) and end > max(seen)
        ), (where, sorted(seen))


@pytest.mark.nvcc
@pytest.mark.slow
def test_pipelined_short_kernel_keeps_its_wgmma_asynchronous(tmp_path: Path) -> None:
    """`shortwo_64x256`'s gain (its exponentials run while its own P V is on the tensor cores)
    exists only while ptxas leaves the wgmma asynchronous. Within the 168 registers of three
    CTAs per SM, quarters of the keys made ptxas serialize them (C7512); halves do not. The
    selection's `shortwot_64x256` builds it twice: loaded by TMA, and by cp.async (the fallback
    where the driver refuses a tensor map)."""
    chain = find_toolchain()
    ks = hopper.render_config(stacked(batch=32, seq=256, nq=16, nkv=4, h=64), "shortwot_64x256")
    src, obj = tmp_path / "cfg.cu", tmp_path / "cfg.o"
    src.write_text(ks.source)
    done = subprocess.run(
        nvcc_argv(ks, chain, src, obj, "-Xptxas=-v", warnings=True),
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = done.stdout + done.stderr
    # ptxas reported on both of our kernels
    assert "short_seq10kernel_tma" in log and "short_seq6kernel" in log
    assert "serialized" not in log, log
    assert not re.search(r"[1-9]\d* bytes spill stores", log), log


def test_render_takes_shape_arguments_that_are_no_tensor() -> None:
    base = stacked(batch=DYNAMIC, seq=DYNAMIC)
    spec = dataclasses.replace(
        base, num_operands=3, operand_shapes=(base.operand_shapes[0], None, None)
    )
    src = hopper.render(spec, "s", "pingpong_128x128").source
    assert "void impl(DLTensor* op0, tvm::ffi::AnyView /*shape*/ op1, " in src
    assert "DLTensor* ops[] = {op0, nullptr, nullptr};" in src
    assert "/*op_rank=*/{3, -1, -1, 0, 0, 0, 0, 0}" in src


def test_supports_rejects_qkv_from_a_shape_argument() -> None:
    base = stacked()
    spec = dataclasses.replace(base, num_operands=2, operand_shapes=(None, base.operand_shapes[0]))
    reason = hopper.supports(spec, "sm_90")
    assert reason is not None and "no tensor operand" in reason


def test_workspace_is_one_log_sum_exp_per_query_row_and_head() -> None:
    # GQA runs as one launch over all Nq query heads: B * Sq * Nq floats
    ks = hopper.render(stacked(nq=32, nkv=8), "s", "pingpong_128x128")
    assert ks.workspace_bytes == 8 * 2048 * 32 * 4


def test_prebuild_covers_every_configuration_the_selection_picks() -> None:
    """`stackfuse prebuild` compiles selected_configs(): every shape class's pick, either
    dtype, each causal mode, must be among them, or a warm worker would still compile."""
    warm = {hopper.render_config(sp, v).source for v, sp in hopper.selected_configs()}
    for tile in (32, 64, 96, 128, 256):
        for seq, batch in ((128, 1), (256, 32), (2048, 8)):
            for causal in ("none", "TopLeft", "BottomRight"):
                for dtype in ("float16", "bfloat16"):
                    for nkv in (16, 4):
                        spec = stacked(
                            dtype=dtype,
                            batch=batch,
                            seq=seq,
                            nq=16,
                            nkv=nkv,
                            h=tile,
                            causal=causal,
                        )
                        ks = hopper.render(spec, "s", hopper.variants(spec)[0])
                        assert ks.needs[0].source in warm, (tile, seq, causal, dtype, nkv)
                        if causal == "none" or tile == 256:
                            continue
                        windowed = replace(spec, window=100)
                        ks = hopper.render(windowed, "s", hopper.variants(windowed)[0])
                        assert ks.needs[0].source in warm, (tile, seq, causal, dtype, nkv)


def test_a_flagged_benchmark_build_gets_a_kernel_type_of_its_own() -> None:
    """The kernel benchmark builds one configuration with and without a -D switch; if both
    keep one Config type, the linker keeps one launch<Config> and both time the same kernel
    (four experiments once timed one kernel twice this way). Each flag set must name a Config
    of its own."""
    from benchmarks.hopper_kernel import _own_names

    ks = hopper.render(stacked(h=64, causal="TopLeft"), "s", "overlap3_192x128")
    glue, source = ks.source, ks.needs[0].source

    def config(text: str) -> str:
        (found,) = re.findall(r"launch<(stackfuse::hopper::Config<.*>)>\(p,", text)
        return found

    def function(text: str) -> set[str]:
        return set(re.findall(r"stackfuse_hcfg_\w+", text))

    glue_a, a = _own_names(glue, source, ("-DSTACKFUSE_X=1",))
    glue_b, b = _own_names(glue, source, ("-DSTACKFUSE_X=2",))
    assert "BuildTag" not in config(source)
    assert re.search(r", stackfuse::hopper::BuildTag<0x[0-9a-f]{8}u>>$", config(a))
    assert len({config(source), config(a), config(b)}) == 3
    assert "struct BuildTag" in a
    # the glue calls the configuration's function by its new name, each build its own
    assert function(glue_a) == function(a) != function(glue_b) == function(b) != function(glue)


def test_the_benchmarks_96_and_128_tile_builds_are_objects_and_methods_of_their_own() -> None:
    """grid96 times each head-dim-80/96 spec in the 96 tile and again, zero-padded, in the
    128 tile: the two must be distinct objects (one configuration each) and distinct methods."""
    from benchmarks.hopper_kernel import GRID96_SHAPES, _bench_slots, catalog

    slots = [s for s in catalog() if s.obj.startswith("f16_overlap_128x128_none_d96")]
    own = {s.symbol: s for s in slots if s.tile is None}
    wide = {s.symbol: s for s in slots if s.tile == 128}
    assert own and wide and not set(own) & set(wide)
    assert {s.method for s in wide.values()} == {"hopper:overlap_128x128@t128"}
    for s in wide.values():
        ks = hopper.render(stacked(nq=s.nq, nkv=s.nkv, h=s.head_dim), "x", s.variant, s.tile)
        assert ks.needs[0].config["tile_head_dim"] == 128
    manifest = [asdict(s) for s in catalog()]
    for shape in GRID96_SHAPES:  # every shape times at least one 96-tile build
        assert any(slot["tile"] is None for slot in _bench_slots(manifest, shape)), shape[0]


def _bench_row(method: str, passes: list[float]) -> dict[str, object]:
    """A kernel-benchmark record as hopper_kernel.bench writes it (B8 S2048 N16 H64 causal)."""
    med = sorted(passes)[len(passes) // 2]
    return {
        "shape": "b8_s2048_n16_h64_causal",
        "B": 8,
        "S": 2048,
        "Nq": 16,
        "Nkv": 16,
        "H": 64,
        "causal": True,
        "dtype": "float16",
        "method": method,
        "kernel_us_profiler": med,
        "tflops_profiler": 1.0,
        "latency_us": med + 10,
        "passes_us": passes,
    }


def test_benchmark_summary_names_the_selection_and_pairs_rounds() -> None:
    """The kernel benchmark's summary reports the selection's variant (not only the fastest
    one built) and its ratio to SDPA's fastest round by round, which cancels the clock's drift
    between rounds that a ratio of medians keeps."""
    from benchmarks.hopper_kernel import _summarize

    pick = "hopper:" + hopper.pick(stacked(batch=8, seq=2048, h=64, causal="TopLeft"))
    rows = [
        _bench_row("hopper:pingpong_128x128", [180.0, 210.0, 210.0]),  # slower by its median
        _bench_row(pick, [200.0, 190.0, 205.0]),
        _bench_row("sdpa:cudnn", [190.0, 200.0, 200.0]),
        _bench_row("sdpa:default", [195.0, 201.0, 203.0]),
    ]
    (s,) = _summarize(rows)
    assert s["selected_hopper"] == pick and s["selected_is_built"]
    assert s["ratio_selected_vs_best_sdpa"] == pytest.approx(200.0 / 200.0)
    # rounds: 190/200, 200/190, 200/205 against sdpa:cudnn (SDPA's fastest by its median)
    assert s["rounds"] == 3 and s["rounds_faster"] == 1
    assert s["paired_ratio_median"] == pytest.approx(0.975609756, rel=1e-6)
    assert s["paired_ratio_min"] == pytest.approx(0.95)
    assert s["paired_ratio_max"] == pytest.approx(200.0 / 190.0)

    # a run that did not build the selection: the best built variant stands in, and says so
    (s,) = _summarize([rows[0], rows[2], rows[3]])
    assert s["selected_hopper"] == "hopper:pingpong_128x128" and not s["selected_is_built"]
    # rounds that do not line up (one failed) are not paired
    (s,) = _summarize([_bench_row(pick, [200.0, 190.0]), rows[2]])
    assert "rounds" not in s


def test_timeline_summary_from_stamps() -> None:
    """The timeline probe's summary (benchmarks/timeline_probe.py) from a buffer laid out as
    hopper_kernel_ws.cuh writes it: per CTA its start and SM, per consumer warpgroup its tile
    count, exit and (begin, end) per tile; CTAs that wrote nothing are not counted."""
    from benchmarks.timeline_probe import PER_CTA, PER_WG, summarize

    def cta(start: int, sm: int, wgs: list[list[tuple[int, int]]]) -> list[int]:
        row = [0] * PER_CTA
        row[0], row[1] = start, sm
        for w, tiles in enumerate(wgs):
            base = 2 + w * PER_WG
            row[base], row[base + 1] = len(tiles), tiles[-1][1]
            for i, (b, e) in enumerate(tiles):
                row[base + 2 + 2 * i], row[base + 3 + 2 * i] = b, e
        return row

    raw = (
        cta(1000, 7, [[(1000, 3000), (3000, 5000)], [(1100, 3200), (3200, 5200)]])
        + cta(1050, 8, [[(1050, 4000)], [(1100, 4100)]])
        + cta(1020, 9, [[(1020, 3020), (3020, 6020)], [(1030, 3100), (3100, 6100)]])
        + [0] * PER_CTA  # a CTA of the buffer that no launch wrote
    )
    s = summarize(raw, 2)
    assert s["ctas"] == 3 and s["span_us"] == pytest.approx(5.1)
    assert s["start_us"]["max"] == pytest.approx(0.05)
    assert s["end_us"]["min"] == pytest.approx(3.1) and s["end_us"]["max"] == pytest.approx(5.1)
    # busy 4.2 + 3.05 + 5.08 us of 3 x 5.1
    assert s["idle_fraction"] == pytest.approx(1 - 12.33 / 15.3, abs=1e-3)
    assert s["tiles_per_cta"] == {"1": 1, "2": 2}
    assert s["tile_us_by_round"][0]["p50"] == pytest.approx(2.0)
    assert s["tile_us_by_round"][1]["p50"] == pytest.approx(2.5)
    assert s["first_tile_end_us"]["p50"] == pytest.approx(2.02)
    assert [c["sm"] for c in s["latest"]] == [9, 7, 8]


# --- sliding windows --------------------------------------------------------------------------
@pytest.mark.parametrize("h", [32, 64, 96, 128])
@pytest.mark.parametrize("causal", ["TopLeft", "BottomRight"])
def test_a_window_runs_on_the_one_variant_built_with_it(h: int, causal: str) -> None:
    """Whatever the shape class, a window goes to WINDOW_SELECTION's variant, the only one whose
    ``takes`` holds; the others refuse it."""
    for batch, seq in ((1, 128), (8, 2048), (DYNAMIC, DYNAMIC)):
        spec = stacked(batch=batch, seq=seq, h=h, causal=causal, window=256)
        assert hopper.supports(spec, "sm_90a") is None
        assert hopper.pick(spec) == "pingpongk_128x128"
        assert hopper.variants(spec) == ["pingpongk_128x128"]
    assert [n for n, v in hopper.VARIANTS.items() if v.window] == ["pingpongk_128x128"]
    assert not hopper.VARIANTS["overlap3kls_192x128"].takes(stacked(h=64, causal=causal, window=4))


@pytest.mark.parametrize(
    ("spec", "arch", "words"),
    [
        (stacked(h=256, causal="BottomRight", window=64), "sm_90", "tile head dim 256"),
        (stacked(causal="none", window=64), "sm_90", "without a causal mask"),
        (stacked(causal="TopLeft", window=0), "sm_90", "at least one key"),
        (stacked(causal="BottomRight", window=64), "sm_80", "not sm_90"),
        (stacked(dtype="float32", causal="TopLeft", window=64), "sm_90", "fp32"),
    ],
)
def test_a_window_the_kernel_cannot_read_is_refused_with_a_reason(
    spec: AttentionSpec, arch: str, words: str
) -> None:
    why = hopper.supports(spec, arch)
    assert why is not None and words in why
    with pytest.raises(ValueError, match="needs the Hopper kernel"):
        select_kernel(spec, arch)


def test_a_top_left_window_that_leaves_rows_without_keys_is_refused() -> None:
    """Top-left, row i sees keys (i - W, i]: rows past S_kv + W - 1 see none (the kernel would
    write zeros, SDPA NaN), as bottom-right causal with S > S_kv."""
    base = replace(stacked(causal="TopLeft", window=64), seq_q=2048, seq_kv=1024)
    why = hopper.supports(base, "sm_90")
    assert why is not None and "no keys" in why
    assert hopper.supports(replace(base, window=1025), "sm_90") is None
    assert hopper.supports(replace(base, seq_q=1087), "sm_90") is None


def test_window_render_passes_the_window_to_a_configuration_that_reads_it() -> None:
    """The window's configuration takes W at run time (one object for every W, keyed by the
    digest of worker/kernels_window, which it alone includes); the glue bakes its site's W in."""
    a = hopper.render(stacked(causal="BottomRight", window=100), "s", "pingpongk_128x128")
    b = hopper.render(stacked(causal="BottomRight", window=7), "s", "pingpongk_128x128")
    plain = hopper.render(stacked(causal="BottomRight"), "s", "pingpongk_128x128")
    (cfg,) = a.needs
    assert cfg.source == b.needs[0].source and cfg.symbol == b.needs[0].symbol
    assert cfg.symbol != plain.needs[0].symbol
    assert '#include "hopper_window.cuh"' in cfg.source and "WindowConfig<" in cfg.source
    assert headers_digest(hopper.WINDOW_KERNELS_DIR) in cfg.source
    assert f"-I{hopper.WINDOW_KERNELS_DIR}" in cfg.flags
    assert "launch_window<" in cfg.source and "int window," in cfg.source
    assert "/*window=*/100" in a.source and "/*window=*/7" in b.source
    assert "run_stacked(&launch_site," in a.source
    assert a.config["window"] == 100 and "window" not in plain.config
    # a configuration without a window neither includes nor digests the window's headers
    assert "kernels_window" not in plain.needs[0].source + " ".join(plain.needs[0].flags)
    assert "hopper_window" not in plain.source
    with pytest.raises(ValueError, match="no sliding window"):
        hopper.render(stacked(causal="TopLeft", window=8), "s", "pingpong_128x128")


def test_a_spec_without_a_window_keeps_its_fingerprint() -> None:
    """The window joined AttentionSpec later: a spec without one names the kernel it named
    before (cached glue stays valid); a window makes another."""
    spec = stacked(causal="TopLeft")
    doc = asdict(spec)
    del doc["window"], doc["ragged"]  # (the ragged batch's field joined it the same way)
    blob = json.dumps(doc, sort_keys=True, default=str)
    assert spec.fingerprint() == hashlib.sha256(blob.encode()).hexdigest()
    assert replace(spec, window=8).fingerprint() != spec.fingerprint()


def test_the_report_names_the_window() -> None:
    _, reason = select_kernel(stacked(h=64, causal="TopLeft", window=512), "sm_90")
    assert "pingpongk_128x128" in reason and "sliding window of 512 keys" in reason
