"""Hopper FMHA kernel: build test objects here, check numerics and time them on an H200.

Two steps, because the GPU machine is scarce and this one has no GPU:

``python benchmarks/hopper_kernel.py build [--out .gpu/hopper] [--jobs 2]``
    (build host, project venv) renders every test configuration through ``worker.hopper.render``,
    compiles each with nvcc for sm_90a, links them into one ``libhopper_test.so`` and writes
    ``manifest.json`` (symbols and their numbers) and ``compile.json`` (seconds, peak RSS).

``python benchmarks/hopper_kernel.py run --dir .gpu/hopper --out $OUT``
    (H200, its python3 with torch; PYTHONPATH=.gpu/site for the runtime-only TVM) checks every
    symbol against an independent float32/float64 reference with poisoned outputs, then times
    the variants against PyTorch SDPA on views of the same stacked tensor, and writes
    ``hopper_kernel.json`` and ``hopper_kernel.md`` to $OUT.

The run step imports only torch, tvm and tvm_ffi: nothing from this repository.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.kernel_source import KernelSource

REPO = Path(__file__).resolve().parent.parent
LIB_NAME = "libhopper_test.so"


# --------------------------------------------------------------------------------------------
# Test catalog (shared by both steps; plain data)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One exported symbol: a spec whose batch and sequence lengths are read at run time."""

    symbol: str
    dtype: str
    variant: str
    causal: str
    kind: str  # "stacked": one operand [B,S,(Nq+2Nkv)H]; "split": q [B,Sq,NqH], kv [B,Sk,2NkvH]
    nq: int
    nkv: int
    head_dim: int
    any_seq: bool  # also checked at ragged sequence lengths (77, 203, 1, 999)
    obj: str
    #: extra nvcc flags of this object (an experiment; the method name shows them)
    flags: tuple[str, ...] = ()
    #: most keys the variant takes (worker.hopper.Variant.max_seq_kv); None: any
    max_seq_kv: int | None = None
    #: a sliding window of this many keys (baked into the glue; the configuration reads it at
    #: run time); None: none
    window: int | None = None
    #: a tile head dim above the smallest that holds ``head_dim`` (worker.hopper.render's
    #: ``tile``: the comparison of one head dim in two tiles); None: the pipeline's own
    tile: int | None = None

    @property
    def method(self) -> str:
        flags = "".join(f"+{f.lstrip('-')}" for f in self.flags)
        return f"hopper:{self.variant}" + flags + (f"@t{self.tile}" if self.tile else "")


_HEADS_128 = [(16, 16, 128), (32, 32, 128), (32, 8, 128), (16, 1, 128), (16, 16, 96)]
_HEADS_64 = [(16, 16, 64), (12, 12, 64), (16, 4, 64)]
#: the heads of the attention grid's non-causal head-dim-64 shapes (``run --shapes grid64``)
_GRID_64 = [(32, 32, 64), (10, 10, 64)]
_HEADS_32 = [(16, 16, 32), (8, 2, 32)]
_HEADS_256 = [(8, 8, 256), (8, 2, 256)]
#: the heads of the attention grid's head-dim-80 and -96 shapes (``run --shapes grid96``), by
#: dtype and mask
_GRID_96 = {
    "f16_none": [(16, 1, 80), (20, 20, 80), (16, 4, 96)],
    "b16_none": [(32, 1, 80), (10, 2, 96)],
    "f16_causal": [(32, 8, 80), (16, 16, 96)],
    "b16_causal": [(16, 1, 80), (16, 16, 80), (20, 5, 96)],
}


#: the sliding windows of the window objects' numerics (one symbol each: the glue bakes W in)
WINDOWS = (1, 64, 100, 256, 1000)


