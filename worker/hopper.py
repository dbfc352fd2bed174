"""Hopper (sm_90a) stacked attention: CUTLASS's TMA + warp-specialized FMHA, read in place.

The SM80-class fMHA runs at ~0.3x of cuDNN on an H200; the Hopper FMHA of
``examples/88_hopper_fmha`` (nvidia-cutlass 4.2) matches it. This module decides whether that
kernel can take an :class:`AttentionSpec` (:func:`supports`), which of its schedules/tiles to try
(:func:`variants`; the measured table is :data:`worker.hopper_selection.SELECTION`), and
renders two translation units per choice: the configuration (:func:`render_config`: the CUTLASS
kernel, shared by every shape that uses it, the expensive compile) and the site's glue
(:func:`render`: the spec's numbers, seconds to compile). The C++ lives in
``worker/kernels/hopper_*``; the example is used as a library from the installed package, never
copied.

The generated sources hold numbers from the spec, our fixed type names and the caller's symbol,
nothing else.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from worker.attention import DYNAMIC, AttentionSpec, TensorAccess, stacked_spec
from worker.hopper_selection import SELECTION, WINDOW_SELECTION, Choice, ShapeClass
from worker.kernel_source import KernelSource
from worker.nvcc import headers_digest

FAMILY = "cutlass_fmha_hopper"
KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
#: the sliding window's mask, mainloop and launcher (hopper_window.cuh). Apart from KERNELS_DIR,
#: whose digest keys every cached object: only window configurations include it, and their
#: generated source carries this directory's digest (``worker.nvcc.headers_digest``)
WINDOW_KERNELS_DIR = Path(__file__).resolve().parent / "kernels_window"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
#: flush-to-zero float math for the configuration units: the example's softmax (the ping-pong
#: kernels' mainloop, and every kernel's first key tile but the lazy ones') calls exp2f, which
#: otherwise adds a compare and two predicated multiplies to each probability's MUFU.EX2 for
#: results below 2^-126 (probabilities fp16 cannot hold; see OverlapMainloop::exp2_ftz).
#: With it the ping-pong head-dim-64 build has 20% fewer instructions, and is 2-7% faster
#: (hopper_kernel_gridlow.md, H100)
FTZ = "-ftz=true"

#: tile head dims the example instantiates; a head_dim below one is zero-padded by TMA. 96 is
#: laid out in CuTe's 64-byte swizzle: 3-16% faster than the 128 tile at head dims 80 and 96
#: (benchmarks/results/hopper_kernel_grid96.md)
_TILE_HEAD_DIMS = (32, 64, 96, 128, 256)
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
    #: also built with a sliding window (``WindowConfig``, hopper_window.cuh: the key tiles
    #: outside the window skipped); only such a variant takes a spec with one
    window: bool = False
    #: most share of its query rows a launch may leave empty in ragged last blocks (a known
    #: query length that is not a multiple of ``block_q``) for the variant to be offered: a
    #: choice from measurements; None: any
    offered_row_waste: float | None = None

    def takes(self, spec: AttentionSpec) -> bool:
        """Whether the variant takes ``spec``'s window (if any) and its grouped query heads (if
        any), ``spec``'s key length is known to fit (a dynamic one does not) and to be no
        longer than ``offered_seq_kv``, and its launch is known to be no larger than
        ``max_ctas``."""
        if spec.window is not None and not self.window:
            return False
        if self.schedule == _TMA and spec.num_q_heads != spec.num_kv_heads:
            # the example's non-warp-specialized kernel runs a GQA group as one launch per query
            # head of the group, one after another: 0.30x SDPA's fastest at B1 S1024 GQA 8/2
            # and B1 S512 16/4, head dim 128 (attention_grid.md); the others take a group whole
            return False
        for most in (self.max_seq_kv, self.offered_seq_kv):
            if most is not None and not (isinstance(spec.seq_kv, int) and spec.seq_kv <= most):
                return False
        if self.offered_row_waste is not None and isinstance(spec.seq_q, int):
            rows = math.ceil(spec.seq_q / self.block_q) * self.block_q
            if (rows - spec.seq_q) / rows > self.offered_row_waste:
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
        if self.offered_row_waste is not None:
            words += (
                f", for query lengths whose last {self.block_q}-row block leaves at most"
                f" {self.offered_row_waste:.0%} of the rows empty"
            )
        return words

    def words(self, causal: bool, window: int | None = None) -> str:
        """:attr:`kind`, plus what a causal mask and a sliding window change (the report's
        words)."""
        words = self.kind
        if window is not None:
            words += (
                f"; a sliding window of {window} keys: each query block reads only the key tiles"
                " its window reaches, masked in place (no mask tensor)"
            )
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
        # per CTA, wgmma ("w"; an mma.sync version was slower at every short shape)
        Variant("shortw_64x128", _SHORT, 64, 128, max_seq_kv=128),
        Variant("shortw_64x256", _SHORT, 64, 256, max_seq_kv=256),
        # the same, its exponentials overlapping its own P V (in two halves of the keys). At 128
        # keys that needs more than the 96 registers of five CTAs per SM (ptxas spilled and
        # serialized the wgmma there), so that one runs four per SM: faster within one wave
        # (B4 S128 N12 3.28 vs 3.41 us), slower past it (BERT-base 10.83 vs 9.52; 9466ce9)
        Variant("shortwo_64x128", _SHORT, 64, 128, _SHORT_PIPELINED, max_seq_kv=128),
        Variant("shortwo_64x256", _SHORT, 64, 256, _SHORT_PIPELINED, max_seq_kv=256),
        # the same, its tiles loaded by TMA: as fast or faster at every 129-256-key shape
        # measured (GQA 16/4 B32 S256 26.8 vs 28.3 us; a36b2fe), slower at 128 keys, so there
        # is no 128-key one
        Variant(
            "shortwot_64x256", _SHORT, 64, 256, (*_SHORT_PIPELINED, *_SHORT_TMA), max_seq_kv=256
        ),
        Variant("coop_128x64", _COOP, 128, 64),
        Variant("pingpong_128x64", _PING, 128, 64),
        Variant("coop_128x128", _COOP, 128, 128),
        Variant("pingpong_128x128", _PING, 128, 128),
        Variant("pingpongB_128x128", _PING, 128, 128, _BATCH_MAJOR),
        # the same with causal tiles heaviest first within chunks of heads: where a chunk
        # balances a launch of a few waves it wins by up to 47%, elsewhere it ties
        # (benchmarks/results/hopper_kernel.md, b1_s4096_n16_h32_causal and b8_s2048_n16_h32_causal)
        # also the one variant with a sliding window (WINDOW_SELECTION): the example's mainloop,
        # whose K/V loads and mask hopper_window.cuh starts at a window's first key tile
        Variant("pingpongk_128x128", _PING, 128, 128, _CHUNKED, window=True),
        # three consumer warpgroups of 64 rows each (FlashAttention-3 uses 192-row tiles at d64)
        Variant("coop3_192x128", _COOP, 192, 128, _THREE_MMA_WARPGROUPS),
        Variant("pingpong3_192x128", _PING, 192, 128, _THREE_MMA_WARPGROUPS),
        # ping-pong with FlashAttention-3's intra-warpgroup overlap (hopper_overlap.cuh): a
        # warpgroup's softmax runs while its own P V product is on the tensor cores
        Variant("overlap_128x128", _PING, 128, 128, (*_OVERLAP, *_EXAMPLE_EPILOGUE)),
        # offered where its 192-row blocks leave at most 5% of the rows empty: at S 512 and
        # 1024 they leave 11% (576 rows for 512), and pingpong_128x128 was 4% faster at B16
        # S512 N16 (hopper_kernel_grid64.md); at S 2048 and 4096 (3%) the two are level or
        # overlap3 leads by 4% (b1_s4096_n32_h64)
        Variant(
            "overlap3_192x128",
            _PING,
            192,
            128,
            (*_THREE_MMA_WARPGROUPS, *_OVERLAP, *_EXAMPLE_EPILOGUE),
            offered_row_waste=0.05,
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
        # out of turn: the example's cannot store shifted rows; on overlap3kl ours out of turn
        # and the example's in turn are within 0.4% of each other)
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
        # less; 2b192ab), so it is offered for short key ranges only
        Variant("pingpongq_128x128", _PING, 128, 128, _Q_AHEAD, offered_seq_kv=SHORT_SEQ_KV),
        # overlapc_128x64's mainloop at head dim 256 in the persistent (ping-pong) kernel, O
        # staged in the warpgroup's finished Q stage so that five K/V stages fit next to 64 KB
        # of Q, our epilogue in turn (the overlapped loop's stagger): faster than overlapc
        # wherever a launch has more than one wave of tiles (c866e95)
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
        "pingpongq_128x128",
        "tma_64x128",
        "tmaB_64x128",
        "shortw_64x128",
        "shortw_64x256",
        "shortwo_64x128",
        "shortwo_64x256",
        "shortwot_64x256",
    ),
    96: (
        "overlap_128x128",
        "pingpong_128x128",
        "pingpongk_128x128",
        "tma1_64x128",
        "pingpongq_128x128",
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
    if spec.ragged is not None:
        return "a ragged batch (seqstart): the Hopper kernel reads sequences of one length"
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
    why_not_window = _window_refusal(spec)
    if why_not_window is not None:
        return why_not_window
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


def _window_refusal(spec: AttentionSpec) -> str | None:
    """What stands in the way of ``spec``'s sliding window (None: no window, or one the window
    variants take)."""
    w = spec.window
    if w is None:
        return None
    if spec.causal == "none":
        return f"window_size={w} without a causal mask; a window needs TopLeft or BottomRight"
    if w < 1:
        return f"window_size={w}; a window holds at least one key"
    tile = tile_head_dim(spec.head_dim)
    if tile not in WINDOW_SELECTION:
        return (
            f"window_size={w} at tile head dim {tile}; only the ping-pong variant at tile head "
            f"dims {', '.join(map(str, sorted(WINDOW_SELECTION)))} takes a sliding window"
        )
    if (
        spec.causal == "TopLeft"
        and isinstance(spec.seq_q, int)
        and isinstance(spec.seq_kv, int)
        and spec.seq_q > spec.seq_kv + w - 1
    ):
        return (
            f"top-left causal window_size={w} with seq_q {spec.seq_q} > seq_kv {spec.seq_kv} + "
            f"{w - 1} leaves rows with no keys"
        )
    return None


def _ctas(spec: AttentionSpec, block_q: int) -> int | None:
    if not isinstance(spec.batch, int) or not isinstance(spec.seq_q, int):
        return None
    return spec.batch * spec.num_q_heads * math.ceil(spec.seq_q / block_q)


def shape_class(spec: AttentionSpec) -> ShapeClass:
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


def _preferences(choice: Choice | None) -> tuple[str, ...]:
    return () if choice is None else (choice,) if isinstance(choice, str) else choice


def pick(spec: AttentionSpec) -> str | None:
    """The measured variant for ``spec``'s shape class (for a sliding window, its tile head
    dim's entry of ``WINDOW_SELECTION``): the first of its preferences that takes ``spec``, or
    None."""
    choice: Choice | None
    if spec.window is not None:
        choice = WINDOW_SELECTION.get(tile_head_dim(spec.head_dim) or 0)
    else:
        choice = SELECTION.get(shape_class(spec))
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


def _tile_for(spec: AttentionSpec, tile: int | None) -> int:
    """``spec``'s tile head dim, or ``tile`` where a caller names a larger one (the kernel
    benchmark's comparison of one head dim in two tiles)."""
    smallest = tile_head_dim(spec.head_dim)
    if smallest is None:
        raise ValueError(f"head_dim {spec.head_dim} is above every tile head dim")
    if tile is None:
        return smallest
    if tile not in _TILE_HEAD_DIMS or tile < smallest:
        raise ValueError(f"tile head dim {tile} cannot hold head_dim {spec.head_dim}")
    return tile


