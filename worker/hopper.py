"""Hopper (sm_90a) stacked attention: CUTLASS's TMA + warp-specialized FMHA, read in place.

The SM80-class fMHA runs at ~0.3x of cuDNN on an H200; the Hopper FMHA of
``examples/88_hopper_fmha`` (nvidia-cutlass 4.2) matches it. This module decides whether that
kernel can take an :class:`AttentionSpec` (:func:`supports`), which of its schedules/tiles to try
(:func:`variants`, :data:`SELECTION`), and renders two translation units per choice: the
configuration (:func:`render_config`: the CUTLASS kernel, shared by every shape that uses it,
the expensive compile) and the site's glue (:func:`render`: the spec's numbers, seconds to
compile). The C++ lives in ``worker/kernels/hopper_*``; the example is used as a library from
the installed package, never copied.

The generated sources hold numbers from the spec, our fixed type names and the caller's symbol,
nothing else.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker.attention import DYNAMIC, AttentionSpec, TensorAccess, stacked_spec

if TYPE_CHECKING:  # codegen imports this module; import it back lazily
    from worker.codegen import KernelSource

FAMILY = "cutlass_fmha_hopper"
KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"

#: tile head dims the example instantiates; a head_dim below one is zero-padded by TMA
_TILE_HEAD_DIMS = (32, 64, 128, 256)
_SYMBOL_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_ELEM_BYTES = {"float16": 2, "bfloat16": 2}
_CUTLASS_TYPE = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t"}
_DL_CODE = {"float16": 2, "bfloat16": 4}  # kDLFloat, kDLBfloat
_CAUSAL_MODE = {
    "none": "stackfuse::hopper::CausalMode::kNone",
    "TopLeft": "stackfuse::hopper::CausalMode::kTopLeft",
    "BottomRight": "stackfuse::hopper::CausalMode::kBottomRight",
}
_INT32_MAX = 2**31 - 1
_MAX_OPERANDS = 8  # kMaxOperands in hopper_fmha_tvm.cuh
_MAX_RANK = 6  # kMaxRank there


_TMA = "cutlass::gemm::KernelTma"
_COOP = "cutlass::gemm::KernelTmaWarpSpecializedCooperative"
_PING = "cutlass::gemm::KernelTmaWarpSpecializedPingpong"
_SHORT = "stackfuse::hopper::ShortSeq"  # ours: worker/kernels/hopper_short.cuh


@dataclass(frozen=True)
class Variant:
    """One instantiation of the example's forward kernel."""

    name: str
    schedule: str  # the cutlass::gemm dispatch policy
    block_q: int
    block_kv: int
    #: C++ kernel options (constants of this table, never client text)
    options: tuple[str, ...] = ()
    #: most keys the variant takes (checked again at run time); None: any
    max_seq_kv: int | None = None
    #: most CTAs (query tiles x heads x batch) of a launch the variant is offered for: a choice
    #: from measurements, not a limit of the kernel; None: any
    max_ctas: int | None = None
    #: most keys the variant is offered for: a choice from measurements, not a limit of the
    #: kernel (it takes any length); None: any
    offered_seq_kv: int | None = None

    def takes(self, spec: AttentionSpec) -> bool:
        """Whether ``spec``'s key length is known to fit (a dynamic one does not) and to be
        no longer than ``offered_seq_kv``, and its launch is known to be no larger than
        ``max_ctas``."""
        for most in (self.max_seq_kv, self.offered_seq_kv):
            if most is not None and not (isinstance(spec.seq_kv, int) and spec.seq_kv <= most):
                return False
        if self.max_ctas is None:
            return True
        ctas = _ctas(spec, self.block_q)
        return ctas is not None and ctas <= self.max_ctas

    def has(self, options: tuple[str, ...]) -> bool:
        """Whether this variant is built with any of ``options`` (one of the tuples below)."""
        return any(o in self.options for o in options)

    @property
    def chunked(self) -> bool:
        """Whether its causal tiles go in the chunked order, the chunk chosen on the host."""
        return self.has(_CHUNKED)

    @property
    def kind(self) -> str:
        """The schedule in words, for the report."""
        words = {
            _TMA: "TMA, not warp-specialized",
            _COOP: "TMA + warp-specialized, cooperative",
            _PING: "TMA + warp-specialized, ping-pong, persistent",
            _SHORT: "ours: all keys in shared memory, one warpgroup on wgmma",
        }[self.schedule]
        if self.has(_OVERLAP):
            words += ", our mainloop: softmax overlapped with the warpgroup's own P V"
        if self.has(_LAZY):
            words += ", O rescaled only when a row maximum grows by more than 2^8"
        if self.has(_Q_AHEAD):
            words += ", the next tile's Q loaded during this one (4 K/V stages, not 5)"
        if self.schedule in (_COOP, _PING) and not self.has(_EXAMPLE_EPILOGUE):
            turn = "in turn" if self.has(_OWN_IN_TURN) else "out of turn"
            words += f", our epilogue: one TMA store per warpgroup, {turn}"
        if self.has(_SHORT_PIPELINED):
            words += ", its exponentials overlapping its own P V (two halves of the keys)"
        if self.has(_SHORT_TMA):
            words += ", its tiles loaded by TMA"
        if self.has(_EPILOGUE_IN_Q):
            words += ", O staged in the warpgroup's Q stage"
        if self.max_ctas is not None:
            words += f", for launches of at most {self.max_ctas} CTAs (one wave)"
        if self.offered_seq_kv is not None:
            words += f", for at most {self.offered_seq_kv} keys"
        return words

    def words(self, causal: bool) -> str:
        """:attr:`kind`, plus what a causal mask changes (the report's words)."""
        words = self.kind
        three = self.has(_THREE_MMA_WARPGROUPS)
        if causal and three and self.has(_OVERLAP):
            # the condition of hopper_overlap.cuh's kWarpgroupTrips
            words += "; each warpgroup computes only the key tiles its rows see"
        if causal and self.chunked:
            words += (
                "; tiles handed out heaviest first within chunks of heads where the host's cost"
                " model finds that balances the launch better than the plain order"
            )
        if causal and self.has(_SHIFT_ROWS):
            words += "; query blocks end at the last row, so a ragged block is the lightest"
        return words

    @property
    def config(self) -> dict[str, int | bool | str]:
        return {
            "variant": self.name,
            "schedule": self.schedule,
            "block_q": self.block_q,
            "block_kv": self.block_kv,
        }