def catalog() -> list[Slot]:
    """Every object (dtype, variant, tile, causal[, window]) and the specs compiled into it."""
    objs: list[
        tuple[
            str,
            str,
            str,
            list[tuple[str, int, int, int, bool]],
            tuple[str, ...],
            tuple[int | None, ...],
            int | None,
        ]
    ] = []

    def add(
        dtype: str,
        variant: str,
        causal: str,
        stacked: list[tuple[int, int, int]],
        split: tuple[tuple[int, int, int], ...] | list[tuple[int, int, int]] = (),
        any_seq: tuple[tuple[int, int, int], ...] | list[tuple[int, int, int]] = (),
        flags: tuple[str, ...] = (),
        windows: tuple[int, ...] = (),
        tile: int | None = None,
    ) -> None:
        rows = [("stacked", *h, False) for h in stacked]
        rows += [("split", *h, False) for h in split]
        rows += [("stacked", *h, True) for h in any_seq]
        objs.append((dtype, variant, causal, rows, flags, windows or (None,), tile))

    f16, b16 = "float16", "bfloat16"
    h128 = (16, 16, 128)
    # fp16, head dim 128 (and 96, zero-padded into the 128 tile); GQA 32/8 and MQA 16/1
    add(f16, "coop_128x128", "none", _HEADS_128, [h128, (16, 4, 128)], [h128])
    add(
        f16,
        "coop_128x128",
        "TopLeft",
        [h128, (32, 8, 128), (16, 16, 96)],
        [h128, (16, 4, 128)],
        [h128],
    )
    add(f16, "coop_128x128", "BottomRight", [h128], [h128, (16, 4, 128)])
    add(f16, "pingpong_128x128", "none", _HEADS_128, [(16, 4, 128)], [h128])
    add(
        f16,
        "pingpong_128x128",
        "TopLeft",
        [h128, (32, 8, 128), (32, 32, 128)],
        [h128, (16, 4, 128)],
        [h128],
    )
    add(f16, "pingpong_128x128", "BottomRight", [h128], [h128, (16, 4, 128)])
    # fp16, head dim 64
    add(f16, "pingpong3_192x128", "none@64", _HEADS_64 + _GRID_64, [(12, 12, 64)], [(12, 12, 64)])
    add(f16, "coop3_192x128", "none@64", _HEADS_64, [], [(12, 12, 64)])
    add(f16, "pingpong_128x128", "none@64", _HEADS_64 + _GRID_64, [], [(12, 12, 64)])
    add(f16, "tma_64x128", "none@64", _HEADS_64, [], [(12, 12, 64)])
    add(f16, "pingpongB_128x128", "none", [h128, (32, 32, 128), (32, 8, 128)])
    add(f16, "pingpongB_128x128", "TopLeft", [(32, 8, 128)])
    add(f16, "tmaB_64x128", "none@64", [(12, 12, 64)])
    add(f16, "pingpong3_192x128", "TopLeft@64", _HEADS_64, [(12, 12, 64)], [(12, 12, 64)])
    add(f16, "coop3_192x128", "TopLeft@64", _HEADS_64)
    add(f16, "pingpong_128x128", "TopLeft@64", _HEADS_64)
    add(f16, "tma_64x128", "TopLeft@64", _HEADS_64)
    # fp16, head dims 32 and 256
    add(f16, "coop_128x64", "none@32", _HEADS_32, [], [(16, 16, 32)])
    add(f16, "tma_64x128", "none@32", _HEADS_32)
    add(f16, "coop_128x64", "TopLeft@32", _HEADS_32)
    add(f16, "coop_128x64", "none@256", _HEADS_256, [], [(8, 8, 256)])
    add(f16, "coop_128x64", "TopLeft@256", _HEADS_256)
    # bf16
    add(b16, "pingpong_128x128", "none", [h128, (32, 8, 128)], [(16, 4, 128)])
    add(b16, "coop_128x128", "none", [h128, (32, 8, 128)])
    add(b16, "pingpong_128x128", "TopLeft", [h128, (32, 8, 128)])
    add(b16, "pingpong3_192x128", "none@64", _HEADS_64)
    add(b16, "tma_64x128", "none@64", [(12, 12, 64)])
    add(b16, "coop_128x64", "none@32", _HEADS_32)
    add(b16, "coop_128x64", "none@256", _HEADS_256)
    # our short-sequence kernel (wgmma; at most 128 or 256 keys, numerics within that only)
    gqa = (16, 4, 64)
    for w in ("shortw_64x128", "shortw_64x256", "shortwo_64x128", "shortwo_64x256"):
        add(f16, w, "none@64", _HEADS_64, [(12, 12, 64)], [gqa])
        add(f16, w, "TopLeft@64", [(12, 12, 64), gqa], [gqa])
        add(f16, w, "BottomRight@64", [], [gqa])
        add(b16, w, "none@64", [(12, 12, 64), gqa], [gqa])
        add(b16, w, "TopLeft@64", [gqa])
    # FlashAttention-3's intra-warpgroup overlap (hopper_overlap.cuh)
    add(f16, "overlap_128x128", "none", _HEADS_128, [(16, 4, 128)], [h128])
    add(f16, "overlap_128x128", "TopLeft", [h128, (32, 8, 128)], [h128, (16, 4, 128)], [h128])
    add(f16, "overlap_128x128", "BottomRight", [h128], [h128, (16, 4, 128)])
    add(b16, "overlap_128x128", "none", [h128, (32, 8, 128)], [(16, 4, 128)])
    add(b16, "overlap_128x128", "TopLeft", [h128, (32, 8, 128)])
    add(f16, "overlap_128x128", "none@64", _HEADS_64 + _GRID_64, [], [(12, 12, 64)])
    add(f16, "overlap_128x128", "TopLeft@64", _HEADS_64, [], [(12, 12, 64)])
    add(f16, "overlap3_192x128", "none@64", _HEADS_64 + _GRID_64, [(12, 12, 64)], [(12, 12, 64)])
    add(f16, "overlap3_192x128", "TopLeft@64", _HEADS_64, [(16, 4, 64)], [(12, 12, 64)])
    add(f16, "overlap3_192x128", "BottomRight@64", [], [(12, 12, 64), (16, 4, 64)])
    add(b16, "overlap3_192x128", "none@64", _HEADS_64)
    add(b16, "overlap3_192x128", "TopLeft@64", [(16, 16, 64)], [], [(12, 12, 64)])
    add(f16, "overlap_128x128", "none@32", _HEADS_32, [], [(16, 16, 32)])
    add(b16, "overlap_128x128", "none@32", _HEADS_32)
    add(f16, "pingpong_128x128", "none@32", _HEADS_32)
    add(f16, "overlap_128x128", "TopLeft@32", _HEADS_32, [], [(16, 16, 32)])
    add(f16, "pingpong_128x128", "TopLeft@32", _HEADS_32)
    add(f16, "tma_64x128", "TopLeft@32", _HEADS_32)
    # without flush-to-zero float math (worker.hopper.FTZ: exp2f as one MUFU.EX2, no subnormal
    # fix-up), the control of its A/B (nvcc takes the last -ftz)
    no_ftz = ("-ftz=false",)
    add(f16, "pingpong_128x128", "none", [h128, (32, 8, 128)], flags=no_ftz)
    add(f16, "pingpong_128x128", "TopLeft", [h128], flags=no_ftz)
    add(f16, "pingpong_128x128", "none@64", _HEADS_64 + _GRID_64, flags=no_ftz)
    add(f16, "pingpong3_192x128", "none@64", [(16, 16, 64)], flags=no_ftz)
    add(f16, "tma_64x128", "none@64", [(12, 12, 64)], flags=no_ftz)
    # causal three-warpgroup tiles in a heavy-first order within chunks of heads
    add(f16, "overlap3k_192x128", "TopLeft@64", [(16, 16, 64)], [(16, 4, 64)], [(12, 12, 64)])
    add(f16, "overlap3k_192x128", "BottomRight@64", [], [(12, 12, 64), (16, 4, 64)])
    add(f16, "overlap3kl_192x128", "TopLeft@64", [(16, 16, 64)], [(16, 4, 64)], [(12, 12, 64)])
    add(f16, "overlap3kl_192x128", "BottomRight@64", [], [(12, 12, 64), (16, 4, 64)])
    add(b16, "overlap3kl_192x128", "TopLeft@64", [(16, 16, 64)], [], [(12, 12, 64)])
    # the causal ping-pong kernel in the chunked order (the A/B of the search over every chunk
    # size against the coarse one, -DSTACKFUSE_NARROW_CHUNKS=1, is commit 7e24661)
    add(
        f16,
        "pingpongk_128x128",
        "TopLeft",
        [h128, (32, 8, 128), (32, 32, 128)],
        [h128, (16, 4, 128)],
        [h128],
    )
    add(f16, "pingpongk_128x128", "BottomRight", [], [h128, (16, 4, 128)])
    add(f16, "pingpongk_128x128", "TopLeft@64", [(16, 16, 64)], [(16, 4, 64)])
    add(f16, "pingpongk_128x128", "TopLeft@32", _HEADS_32)
    add(b16, "pingpongk_128x128", "TopLeft", [h128, (32, 8, 128)])
    # (K = 1 in place of the plain order, no branch between two orders on the device, was
    # measured as -DSTACKFUSE_CHUNK_BRANCH_FREE=1 and ships: commit bb53392; FastDivmod against
    # the integer divisions of commit 7bcb0ef, -DSTACKFUSE_CHUNK_SLOW_DIV=1: commit dc2a7c5)
    # the same with the query blocks aligned to the last row (ShiftRows)
    add(f16, "overlap3kls_192x128", "TopLeft@64", [(16, 16, 64)], [(16, 4, 64)], [(12, 12, 64)])
    add(f16, "overlap3kls_192x128", "BottomRight@64", [], [(12, 12, 64), (16, 4, 64)])
    add(b16, "overlap3kls_192x128", "TopLeft@64", [(16, 16, 64)], [], [(12, 12, 64)])
    # (its control, overlap3klo_192x128, overlap3kl with our epilogue and no shift: 180.0 vs
    # overlap3kls's 177.4 us at B8 S2048 N16 causal; commit c9a21ab)
    # head dim 256: the overlapped mainloop with lazy rescale, in the cooperative kernel
    add(f16, "overlapc_128x64", "none@256", _HEADS_256, [], [(8, 8, 256)])
    add(f16, "overlapc_128x64", "TopLeft@256", _HEADS_256, [], [(8, 8, 256)])
    add(b16, "overlapc_128x64", "none@256", _HEADS_256)
    # head dim 128 in 64-row tiles: one wave of them for single short sequences
    add(f16, "tma1_64x128", "none", [h128, (32, 32, 128), (32, 8, 128)], [(16, 4, 128)], [h128])
    add(f16, "tma1_64x128", "TopLeft", [h128, (32, 8, 128)], [(16, 4, 128)], [h128])
    add(f16, "tma1_64x128", "BottomRight", [], [h128, (16, 4, 128)])
    add(b16, "tma1_64x128", "none", [h128], [(16, 4, 128)])
    # the A/B of the warp-specialized kernels' epilogue: the example's in turn (=1) and ours in
    # turn (=2), against ours out of turn unless the variant keeps the example's
    # (hopper_kernel_ws.cuh; commit 499bb57)
    turn = ("-DSTACKFUSE_EPILOGUE_IN_TURN=1",)
    for ab in (turn, ("-DSTACKFUSE_EPILOGUE_IN_TURN=2",)):
        add(f16, "pingpong_128x128", "none", [h128], flags=ab)
        add(f16, "overlap_128x128", "none", [h128, (32, 8, 128)], flags=ab)
        add(f16, "overlap_128x128", "TopLeft", [h128, (32, 8, 128)], flags=ab)
        add(b16, "overlap_128x128", "none", [h128], flags=ab)
        add(f16, "overlap_128x128", "none@32", _HEADS_32, flags=ab)
        add(f16, "overlap3_192x128", "none@64", _HEADS_64, flags=ab)
        add(f16, "overlap3kl_192x128", "TopLeft@64", [(16, 16, 64)], flags=ab)
    add(f16, "pingpong_128x128", "TopLeft", [h128], flags=turn)
    add(f16, "overlapc_128x64", "none@256", _HEADS_256, flags=turn)
    # the next tile's Q loaded during this one (two Q stages per warpgroup, four K/V stages; on
    # the overlapped kernels, overlapq_128x128 0.94-1.01x and overlap3q_192x128 0.98-1.02x: not
    # kept, commit 2b192ab)
    add(f16, "pingpongq_128x128", "none", [h128, (32, 32, 128), (32, 8, 128)], [], [h128])
    add(f16, "pingpongq_128x128", "TopLeft", [h128, (32, 8, 128)], [], [h128])
    add(f16, "pingpongq_128x128", "none@32", _HEADS_32, [], [(16, 16, 32)])
    add(f16, "pingpongq_128x128", "TopLeft@32", _HEADS_32)
    # (O staged in the warpgroup's finished Q stage, its 32 KB spent on a sixth K/V stage or on
    # a second Q stage per warpgroup: 0.89-0.98x, not kept; commit 0a43dd9)
    # (deeper K/V pipelines, Option<kStagesKV, 8> on overlap3(kl)_192x128 at head dim 64 and 10
    # on overlap_128x128 / pingpong_128x128 at head dim 32: 0.98-1.00x and 1.01x; not kept,
    # commit 2b192ab)
    # head dim 256 in the persistent kernel. The cooperative overlapc_128x64 runs its 128-row
    # tiles in waves of one CTA per SM, each wave loading its tiles from scratch (a %globaltimer
    # timeline, commit 122da52: two waves of ~11 us at B16 S256 N8). With the three K/V stages
    # that fit next to the epilogue's buffers (overlapkv3_128x64, pingpongkv3_128x64) it was
    # faster only at B16 S256 N8 causal, up to 63% slower elsewhere (commit 1b9491b); with O
    # staged in the Q stage and five K/V stages, overlapoq_128x64 is kept and
    # pingpongoq_128x64, the example's mainloop, slower everywhere, is not (commit c866e95)
    add(f16, "overlapoq_128x64", "none@256", _HEADS_256, [], [(8, 8, 256)])
    add(f16, "overlapoq_128x64", "TopLeft@256", _HEADS_256, [(8, 8, 256)], [(8, 8, 256)])
    add(f16, "overlapoq_128x64", "BottomRight@256", [], [(8, 8, 256), (8, 2, 256)])
    add(b16, "overlapoq_128x64", "none@256", _HEADS_256)
    add(b16, "overlapoq_128x64", "TopLeft@256", [(8, 8, 256)])
    # the short kernel's tiles loaded by TMA (K and V only, shortwt_64x256, and both at 128
    # keys: slower there, not kept, commit a36b2fe; try_wait with a suspend-time hint: no gain,
    # commit 257fb20)
    add(f16, "shortwot_64x256", "none@64", _HEADS_64, [(12, 12, 64)], [gqa])
    add(f16, "shortwot_64x256", "TopLeft@64", [(12, 12, 64), gqa], [gqa])
    add(f16, "shortwot_64x256", "BottomRight@64", [], [gqa])
    add(b16, "shortwot_64x256", "none@64", [(12, 12, 64), gqa], [gqa])
    add(b16, "shortwot_64x256", "TopLeft@64", [gqa])
    # (pingpongq with O staged in the Q stage, five K/V stages again:
    # pingpongqo_128x128, 1.012x pingpongq at B16 S256 N16 H128, 0.967-0.978x at the causal and
    # head-dim-32 short shapes; not kept, commit 54beefc)
    # %globaltimer stamps per CTA and tile (benchmarks/timeline_probe.py); N in
    # -DSTACKFUSE_TIMELINE=N names each object's stackfuse_timeline_set_N
    for n, (dtype, variant, causal, heads) in enumerate(
        [
            (f16, "pingpongq_128x128", "none", h128),
            (f16, "pingpong_128x128", "none", h128),
            (f16, "overlap_128x128", "none", h128),
            (f16, "overlapc_128x64", "none@256", (8, 8, 256)),
        ],
        start=1,
    ):
        add(dtype, variant, causal, [heads], flags=(f"-DSTACKFUSE_TIMELINE={n}",))
    # (FlashAttention-3's key tiles with O in the Q stage and four K/V stages, overlapoq_128x80 at
    # head dim 256 and overlapoq_128x176 / overlapoq_128x128 at 128,
    # CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED defined so that CuTe picks 64 x 80 and 64 x 176
    # products: level with the 64- and 128-key tiles at best; commit b6e00cd)
    # (the overlapped mainloop with Q in registers for Q K^T,
    # -DSTACKFUSE_Q_REGS=1 on overlap_128x128 at head dims 128 and 32 and on overlap3 /
    # overlap3kls at 64: ptxas serialized the wgmmas at 64 and 128, 10-22% slower; 0.8% faster
    # at 32; not kept, commit 437e010)
    # (the last partial round split along the keys over every SM: TailSplitScheduler,
    # -DSTACKFUSE_TAIL_SPLIT=1 on overlap_128x128 at head dims 128 and 32, overlap3_192x128 and
    # overlapoq_128x64. 1.6-3.8% faster than the same code without the split, but that code ran at
    # 0.85-0.96x the shipped kernels' speed; not kept, commit dbe5b74. Commit a24f6a1 has it with
    # 32-bit range arithmetic, no spills and no calls: 0.94-0.99x the shipped kernels, its no-split
    # control 0.95-0.97x; not kept)
    # (-Xptxas=--register-usage-level=N, N in 0, 2, 8, 10, on overlap_128x128 at head dim 128
    # and overlap3_192x128 at 64: 0.97-1.01x the default level per round, none ahead at every
    # shape; not kept, commit e1f9620)
    # with line info, for Nsight Compute's source view (benchmarks/ncu_probe.py)
    add(f16, "pingpong_128x128", "none@64", [(12, 12, 64)], flags=("-lineinfo",))
    add(f16, "pingpong_128x128", "none", [h128], flags=("-lineinfo",))
    # sliding windows (WindowConfig, worker/kernels_window): the one variant that takes them, at
    # tile head dims 128, 64 and 32, both causal alignments, fp16 and bf16, MHA and GQA; stacked
    # (S == S_kv) and split (S != S_kv) operands
    for dtype in (f16, b16):
        for causal in ("TopLeft", "BottomRight"):
            add(dtype, "pingpongk_128x128", causal, [h128, (32, 8, 128)], [(16, 4, 128)],
                windows=WINDOWS)  # fmt: skip
            add(dtype, "pingpongk_128x128", f"{causal}@64", [(16, 4, 64)], [(12, 12, 64)],
                windows=WINDOWS)  # fmt: skip
    add(f16, "pingpongk_128x128", "BottomRight@32", [(8, 2, 32)], [(16, 16, 32)], windows=WINDOWS)

    # head dims 80 and 96 in the 96 tile (CuTe's 64-byte swizzle, 64 x 96 P V products), each
    # A/B row also zero-padded in the 128 tile (``tile=128``): the grid96 shapes
    for tile in (None, 128):
        add(f16, "overlap_128x128", "none@96", _GRID_96["f16_none"], tile=tile,
            split=[(16, 4, 96)] if tile is None else [],
            any_seq=[(16, 16, 96), (12, 3, 80)] if tile is None else [])  # fmt: skip
        add(b16, "overlap_128x128", "none@96", _GRID_96["b16_none"], tile=tile)
        add(f16, "pingpongk_128x128", "TopLeft@96", _GRID_96["f16_causal"], tile=tile,
            split=[(16, 4, 96)] if tile is None else [],
            any_seq=[(16, 16, 96)] if tile is None else [])  # fmt: skip
        add(b16, "pingpongk_128x128", "TopLeft@96", _GRID_96["b16_causal"], tile=tile)
        add(f16, "pingpongq_128x128", "none@96", [(12, 1, 96)], tile=tile,
            any_seq=[(12, 1, 96)] if tile is None else [])  # fmt: skip
        add(b16, "pingpong_128x128", "TopLeft@96", [(12, 1, 96)], tile=tile)
    add(f16, "pingpongk_128x128", "BottomRight@96", [], [(16, 4, 96), (12, 12, 80)])
    add(b16, "pingpongq_128x128", "none@96", [(12, 3, 80)])
    add(b16, "pingpong_128x128", "none@96", [(12, 3, 80), (16, 16, 96)])
    add(f16, "pingpongq_128x128", "TopLeft@96", [(12, 1, 96)], [], [(12, 1, 96)])
    add(f16, "tma1_64x128", "TopLeft@96", [(8, 8, 80)], [(16, 16, 96)], [(8, 8, 80)])
    add(f16, "pingpong_128x128", "TopLeft@96", [(8, 8, 80)])
    add(b16, "tma1_64x128", "none@96", [(16, 16, 96)], [(16, 16, 96)])
    for dtype in (f16, b16):
        add(dtype, "pingpongk_128x128", "BottomRight@96", [(16, 4, 96)], [(12, 12, 80)],
            windows=WINDOWS)  # fmt: skip
    add(f16, "pingpongk_128x128", "TopLeft@96", [(16, 4, 80)], [(12, 12, 96)], windows=WINDOWS)

    # the attention grid's shapes still below SDPA's fastest (``run --shapes gridlow``): the
    # selected variant beside the others its class could take
    mqa, gqa3 = (16, 1, 64), (12, 3, 64)
    add(f16, "pingpongq_128x128", "none@64", [(16, 16, 64)], [], [(12, 12, 64)])
    add(b16, "pingpongq_128x128", "none@64", [(16, 1, 64)])
    add(b16, "pingpong_128x128", "none@64", [(16, 1, 64)])
    add(b16, "overlap3_192x128", "none@64", [(16, 1, 64)])
    for v in ("pingpong_128x128", "pingpongk_128x128", "overlap3kls_192x128"):
        add(f16, v, "TopLeft@64", [mqa])
    add(f16, "pingpongq_128x128", "TopLeft@64", [mqa, gqa3], [], [gqa3])
    for v in ("shortwot_64x256", "shortw_64x256", "pingpongk_128x128"):
        add(f16, v, "TopLeft@64", [gqa3])
    for v in ("pingpongq_128x128", "pingpongk_128x128", "pingpong_128x128"):
        add(b16, v, "TopLeft", [(12, 12, 128)])
    for v in ("overlapoq_128x64", "overlapc_128x64"):
        add(f16, v, "none@256", [(12, 12, 256)])
    # the same without flush-to-zero float math: the example's softmax (the ping-pong kernels')
    # calls exp2f, which then adds a compare and two predicated multiplies to each
    # probability's MUFU.EX2. The overlapped mainloops call ex2.approx.ftz in their loops
    # either way: their two show what the flag does to the rest
    add(f16, "pingpongq_128x128", "none@64", [(16, 16, 64)], flags=no_ftz)
    add(b16, "pingpong_128x128", "none@64", [(16, 1, 64)], flags=no_ftz)
    add(f16, "pingpong_128x128", "TopLeft@64", [mqa], flags=no_ftz)
    for v in ("pingpongq_128x128", "pingpongk_128x128"):
        add(b16, v, "TopLeft", [(12, 12, 128)], flags=no_ftz)
    add(f16, "overlap3_192x128", "none@64", [(16, 16, 64)], flags=no_ftz)
    add(f16, "overlapoq_128x64", "none@256", [(12, 12, 256)], flags=no_ftz)

    from worker.hopper import VARIANTS

    slots: list[Slot] = []
    for dtype, variant, causal_tag, rows, flags, windows, tile in objs:
        causal = causal_tag.split("@")[0]
        tag = causal_tag.replace("@", "_d")
        suffix = "".join("_" + re.sub(r"[^a-z0-9]", "", f.lower()) for f in flags)
        suffix += "_window" if windows != (None,) else ""
        suffix += f"_t{tile}" if tile is not None else ""
        obj = f"{'f16' if dtype == f16 else 'b16'}_{variant}_{tag}{suffix}"
        for kind, nq, nkv, hd, any_seq in rows:
            for win in windows:
                sym = f"hfa_{obj}_{kind}_{nq}_{nkv}_{hd}{'_anyseq' if any_seq else ''}"
                sym += f"_w{win}" if win is not None else ""
                slots.append(
                    Slot(
                        sym,
                        dtype,
                        variant,
                        causal,
                        kind,
                        nq,
                        nkv,
                        hd,
                        any_seq,
                        obj,
                        flags,
                        VARIANTS[variant].max_seq_kv,
                        win,
                        tile,
                    )
                )
    return slots


