"""Numerics cases for the GPU: build libraries here, check them on an H200 against PyTorch.

Two halves, so a GPU machine with only a runtime TVM can run the check:

    python -m benchmarks.gpu_cases build OUT_DIR [NAMES]  # here: full TVM + nvcc, no GPU needed
    python -m benchmarks.gpu_cases check OUT_DIR          # there: runtime TVM + torch + a GPU

NAMES: case names, or ``ragged`` / ``window`` for those groups; none: the cases the Hopper kernel
takes (``--kernel=sm80`` first: the SM80-class kernel's).

The reference is independent of our kernels: q, k and v are cut out of the stacked tensor by
PyTorch, and attention is computed in float32 (float64 on CPU for small cases) by plain matmul
and softmax; for a ragged batch (``R.nn.attention_var_len``), one sequence at a time over its own
keys. ``tests/gpu/test_numerics.py`` runs the same cases under pytest where a GPU exists.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# relative error ||out - ref|| / ||ref|| allowed per dtype (fp32 inputs: CUTLASS uses 3xTF32)
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-3}


@dataclass
class Case:
    name: str
    kind: str  # "stacked" | "plain" | "ragged" (b: sequences, s: their total tokens)
    b: int | str
    s: int
    n: int
    h: int
    h_v: int | None = None
    module: dict[str, Any] = field(default_factory=dict)  # extra builder kwargs
    run_batch: int | None = None  # batch to run with when b is symbolic
    s_kv: int | None = None  # plain only
    expect: str = "stacked"  # what the report must say for the site: stacked | plain | none
    options: dict[str, Any] = field(default_factory=dict)  # CompileOptions for this case

    @property
    def hv(self) -> int:
        return self.h if self.h_v is None else self.h_v


CASES: list[Case] = [
    # apache/tvm test_codegen_cutlass.py stacked parametrizations (split: fp16, slice: fp32)
    Case("split_fp16_hv32", "stacked", 4, 8, 32, 64, 32),
    Case(
        "split_fp16_bias_scale",
        "stacked",
        4,
        8,
        32,
        64,
        32,
        {"bias_shape": (4, 32, 8, 8), "scale": 0.5},
    ),
    Case("split_fp16_single_shape", "stacked", 4, 8, 32, 64, 64, {"single_shape": True}),
    Case(
        "slice_fp32_hv32", "stacked", 4, 8, 32, 64, 32, {"op": "strided_slice", "dtype": "float32"}
    ),
    Case(
        "slice_fp32_bias_scale",
        "stacked",
        4,
        8,
        32,
        64,
        32,
        {"op": "strided_slice", "dtype": "float32", "bias_shape": (4, 32, 8, 8), "scale": 0.5},
    ),
    Case(
        "slice_fp32_single_shape",
        "stacked",
        4,
        8,
        32,
        64,
        64,
        {"op": "strided_slice", "dtype": "float32", "single_shape": True},
    ),
    # beyond upstream
    Case("split_bf16", "stacked", 2, 128, 8, 64, 64, {"dtype": "bfloat16"}),
    Case("split_fp16_causal_topleft", "stacked", 2, 128, 8, 64, 64, {"causal": "TopLeft"}),
    Case("split_fp16_causal_bottomright", "stacked", 2, 96, 8, 128, 128, {"causal": "BottomRight"}),
    Case("split_fp16_broadcast_bias", "stacked", 2, 64, 4, 64, 64, {"bias_shape": (1, 4, 1, 64)}),
    Case("split_fp16_hv256_workspace", "stacked", 2, 64, 4, 128, 256),
    Case("split_fp16_symbolic_batch", "stacked", "b", 64, 8, 64, 64, run_batch=3),
    Case(
        "slice_fp16_order_kqv",
        "stacked",
        2,
        64,
        8,
        64,
        64,
        {"op": "strided_slice", "slice_order": "kqv"},
    ),
    Case("split_fp16_unaligned_h36", "stacked", 2, 32, 4, 36, 36),
    Case("split_fp16_epilogue", "stacked", 2, 64, 8, 64, 64, {"epilogue": True}),
    Case(
        "split_fp16_leak_plain_fallback",
        "stacked",
        2,
        64,
        8,
        64,
        64,
        {"leak": True},
        expect="plain",
    ),
    Case(
        "plain_fp16_causal_bottomright",
        "plain",
        2,
        16,
        8,
        64,
        64,
        {"causal": "BottomRight"},
        s_kv=24,
        expect="plain",
    ),
    Case(
        "plain_fp16_bias",
        "plain",
        2,
        32,
        4,
        64,
        32,
        {"bias_shape": (2, 4, 32, 48)},
        s_kv=48,
        expect="plain",
    ),
    # benchmark shapes, checked too
    Case("bert_base_fp16", "stacked", 32, 128, 12, 64, 64),
    Case("b8_s2048_n16_h128_fp16", "stacked", 8, 2048, 16, 128, 128),
    # GQA in the stacked layout [B, S, (Nq + 2 Nkv) H]: Hopper kernel only
    Case("split_fp16_gqa_q32_kv8", "stacked", 2, 256, 32, 128, 128, {"n_kv": 8}),
    Case(
        "split_fp16_gqa_q16_kv4_causal_h64",
        "stacked",
        4,
        384,
        16,
        64,
        64,
        {"n_kv": 4, "causal": "TopLeft"},
    ),
    Case(
        "split_bf16_mqa_q16_kv1", "stacked", 2, 200, 16, 128, 128, {"n_kv": 1, "dtype": "bfloat16"}
    ),
    # a tiny launch with every key in one tile: the selector's short-sequence kernel, GQA 16/4
    Case("split_fp16_gqa_q16_kv4_tiny_s100_h64", "stacked", 2, 100, 16, 64, 64, {"n_kv": 4}),
    # 129-256 keys, a "small" launch: the 256-key short-sequence kernel, and its causal sibling
    # (the same kernel, computing only the keys a block sees), bf16 at
    # BERT-base size (the 128-key one)
    Case("split_fp16_s200_h64", "stacked", 16, 200, 12, 64, 64),
    Case("split_fp16_s200_h64_causal", "stacked", 16, 200, 12, 64, 64, {"causal": "TopLeft"}),
    Case(
        "bert_base_bf16_causal",
        "stacked",
        32,
        128,
        12,
        64,
        64,
        {"dtype": "bfloat16", "causal": "BottomRight"},
    ),
    # GQA 16/4 at 129-256 keys on the 256-key kernel, and a tiny launch of 256 keys
    Case("split_fp16_gqa_q16_kv4_s200_h64", "stacked", 16, 200, 16, 64, 64, {"n_kv": 4}),
    Case("split_fp16_tiny_s256_h64", "stacked", 1, 256, 12, 64, 64),
    # long sequences on the overlapped mainloop (hopper_overlap.cuh): head dim 32,
    # three warpgroups at head dim 64 with a ragged key tile, bf16 causal GQA with a ragged one
    Case("split_fp16_s1024_h32", "stacked", 4, 1024, 16, 32, 32),
    Case("split_fp16_s2000_h64", "stacked", 2, 2000, 16, 64, 64),
    Case(
        "split_bf16_gqa_q32_kv8_causal_s1000",
        "stacked",
        2,
        1000,
        32,
        128,
        128,
        {"n_kv": 8, "dtype": "bfloat16", "causal": "TopLeft"},
    ),
    # long causal head dim 64 on three warpgroups with per-warpgroup key-tile counts: a ragged
    # last tile, and 1000 rows, which leave two of the last block's three warpgroups without a
    # row (they only drain K/V)
    Case("split_fp16_s1500_h64_causal", "stacked", 2, 1500, 16, 64, 64, {"causal": "TopLeft"}),
    Case("split_fp16_s1000_h64_causal", "stacked", 4, 1000, 16, 64, 64, {"causal": "TopLeft"}),
    # head dim 256 on the overlapped cooperative kernel with lazy rescale, a large
    # launch with a ragged key tile and a tiny bf16 causal one
    Case("split_fp16_s1100_h256", "stacked", 4, 1100, 8, 256, 256),
    Case(
        "split_bf16_s600_h256_causal",
        "stacked",
        2,
        600,
        8,
        256,
        256,
        {"dtype": "bfloat16", "causal": "TopLeft"},
    ),
    # one short sequence at head dim 128 in one wave of 64-row tiles (the
    # non-warp-specialized TMA kernel), ragged, and its bf16 causal sibling
    Case("split_fp16_s500_h128_tiny", "stacked", 1, 500, 16, 128, 128),
    Case(
        "split_bf16_s512_h128_tiny_causal",
        "stacked",
        1,
        512,
        16,
        128,
        128,
        {"dtype": "bfloat16", "causal": "BottomRight"},
    ),
    # short key ranges in "small" launches at head dims 128 and 32: ping-pong with
    # the next tile's Q loaded ahead (pingpongq_128x128); bf16 causal with a ragged key tile
    Case("split_fp16_s256_h128_small", "stacked", 16, 256, 16, 128, 128),
    Case(
        "split_bf16_s200_h128_small_causal",
        "stacked",
        16,
        200,
        16,
        128,
        128,
        {"dtype": "bfloat16", "causal": "BottomRight"},
    ),
    Case("split_fp16_s256_h32_small_causal", "stacked", 16, 256, 16, 32, 32, {"causal": "TopLeft"}),
    # short causal launches at head dim 256 on the persistent kernel
    # (overlapoq_128x64, O staged in the Q stage); bf16 bottom-right with a ragged key tile
    Case(
        "split_fp16_s256_h256_small_causal",
        "stacked",
        16,
        256,
        8,
        256,
        256,
        {"causal": "TopLeft"},
    ),
    Case(
        "split_bf16_s200_h256_small_causal",
        "stacked",
        16,
        200,
        8,
        256,
        256,
        {"dtype": "bfloat16", "causal": "BottomRight"},
    ),
    # the 256-key short kernel with its exponentials overlapping its own P V
    # (shortwo_64x256), bf16 GQA 16/4 bottom-right at a ragged 250 keys
    Case(
        "split_bf16_gqa_q16_kv4_s250_h64_bottomright",
        "stacked",
        4,
        250,
        16,
        64,
        64,
        {"n_kv": 4, "dtype": "bfloat16", "causal": "BottomRight"},
    ),
    # the 256-key short kernel with its tiles loaded by TMA (shortwot_64x256): MQA causal at a
    # ragged 160 keys (a tiny launch), and separate Q, K and V tensors with fewer queries than
    # keys (Q's tensor map over its own tensor, rows past 100 zero-filled)
    Case(
        "split_fp16_mqa_q8_kv1_s160_h64_causal",
        "stacked",
        3,
        160,
        8,
        64,
        64,
        {"n_kv": 1, "causal": "TopLeft"},
    ),
    Case(
        "plain_fp16_s100_kv230_h64",
        "plain",
        4,
        100,
        12,
        64,
        64,
        {"causal": "BottomRight"},
        s_kv=230,
        expect="plain",
    ),
    # long causal head dim 64 with the query blocks aligned to the last row
    # (overlap3kls_192x128): GQA 16/4 bottom-right at 2048 rows (one warpgroup tile before row
    # 0), and separate tensors with 700 queries and 1300 keys, bottom-right (68 empty rows: one
    # tile moved, 4 rows of the last block still past Sq)
    Case(
        "split_fp16_gqa_q16_kv4_s2048_h64_bottomright",
        "stacked",
        2,
        2048,
        16,
        64,
        64,
        {"n_kv": 4, "causal": "BottomRight"},
    ),
    Case(
        "plain_fp16_s700_kv1300_h64_bottomright",
        "plain",
        4,
        700,
        12,
        64,
        64,
        {"causal": "BottomRight"},
        s_kv=1300,
        expect="plain",
    ),
    # causal launches of a few waves, their tiles in chunks of all heads chosen on the host:
    # 192-row blocks at head dim 64 (32 heads in one chunk) and 128-row tiles at head dim
    # 128 on pingpongk_128x128 (chunks of 9 heads)
    Case("split_fp16_s2048_h64_causal_b2", "stacked", 2, 2048, 16, 64, 64, {"causal": "TopLeft"}),
    Case(
        "split_fp16_s4096_h128_causal_b1", "stacked", 1, 4096, 16, 128, 128, {"causal": "TopLeft"}
    ),
    # sliding windows (window_size=W, causal): on sm_90 fp16/bf16 at tile head dims 32/64/128 the
    # Hopper window kernel (key tiles outside the window skipped, W read at run time), stacked and
    # GQA, both alignments, W under, across and over a 128-key tile; what it does not take
    # (head dim 256, a bias, options.kernel=sm80) runs masked on the SM80-class kernel
    Case(
        "window_fp16_s1000_w256_h128_topleft",
        "stacked",
        2,
        1000,
        16,
        128,
        module={"causal": "TopLeft", "window": 256},
    ),
    Case(
        "window_bf16_gqa_q16_kv4_s700_w100_h64_bottomright",
        "stacked",
        3,
        700,
        16,
        64,
        module={"causal": "BottomRight", "window": 100, "n_kv": 4, "dtype": "bfloat16"},
    ),
    Case(
        "window_fp16_s4096_w4096_h128_bottomright",
        "stacked",
        1,
        4096,
        8,
        128,
        module={"causal": "BottomRight", "window": 4096, "n_kv": 2},
    ),
    Case(
        "window_fp16_s333_w1_h32_topleft",
        "stacked",
        2,
        333,
        8,
        32,
        module={"causal": "TopLeft", "window": 1},
    ),
    Case(
        "window_fp16_s600_w128_h256_masked",
        "stacked",
        2,
        600,
        4,
        256,
        module={"causal": "BottomRight", "window": 128},
    ),
    Case(
        "window_fp16_s300_w64_h64_bias_masked",
        "stacked",
        2,
        300,
        8,
        64,
        module={"causal": "TopLeft", "window": 64, "bias_shape": (2, 8, 300, 300)},
    ),
    Case(
        "window_bf16_s500_w200_h64_sm80_masked",
        "stacked",
        2,
        500,
        8,
        64,
        module={"causal": "BottomRight", "window": 200, "dtype": "bfloat16"},
        options={"kernel": "sm80"},
    ),
    # ragged batches (attention_var_len) on the SM80-class kernel's seqstart path, every arch:
    # lengths of 1, of 64 and off a 64-row tile; seqstart computed from the lengths or given;
    # the packed stacked tensor or separate q/k/v; causal masks within each sequence; GQA
    # (K/V repeated in the graph); keys with offsets of their own; head dim 256 (the output
    # accumulated in a workspace); float32
    Case("ragged_fp16_split", "ragged", 5, 345, 8, 64, module={"lens": [1, 63, 64, 200, 17]}),
    Case(
        "ragged_fp16_split_causal_bottomright",
        "ragged",
        5,
        345,
        8,
        64,
        module={"lens": [1, 63, 64, 200, 17], "causal": "BottomRight"},
    ),
    Case(
        "ragged_bf16_split_seqstart_input_causal_topleft",
        "ragged",
        4,
        213,
        8,
        128,
        module={
            "lens": [130, 1, 77, 5],
            "dtype": "bfloat16",
            "seqstart": "input",
            "causal": "TopLeft",
        },
    ),
    Case(
        "ragged_bf16_slice",
        "ragged",
        3,
        150,
        4,
        64,
        module={"lens": [50, 1, 99], "dtype": "bfloat16", "layout": "strided_slice"},
    ),
    Case(
        "ragged_fp16_separate_gqa_q16_kv4_causal",
        "ragged",
        3,
        134,
        16,
        64,
        module={"lens": [1, 100, 33], "layout": "separate", "n_kv": 4, "causal": "TopLeft"},
        expect="plain",
    ),
    Case(
        "ragged_bf16_separate_seqstart_k_bottomright",
        "ragged",
        3,
        54,
        8,
        64,
        module={
            "lens": [3, 50, 1],
            "lens_k": [10, 50, 70],
            "layout": "separate",
            "seqstart_k": True,
            "dtype": "bfloat16",
            "causal": "BottomRight",
        },
        expect="plain",
    ),
    Case(
        "ragged_fp16_split_h256_causal",
        "ragged",
        3,
        195,
        4,
        256,
        module={"lens": [1, 65, 129], "causal": "TopLeft"},
    ),
    Case(
        "ragged_fp32_separate",
        "ragged",
        3,
        48,
        4,
        32,
        module={"lens": [7, 1, 40], "layout": "separate", "dtype": "float32"},
        expect="plain",
    ),
    # GQA/MQA sites left to TVM (here: forced onto the SM80 kernel, which takes no GQA): build.py
    # repeats K and V up to the query heads first, without which TVM's own attention reads K/V by
    # the query head (relative error ~1)
    Case(
        "split_fp16_gqa_q16_kv4_on_tvm",
        "stacked",
        2,
        128,
        16,
        64,
        64,
        {"n_kv": 4},
        expect="none",
        options={"kernel": "sm80"},
    ),
    Case(
        "split_fp16_mqa_q8_kv1_causal_on_tvm",
        "stacked",
        2,
        96,
        8,
        64,
        64,
        {"n_kv": 1, "causal": "BottomRight"},
        expect="none",
        options={"kernel": "sm80"},
    ),
]

#: the ragged batches: ``build OUT ragged`` builds these
RAGGED_CASES = tuple(c.name for c in CASES if c.kind == "ragged")

#: the sliding windows: ``build OUT window`` builds these
WINDOW_CASES = tuple(c.name for c in CASES if "window" in c.module)

#: cases the Hopper kernel takes, built a second time with the selector's default on sm_90
HOPPER_CASES = (
    "bert_base_fp16",
    "b8_s2048_n16_h128_fp16",
    "split_fp16_causal_bottomright",
    "split_fp16_causal_topleft",
    "split_bf16",
    "split_fp16_symbolic_batch",
    "split_fp16_epilogue",
    "plain_fp16_causal_bottomright",
    "split_fp16_gqa_q32_kv8",
    "split_fp16_gqa_q16_kv4_causal_h64",
    "split_bf16_mqa_q16_kv1",
    "split_fp16_gqa_q16_kv4_tiny_s100_h64",
    "split_fp16_s200_h64",
    "split_fp16_s200_h64_causal",
    "bert_base_bf16_causal",
    "split_fp16_gqa_q16_kv4_s200_h64",
    "split_fp16_tiny_s256_h64",
    "split_fp16_s1024_h32",
    "split_fp16_s2000_h64",
    "split_bf16_gqa_q32_kv8_causal_s1000",
    "split_fp16_s1500_h64_causal",
    "split_fp16_s1000_h64_causal",
    "split_fp16_s1100_h256",
    "split_bf16_s600_h256_causal",
    "split_fp16_s500_h128_tiny",
    "split_bf16_s512_h128_tiny_causal",
    "split_fp16_s256_h128_small",
    "split_bf16_s200_h128_small_causal",
    "split_fp16_s256_h32_small_causal",
    "split_fp16_s256_h256_small_causal",
    "split_bf16_s200_h256_small_causal",
    "split_bf16_gqa_q16_kv4_s250_h64_bottomright",
    "split_fp16_mqa_q8_kv1_s160_h64_causal",
    "plain_fp16_s100_kv230_h64",
    "split_fp16_gqa_q16_kv4_s2048_h64_bottomright",
    "plain_fp16_s700_kv1300_h64_bottomright",
    "split_fp16_s2048_h64_causal_b2",
    "split_fp16_s4096_h128_causal_b1",
)


# --------------------------------------------------------------------------------------------
# build (needs the full toolchain; no GPU)
# --------------------------------------------------------------------------------------------
def module_for(case: Case) -> Any:
    from tests.models import attention_module, ragged_attention_module, stacked_attention_module

    if case.kind == "ragged":
        kwargs = {k: v for k, v in case.module.items() if k not in ("lens", "lens_k")}
        return ragged_attention_module(case.n, case.h, **kwargs)
    if case.kind == "plain":
        return attention_module(
            case.b,  # type: ignore[arg-type]
            case.s,
            case.s_kv or case.s,
            case.n,
            case.h,
            case.hv,
            **case.module,
        )
    return stacked_attention_module(case.b, case.s, case.n, case.h, case.hv, **case.module)


def build(out_dir: Path, names: list[str] | None = None, **opts: Any) -> None:
    from service.settings import get_settings
    from service.spec import CompileOptions, Target
    from tests.models import to_json
    from worker.pipeline import compile_module

    out_dir.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        if names and case.name not in names:
            continue
        t0 = time.monotonic()
        work = out_dir / case.name
        res = compile_module(
            to_json(module_for(case)),
            target=Target(arch="sm_90"),
            options=CompileOptions(**{**opts, **case.options}),
            out_dir=work,
            settings=get_settings(),
        )
        summary = res.report.summary
        got = "stacked" if summary.fused_stacked else ("plain" if summary.fused_plain else "none")
        if got != case.expect:
            raise SystemExit(f"{case.name}: report says {got}, expected {case.expect}")
        (work / "case.json").write_text(json.dumps(asdict(case)))
        kernels = sorted({m.kernel.family for m in res.report.matches if m.kernel})
        (work / "kernels.json").write_text(json.dumps(kernels))
        if case.name in VALIDATED:
            _build_reference(case, work)
        took = time.monotonic() - t0
        print(f"built {case.name} in {took:.1f}s ({got}, {kernels})", flush=True)


#: cases whose worker-side validation child (worker/validate.py) also runs on the GPU
VALIDATED = ("split_fp16_epilogue", "split_fp16_symbolic_batch")


def _build_reference(case: Case, work: Path) -> None:
    """The TVM-only library and the input signature the worker's validation child takes."""
    from service.settings import get_settings
    from service.spec import CompileOptions, Target
    from tests.models import to_json
    from worker import validate
    from worker.pipeline import compile_module

    mod = module_for(case)
    compile_module(
        to_json(mod),
        target=Target(arch="sm_90"),
        options=CompileOptions(fuse_stacked=False, offload_plain=False, validate_on_gpu="never"),
        out_dir=work / "ref",
        settings=get_settings(),
    )
    (work / "inputs.json").write_text(json.dumps(validate.signature(mod["main"])))