_THREE_MMA_WARPGROUPS = (
    "cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kNumMmaWarpGroups, cute::Int<3>>",
)

#: the example's tile order (batch before heads); ours walks the heads first
_BATCH_MAJOR = ("stackfuse::hopper::BatchMajor",)

#: FlashAttention-3's intra-warpgroup overlap (hopper_overlap.cuh)
_OVERLAP = ("stackfuse::hopper::Overlap",)
#: with it, O rescaled only when a row maximum grows by more than 2^8 (FlashAttention-4's)
_LAZY = ("stackfuse::hopper::LazyRescale",)
#: causal ping-pong tiles in a heavy-first order within chunks of heads (hopper_fmha.cuh)
_CHUNKED = ("stackfuse::hopper::ChunkedOrder",)
#: the example's epilogue, each consumer warpgroup's in turn (hopper_kernel_ws.cuh): what the
#: overlapped mainloop in the persistent kernel wants; every other warp-specialized kernel
#: stores O with ours, out of turn
_EXAMPLE_EPILOGUE = ("stackfuse::hopper::ExampleEpilogue",)
_OPTION = "cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::{}, cute::Int<{}>>"
#: the next tile's Q loaded during this one (two Q stages per consumer warpgroup instead of one),
#: paid for with one K/V stage less (4 instead of 5: the shared memory of head dim 128)
_Q_AHEAD = (_OPTION.format("kStagesQ", 4), _OPTION.format("kStagesKV", 4))
#: O staged in the warpgroup's finished Q stage instead of buffers of its own (our epilogue,
#: persistent kernels): at head dim 256 the room for five K/V stages instead of three
_EPILOGUE_IN_Q = ("stackfuse::hopper::EpilogueInQ",)
#: our epilogue in turn: the stagger the overlapped mainloop wants (in the other overlapped
#: kernels the example's epilogue, in turn, gives it)
_OWN_IN_TURN = ("stackfuse::hopper::OwnEpilogueInTurn",)


#: causal masks: query blocks aligned to the last row instead of row 0, so the rows a ragged
#: block wastes are the first (lightest) block's, not the last (heaviest) one's (StackfuseMask)
_SHIFT_ROWS = ("stackfuse::hopper::ShiftRows",)


#: the short-sequence kernel's exponentials overlapping its own P V (hopper_short.cuh)
_SHORT_PIPELINED = ("stackfuse::hopper::ShortPipelined",)
#: the short-sequence kernel's tiles loaded by TMA (kernel_tma)
_SHORT_TMA = ("stackfuse::hopper::ShortTma",)


#: the H200's SMs: one wave of CTAs that take a whole SM each (the selection was measured there)
SMS = 132
#: key lengths up to which a launch counts as "small" too: one or two key tiles per CTA, where
#: per-CTA fixed costs dominate (BERT-base, 384 CTAs: 128-row tiles 12.0 us, 192-row 13.4 us)
SHORT_SEQ_KV = 256