def config_type(spec: AttentionSpec, variant: str, tile: int | None = None) -> str:
    """The C++ ``Config<...>`` of ``variant`` for ``spec``'s dtype, tile head dim (``tile``
    where given, else the smallest that holds the head dim) and mask (``WindowConfig<...>``
    with a sliding window, whose size is read at run time): everything the CUTLASS
    instantiation depends on (the shape numbers are not part of it)."""
    tile = _tile_for(spec, tile)
    v = VARIANTS[variant]
    name = "WindowConfig" if spec.window is not None else "Config"
    return (
        f"stackfuse::hopper::{name}<{_CUTLASS_TYPE[spec.dtype]}, {v.block_q}, {v.block_kv}, "
        f"{tile}, {v.schedule}, {_CAUSAL_MODE[spec.causal]}{''.join(', ' + o for o in v.options)}>"
    )


def render_config(spec: AttentionSpec, variant: str, tile: int | None = None) -> KernelSource:
    """The translation unit of one configuration: the CUTLASS kernel and its launcher, exported
    as a ``LaunchFn`` (hopper_api.h) named by a digest of the configuration. Every site and
    model with the same configuration shares this object; it is the expensive compile (~45 s,
    ~4 GB on 2 cores), so it is keyed by the configuration alone. ``tile`` as in
    :func:`config_type`."""
    tile = _tile_for(spec, tile)
    cfg = config_type(spec, variant, tile)
    symbol = "stackfuse_hcfg_" + hashlib.sha256(cfg.encode()).hexdigest()[:24]
    header = f"// Generated by stackfuse worker.hopper ({FAMILY} configuration). Type names only."
    dirs = include_dirs()
    if spec.window is None:
        include, signature, call = "hopper_fmha.cuh", "", "launch"
        args = "p, stream, cuda_error"
    else:  # the window's size is the launcher's argument: one object serves every size
        header += f"\n// {WINDOW_KERNELS_DIR.name} sha256 {headers_digest(WINDOW_KERNELS_DIR)}"
        include, signature, call = "hopper_window.cuh", "int window, ", "launch_window"
        args = "p, window, stream, cuda_error"
        dirs = [WINDOW_KERNELS_DIR, *dirs]
    source = f"""{header}
#include "{include}"

namespace stackfuse {{
namespace hopper {{

Status {symbol}(Problem const& p, {signature}cudaStream_t stream, cudaError_t* cuda_error) {{
  return {call}<{cfg}>({args});
}}

}}  // namespace hopper
}}  // namespace stackfuse
"""
    return KernelSource(
        symbol=symbol,
        source=source,
        family=FAMILY,
        flags=(GENCODE, FTZ, *(f"-I{p}" for p in dirs)),
        config={**VARIANTS[variant].config, "tile_head_dim": tile, "type": cfg},
    )