def run_validation_child(work: Path) -> dict[str, Any]:
    """What a GPU worker records in the report's ``validation`` (worker/validate.py child)."""
    import subprocess

    out = work / "validation.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.validate",
            str(work / "model.so"),
            str(work / "ref" / "model.so"),
            str(work / "inputs.json"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        return {"status": "error", "reason": proc.stdout[-500:] + proc.stderr[-500:]}
    return json.loads(out.read_text())


# --------------------------------------------------------------------------------------------
# check (GPU: runtime TVM + torch)
# --------------------------------------------------------------------------------------------
def reference(case: Case, inputs: list[Any]) -> list[Any]:
    """Attention by plain PyTorch ops in float32 (independent of any fused kernel)."""
    import torch

    if case.kind == "ragged":
        return [_ragged_reference(case, inputs)]
    m = case.module
    h, hv, n = case.h, case.hv, case.n
    n_kv = m.get("n_kv", n)
    dtype_out = inputs[0].dtype
    if case.kind == "stacked":
        qkv = inputs[0].float()
        widths = {"q": n * h, "k": n_kv * h, "v": n_kv * hv}
        order = m.get("slice_order", "qkv")
        begin, pos = {}, 0
        for role in order:
            begin[role] = pos
            pos += widths[role]
        bsz, s = qkv.shape[0], qkv.shape[1]
        q = qkv[:, :, begin["q"] : begin["q"] + widths["q"]].reshape(bsz, s, n, h)
        k = qkv[:, :, begin["k"] : begin["k"] + widths["k"]].reshape(bsz, s, n_kv, h)
        v = qkv[:, :, begin["v"] : begin["v"] + widths["v"]].reshape(bsz, s, n_kv, hv)
        # GQA: query head i attends key/value head i // (n / n_kv) (PyTorch's enable_gqa)
        k, v = k.repeat_interleave(n // n_kv, dim=2), v.repeat_interleave(n // n_kv, dim=2)
        bias = inputs[1].float() if len(inputs) > 1 else None
    else:
        q, k, v = (t.float() for t in inputs[:3])
        bias = inputs[3].float() if len(inputs) > 3 else None
    scale = m.get("scale") or 1.0 / math.sqrt(h)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # B N S H
    score = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if bias is not None:
        score = score + bias
    causal = m.get("causal")
    if causal:
        sq, skv = score.shape[-2], score.shape[-1]
        i = torch.arange(sq, device=score.device)[:, None]
        j = torch.arange(skv, device=score.device)[None, :]
        offset = 0 if causal == "TopLeft" else skv - sq
        score = score.masked_fill(j > i + offset, float("-inf"))
        if m.get("window") is not None:  # key j seen iff i + offset - W < j <= i + offset
            score = score.masked_fill(j <= i + offset - m["window"], float("-inf"))
    out = torch.matmul(torch.softmax(score, dim=-1), vt).transpose(1, 2).to(dtype_out)
    if m.get("epilogue"):
        out = out + out
    if m.get("leak"):
        return [out, q.to(dtype_out)]
    return [out]


def _attend(q: Any, k: Any, v: Any, causal: str | None, scale: float) -> Any:
    """softmax(scale q k^T, causal) v in float32 on ``[B, S, N, H]``, K/V heads equal to Q's."""
    import torch

    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    score = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if causal:
        sq, skv = score.shape[-2], score.shape[-1]
        i = torch.arange(sq, device=score.device)[:, None]
        j = torch.arange(skv, device=score.device)[None, :]
        score = score.masked_fill(j > i + (0 if causal == "TopLeft" else skv - sq), float("-inf"))
    return torch.matmul(torch.softmax(score, dim=-1), vt).transpose(1, 2)


def _ragged_reference(case: Case, inputs: list[Any]) -> Any:
    """Each sequence over its own keys (BottomRight: the diagonal at its last key), the
    sequences' outputs packed again: ``[1, T, N, H]``."""
    import torch

    m = case.module
    n, h = case.n, case.h
    n_kv = m.get("n_kv", n)
    lens, lens_k = m["lens"], m.get("lens_k", m["lens"])
    if m.get("layout", "split") == "separate":
        q, k, v = inputs[:3]
    else:
        qkv, t = inputs[0], inputs[0].shape[1]
        q = qkv[..., : n * h].reshape(1, t, n, h)
        k = qkv[..., n * h : (n + n_kv) * h].reshape(1, t, n_kv, h)
        v = qkv[..., (n + n_kv) * h :].reshape(1, t, n_kv, h)
    k, v = k.repeat_interleave(n // n_kv, dim=2), v.repeat_interleave(n // n_kv, dim=2)
    out, sq, sk = [], 0, 0
    for lq, lk in zip(lens, lens_k, strict=True):
        qs, ks, vs = q[:, sq : sq + lq], k[:, sk : sk + lk], v[:, sk : sk + lk]
        out.append(_attend(qs, ks, vs, m.get("causal"), 1.0 / math.sqrt(h)))
        sq, sk = sq + lq, sk + lk
    return torch.cat(out, dim=1).to(inputs[0].dtype)


def _ragged_inputs(case: Case, torch: Any, dev: str, rnd: Any) -> list[Any]:
    """The module's inputs in its argument order: the packed tokens (or q, k, v), then the
    lengths, or seqstart and max_seqlen, of the queries (and of the keys, ``seqstart_k``)."""
    m = case.module
    n, h, n_kv = case.n, case.h, case.module.get("n_kv", case.n)
    lens = [m["lens"], m["lens_k"]] if m.get("seqstart_k") else [m["lens"]]
    t, tk = sum(lens[0]), sum(lens[-1])
    if m.get("layout", "split") == "separate":
        out = [rnd(1, t, n, h), rnd(1, tk, n_kv, h), rnd(1, tk, n_kv, h)]
    else:
        out = [rnd(1, t, (n + 2 * n_kv) * h)]

    def i32(values: list[int]) -> Any:
        return torch.tensor(values, dtype=torch.int32, device=dev)

    if m.get("seqstart", "cumsum") == "cumsum":
        return out + [i32(ln) for ln in lens]
    starts = [i32([0, *itertools.accumulate(ln)]) for ln in lens]
    longest = [torch.tensor(max(ln), dtype=torch.int32, device=dev) for ln in lens]
    return out + starts + longest


def _inputs(case: Case, torch: Any, dev: str) -> list[Any]:
    dt = getattr(torch, case.module.get("dtype", "float16"))
    b = case.b if isinstance(case.b, int) else case.run_batch
    assert b is not None, "a symbolic batch needs run_batch"
    g = torch.Generator(device=dev).manual_seed(hash(case.name) % 2**31)

    def rnd(*shape: int) -> Any:
        return (torch.randn(*shape, generator=g, device=dev) * 0.5).to(dt)

    if case.kind == "ragged":
        return _ragged_inputs(case, torch, dev, rnd)
    if case.kind == "stacked":
        n_kv = case.module.get("n_kv", case.n)
        width = case.n * case.h + n_kv * case.h + n_kv * case.hv
        out = [rnd(b, case.s, width)]
    else:
        skv = case.s_kv or case.s
        out = [
            rnd(b, case.s, case.n, case.h),
            rnd(b, skv, case.n, case.h),
            rnd(b, skv, case.n, case.hv),
        ]
    bias_shape = case.module.get("bias_shape")
    if bias_shape:
        out.append(rnd(*[b if d == "b" else d for d in bias_shape]))
    return out


def check(out_dir: Path, names: list[str] | None = None) -> list[dict[str, Any]]:
    import torch

    from worker.toolchain import import_tvm

    tvm = import_tvm()
    import tvm_ffi
    from tvm.runtime.vm import VirtualMachine

    dev = tvm.cuda(0)
    results = []
    for case_dir in sorted(p for p in out_dir.iterdir() if (p / "case.json").exists()):
        case = Case(**json.loads((case_dir / "case.json").read_text()))
        if names and case.name not in names:
            continue
        row: dict[str, Any] = {"case": case.name, "dtype": case.module.get("dtype", "float16")}
        if (case_dir / "kernels.json").exists():
            row["kernels"] = json.loads((case_dir / "kernels.json").read_text())
        try:
            vm = VirtualMachine(tvm.runtime.load_module(str(case_dir / "model.so")), dev)
            inputs = _inputs(case, torch, "cuda")
            with tvm_ffi.use_torch_stream():
                got = vm["main"](*[tvm.runtime.from_dlpack(t) for t in inputs])
            torch.cuda.synchronize()
            got_list = [got] if hasattr(got, "shape") else list(got)
            want = reference(case, inputs)
            worst = 0.0
            worst_abs = 0.0
            for g_t, w_t in zip(got_list, want, strict=True):
                g_torch = torch.from_dlpack(g_t).float()
                w_f = w_t.float()
                if not torch.isfinite(g_torch).all():
                    worst = float("inf")
                    continue
                worst = max(worst, float((g_torch - w_f).norm() / w_f.norm().clamp_min(1e-30)))
                worst_abs = max(worst_abs, float((g_torch - w_f).abs().max()))
            tol = TOLERANCE[row["dtype"]]
            row.update(rel_error=worst, max_abs_error=worst_abs, tolerance=tol, passed=worst <= tol)
            if (case_dir / "inputs.json").exists():
                row["worker_validation"] = run_validation_child(case_dir)
                row["passed"] = row["passed"] and row["worker_validation"]["status"] == "passed"
        except Exception as exc:  # report every case, including crashes
            row.update(passed=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def main(argv: list[str]) -> int:
    cmd, out = argv[0], Path(argv[1])
    names = argv[2:] or None
    if cmd == "build":
        kernel = "auto"
        if names and names[0].startswith("--kernel="):
            kernel = names.pop(0).split("=", 1)[1]
        if names == ["ragged"]:
            names = list(RAGGED_CASES)
        elif names == ["window"]:
            names = list(WINDOW_CASES)
        elif kernel == "auto" and not names:
            names = list(HOPPER_CASES)
        if kernel == "sm80" and not names:
            names = [c.name for c in CASES if "gqa" not in c.name and "mqa" not in c.name]
        build(out, names or None, kernel=kernel)
        return 0
    results = check(out, names)
    import torch

    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "command": "python -m benchmarks.gpu_cases check <cases>",
        "reference": "PyTorch float32 matmul/softmax on q/k/v cut from the stacked tensor",
        "results": results,
        "passed": sum(r.get("passed", False) for r in results),
        "total": len(results),
    }
    dest = Path(argv[1]) / "numerics.json"
    dest.write_text(json.dumps(doc, indent=2))
    print(f"{doc['passed']}/{doc['total']} passed")
    return 0 if doc["passed"] == doc["total"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