#: every variant, by name; "tma" is the non-warp-specialized kernel (2 CTAs per SM),
#: "coop" two consumer warpgroups sharing one CTA tile, "pingpong" the persistent version of it
#: with Q loaded by its own producer warp.
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("tma_64x128", _TMA, 64, 128),
        Variant("tmaB_64x128", _TMA, 64, 128, _BATCH_MAJOR),
        # the same kernel, offered for head dim 128 only while its 64-row tiles fit in one wave
        # of the H200's SMs: twice the CTAs of a 128-row launch that leaves SMs idle
        Variant("tma1_64x128", _TMA, 64, 128, max_ctas=SMS),
        # ours: the whole key range (at most 128 or 256 keys) in shared memory, 64 query rows
        # per CTA, wgmma ("w"; session 4's mma.sync short_* kernels are gone, slower everywhere)
        Variant("shortw_64x128", _SHORT, 64, 128, max_seq_kv=128),
        Variant("shortw_64x256", _SHORT, 64, 256, max_seq_kv=256),
        # the same, its exponentials overlapping its own P V (in two halves of the keys; session
        # 15). At 128 keys that needs more than the 96 registers of five CTAs per SM (ptxas
        # spilled and serialized the wgmma there), so that one runs four per SM: faster within
        # one wave (B4 S128 N12 3.28 vs 3.41 us), slower past it (BERT-base 10.83 vs 9.52; run 91)
        Variant("shortwo_64x128", _SHORT, 64, 128, _SHORT_PIPELINED, max_seq_kv=128),
        Variant("shortwo_64x256", _SHORT, 64, 256, _SHORT_PIPELINED, max_seq_kv=256),
        # the same, its tiles loaded by TMA (session 16): as fast or faster at every 129-256-key
        # shape measured (GQA 16/4 B32 S256 26.8 vs 28.3 us; run 99, where it was named
        # shortwtq_64x256), slower at 128 keys, so there is no 128-key one
        Variant(
            "shortwot_64x256", _SHORT, 64, 256, (*_SHORT_PIPELINED, *_SHORT_TMA), max_seq_kv=256
        ),
        Variant("coop_128x64", _COOP, 128, 64),
        Variant("pingpong_128x64", _PING, 128, 64),
        Variant("coop_128x128", _COOP, 128, 128),
        Variant("pingpong_128x128", _PING, 128, 128),
        Variant("pingpongB_128x128", _PING, 128, 128, _BATCH_MAJOR),
        # the same with causal tiles heaviest first within chunks of heads (session 18): where a
        # chunk balances a launch of a few waves it wins by up to 47%, elsewhere it ties (run 120)
        Variant("pingpongk_128x128", _PING, 128, 128, _CHUNKED),
        # three consumer warpgroups of 64 rows each (FlashAttention-3 uses 192-row tiles at d64)
        Variant("coop3_192x128", _COOP, 192, 128, _THREE_MMA_WARPGROUPS),
        Variant("pingpong3_192x128", _PING, 192, 128, _THREE_MMA_WARPGROUPS),
        # ping-pong with FlashAttention-3's intra-warpgroup overlap (hopper_overlap.cuh): a
        # warpgroup's softmax runs while its own P V product is on the tensor cores
        Variant("overlap_128x128", _PING, 128, 128, (*_OVERLAP, *_EXAMPLE_EPILOGUE)),
        Variant(
            "overlap3_192x128",
            _PING,
            192,
            128,
            (*_THREE_MMA_WARPGROUPS, *_OVERLAP, *_EXAMPLE_EPILOGUE),
        ),
        Variant(
            "overlap3k_192x128",
            _PING,
            192,
            128,
            (*_THREE_MMA_WARPGROUPS, *_OVERLAP, *_CHUNKED, *_EXAMPLE_EPILOGUE),
        ),
        # and with O rescaled lazily (the pick for long causal launches at head dim 64)
        Variant(
            "overlap3kl_192x128",
            _PING,
            192,
            128,
            (*_THREE_MMA_WARPGROUPS, *_OVERLAP, *_CHUNKED, *_LAZY, *_EXAMPLE_EPILOGUE),
        ),
        # and with the query blocks aligned to the last row under a causal mask (our epilogue,
        # out of turn: the example's cannot store shifted rows; runs 73-74 had ours out of turn
        # and the example's in turn within 0.4% of each other on overlap3kl)
        Variant(
            "overlap3kls_192x128",
            _PING,
            192,
            128,
            (*_THREE_MMA_WARPGROUPS, *_OVERLAP, *_CHUNKED, *_LAZY, *_SHIFT_ROWS),
        ),
        # the same mainloop in the cooperative kernel, with O rescaled lazily, for head dim 256
        # (no ping-pong fits there; O is 128 floats per thread, rescaled per 64-key tile)
        Variant("overlapc_128x64", _COOP, 128, 64, (*_OVERLAP, *_LAZY)),
        # ping-pong with the next tile's Q loaded during this one: pays where a CTA runs many
        # short tiles (at most 256 keys), loses up to 12% where tiles are long (one K/V stage
        # less, run 79), so it is offered for short key ranges only
        Variant("pingpongq_128x128", _PING, 128, 128, _Q_AHEAD, offered_seq_kv=SHORT_SEQ_KV),
        # overlapc_128x64's mainloop at head dim 256 in the persistent (ping-pong) kernel, O
        # staged in the warpgroup's finished Q stage so that five K/V stages fit next to 64 KB
        # of Q, our epilogue in turn (the overlapped loop's stagger): run 86, faster than
        # overlapc wherever a launch has more than one wave of tiles
        Variant(
            "overlapoq_128x64",
            _PING,
            128,
            64,
            (*_OVERLAP, *_LAZY, *_EPILOGUE_IN_Q, *_OWN_IN_TURN),
        ),
    )
}

#: which variants are offered per tile head dim, best first (measured on one H200,
#: benchmarks/results/hopper_kernel.md). At head dim 64 the example's 128x64 tiles
#: (coop_128x64, pingpong_128x64) lost to every other variant at every shape measured
#: (334-351 vs 414-453 TFLOP/s at B2 S8192 N16), so they are not offered there.
_BY_HEAD_DIM: dict[int, tuple[str, ...]] = {
    32: (
        "overlap_128x128",
        "pingpong_128x128",
        "pingpongk_128x128",
        "tma_64x128",
        "coop_128x64",
        "pingpongq_128x128",
    ),
    64: (
        "overlap3_192x128",
        "overlap3kl_192x128",
        "overlap3kls_192x128",
        "overlap3k_192x128",
        "pingpong3_192x128",
        "coop3_192x128",
        "pingpong_128x128",
        "pingpongk_128x128",
        "overlap_128x128",
        "tma_64x128",
        "tmaB_64x128",
        "shortw_64x128",
        "shortw_64x256",
        "shortwo_64x128",
        "shortwo_64x256",
        "shortwot_64x256",
    ),
    128: (
        "overlap_128x128",
        "pingpong_128x128",
        "coop_128x128",
        "pingpongB_128x128",
        "pingpongk_128x128",
        "tma1_64x128",
        "pingpongq_128x128",
    ),
    256: ("overlapoq_128x64", "overlapc_128x64", "coop_128x64"),
}