# --------------------------------------------------------------------------------------------
# build (here)
# --------------------------------------------------------------------------------------------


def _spec_for(slot: Slot) -> Any:
    from worker.attention import DYNAMIC, AttentionSpec, TensorAccess, stacked_spec

    h, nq, nkv = slot.head_dim, slot.nq, slot.nkv
    if slot.kind == "stacked":
        return stacked_spec(
            dtype=slot.dtype,  # type: ignore[arg-type]
            nq=nq,
            nkv=nkv,
            h=h,
            causal=slot.causal,  # type: ignore[arg-type]
            window=slot.window,
        )
    cq, ckv = nq * h, 2 * nkv * h
    return AttentionSpec(
        dtype=slot.dtype,  # type: ignore[arg-type]
        batch=DYNAMIC,
        seq_q=DYNAMIC,
        seq_kv=DYNAMIC,
        num_q_heads=nq,
        num_kv_heads=nkv,
        head_dim=h,
        head_dim_v=h,
        scale=1.0 / math.sqrt(h),
        causal=slot.causal,  # type: ignore[arg-type]
        q=TensorAccess(0, 0, cq, h),
        k=TensorAccess(1, 0, ckv, h),
        v=TensorAccess(1, nkv * h, ckv, h),
        num_operands=2,
        packing="separate",
        operand_shapes=((DYNAMIC, DYNAMIC, cq), (DYNAMIC, DYNAMIC, ckv)),
        window=slot.window,
    )


def _namespaced(source: str, idx: int, symbol: str) -> str:
    """Several rendered units in one file (one kernel instantiation, several specs): each in a
    namespace of its own inside the unnamed one; the exported function is unchanged."""
    body = source.replace("\nnamespace {\n", f"\nnamespace {{\nnamespace slot{idx} {{\n", 1)
    body = body.replace("\n}  // namespace\n", "\n}  // namespace slot\n}  // namespace\n", 1)
    return body.replace(
        f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol}, impl);",
        f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol}, slot{idx}::impl);",
    )


_BUILD_TAG = """
namespace stackfuse {
namespace hopper {
// an experiment's build (hopper_kernel.py): an option no one reads, so that its Config, kernel
// and launch<> are types and symbols of their own
template <unsigned kTag>
struct BuildTag {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(2000);
  using option_value = cute::true_type;
};
}  // namespace hopper
}  // namespace stackfuse
"""


def _own_names(glue: str, cfg_source: str, flags: tuple[str, ...]) -> tuple[str, str]:
    """The glue and configuration source of a build with extra ``flags``, with names of their
    own: the configuration's function (``stackfuse_hcfg_<hash>_<tag>``, else two objects
    collide at link time) and its ``Config`` type, which gains ``BuildTag<tag>``.

    Why the type: ``launch<Config>`` is a template, so objects built from one configuration
    with different flags define it under one name and the linker keeps the first; every
    flagged copy then ran the unflagged kernel (Nsight Compute counted the same instruction mix
    for all of them)."""
    tag = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]
    glue, cfg_source = (
        re.sub(r"(stackfuse_hcfg_[0-9a-f]{24})", rf"\1_{tag}", t) for t in (glue, cfg_source)
    )
    include = '#include "hopper_fmha.cuh"\n'
    assert include in cfg_source and cfg_source.count(">>(p, stream, cuda_error)") == 1
    cfg_source = cfg_source.replace(include, include + _BUILD_TAG, 1).replace(
        ">>(p, stream, cuda_error)",
        f", stackfuse::hopper::BuildTag<0x{tag}u>>>(p, stream, cuda_error)",
    )
    return glue, cfg_source


def _nvcc_command(unit: KernelSource, extra: tuple[str, ...], src: Path, obj: Path) -> list[str]:
    """The service's own nvcc command for ``unit`` (:func:`worker.nvcc.nvcc_argv`) plus the
    experiment's ``extra`` flags, timed, with ptxas's report and its warnings on (they fill
    ``compile.json``)."""
    from worker.nvcc import nvcc_argv
    from worker.toolchain import find_toolchain

    argv = nvcc_argv(unit, find_toolchain(), src, obj, "-Xptxas=-v", *extra, warnings=True)
    return ["/usr/bin/time", "-v", *argv]