def selected_configs(
    dtypes: tuple[str, ...] = ("float16", "bfloat16"),
) -> list[tuple[str, AttentionSpec]]:
    """(variant, a spec of it) for every configuration the selection can pick, one per C++
    configuration: what ``stackfuse prebuild`` compiles so that workers start warm."""
    picks = sorted(
        (key, variant) for key, choice in SELECTION.items() for variant in _preferences(choice)
    )
    # sliding windows: the window's size is no part of the configuration (any one stands in)
    picks += sorted(
        ((tile, True, "window"), variant)
        for tile, choice in WINDOW_SELECTION.items()
        for variant in _preferences(choice)
    )
    out: dict[str, tuple[str, AttentionSpec]] = {}
    for (tile, causal, size), variant in picks:
        for dtype in dtypes:
            for mode in ("TopLeft", "BottomRight") if causal else ("none",):
                spec = stacked_spec(
                    dtype=dtype,  # type: ignore[arg-type]
                    nq=8,
                    nkv=8,
                    h=tile,
                    causal=mode,
                    window=1 if size == "window" else None,
                )
                out.setdefault(config_type(spec, variant), (variant, spec))  # one per type
    return list(out.values())


def render(spec: AttentionSpec, symbol: str, variant: str, tile: int | None = None) -> KernelSource:
    """One translation unit exporting ``symbol(op_0, ..., op_{n-1}, out)`` for ``spec``: the
    TVM-FFI glue with ``spec``'s numbers, calling the configuration that ``needs`` holds
    (:func:`render_config`), which is compiled and linked with it. ``tile``: a tile head dim
    larger than the smallest that holds the head dim (the kernel benchmark's comparison);
    the pipeline never names one."""
    reason = supports(spec, "sm_90a")
    if reason is not None:
        raise ValueError(reason)
    if not _SYMBOL_RE.match(symbol):
        raise ValueError("symbol must be a C identifier")
    tile = _tile_for(spec, tile)
    if variant not in _BY_HEAD_DIM[tile]:
        raise ValueError(
            f"variant {variant} does not exist for head_dim {spec.head_dim}; "
            f"choose one of {', '.join(_BY_HEAD_DIM[tile])}"
        )
    v = VARIANTS[variant]
    if v.max_seq_kv is not None and isinstance(spec.seq_kv, int) and spec.seq_kv > v.max_seq_kv:
        raise ValueError(f"variant {variant} takes at most {v.max_seq_kv} keys")
    if spec.window is not None and not v.window:
        raise ValueError(f"variant {variant} takes no sliding window")
    library = render_config(spec, variant, tile)
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
    launch = f"&stackfuse::hopper::{library.symbol}"
    window_param, window_launch = "", ""
    if spec.window is not None:  # the configuration takes the window: this site's, baked in
        window_param = "int window, "
        launch = "&launch_site"
        window_launch = f"""
stackfuse::hopper::Status launch_site(stackfuse::hopper::Problem const& p, cudaStream_t stream,
                                      cudaError_t* cuda_error) {{
  return stackfuse::hopper::{library.symbol}(p, /*window=*/{int(spec.window)}, stream, cuda_error);
}}
"""
    source = f"""// Generated by stackfuse worker.hopper ({FAMILY}, variant {v.name}). Numbers only.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "hopper_fmha_tvm.cuh"

namespace stackfuse {{
namespace hopper {{
// {library.config["type"]}, compiled apart (its object is linked with this one)
Status {library.symbol}(Problem const& p, {window_param}cudaStream_t stream,
                        cudaError_t* cuda_error);
}}  // namespace hopper
}}  // namespace stackfuse

namespace {{
{window_launch}
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
  stackfuse::hopper::run_stacked({launch}, kSpec, ops, out);
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
    if spec.window is not None:
        config["window"] = int(spec.window)
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