#: Per shape class, the variant to use, from three H200 runs (benchmarks/results/
#: hopper_kernel.md; TFLOP/s of the pick, run 1 / run 2 / run 3; runs 1-2 timed the example's
#: batch-major order and G launches per GQA group, run 3 ours). Keys: (tile head dim, causal?,
#: size): "tiny" = fewer 128-row query tiles x heads x batch than the H200's 132 SMs, "small" =
#: fewer than two waves of them or a key length of at most SHORT_SEQ_KV, else "large".
#: The SM80-class kernel never won a shape the Hopper kernel takes (B32 S128 N12 H64: ~30
#: TFLOP/s against ~134), so no class maps to it; it stays the kernel for what supports()
#: rejects and for other archs. "unmeasured": no benchmark shape of that class was run. A tuple
#: names variants in order of preference: the first that takes the spec (its key length fits,
#: see Variant.takes) is the pick.
SELECTION: dict[tuple[int, bool, str], str | tuple[str, ...]] = {
    # B8 S2048 N16: overlap_128x128 272.9 us vs pingpong_128x128 281.7, tma_64x128 303.2 (cuDNN
    # 303.1; run 27); tma_64x128 before: 225 / 225 TFLOP/s vs coop_128x64 186 / 185
    (32, False, "large"): "overlap_128x128",
    # B8 S2048 N16 causal: pingpong_128x128 166.6 us vs overlap_128x128 179.5, tma_64x128
    # 181.3, coop_128x64 (the pick before) 231.3 (cuDNN 178.1; run 29)
    # Session 18 (run 120, us): pingpongk_128x128 (tiles in chunks of heads, the host's pick): B1
    # S4096 N16 causal 75.5 vs ping-pong 111.0 (cuDNN 102.2), B8 S2048 N16 causal 167.1 vs 166.9
    # (1.000 per round; 178.0)
    (32, True, "large"): "pingpongk_128x128",
    # B16 S256 N16: pingpongq_128x128 (the next tile's Q loaded ahead) 16.0 us vs ping-pong
    # 16.6, 9 of 9 rounds faster (SDPA's fastest 16.0); causal 15.3 vs 15.8, 9 of 9 (15.7; run
    # 79). Offered up to 256 keys; longer ones take ping-pong. Before: 16.6 us (overlap 16.6,
    # tma 17.4, coop 23.6; cuDNN 16.1); causal 16.0 (overlap 15.8, tma 16.5; cuDNN 15.8; run 29)
    (32, False, "small"): ("pingpongq_128x128", "pingpong_128x128"),
    (32, True, "small"): ("pingpongq_128x128", "pingpongk_128x128"),
    (32, False, "tiny"): "tma_64x128",  # unmeasured
    # unmeasured; coop_128x64 lost by 23-35% at every head-dim-32 shape measured (run 29)
    (32, True, "tiny"): "pingpong_128x128",
    # B2 S8192 N16: overlap3_192x128 1089 us vs pingpong3_192x128 1207 (cuDNN 1204; run 25);
    # pingpong3 before: 453 / 441 / 432 TFLOP/s in runs 1-3 (coop3 445 in 3)
    (64, False, "large"): "overlap3_192x128",
    # B8 S2048 N16 causal (us): overlap3kl_192x128 (chunked order + lazy rescale) vs
    # overlap3k_192x128 (chunked order) 189.9 / 189.5 vs 191.1 / 191.5 (SDPA's fastest 191.6 /
    # 191.8; runs 58-59; the lazy rescale alone on overlap3_192x128: 197.9 / 199.3 vs 200.7 /
    # 200.2, runs 50-51). overlap3k_192x128 (tiles heaviest first within chunks of 32 heads) vs
    # overlap3_192x128 (the plain serpentine): 193.8 / 193.6 / 193.6 vs 199.1 / 200.7 / 197.4
    # (SDPA's fastest 191.7 / 193.7 / 191.1; runs 55-57); Nsight Compute: the busiest SM's
    # active cycles 1.06x the mean instead of 1.13x (cuDNN 1.08x), 189-192 vs 198 us.
    # Session 9: overlap3_192x128 with per-warpgroup key-tile counts vs
    # overlap_128x128 vs pingpong_128x128, one run each: 195.4 / 196.7 / 200.5 (run 42), 197.1
    # / 198.4 / 202.0 (43), 197.8 / 198.9 / 201.8 (44); cuDNN 191.1-193.7. overlap3 without
    # the per-warpgroup counts: 216 vs ping-pong 203 (run 24), 211.3 (42). (Runs 31-32's "with
    # or without" timed one kernel twice: docs/field-notes.md, session 9.) Before: ping-pong,
    # overlap_128x128 a tie with it over runs 25-34.
    # Session 17 (run 108, medians of 9 rounds, paired per round): overlap3kls_192x128 (query
    # blocks aligned to the last row) vs overlap3kl_192x128: B8 S2048 N16 177.4 vs 179.6 us
    # (1.013, 7 of 9 rounds; SDPA's fastest 188.9), bf16 173.2 vs 176.6 (1.017, 9/9), B4 S1024
    # 35.3 vs 36.4 (1.030, 9/9; cuDNN 34.1), B2 S4096 1.003, B1 S8192 1.001; where no whole
    # warpgroup tile is left to shift (B4 S1500) 53.9 vs 53.4 (0.991, 0/9)
    # Session 18 (runs 113 / 115): the host's chunk search over every chunk size (one chunk of
    # all heads included) instead of 8 ... 64 below the heads: B2 S2048 N16 49.7 vs 59.7 us, B1
    # S4096 82.9 vs 105.7, B4 S1024 32.5 vs 35.5, B8 S512 23.2 vs 25.3, B1 S8192 300.5 vs 315.3
    # (cuDNN 57.3, 103.4, 34.1, 22.8, 336.5); unchanged at B8 S2048 N16 (chunks of 32 either way)
    (64, True, "large"): "overlap3kls_192x128",
    # Our wgmma short-sequence kernel where every key fits (run 18, kernel time, medians of 5):
    # BERT B32 S128 N12 9.5 us vs pingpong_128x128 12.0 (cuDNN 10.5); B16 S256 N12: shortw_64x256
    # 14.1 vs 15.5 (cuDNN 13.5); B32 S256 GQA 16/4: 29.0 vs 32.9 (cuDNN 28.9). GQA classes had
    # their own table until session 6 (ping-pong won that GQA shape, 32.9 vs 36.0 us, before the
    # short kernel's loads lost their per-copy address arithmetic; B8 S2048 Nq32 Nkv8 H128 took
    # the cooperative kernel from run 3's best-of-two passes until the medians of runs 7 and 10
    # said ping-pong: 957 vs 984 us and 954 vs 983 us).
    # Session 15 (run 90, 9 rounds, paired): shortwo_64x256 (its exponentials overlapping its
    # own P V) vs shortw_64x256: GQA 16/4 28.44 vs 28.93 us (cuDNN 28.71), B16 S256 N12 13.76
    # vs 14.05 (13.49), 9 of 9 rounds each. Session 16 (run 99, paired): its tiles loaded by TMA
    # (shortwot_64x256) vs shortwo_64x256: GQA 16/4 26.81 vs 28.34 us, 9 of 9 rounds (cuDNN
    # 28.7), B16 S256 N12 13.59 vs 13.71, 9 of 9
    (64, False, "small"): ("shortw_64x128", "shortwot_64x256", "pingpong_128x128"),
    # B32 S128 N12 causal: shortw_64x128 10.2 us vs pingpong_128x128 12.3 (cuDNN 11.3; run 18);
    # B16 S256 N12 causal: shortw_64x256, computing only the keys a block sees, 14.4 vs 15.2
    # (cuDNN 13.9; run 21); shortwo_64x256 14.16 vs 14.27, 9 of 9 rounds (cuDNN 13.98; run 90);
    # shortwot_64x256 14.05 vs 14.09, 6 of 9 (run 99)
    # past 256 keys, pingpongk_128x128 (session 18, run 115): B1 S2048 N16 causal 27.8 us vs
    # ping-pong 37.1, overlap3kls_192x128 30.5 (cuDNN 37.0)
    (64, True, "small"): ("shortw_64x128", "shortwot_64x256", "pingpongk_128x128"),
    # B4 S128 N12: shortw_64x128 3.4 us vs tma_64x128 4.2, pingpong_128x128 5.4 (cuDNN 4.8);
    # B2 S256 N12: shortw_64x256 4.4 vs tma_64x128 5.4 (cuDNN 5.9; run 18). Pipelined (session
    # 15, 9 of 9 rounds each in runs 91 / 92): B4 S128 shortwo_64x128 3.28 / 3.37 vs 3.41 /
    # 3.45 (cuDNN 4.84 / 4.73); B2 S256 shortwo_64x256 4.14 vs 4.48 (cuDNN 5.96; run 91). A
    # tiny launch is at most 264 CTAs of 64 rows: one wave at four per SM. By TMA (run 99): B2
    # S256 shortwot_64x256 4.12 vs 4.16, 7 of 9 rounds
    (64, False, "tiny"): ("shortwo_64x128", "shortwot_64x256", "tma_64x128"),
    # B4 S128 N12 causal: shortw_64x128 3.6 us vs pingpong_128x128 5.7 (cuDNN 5.2; run 21); B2
    # S256 N12 causal: shortw_64x256 5.4 vs 7.6 (cuDNN 6.2; run 22). Pipelined (run 91, 9 of 9
    # rounds each): shortwo_64x128 3.51 vs 3.60 (cuDNN 5.15), shortwo_64x256 5.17 vs 5.33 (6.06);
    # by TMA (run 99) shortwot_64x256 4.92 vs 5.09, 9 of 9
    (64, True, "tiny"): ("shortwo_64x128", "shortwot_64x256", "pingpong_128x128"),
    # overlap_128x128 vs pingpong_128x128 (run 25, us): B8 S2048 N16 431.4 vs 443.8, B4 S4096
    # N32 1801.5 vs 1811.9, GQA 32/8 921.0 vs 932.1, bf16 415.2 vs 431.8; over runs 24-28 1-3%
    # faster at all but B4 S4096 (+1.1, +0.6, -3.2, -3.5, +2.9%); ping-pong before: 645 / 609 /
    # 643 TFLOP/s, GQA 32/8 954 us vs coop 983 (run 10)
    (128, False, "large"): "overlap_128x128",
    # Session 12 (our epilogue, out of turn, in ping-pong; runs 73 / 74, us): B8 S2048 N16
    # causal pingpong_128x128 245.4 / 249.2 vs overlap_128x128 (the example's epilogue in turn)
    # 255.5 / 259.1 (cuDNN 267.5 / 270.7), GQA 32/8 causal 495.6 / 498.9 vs 488.4 / 505.4
    # (SDPA's fastest 524.7 / 534.8). Before: overlap, 254.3 vs 255.5 us, GQA 32/8 causal
    # 509.5 vs 529.5 (run 25)
    # Session 18 (run 120, us): pingpongk_128x128, B1 S4096 N16 132.1 vs ping-pong 165.9 (cuDNN
    # 159.2), B3 S1024 N16 34.1 vs 35.4 (39.9), and level where no chunk beats K = 1: B8 S2048
    # N16 251.4 vs 252.1 (272.3), GQA 32/8 506.5 vs 520.2 (535.6), B2 S2048 N16 65.3 vs 66.4
    (128, True, "large"): "pingpongk_128x128",
    # B16 S256 N16: pingpongq_128x128 24.4 us vs ping-pong 25.0, 9 of 9 rounds faster (cuDNN
    # 23.0); causal 23.6 vs 24.8, 9 of 9 (cuDNN 23.3; run 79). Offered up to 256 keys: at B1
    # S1024 N32 (a "small" launch of 256 CTAs with 8 key tiles each) it lost 12% (36.6 vs 32.1).
    # Before: ping-pong (its overlap version lost at these: 26.2 vs 25.8, 25.3 vs 25.1, 12.4 vs
    # 11.5, 12.6 vs 12.3 us, run 25; B16 S256 N16 25.8 us vs coop 34.0, causal 25.1 vs 32.2)
    (128, False, "small"): ("pingpongq_128x128", "pingpong_128x128"),
    # past 256 keys, pingpongk_128x128 (session 18, run 115): B1 S2048 N16 causal 34.9 us vs
    # ping-pong 45.0 (cuDNN 52.2)
    (128, True, "small"): ("pingpongq_128x128", "pingpongk_128x128"),
    # B1 S512 N16 (64 tiles of 128 rows, half the SMs idle): 128 CTAs of 64 rows, tma1_64x128
    # 10.4 us vs pingpong_128x128 11.5 (cuDNN 11.1; runs 66, 67); causal 10.5-10.6 vs 12.2-12.3
    # (cuDNN 11.7-11.8). Past one wave of 64-row tiles it is not offered (B2 S512 N16: 19.4 vs
    # 12.5, run 67) and ping-pong takes the launch (before: 11.49 vs coop 11.57, run 8)
    (128, False, "tiny"): ("tma1_64x128", "pingpong_128x128"),
    (128, True, "tiny"): ("tma1_64x128", "pingpong_128x128"),
    # Head dim 256: overlapc_128x64 (overlapped mainloop, lazy rescale) vs coop_128x64 (the only
    # variant until session 10), us. B4 S2048 N8: 199.3 / 197.9 vs 210.5 / 210.5, overlapc
    # without the lazy rescale 212.3 / 212.0 (cuDNN 207.3 / 208.7; runs 50-51); 197.1 / 198.1 vs
    # 210.9 / 211.2 (cuDNN 208.1 / 208.5; runs 52-53). Sweep (run 54, cuDNN in brackets): B4
    # S2048 N8 causal 145.4 vs 156.1 (152.9); B16 S256 N8 28.0 vs 28.8 (26.5), causal 27.6 vs
    # 28.2 (25.4); B1 S1024 N8 27.3 vs 28.1 (27.9), causal 26.5 vs 28.5 (28.2). Run 71 (session
    # 11, overlapc's first key tile through our own softmax): B4 S2048 N8 causal 144.4 vs 153.7
    # (151.4); B16 S256 N8 27.9 vs 28.8 (26.2), causal 27.2 vs 28.3 (25.3); B1 S1024 N8 25.8 vs
    # 28.0 (28.1), causal 26.2 vs 28.4 (28.3).
    # Session 14, persistent kernels in 128 x 64 tiles, us. Run 84: with the three K/V stages
    # that fit next to the epilogue's own buffers (overlapkv3: overlapc's mainloop; pingpongkv3:
    # the example's), B16 S256 N8 causal 25.2 / 26.1 vs overlapc 26.7 (cuDNN 25.5), elsewhere up
    # to 63% slower (B4 S2048 N8 287 vs 192). Run 86: with O staged in the Q stage, five K/V
    # stages (overlapoq: our epilogue in turn; pingpongoq: the example's mainloop, ours out of
    # turn) vs overlapc, 9 of 9 rounds each: B4 S2048 N8 188.4 vs 191.3 (cuDNN 204.9), causal
    # 124.6 vs 141.8 (146.7), B16 S256 N8 25.1 vs 27.7 (26.5), causal 23.7 vs 26.8 (25.5), B8
    # S512 N8 34.3 vs 35.8 (36.8); pingpongoq 221.5, 148.7, 25.7, 24.3, 37.1. At B1 S1024 N8
    # (64 CTAs, one partial wave) overlapc stays ahead: 25.5 vs 25.8, causal 25.7 vs 26.2
    (256, False, "large"): "overlapoq_128x64",
    (256, True, "large"): "overlapoq_128x64",
    (256, False, "small"): "overlapoq_128x64",
    (256, True, "small"): "overlapoq_128x64",
    (256, False, "tiny"): "overlapc_128x64",
    (256, True, "tiny"): "overlapc_128x64",
}