def _compile(cmd: list[str], log: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    log.write_text(text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    # ptxas's "Potential Performance Loss" warnings (C7512 and kin: serialized or waited-on
    # wgmma; docs/field-notes.md): Q in registers lost 10-22% to C7512 with no spill reported
    perf = sorted(
        {
            f"{c}: {w}"
            for c, w in re.findall(
                r"\((C75\d\d)\) Potential Performance Loss: (.*?)(?: for the function|\n)", text
            )
        }
    )
    return {
        "ok": proc.returncode == 0,
        "seconds": round(wall, 1),
        "peak_rss_mb": round(int(rss.group(1)) / 1024) if rss else None,
        "registers": [int(r) for r in regs],
        "spill_store_bytes": [int(s) for s in spills],
        "ptxas_performance_warnings": perf,
    }


def build(out: Path, jobs: int, only: str | None) -> int:
    from worker import hopper

    out.mkdir(parents=True, exist_ok=True)
    slots = [s for s in catalog() if only is None or re.search(only, s.obj)]
    by_obj: dict[str, list[Slot]] = {}
    for s in slots:
        by_obj.setdefault(s.obj, []).append(s)

    # an object is up to date only if newer than its source and our headers
    newest_header = max(
        p.stat().st_mtime
        for d in (hopper.KERNELS_DIR, hopper.WINDOW_KERNELS_DIR)
        for p in d.glob("hopper*.cuh")
    )
    tasks = []
    objects: list[str] = []

    def add_task(name: str, text: str, unit: KernelSource, extra: tuple[str, ...] = ()) -> None:
        """Compile ``text`` as ``name``.o with ``unit``'s flags and ``extra`` unless an object
        newer than it and our headers is there (the source keeps its mtime when unchanged)."""
        src, objf = out / f"{name}.cu", out / f"{name}.o"
        if not src.exists() or src.read_text() != text:
            src.write_text(text)
        if objf.exists() and objf.stat().st_mtime > max(src.stat().st_mtime, newest_header):
            return
        tasks.append((name, _nvcc_command(unit, extra, src, objf), out / f"{name}.log"))

    for obj, members in by_obj.items():
        # one configuration (the CUTLASS kernel) per object, plus the glue of each of its specs
        parts: list[str] = []
        configs: set[str] = set()
        for i, slot in enumerate(members):
            ks = hopper.render(_spec_for(slot), slot.symbol, slot.variant, slot.tile)
            (cfg,) = ks.needs
            glue, cfg_source = ks.source, cfg.source
            if slot.flags:  # the same configuration built differently
                glue, cfg_source = _own_names(glue, cfg_source, slot.flags)
            parts.append(_namespaced(glue, i, slot.symbol))
            if cfg_source not in configs:
                configs.add(cfg_source)
                add_task(f"{obj}.cfg", cfg_source, cfg, slot.flags)
        assert len(configs) == 1, f"{obj}: one configuration per object"
        add_task(obj, "\n".join(parts), ks, members[-1].flags)
        objects += [f"{obj}.cfg.o", f"{obj}.o"]

    # the as-rendered units (one spec, one symbol): the compiles the service pays for, cold
    single = catalog()[0]
    ks = hopper.render(_spec_for(single), "hopper_single", single.variant)
    add_task("single.cfg", ks.needs[0].source, ks.needs[0])
    add_task("single", ks.source, ks)

    times_path = out / "compile.json"
    times: dict[str, Any] = json.loads(times_path.read_text()) if times_path.exists() else {}

    def work(t: tuple[str, list[str], Path]) -> tuple[str, dict[str, Any]]:
        name, cmd, log = t
        res = _compile(cmd, log)
        print(f"{name}: {res}", flush=True)
        return name, res

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, res in pool.map(work, tasks):
            times[name] = res
    times["_jobs"] = jobs
    times_path.write_text(json.dumps(times, indent=1))
    failed = [n for n, r in times.items() if isinstance(r, dict) and not r.get("ok")]
    if failed:
        print("FAILED:", failed)
        return 1

    from worker.toolchain import find_toolchain

    chain = find_toolchain()
    objs = [str(out / o) for o in objects]
    subprocess.run(
        [
            "g++",
            "-shared",
            "-fPIC",
            "-o",
            str(out / LIB_NAME),
            *objs,
            str(chain.cudart_static),
            "-lpthread",
            "-ldl",
            "-lrt",
        ],
        check=True,
    )
    (out / "manifest.json").write_text(json.dumps([asdict(s) for s in slots], indent=1))
    print(f"linked {out / LIB_NAME} with {len(slots)} symbols from {len(objs)} objects")
    return 0


# --------------------------------------------------------------------------------------------
# run (on the H200)
# --------------------------------------------------------------------------------------------

#: (name, B, S, Nq, Nkv, H, causal, dtype); the five shapes of issue #6 plus GQA and bf16
BENCH_SHAPES = [
    ("b8_s2048_n16_h128", 8, 2048, 16, 16, 128, False, "float16"),
    ("b4_s4096_n32_h128", 4, 4096, 32, 32, 128, False, "float16"),
    ("b2_s8192_n16_h64", 2, 8192, 16, 16, 64, False, "float16"),
    ("b8_s2048_n16_h128_causal", 8, 2048, 16, 16, 128, True, "float16"),
    ("b32_s128_n12_h64_bert", 32, 128, 12, 12, 64, False, "float16"),
    ("b4_s128_n12_h64", 4, 128, 12, 12, 64, False, "float16"),
    ("b32_s256_n16_h64_gqa4", 32, 256, 16, 4, 64, False, "float16"),
    ("b8_s2048_q32_kv8_h128_gqa", 8, 2048, 32, 8, 128, False, "float16"),
    ("b8_s2048_q32_kv8_h128_gqa_causal", 8, 2048, 32, 8, 128, True, "float16"),
    ("b8_s2048_n16_h128_bf16", 8, 2048, 16, 16, 128, False, "bfloat16"),
    ("b8_s2048_n16_h64_causal", 8, 2048, 16, 16, 64, True, "float16"),
    ("b8_s2048_n16_h32", 8, 2048, 16, 16, 32, False, "float16"),
    ("b4_s2048_n8_h256", 4, 2048, 8, 8, 256, False, "float16"),
]

#: one shape per SELECTION class that had no measurement (``run --shapes sweep``): short
#: prompts and single sequences at head dim 128, causal or not, and causal BERT-like shapes
SWEEP_SHAPES = [
    ("b16_s256_n16_h128", 16, 256, 16, 16, 128, False, "float16"),  # (128, False, small)
    ("b16_s256_n16_h128_causal", 16, 256, 16, 16, 128, True, "float16"),  # (128, True, small)
    ("b1_s512_n16_h128", 1, 512, 16, 16, 128, False, "float16"),  # (128, False, tiny)
    ("b1_s512_n16_h128_causal", 1, 512, 16, 16, 128, True, "float16"),  # (128, True, tiny)
    ("b4_s128_n12_h64_causal", 4, 128, 12, 12, 64, True, "float16"),  # (64, True, tiny)
    ("b32_s128_n12_h64_causal", 32, 128, 12, 12, 64, True, "float16"),  # (64, True, small)
    ("b8_s2048_n16_h32_causal", 8, 2048, 16, 16, 32, True, "float16"),  # (32, True, large)
    ("b16_s256_n16_h32", 16, 256, 16, 16, 32, False, "float16"),  # (32, False, small)
    ("b16_s256_n16_h32_causal", 16, 256, 16, 16, 32, True, "float16"),  # (32, True, small)
    ("b4_s2048_n8_h256_causal", 4, 2048, 8, 8, 256, True, "float16"),  # (256, True, large)
    ("b16_s256_n8_h256", 16, 256, 8, 8, 256, False, "float16"),  # (256, False, small)
    ("b16_s256_n8_h256_causal", 16, 256, 8, 8, 256, True, "float16"),  # (256, True, small)
    ("b1_s1024_n8_h256", 1, 1024, 8, 8, 256, False, "float16"),  # (256, False, tiny)
    ("b1_s1024_n8_h256_causal", 1, 1024, 8, 8, 256, True, "float16"),  # (256, True, tiny)
]


#: every shape with at most 256 keys at head dim 64 (``run --shapes short``): where the
#: example's kernels trail cuDNN and our short-sequence kernels compete
SHORT_SHAPES = [
    *(sh for sh in BENCH_SHAPES if sh[2] <= 256 and sh[5] == 64),
    *(sh for sh in SWEEP_SHAPES if sh[2] <= 256 and sh[5] == 64),
    ("b16_s256_n12_h64", 16, 256, 12, 12, 64, False, "float16"),  # BERT at 256 tokens
    ("b16_s256_n12_h64_causal", 16, 256, 12, 12, 64, True, "float16"),  # (64, True, small)
    ("b2_s256_n12_h64", 2, 256, 12, 12, 64, False, "float16"),  # (64, False, tiny), 256 keys
    ("b2_s256_n12_h64_causal", 2, 256, 12, 12, 64, True, "float16"),  # (64, True, tiny)
]


#: head dim 128 at up to 1024 keys and fewer than two waves of 128-row tiles (``run --shapes
#: h128``): short prompts and single sequences of Llama-class models, where the example's
#: persistent kernels trailed cuDNN by 4-12% at the sweep shapes
H128_SHAPES = [
    *(sh for sh in SWEEP_SHAPES if sh[5] == 128),
    ("b2_s512_n16_h128", 2, 512, 16, 16, 128, False, "float16"),  # 128 tiles: 2 waves of 64 rows
    ("b1_s1024_n32_h128", 1, 1024, 32, 32, 128, False, "float16"),  # Llama-2-7B, one prompt
    ("b1_s1024_q32_kv8_h128_gqa_causal", 1, 1024, 32, 8, 128, True, "float16"),  # Llama-3-8B
]

#: the long non-causal head-dim-128 shapes of the main set (``run --shapes long128``)
LONG128_SHAPES = [sh for sh in BENCH_SHAPES if sh[5] == 128 and not sh[6]]

#: every head-dim-256 shape of the main and sweep sets (``run --shapes h256``), plus B8 S512
H256_SHAPES = [
    *(sh for sh in (*BENCH_SHAPES, *SWEEP_SHAPES) if sh[5] == 256),
    ("b8_s512_n8_h256", 8, 512, 8, 8, 256, False, "float16"),  # 256 tiles of 8 key tiles
]

#: long causal launches at head dim 64 (``run --shapes causal64``): 192-row query blocks whose
#: last one is ragged at 1024-8192 rows (row_shift 64 or 128), and 1500 rows (36: no key tile
#: saved)
CAUSAL64_SHAPES = [
    *(sh for sh in BENCH_SHAPES if sh[5] == 64 and sh[6]),
    ("b4_s1024_n16_h64_causal", 4, 1024, 16, 16, 64, True, "float16"),
    ("b2_s4096_n16_h64_causal", 2, 4096, 16, 16, 64, True, "float16"),
    ("b1_s8192_n16_h64_causal", 1, 8192, 16, 16, 64, True, "float16"),
    ("b4_s1500_n16_h64_causal", 4, 1500, 16, 16, 64, True, "float16"),
    ("b8_s2048_n16_h64_causal_bf16", 8, 2048, 16, 16, 64, True, "bfloat16"),
]

#: long causal launches at head dim 64 of 3-8 waves of 128-row tiles (``run --shapes
#: causal64w``): where the 192-row kernel starts to beat the 128-row ones
CAUSAL64W_SHAPES = [
    ("b3_s1024_n16_h64_causal", 3, 1024, 16, 16, 64, True, "float16"),  # 2.9 waves
    ("b4_s768_n16_h64_causal", 4, 768, 16, 16, 64, True, "float16"),  # 2.9
    ("b4_s1024_n16_h64_causal", 4, 1024, 16, 16, 64, True, "float16"),  # 3.9
    ("b8_s512_n16_h64_causal", 8, 512, 16, 16, 64, True, "float16"),  # 3.9
    ("b2_s2048_n16_h64_causal", 2, 2048, 16, 16, 64, True, "float16"),  # 3.9
    ("b1_s4096_n16_h64_causal", 1, 4096, 16, 16, 64, True, "float16"),  # 3.9
    ("b5_s1024_n16_h64_causal", 5, 1024, 16, 16, 64, True, "float16"),  # 4.8
    ("b6_s1024_n16_h64_causal", 6, 1024, 16, 16, 64, True, "float16"),  # 5.8
    ("b3_s2048_n16_h64_causal", 3, 2048, 16, 16, 64, True, "float16"),  # 5.8
    ("b8_s1024_n16_h64_causal", 8, 1024, 16, 16, 64, True, "float16"),  # 7.8
]

#: the non-causal fp16 head-dim-64 shapes of ``attention_bench.grid_shapes()`` (``run --shapes
#: grid64``), where the 192-row kernel the selector picks trailed SDPA's fastest from outside
GRID64_SHAPES = [
    ("b1_s4096_n32_h64", 1, 4096, 32, 32, 64, False, "float16"),
    ("b2_s2048_q16_kv4_h64", 2, 2048, 16, 4, 64, False, "float16"),
    ("b16_s512_n16_h64", 16, 512, 16, 16, 64, False, "float16"),
    ("b2_s4096_n10_h64", 2, 4096, 10, 10, 64, False, "float16"),
]

#: the attention grid's head-dim-80 and -96 shapes (``run --shapes grid96``; causal ones
#: top-left, the same mask there as S = S_kv): the 96 tile against the 128 tile (zero-padded)
GRID96_SHAPES = [
    ("b1_s8192_q16_kv1_h80", 1, 8192, 16, 1, 80, False, "float16"),
    ("b8_s1024_n20_h80", 8, 1024, 20, 20, 80, False, "float16"),
    ("b8_s128_q12_kv3_h80_bf16", 8, 128, 12, 3, 80, False, "bfloat16"),
    ("b4_s2048_q32_kv1_h80_bf16", 4, 2048, 32, 1, 80, False, "bfloat16"),
    ("b1_s1024_n8_h80_causal", 1, 1024, 8, 8, 80, True, "float16"),
    ("b1_s4096_q32_kv8_h80_causal", 1, 4096, 32, 8, 80, True, "float16"),
    ("b2_s2048_q16_kv1_h80_causal_bf16", 2, 2048, 16, 1, 80, True, "bfloat16"),
    ("b4_s1024_n16_h80_causal_bf16", 4, 1024, 16, 16, 80, True, "bfloat16"),
    ("b16_s512_q16_kv4_h96", 16, 512, 16, 4, 96, False, "float16"),
    ("b32_s256_q12_kv1_h96", 32, 256, 12, 1, 96, False, "float16"),
    ("b1_s512_n16_h96_bf16", 1, 512, 16, 16, 96, False, "bfloat16"),
    ("b2_s4096_q10_kv2_h96_bf16", 2, 4096, 10, 2, 96, False, "bfloat16"),
    ("b64_s197_q12_kv1_h96_causal", 64, 197, 12, 1, 96, True, "float16"),
    ("b1_s8192_n16_h96_causal", 1, 8192, 16, 16, 96, True, "float16"),
    ("b8_s1024_q20_kv5_h96_causal_bf16", 8, 1024, 20, 5, 96, True, "bfloat16"),
    ("b8_s128_q12_kv1_h96_causal_bf16", 8, 128, 12, 1, 96, True, "bfloat16"),
]

#: the attention grid's shapes below SDPA's fastest after the 96 tile (``run --shapes gridlow``;
#: causal ones top-left, the same mask there as S = S_kv)
GRIDLOW_SHAPES = [
    ("b16_s512_n16_h64", 16, 512, 16, 16, 64, False, "float16"),
    ("b4_s1024_q16_kv1_h64_bf16", 4, 1024, 16, 1, 64, False, "bfloat16"),
    ("b1_s512_q16_kv1_h64_causal", 1, 512, 16, 1, 64, True, "float16"),
    ("b32_s256_q12_kv3_h64_causal", 32, 256, 12, 3, 64, True, "float16"),
    ("b32_s256_n12_h128_causal_bf16", 32, 256, 12, 12, 128, True, "bfloat16"),
    ("b64_s197_n12_h256", 64, 197, 12, 12, 256, False, "float16"),
]

#: causal launches of a few waves and the main set's causal shapes (``run --shapes balance``):
#: the chunked tile order's chunk sizes
BALANCE_SHAPES = [
    *CAUSAL64W_SHAPES,
    ("b1_s8192_n16_h64_causal", 1, 8192, 16, 16, 64, True, "float16"),
    *(sh for sh in BENCH_SHAPES if sh[6]),
    ("b1_s4096_n16_h128_causal", 1, 4096, 16, 16, 128, True, "float16"),  # 3.9 waves
    ("b2_s2048_n16_h128_causal", 2, 2048, 16, 16, 128, True, "float16"),  # 3.9
    ("b3_s1024_n16_h128_causal", 3, 1024, 16, 16, 128, True, "float16"),  # 2.9
    ("b1_s4096_q32_kv8_h128_gqa_causal", 1, 4096, 32, 8, 128, True, "float16"),  # Llama-3-8B
    # "small" launches (fewer than two waves of 128-row tiles) and head dim 32
    ("b1_s2048_n16_h128_causal", 1, 2048, 16, 16, 128, True, "float16"),  # 1.9 waves
    ("b1_s1536_n32_h128_causal", 1, 1536, 32, 32, 128, True, "float16"),  # 2.9
    ("b1_s2048_n16_h64_causal", 1, 2048, 16, 16, 64, True, "float16"),  # 1.9
    ("b8_s2048_n16_h32_causal", 8, 2048, 16, 16, 32, True, "float16"),
    ("b1_s4096_n16_h32_causal", 1, 4096, 16, 16, 32, True, "float16"),  # 3.9
]

#: the main set's non-causal shapes of at least a few waves (``run --shapes tail``): where the
#: last partial round leaves SMs idle (the tail split tried there: commit dbe5b74)
TAIL_SHAPES = [sh for sh in BENCH_SHAPES if not sh[6] and sh[2] >= 2048]

#: every shape of every set, by name (the probes' --shape choices)
ALL_SHAPES = {
    s[0]: s
    for s in (
        *BENCH_SHAPES,
        *SWEEP_SHAPES,
        *SHORT_SHAPES,
        *H128_SHAPES,
        *H256_SHAPES,
        *CAUSAL64_SHAPES,
        *CAUSAL64W_SHAPES,
        *BALANCE_SHAPES,
    )
}


#: the shape sets by ``run --shapes`` name (the argument's choices)
SHAPE_SETS = {
    "main": BENCH_SHAPES,
    "sweep": SWEEP_SHAPES,
    "short": SHORT_SHAPES,
    "h128": H128_SHAPES,
    "h256": H256_SHAPES,
    "long128": LONG128_SHAPES,
    "causal64": CAUSAL64_SHAPES,
    "causal64w": CAUSAL64W_SHAPES,
    "balance": BALANCE_SHAPES,
    "tail": TAIL_SHAPES,
    "grid64": GRID64_SHAPES,
    "grid96": GRID96_SHAPES,
    "gridlow": GRIDLOW_SHAPES,
}


def shapes() -> list[tuple[str, int, int, int, int, int, bool, str]]:
    """The benchmark's shapes: SHAPE_SETS[HOPPER_BENCH_SHAPES], BENCH_SHAPES when unset (set by
    ``run --shapes``; the worker processes inherit it)."""
    return SHAPE_SETS.get(os.environ.get("HOPPER_BENCH_SHAPES") or "main", BENCH_SHAPES)


def _setup_runtime() -> tuple[Any, Any]:
    import ctypes

    import torch

    assert torch.cuda.is_available(), "no GPU"
    import tvm  # runtime-only TVM from .gpu/site
    import tvm_ffi

    lib_dir = Path(tvm.__file__).parent / "lib"
    try:
        ctypes.CDLL(str(lib_dir / "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        import glob

        for cand in glob.glob(
            str(Path(torch.__file__).parent.parent / "nvidia" / "**" / "libcudart.so.13"),
            recursive=True,
        ):
            ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            break
        ctypes.CDLL(str(lib_dir / "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)
    return torch, tvm_ffi


def _reference(
    torch: Any,
    q: Any,
    k: Any,
    v: Any,
    causal: str,
    scale: float,
    dtype: Any,
    window: int | None = None,
) -> Any:
    """softmax(scale q k^T + mask) v in `dtype`; q [B,Sq,Nq,H], k/v [B,Sk,Nkv,H] -> [B,Sq,Nq,H].
    ``window``: key j is seen from query i iff ``i + off - W < j <= i + off`` (off 0 top-left,
    Sk - Sq bottom-right), an explicit boolean mask."""
    b, sq, nq, h = q.shape
    sk, nkv = k.shape[1], k.shape[2]
    g = nq // nkv
    qf = q.to(dtype).permute(0, 2, 1, 3)
    kf = k.to(dtype).permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    vf = v.to(dtype).permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    out = torch.empty(b, nq, sq, h, dtype=dtype, device=q.device)
    rows = torch.arange(sq, device=q.device)[:, None]
    cols = torch.arange(sk, device=q.device)[None, :]
    mask = None
    off = sk - sq if causal == "BottomRight" else 0
    if causal in ("TopLeft", "BottomRight"):
        mask = cols > rows + off
        if window is not None:
            mask = mask | (cols <= rows + off - window)
    for i in range(b):  # one batch at a time bounds the score matrix
        s = torch.matmul(qf[i], kf[i].transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        out[i] = torch.matmul(torch.softmax(s, dim=-1), vf[i])
    return out.permute(0, 2, 1, 3)


def _make_inputs(
    torch: Any, slot: dict[str, Any], b: int, sq: int, sk: int, dt: Any, gen: Any
) -> tuple[list[Any], Any, Any, Any]:
    nq, nkv, h = slot["nq"], slot["nkv"], slot["head_dim"]
    if slot["kind"] == "stacked":
        assert sq == sk
        qkv = torch.randn(b, sq, (nq + 2 * nkv) * h, generator=gen, device="cuda").to(dt)
        q = qkv[..., : nq * h].view(b, sq, nq, h)
        k = qkv[..., nq * h : (nq + nkv) * h].view(b, sq, nkv, h)
        v = qkv[..., (nq + nkv) * h :].view(b, sq, nkv, h)
        return [qkv], q, k, v
    qt = torch.randn(b, sq, nq * h, generator=gen, device="cuda").to(dt)
    kv = torch.randn(b, sk, 2 * nkv * h, generator=gen, device="cuda").to(dt)
    return (
        [qt, kv],
        qt.view(b, sq, nq, h),
        kv[..., : nkv * h].view(b, sk, nkv, h),
        kv[..., nkv * h :].view(b, sk, nkv, h),
    )


#: per-tile growth of the scores, in log2 units, of the "ramp" cases (one value per head, cycled)
_RAMP_LOG2_PER_TILE = (0.0, 3.0, 7.0, 9.0, 20.0)


def _ramp_scores(torch: Any, q: Any, k: Any) -> None:
    """Scores that grow with the key position, by a different rate per head (in place).

    Random inputs set a row's maximum in the first key tile and never move it much, so a
    kernel's rescale of O (and a lazy one's threshold) would go untested: here feature 0 of every
    query is 1 and of key t is ``r_h * t``, so each 128-key tile raises the scores by
    _RAMP_LOG2_PER_TILE[h] in log2 units (below, near and far above a threshold of 8).
    """
    h = q.shape[-1]
    sk, nkv = k.shape[1], k.shape[2]
    per_tile = torch.tensor(
        [_RAMP_LOG2_PER_TILE[i % len(_RAMP_LOG2_PER_TILE)] for i in range(nkv)], device=k.device
    )
    rate = per_tile * math.sqrt(h) / (128 * math.log2(math.e))  # score units per key
    pos = torch.arange(sk, device=k.device, dtype=torch.float32)
    q[..., 0] = 1.0
    k[..., 0] = (pos[:, None] * rate[None, :]).to(k.dtype)[None]


def _numerics_cases(slot: dict[str, Any]) -> list[tuple[int, int, int] | tuple[int, int, int, str]]:
    """(B, Sq, Sk[, "ramp"]) per slot: tile-aligned, ragged, tiny, Sq != Sk where the layout
    allows, and for the long-sequence kernels scores that grow along the keys (rescales)."""
    most = slot.get("max_seq_kv")
    if most == 128:  # short-sequence kernels
        if slot["kind"] == "split":
            return [(2, 64, 128), (1, 37, 100), (3, 128, 128)]
        return [(2, 128, 128), (3, 77, 77), (1, 1, 1), (5, 120, 120)]
    if most == 256:
        if slot["kind"] == "split":
            return [(2, 64, 256), (1, 37, 200), (3, 256, 256), (2, 129, 200)]
        return [(2, 256, 256), (3, 77, 77), (1, 1, 1), (5, 200, 200), (2, 129, 129)]
    if slot.get("window") is not None:
        # S 77, 1024, 2048; split: S != S_kv, every row with a key in its window (S <= S_kv)
        if slot["kind"] == "split":
            return [(2, 77, 300), (1, 1024, 2048), (2, 2000, 2048), (1, 1, 1000), (1, 77, 77)]
        return [(2, 77, 77), (1, 1024, 1024), (2, 2048, 2048), (1, 2048, 2048, "ramp")]
    if slot["any_seq"]:
        return [(2, 77, 77), (1, 203, 203), (3, 1, 1), (1, 999, 999), (1, 999, 999, "ramp")]
    if slot["kind"] == "split":
        if slot["causal"] == "BottomRight":
            return [(2, 128, 384), (1, 200, 328), (2, 256, 256), (1, 8, 1000)]
        return [(2, 128, 384), (1, 200, 136), (2, 384, 128), (1, 256, 256)]
    cases: list[tuple[int, int, int] | tuple[int, int, int, str]] = [
        (2, 256, 256),
        (1, 200, 200),
        (3, 128, 128),
        (1, 1032, 1032),
        (1, 1032, 1032, "ramp"),
    ]
    from worker.hopper import VARIANTS

    if slot["causal"] != "none" and VARIANTS[slot["variant"]].chunked:
        # launches of several rounds, where the chunked order's chunk is not trivially 0
        cases += [(2, 2048, 2048), (1, 3000, 3000)]
    return cases


def _dtype(torch: Any, name: str) -> Any:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _tensor_args(tvm_ffi: Any, ts: list[Any]) -> list[Any]:
    return [tvm_ffi.from_dlpack(t) for t in ts]


def numerics_items(
    manifest: list[dict[str, Any]],
) -> list[tuple[dict[str, Any], tuple[int, ...] | tuple[int, int, int, str]]]:
    """Every (slot, (B, Sq, Sk)) to check, riskiest layouts last."""
    order = {"stacked": 0, "split": 1}
    slots = sorted(manifest, key=lambda s: (s["any_seq"], order[s["kind"]]))
    return [(slot, case) for slot in slots for case in _numerics_cases(slot)]


def numerics(torch: Any, tvm_ffi: Any, mod: Any, manifest: list[dict[str, Any]], start: int) -> Any:
    """Yields one record per case from index ``start`` on (a restart skips a hung case)."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234 + start)
    for index, (slot, (b, sq, sk, *how)) in enumerate(numerics_items(manifest)):
        if index < start:
            continue
        ramp = how == ["ramp"]
        fn = mod[slot["symbol"]]
        dt = _dtype(torch, slot["dtype"])
        rec: dict[str, Any] = {
            "index": index,
            "symbol": slot["symbol"],
            "dtype": slot["dtype"],
            "variant": slot["variant"],
            "causal": slot["causal"],
            **({"window": slot["window"]} if slot.get("window") is not None else {}),
            "kind": slot["kind"],
            "nq": slot["nq"],
            "nkv": slot["nkv"],
            "head_dim": slot["head_dim"],
            "any_seq": slot["any_seq"],
            "B": b,
            "Sq": sq,
            "Sk": sk,
            **({"inputs": "ramp"} if ramp else {}),
        }
        try:
            ops, q, k, v = _make_inputs(torch, slot, b, sq, sk, dt, gen)
            if ramp:
                _ramp_scores(torch, q, k)
            out = torch.full(
                (b, sq, slot["nq"], slot["head_dim"]), float("nan"), dtype=dt, device="cuda"
            )
            with tvm_ffi.use_torch_stream():
                fn(*ops, out)
            # no synchronize: reading `out` on torch's stream must see every launch (GQA lanes
            # run on side streams and join back through events)
            small = b * slot["nq"] * sq * sk <= (1 << 24)
            ref_dt = torch.float64 if small else torch.float32
            ref = _reference(
                torch,
                q,
                k,
                v,
                slot["causal"],
                1.0 / math.sqrt(slot["head_dim"]),
                ref_dt,
                slot.get("window"),
            )
            o = out.to(ref_dt)
            unwritten = int(torch.isnan(o).sum().item())
            err = (o - ref).nan_to_num(nan=float("inf"))
            rel = (torch.linalg.vector_norm(err) / torch.linalg.vector_norm(ref)).item()
            rec.update(
                ref_dtype=str(ref_dt).replace("torch.", ""),
                unwritten=unwritten,
                rel_err=rel,
                max_abs_err=err.abs().max().item(),
                passed=bool(unwritten == 0 and rel < 1e-2),
            )
        except Exception as exc:  # recorded, not hidden
            rec.update(passed=False, error=f"{type(exc).__name__}: {exc}"[:400])
        yield rec


def _events_median(torch: Any, call: Any, reps: int, nbuf: int) -> float:
    """Median kernel time in microseconds, CUDA events around each call."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        call(i % nbuf)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))


def _profiler_kernel_us(torch: Any, call: Any, reps: int, nbuf: int) -> tuple[float, list[str]]:
    """Sum of GPU kernel durations per call, from the CUDA profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            call(i % nbuf)
        torch.cuda.synchronize()
    total = 0.0
    names: set[str] = set()
    for ev in prof.events():
        if "CUDA" not in str(getattr(ev, "device_type", "")):
            continue
        if getattr(ev, "is_user_annotation", False) or ev.name.startswith("ProfilerStep"):
            continue
        total += ev.time_range.elapsed_us()
        names.add(ev.name[:80])
    return total / reps, sorted(names)


def _latency_us(torch: Any, call: Any, reps: int, nbuf: int) -> tuple[float, float]:
    """(median call+synchronize wall time, mean host time to issue one call) in microseconds."""
    torch.cuda.synchronize()
    lat = []
    for i in range(reps):
        t0 = time.perf_counter()
        call(i % nbuf)
        torch.cuda.synchronize()
        lat.append((time.perf_counter() - t0) * 1e6)
    n = min(reps, 50)
    t0 = time.perf_counter()
    for i in range(n):
        call(i % nbuf)
    issue = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return statistics.median(lat), issue


#: timing rounds per shape (each method once per round; its median is reported); shared with
#: benchmarks/attention_bench.py
ROUNDS = int(os.environ.get("STACKFUSE_BENCH_ROUNDS", "5"))


def rotated_rounds(names: list[str], rounds: int = ROUNDS) -> list[tuple[int, str]]:
    """(round, name) in the order the benchmarks time methods: every name once per round, the
    order rotated by one each round and reversed every other round, so that clock drift and
    warm-up favour no method."""
    out: list[tuple[int, str]] = []
    for rnd in range(rounds):
        k = rnd % len(names) if names else 0
        order = names[k:] + names[:k]
        out += [(rnd, n) for n in (order if rnd % 2 == 0 else order[::-1])]
    return out


def warm_clocks(torch: Any, calls: list[Any], nbuf: int = 1, seconds: float = 0.3) -> None:
    """Keep the GPU busy for ``seconds`` before the first timing, so that it starts at its
    boost clock (idle, the H200 sits at 345 MHz) and not during the first method's rounds.
    A method that cannot run this shape (an SDPA backend without GQA) is left out here; its
    own measurement records the error."""
    ok = []
    for call in calls:
        try:
            call(0)
            ok.append(call)
        except Exception:  # reported by the timing loop
            pass
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    i = 0
    while ok and time.perf_counter() - t0 < seconds:
        ok[i % len(ok)](i % nbuf)
        i += 1
        if i % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def _bench_slots(
    manifest: list[dict[str, Any]],
    shape: tuple[str, int, int, int, int, int, bool, str],
) -> list[dict[str, Any]]:
    """The stacked, fixed-layout symbols timed at one benchmark shape (a variant that takes
    fewer keys than the shape has is left out)."""
    _name, _b, s, nq, nkv, h, causal, dtype = shape
    want = "TopLeft" if causal else "none"
    return [
        slot
        for slot in manifest
        if slot["kind"] == "stacked"
        and not slot["any_seq"]
        and slot.get("window") is None
        and slot["dtype"] == dtype
        and slot["causal"] == want
        and slot["nq"] == nq
        and slot["nkv"] == nkv
        and slot["head_dim"] == h
        and (slot.get("max_seq_kv") or s) >= s
    ]


def bench(torch: Any, tvm_ffi: Any, mod: Any, manifest: list[dict[str, Any]], start: int) -> Any:
    """Yields one record per (shape, method), from item ``start`` on."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda")
    gen.manual_seed(99)
    index = -1
    for shape in shapes():
        name, b, s, nq, nkv, h, causal, dtype = shape
        want_causal = "TopLeft" if causal else "none"
        slots = _bench_slots(manifest, shape)
        if not slots:  # none of ours built for this shape: nothing to compare
            continue
        names = [Slot(**slot).method for slot in slots]
        names += ["sdpa:default", "sdpa:flash", "sdpa:efficient", "sdpa:cudnn"]
        first = index + 1
        index += len(names)
        if index < start:
            continue
        dt = _dtype(torch, dtype)
        flops = 4.0 * b * s * s * nq * h * (0.5 if causal else 1.0)
        c = (nq + 2 * nkv) * h
        qkv_bytes = b * s * c * 2
        nbuf = max(1, min(16, (256 << 20) // max(qkv_bytes, 1)))  # > 4x the 60 MB L2
        qkvs = [torch.randn(b, s, c, generator=gen, device="cuda").to(dt) for _ in range(nbuf)]
        outs = [torch.empty(b, s, nq, h, dtype=dt, device="cuda") for _ in range(nbuf)]
        reps = 30 if flops > 1e11 else 300
        gqa = nq != nkv

        def views(
            i: int,
            qkvs: list[Any] = qkvs,
            b: int = b,
            s: int = s,
            nq: int = nq,
            nkv: int = nkv,
            h: int = h,
        ) -> tuple[Any, Any, Any]:
            x = qkvs[i]
            q = x[..., : nq * h].view(b, s, nq, h).transpose(1, 2)
            k = x[..., nq * h : (nq + nkv) * h].view(b, s, nkv, h).transpose(1, 2)
            v = x[..., (nq + nkv) * h :].view(b, s, nkv, h).transpose(1, 2)
            return q, k, v

        methods: dict[str, Any] = {}
        for slot in slots:
            fn = mod[slot["symbol"]]
            ffi_in = _tensor_args(tvm_ffi, qkvs)
            ffi_out = _tensor_args(tvm_ffi, outs)

            def ours(i: int, fn: Any = fn, qkvs: list[Any] = qkvs, outs: list[Any] = outs) -> None:
                fn(qkvs[i], outs[i])

            def ours_pre(
                i: int, fn: Any = fn, a: list[Any] = ffi_in, o: list[Any] = ffi_out
            ) -> None:
                fn(a[i], o[i])

            methods[Slot(**slot).method] = (ours, ours_pre)

        def sdpa(i: int, views: Any = views, causal: bool = causal, gqa: bool = gqa) -> Any:
            q, k, v = views(i)
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        methods["sdpa:default"] = (sdpa, None)
        backends = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }
        for bname, be in backends.items():

            def sdpa_be(i: int, be: Any = be, sdpa: Any = sdpa) -> Any:
                with sdpa_kernel(be):
                    return sdpa(i)

            methods[f"sdpa:{bname}"] = (sdpa_be, None)

        ref = None
        todo = [m for off, m in enumerate(names) if first + off >= start]
        timings: dict[str, list[dict[str, Any]]] = {m: [] for m in todo}
        with tvm_ffi.use_torch_stream():
            warm_clocks(torch, [methods[m][0] for m in todo], nbuf)
            # a method's figure is its median over the rounds (a noisy round moves it little)
            for rnd, mname in rotated_rounds(todo):
                call, _ = methods[mname]
                t: dict[str, Any] = {}
                try:
                    for i in range(3):
                        call(i % nbuf)
                    torch.cuda.synchronize()
                    t["ev"] = _events_median(torch, call, reps, nbuf)
                    t["prof"], t["kernels"] = _profiler_kernel_us(torch, call, min(reps, 20), nbuf)
                    if rnd in (0, ROUNDS - 1):  # call latency: two rounds are enough
                        t["lat"], t["issue"] = _latency_us(torch, call, min(reps, 100), nbuf)
                except Exception as exc:
                    t["error"] = f"{type(exc).__name__}: {exc}"[:300]
                timings[mname].append(t)
            for mname in todo:
                call, call_pre = methods[mname]
                rec: dict[str, Any] = {
                    "index": first + names.index(mname),
                    "shape": name,
                    "B": b,
                    "S": s,
                    "Nq": nq,
                    "Nkv": nkv,
                    "H": h,
                    "causal": causal,
                    "dtype": dtype,
                    "method": mname,
                    "flops": flops,
                    "buffers": nbuf,
                }
                passes = timings[mname]
                good = [t for t in passes if "error" not in t]
                if not good:
                    rec["error"] = passes[0].get("error", "no measurement")
                    yield rec
                    continue
                ev = statistics.median(t["ev"] for t in good)
                prof_us = statistics.median(t["prof"] for t in good)
                lat = [t for t in good if "lat" in t] or [{"lat": None, "issue": None}]
                rec.update(
                    kernel_us_events=ev,
                    kernel_us_profiler=prof_us,
                    kernel_us_profiler_min=min(t["prof"] for t in good),
                    tflops_events=flops / ev / 1e6,
                    tflops_profiler=flops / prof_us / 1e6 if prof_us > 0 else None,
                    latency_us=min((t["lat"] for t in lat if t["lat"] is not None), default=None),
                    issue_us=min((t["issue"] for t in lat if t["issue"] is not None), default=None),
                    kernels=good[0]["kernels"],
                    passes_us=[round(t["prof"], 2) for t in good],
                )
                try:
                    if call_pre is not None:
                        lat_pre, issue_pre = _latency_us(torch, call_pre, min(reps, 100), nbuf)
                        rec.update(latency_us_prewrapped=lat_pre, issue_us_prewrapped=issue_pre)
                        # the timed kernel's own output, against a float32 reference
                        outs[0].fill_(float("nan"))
                        call(0)  # then read on the same stream, no synchronize (see numerics)
                        if ref is None:
                            q, k, v = (x.transpose(1, 2) for x in views(0))
                            ref = _reference(
                                torch, q, k, v, want_causal, 1.0 / math.sqrt(h), torch.float32
                            )
                        o = outs[0].float()
                        rec["unwritten"] = int(torch.isnan(o).sum().item())
                        err = (o - ref).nan_to_num(nan=float("inf"))
                        rec["rel_err"] = (
                            torch.linalg.vector_norm(err) / torch.linalg.vector_norm(ref)
                        ).item()
                        rec["max_abs_err"] = err.abs().max().item()
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                yield rec
        del qkvs, outs, ref
        torch.cuda.empty_cache()


def _selected_method(row: dict[str, Any]) -> str | None:
    """``hopper:<variant>`` that the shipped selection (worker.hopper.pick) takes for the shape
    of bench ``row``: the figure the issue's goal is about, whatever else the run built."""
    from worker.attention import stacked_spec
    from worker.hopper import pick

    spec = stacked_spec(
        dtype=row["dtype"],
        nq=row["Nq"],
        nkv=row["Nkv"],
        h=row["H"],
        causal="TopLeft" if row["causal"] else "none",
        batch=row["B"],
        seq=row["S"],
    )
    name = pick(spec)
    return f"hopper:{name}" if name else None


def _paired(ours: dict[str, Any], sdpa: dict[str, Any]) -> dict[str, Any]:
    """Round-by-round ratios (SDPA / ours). A round times every method of a shape once, close
    together in time, so pairing them cancels most of the clock's drift between rounds (the
    H200 under load moves 2-5%), which a ratio of medians keeps."""
    a, b = ours.get("passes_us") or [], sdpa.get("passes_us") or []
    if not a or len(a) != len(b):  # a failed round would misalign the pairs
        return {}
    ratios = sorted(y / x for x, y in zip(a, b, strict=True) if x > 0)
    if not ratios:
        return {}
    return {
        "paired_ratio_median": statistics.median(ratios),
        "paired_ratio_min": ratios[0],
        "paired_ratio_max": ratios[-1],
        "rounds_faster": sum(r > 1 for r in ratios),
        "rounds": len(ratios),
    }


def _summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_shape: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(r["shape"], []).append(r)
    summary: list[dict[str, Any]] = []
    for shape, rs in by_shape.items():
        ok = [r for r in rs if "kernel_us_profiler" in r and r["kernel_us_profiler"] > 0]
        ours = [r for r in ok if r["method"].startswith("hopper:")]
        sdpas = [r for r in ok if r["method"].startswith("sdpa:")]
        default = next((r for r in ok if r["method"] == "sdpa:default"), None)
        if not ours or not sdpas:
            summary.append({"shape": shape, "note": "missing measurements"})
            continue
        best_ours = min(ours, key=lambda r: r["kernel_us_profiler"])
        best_sdpa = min(sdpas, key=lambda r: r["kernel_us_profiler"])
        wanted = _selected_method(best_ours)
        chosen = next((r for r in ours if r["method"] == wanted), best_ours)
        summary.append(
            {
                "shape": shape,
                "best_hopper": best_ours["method"],
                "hopper_us": best_ours["kernel_us_profiler"],
                "hopper_tflops": best_ours["tflops_profiler"],
                "hopper_latency_us": best_ours["latency_us"],
                "best_sdpa": best_sdpa["method"],
                "sdpa_best_us": best_sdpa["kernel_us_profiler"],
                "sdpa_best_tflops": best_sdpa["tflops_profiler"],
                "sdpa_default_us": default["kernel_us_profiler"] if default else None,
                "sdpa_default_latency_us": default["latency_us"] if default else None,
                "ratio_vs_best_sdpa": best_sdpa["kernel_us_profiler"]
                / best_ours["kernel_us_profiler"],
                "ratio_vs_default_sdpa": (
                    default["kernel_us_profiler"] / best_ours["kernel_us_profiler"]
                    if default
                    else None
                ),
                "latency_ratio_vs_default_sdpa": (
                    default["latency_us"] / best_ours["latency_us"] if default else None
                ),
                # the selection's variant (the best one built if the run lacks it), against
                # SDPA's fastest: by medians, and round by round
                "selected_hopper": chosen["method"],
                "selected_is_built": chosen["method"] == wanted,
                "selected_us": chosen["kernel_us_profiler"],
                "ratio_selected_vs_best_sdpa": best_sdpa["kernel_us_profiler"]
                / chosen["kernel_us_profiler"],
                **_paired(chosen, best_sdpa),
            }
        )
    return summary


def _markdown(
    meta: dict[str, Any],
    num: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    summary: list[dict[str, Any]],
) -> str:
    lines = [
        f"# Hopper FMHA kernel on {meta.get('device')}",
        "",
        f"Date: {meta.get('date')}. Command: `{meta.get('command')}`.",
        "",
        f"torch {meta.get('torch')}, CUDA {meta.get('cuda')}; {meta.get('gpu_state', '')}",
        "",
        "## Numerics (poisoned output, independent float32/float64 reference)",
        "",
        f"{sum(r['passed'] for r in num)} of {len(num)} cases pass "
        "(no unwritten element, ||out-ref||/||ref|| < 1e-2).",
        "",
        "| symbol | B | Sq | Sk | ref | rel err | max abs err | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in num:
        lines.append(
            f"| {r['symbol']} | {r['B']} | {r['Sq']} | {r['Sk']}"
            f"{' (ramp)' if r.get('inputs') == 'ramp' else ''} | {r.get('ref_dtype', '')} "
            f"| {r.get('rel_err', float('nan')):.2e} | {r.get('max_abs_err', float('nan')):.2e} "
            f"| {'yes' if r['passed'] else 'NO ' + r.get('error', '')} |"
        )
    lines += [
        "",
        "## Speed: GPU kernel time (profiler) and call latency",
        "",
        f"Kernel time: the median over {meta.get('rounds', '?')} rounds (each round times "
        "every method of a shape once, the order rotated and reversed between rounds), each "
        "round the mean of 20 calls from the profiler; the rounds are listed. Latency: the "
        "better of two rounds' median call + synchronize.",
        "",
        "| shape | method | kernel us (profiler) | TFLOP/s | kernel us (events) | "
        "latency us | issue us | rounds us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['method']} | error: {r['error'][:80]} | | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['kernel_us_profiler']:.1f} | "
            f"{r['tflops_profiler']:.0f} | {r['kernel_us_events']:.1f} | "
            f"{r['latency_us'] or 0:.1f} | {r['issue_us'] or 0:.1f} | "
            f"{', '.join(f'{x:.1f}' for x in r.get('passes_us', []))} |"
        )
    lines += [
        "",
        "## Ratios (SDPA kernel time / Hopper kernel time; >1 means we are faster)",
        "",
        "Selected: the variant worker.hopper's selection takes for the shape (marked * where the "
        "run did not build it and the best built one stands in). Per round: the ratio of the "
        "two methods' times in each round (median [lowest, highest]) and in how many rounds "
        "ours was faster.",
        "",
        "| shape | best Hopper variant | TFLOP/s | best SDPA | TFLOP/s | vs best SDPA | "
        "selected | selected vs best SDPA | per round | vs default SDPA | "
        "latency vs default SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios, chosen = [], []
    for s in summary:
        if "note" in s:
            lines.append(f"| {s['shape']} | {s['note']} | | | | | | | | | |")
            continue
        ratios.append(s["ratio_vs_best_sdpa"])
        chosen.append(s["ratio_selected_vs_best_sdpa"])
        rounds = (
            f"{s['paired_ratio_median']:.3f} [{s['paired_ratio_min']:.3f}, "
            f"{s['paired_ratio_max']:.3f}], {s['rounds_faster']}/{s['rounds']}"
            if "rounds" in s
            else ""
        )
        lines.append(
            f"| {s['shape']} | {s['best_hopper']} | {s['hopper_tflops']:.0f} | "
            f"{s['best_sdpa']} | {s['sdpa_best_tflops']:.0f} | "
            f"{s['ratio_vs_best_sdpa']:.3f} | "
            f"{s['selected_hopper']}{'' if s['selected_is_built'] else ' *'} | "
            f"{s['ratio_selected_vs_best_sdpa']:.3f} | {rounds} | "
            f"{s['ratio_vs_default_sdpa'] or 0:.3f} | "
            f"{s['latency_ratio_vs_default_sdpa'] or 0:.2f} |"
        )
    if ratios:
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        gs = math.exp(sum(math.log(x) for x in chosen) / len(chosen))
        lines += [
            "",
            f"Geometric mean vs best SDPA: {gm:.3f} (best variant built), {gs:.3f} (selected); "
            f"minimum {min(ratios):.3f} / {min(chosen):.3f}.",
        ]
    return "\n".join(lines) + "\n"


#: a worker's exit status after a CUDA fault (its item is recorded): start a fresh process
_CUDA_BROKEN = 75


def worker(directory: Path, out: Path, phase: str, start: int) -> int:
    """Child process: one JSON line per item into $OUT/<phase>.jsonl, from ``start`` on."""
    torch, tvm_ffi = _setup_runtime()
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references stay float32
    manifest = json.loads((directory / "manifest.json").read_text())
    mod = tvm_ffi.load_module(str(directory / LIB_NAME))
    items = numerics if phase == "numerics" else bench
    if phase == "bench":  # bring the clocks up before the first measurement
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        t_end = time.perf_counter() + 3.0
        while time.perf_counter() < t_end:
            for _ in range(10):
                x @ x
            torch.cuda.synchronize()
        del x
    with open(out / f"{phase}.jsonl", "a") as f:
        for rec in items(torch, tvm_ffi, mod, manifest, start):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            brief = {
                k: rec.get(k)
                for k in (
                    "index",
                    "symbol",
                    "shape",
                    "method",
                    "B",
                    "Sq",
                    "rel_err",
                    "tflops_profiler",
                    "error",
                )
                if k in rec
            }
            print(phase, brief, flush=True)
            if "CUDA error" in str(rec.get("error", "")):
                # a kernel fault leaves the context broken: every later call would fail too
                return _CUDA_BROKEN
    return 0


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _supervise(
    directory: Path, out: Path, phase: str, total: int, stall_s: float, deadline: float
) -> None:
    """Runs the phase in child processes; a child that hangs or dies loses only its item."""
    path = out / f"{phase}.jsonl"
    start = 0
    fruitless = 0  # children in a row that produced nothing: setup is broken, stop
    while start < total and time.monotonic() < deadline and fruitless < 3:
        cmd = [
            sys.executable,
            __file__,
            "worker",
            "--phase",
            phase,
            "--start",
            str(start),
            "--dir",
            str(directory),
            "--out",
            str(out),
        ]
        log = open(out / f"{phase}.log", "a")  # noqa: SIM115
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        seen = seen_at_start = len(_records(path))
        last = time.monotonic()
        while child.poll() is None:
            time.sleep(1.0)
            n = len(_records(path))
            if n != seen:
                seen, last = n, time.monotonic()
            if time.monotonic() - last > stall_s or time.monotonic() > deadline:
                child.kill()
                child.wait()
                break
        log.close()
        fruitless = fruitless + 1 if len(_records(path)) == seen_at_start else 0
        done = {r["index"] for r in _records(path)}
        nxt = start
        while nxt in done:
            nxt += 1
        if nxt >= total:
            break
        if child.returncode == _CUDA_BROKEN:  # its last item is on record; go on after it
            start = nxt
            continue
        why = "hung (no progress)" if child.returncode in (-9, None) else f"exit {child.returncode}"
        with open(path, "a") as f:
            f.write(json.dumps({"index": nxt, "passed": False, "error": f"child {why}"}) + "\n")
        print(f"{phase}: item {nxt} {why}; restarting after it", flush=True)
        start = nxt + 1


def run(directory: Path, out: Path, budget_s: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    manifest = json.loads((directory / "manifest.json").read_text())
    n_num = len(numerics_items(manifest))
    n_bench = 0
    for shape in shapes():
        slots = _bench_slots(manifest, shape)
        n_bench += 4 + len(slots) if slots else 0  # + 4 SDPA ways
    t0 = time.monotonic()
    _supervise(directory, out, "numerics", n_num, 45.0, deadline - 120)
    num_s = time.monotonic() - t0
    t0 = time.monotonic()
    _supervise(directory, out, "bench", n_bench, 150.0, deadline)
    bench_s = time.monotonic() - t0

    import torch

    gpu_state = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu_state = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv),
        "gpu_state": gpu_state,
        "bench_seconds": round(bench_s, 1),
        "rounds": ROUNDS,
        "numerics_seconds": round(num_s, 1),
    }
    num = sorted(_records(out / "numerics.jsonl"), key=lambda r: r["index"])
    rows = sorted(_records(out / "bench.jsonl"), key=lambda r: r["index"])
    num_items = numerics_items(manifest)
    for r in num:  # fill in what a hung item was
        if "symbol" not in r and r["index"] < len(num_items):
            slot, (b, sq, sk, *_) = num_items[r["index"]]
            r.update(symbol=slot["symbol"], B=b, Sq=sq, Sk=sk)
    rows = [r for r in rows if "shape" in r] + [
        {"shape": "?", "method": f"item {r['index']}", "error": r.get("error", "")}
        for r in rows
        if "shape" not in r
    ]
    summary = _summarize(rows)
    (out / "hopper_kernel.json").write_text(
        json.dumps({"meta": meta, "numerics": num, "bench": rows, "summary": summary}, indent=1)
    )
    md = _markdown(meta, num, rows, summary)
    (out / "hopper_kernel.md").write_text(md)
    failed = [r for r in num if not r.get("passed")]
    print(f"numerics: {len(num) - len(failed)}/{len(num)} pass (of {n_num} items)")
    for r in failed[:25]:
        print(
            "FAIL",
            r.get("symbol"),
            r.get("B"),
            r.get("Sq"),
            r.get("Sk"),
            r.get("rel_err"),
            r.get("unwritten"),
            r.get("error", ""),
        )
    checks = [(r["shape"], r["method"], r["rel_err"]) for r in rows if "rel_err" in r]
    print("bench output checks (rel err):", max((c[2] for c in checks), default=None))
    print(md[md.find("## Ratios") :])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=REPO / ".gpu" / "hopper")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--only", default=None, help="regex on object names")
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, default=REPO / ".gpu" / "hopper")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    r.add_argument("--budget", type=float, default=240.0, help="seconds for both phases")
    r.add_argument(
        "--shapes",
        choices=list(SHAPE_SETS),
        default="main",
        help="a set of SHAPE_SETS",
    )
    w = sub.add_parser("worker")
    w.add_argument("--dir", type=Path, required=True)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--phase", choices=["numerics", "bench"], required=True)
    w.add_argument("--start", type=int, default=0)
    args = ap.parse_args()
    if args.cmd == "build":
        sys.path.insert(0, str(REPO))
        return build(args.out, args.jobs, args.only)
    if args.cmd == "worker":
        return worker(args.dir, args.out, args.phase, args.start)
    os.environ["HOPPER_BENCH_SHAPES"] = args.shapes
    return run(args.dir, args.out, args.budget)


if __name__ == "__main__":
    sys.exit(main())