#: the H200's SMs: fewer 128-row tiles than this is a "tiny" launch (less than one wave)
TINY_CTAS = SMS
#: CTAs below which a launch counts as "small" (about two waves of the H200's 132 SMs)
SMALL_CTAS = 2 * SMS


def tile_head_dim(head_dim: int) -> int | None:
    """The example's tile head dim that holds ``head_dim`` (TMA zero-fills the rest)."""
    return next((t for t in _TILE_HEAD_DIMS if head_dim <= t), None)


def _is_sm90(arch: str) -> bool:
    digits = re.sub(r"[^0-9]", "", arch)
    return digits == "90"


def supports(spec: AttentionSpec, arch: str) -> str | None:
    """None when the Hopper kernel can run ``spec`` on ``arch``; else what stands in the way."""
    if not _is_sm90(arch):
        return f"target arch {arch} is not sm_90; the Hopper kernel needs an H100/H200 (sm_90a)"
    if spec.dtype not in _ELEM_BYTES:
        return f"dtype {spec.dtype} is not float16/bfloat16; the Hopper kernel has no fp32 path"
    if spec.bias is not None:
        return "an additive bias is present; the Hopper kernel has no bias input"
    if spec.head_dim_v != spec.head_dim:
        return (
            f"head_dim_v {spec.head_dim_v} differs from head_dim {spec.head_dim}; "
            "the Hopper kernel needs equal head dims"
        )
    if spec.head_dim % 8 != 0 or tile_head_dim(spec.head_dim) is None:
        return (
            f"head_dim {spec.head_dim} is not a multiple of 8 up to 256; "
            "the Hopper kernel loads rows with 16-byte TMA"
        )
    if spec.num_kv_heads <= 0 or spec.num_q_heads % spec.num_kv_heads != 0:
        return (
            f"{spec.num_q_heads} query heads are not a multiple of {spec.num_kv_heads} "
            "key/value heads"
        )
    if spec.causal not in _CAUSAL_MODE:
        return f"causal mode {spec.causal} is not none/TopLeft/BottomRight"
    shapes = _operand_shapes(spec)
    if not 1 <= len(shapes) <= _MAX_OPERANDS:
        return f"{len(shapes)} kernel arguments; the Hopper wrapper takes 1 to {_MAX_OPERANDS}"
    elem = _ELEM_BYTES[spec.dtype]
    for name, acc in (("q", spec.q), ("k", spec.k), ("v", spec.v)):
        for what, n in (
            ("offset", acc.offset),
            ("row stride", acc.row_stride),
            ("head stride", acc.head_stride),
        ):
            if n < 0 or (n * elem) % 16 != 0:
                return (
                    f"{name} {what} {n} elements is not 16-byte aligned; "
                    "TMA needs 16-byte aligned addresses and strides"
                )
        if acc.row_stride > _INT32_MAX:
            return f"{name} row stride {acc.row_stride} exceeds 2^31 elements"
        if not 0 <= acc.operand < len(shapes) or shapes[acc.operand] is None:
            return f"{name} reads argument {acc.operand}, which is no tensor operand"
        shape = shapes[acc.operand]
        if shape is not None and not 3 <= len(shape) <= _MAX_RANK:
            return (
                f"{name}'s operand has rank {len(shape)}; the wrapper reads [B, S, ...] "
                f"of rank 3 to {_MAX_RANK}"
            )
    if (
        spec.causal == "BottomRight"
        and isinstance(spec.seq_q, int)
        and isinstance(spec.seq_kv, int)
        and spec.seq_q > spec.seq_kv
    ):
        return (
            f"bottom-right causal mask with seq_q {spec.seq_q} > seq_kv {spec.seq_kv} "
            "leaves rows with no keys"
        )
    for name, acc, seq in (
        ("q", spec.q, spec.seq_q),
        ("k", spec.k, spec.seq_kv),
        ("v", spec.v, spec.seq_kv),
    ):
        if isinstance(seq, int) and acc.row_stride * seq > _INT32_MAX:
            return f"{name} batch stride {acc.row_stride * seq} exceeds 2^31 elements"
    return None


def _ctas(spec: AttentionSpec, block_q: int) -> int | None:
    if not isinstance(spec.batch, int) or not isinstance(spec.seq_q, int):
        return None
    return spec.batch * spec.num_q_heads * math.ceil(spec.seq_q / block_q)


def shape_class(spec: AttentionSpec) -> tuple[int, bool, str]:
    """The SELECTION key of ``spec``; dynamic shapes count as large."""
    tile = tile_head_dim(spec.head_dim) or 0
    ctas = _ctas(spec, 128)
    short = isinstance(spec.seq_kv, int) and spec.seq_kv <= SHORT_SEQ_KV
    if ctas is not None and ctas < TINY_CTAS:
        size = "tiny"
    elif short or (ctas is not None and ctas < SMALL_CTAS):
        size = "small"
    else:
        size = "large"
    return (tile, spec.causal != "none", size)


def _preferences(choice: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if choice is None else (choice,) if isinstance(choice, str) else choice


def pick(spec: AttentionSpec) -> str | None:
    """The measured variant for ``spec``'s shape class: the first of the class's preferences
    that takes ``spec``, or None."""
    choice: str | tuple[str, ...] | None = SELECTION.get(shape_class(spec))
    return next((n for n in _preferences(choice) if VARIANTS[n].takes(spec)), None)


def variants(spec: AttentionSpec) -> list[str]:
    """Variant names valid for ``spec``, the SELECTION's pick first; empty if unsupported."""
    tile = tile_head_dim(spec.head_dim)
    if tile is None:
        return []
    names = [n for n in _BY_HEAD_DIM[tile] if VARIANTS[n].takes(spec)]
    best = pick(spec)
    if best in names:
        names.remove(best)
        names.insert(0, best)
    return names


def _operand_shapes(spec: AttentionSpec) -> list[tuple[int | str, ...] | None]:
    """One entry per kernel argument before the output; None for a non-tensor argument."""
    if spec.operand_shapes:
        return list(spec.operand_shapes)
    return [(DYNAMIC, DYNAMIC, DYNAMIC)] * spec.num_operands


def _num(x: int | str) -> int:
    return -1 if x == DYNAMIC or not isinstance(x, int) else int(x)


def _float_literal(x: float) -> str:
    if not math.isfinite(x):
        raise ValueError(f"scale {x} is not finite")
    return f"{float(x)!r}f"


def include_dirs() -> list[Path]:
    """Headers the generated source needs beyond the compiler's common set."""
    from worker.toolchain import find_toolchain

    chain = find_toolchain()
    return [KERNELS_DIR, chain.fmha_hopper_dir, *chain.cutlass_includes]


def config_type(spec: AttentionSpec, variant: str) -> str:
    """The C++ ``Config<...>`` of ``variant`` for ``spec``'s dtype, tile head dim and mask:
    everything the CUTLASS instantiation depends on (the shape numbers are not part of it)."""
    tile = tile_head_dim(spec.head_dim)
    assert tile is not None
    v = VARIANTS[variant]
    return (
        f"stackfuse::hopper::Config<{_CUTLASS_TYPE[spec.dtype]}, {v.block_q}, {v.block_kv}, "
        f"{tile}, {v.schedule}, {_CAUSAL_MODE[spec.causal]}{''.join(', ' + o for o in v.options)}>"
    )


def render_config(spec: AttentionSpec, variant: str) -> KernelSource:
    """The translation unit of one configuration: the CUTLASS kernel and its launcher, exported
    as a ``LaunchFn`` (hopper_api.h) named by a digest of the configuration. Every site and
    model with the same configuration shares this object; it is the expensive compile (~45 s,
    ~4 GB on 2 cores), so it is keyed by the configuration alone."""
    from worker.codegen import KernelSource

    cfg = config_type(spec, variant)
    symbol = "stackfuse_hcfg_" + hashlib.sha256(cfg.encode()).hexdigest()[:24]
    source = f"""// Generated by stackfuse worker.hopper ({FAMILY} configuration). Type names only.
#include "hopper_fmha.cuh"

namespace stackfuse {{
namespace hopper {{

Status {symbol}(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error) {{
  return launch<{cfg}>(p, stream, cuda_error);
}}

}}  // namespace hopper
}}  // namespace stackfuse
"""
    tile = tile_head_dim(spec.head_dim)
    return KernelSource(
        symbol=symbol,
        source=source,
        family=FAMILY,
        flags=(GENCODE, *(f"-I{p}" for p in include_dirs())),
        config={**VARIANTS[variant].config, "tile_head_dim": tile or 0, "type": cfg},
    )


def selected_configs(
    dtypes: tuple[str, ...] = ("float16", "bfloat16"),
) -> list[tuple[str, AttentionSpec]]:
    """(variant, a spec of it) for every configuration the selection can pick, one per C++
    configuration: what ``stackfuse prebuild`` compiles so that workers start warm."""
    picks = sorted(
        (key, variant) for key, choice in SELECTION.items() for variant in _preferences(choice)
    )
    out: dict[str, tuple[str, AttentionSpec]] = {}
    for (tile, causal, _size), variant in picks:
        for dtype in dtypes:
            for mode in ("TopLeft", "BottomRight") if causal else ("none",):
                spec = stacked_spec(
                    dtype=dtype,  # type: ignore[arg-type]
                    nq=8,
                    nkv=8,
                    h=tile,
                    causal=mode,
                )
                out.setdefault(config_type(spec, variant), (variant, spec))  # one per type
    return list(out.values())


def render(spec: AttentionSpec, symbol: str, variant: str) -> KernelSource:
    """One translation unit exporting ``symbol(op_0, ..., op_{n-1}, out)`` for ``spec``: the
    TVM-FFI glue with ``spec``'s numbers, calling the configuration that ``needs`` holds
    (:func:`render_config`), which is compiled and linked with it."""
    from worker.codegen import KernelSource

    reason = supports(spec, "sm_90a")
    if reason is not None:
        raise ValueError(reason)
    if not _SYMBOL_RE.match(symbol):
        raise ValueError("symbol must be a C identifier")
    tile = tile_head_dim(spec.head_dim)
    assert tile is not None
    if variant not in _BY_HEAD_DIM[tile]:
        raise ValueError(
            f"variant {variant} does not exist for head_dim {spec.head_dim}; "
            f"choose one of {', '.join(_BY_HEAD_DIM[tile])}"
        )
    v = VARIANTS[variant]
    if v.max_seq_kv is not None and isinstance(spec.seq_kv, int) and spec.seq_kv > v.max_seq_kv:
        raise ValueError(f"variant {variant} takes at most {v.max_seq_kv} keys")
    library = render_config(spec, variant)
    shapes = _operand_shapes(spec)
    n = len(shapes)
    ranks = [len(sh) if sh is not None else -1 for sh in shapes]
    shape_rows = []
    for i in range(_MAX_OPERANDS):
        sh = shapes[i] if i < n else None
        dims = list(sh) if sh is not None else []
        nums = [_num(d) for d in dims] + [-1] * (_MAX_RANK - len(dims))
        shape_rows.append("{" + ", ".join(str(x) for x in nums) + "}")
    rank_row = ", ".join(str(r) for r in (ranks + [0] * _MAX_OPERANDS)[:_MAX_OPERANDS])

    def access(a: TensorAccess) -> str:
        return f"{{{int(a.operand)}, {int(a.offset)}, {int(a.row_stride)}, {int(a.head_stride)}}}"

    params = ", ".join(
        f"DLTensor* op{i}" if sh is not None else f"tvm::ffi::AnyView /*shape*/ op{i}"
        for i, sh in enumerate(shapes)
    )
    op_list = ", ".join(f"op{i}" if sh is not None else "nullptr" for i, sh in enumerate(shapes))
    rows = ",\n        ".join(shape_rows)
    source = f"""// Generated by stackfuse worker.hopper ({FAMILY}, variant {v.name}). Numbers only.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "hopper_fmha_tvm.cuh"

namespace stackfuse {{
namespace hopper {{
// {library.config["type"]}, compiled apart (its object is linked with this one)
Status {library.symbol}(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error);
}}  // namespace hopper
}}  // namespace stackfuse

namespace {{

const stackfuse::hopper::StackedSpec kSpec = {{
    /*num_operands=*/{n},
    /*q=*/{access(spec.q)},
    /*k=*/{access(spec.k)},
    /*v=*/{access(spec.v)},
    /*batch=*/{_num(spec.batch)}, /*seq_q=*/{_num(spec.seq_q)}, /*seq_kv=*/{_num(spec.seq_kv)},
    /*q_heads=*/{int(spec.num_q_heads)}, /*kv_heads=*/{int(spec.num_kv_heads)},
    /*head_dim=*/{int(spec.head_dim)}, /*head_dim_v=*/{int(spec.head_dim_v)},
    /*scale=*/{_float_literal(spec.scale)},
    /*dtype_code=*/{_DL_CODE[spec.dtype]}, /*dtype_bits=*/16,
    /*op_rank=*/{{{rank_row}}},
    /*op_shape=*/{{
        {rows}}},
}};

void impl({params}, DLTensor* out) {{
  DLTensor* ops[] = {{{op_list}}};
  stackfuse::hopper::run_stacked(&stackfuse::hopper::{library.symbol}, kSpec, ops, out);
}}

}}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol}, impl);
"""
    # the report names the shared configuration object this site links
    config: dict[str, int | bool | str] = {
        **v.config,
        "tile_head_dim": tile,
        "configuration": library.symbol,
    }
    workspace: int | str
    per_row = 4 * spec.num_q_heads  # the epilogue's log-sum-exp, one float per query row
    if isinstance(spec.batch, int) and isinstance(spec.seq_q, int):
        workspace = spec.batch * spec.seq_q * per_row
    else:
        workspace = f"batch*seq_q*{per_row}"
    return KernelSource(
        symbol=symbol,
        source=source,
        family=FAMILY,
        flags=(GENCODE, f"-I{KERNELS_DIR}"),
        config=config,
        workspace_bytes=workspace,
        needs=(library,),
    )
