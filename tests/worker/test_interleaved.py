"""Per-head interleaved q|k|v packing (GPT-NeoX, Falcon, Bloom): pattern, checks, layout, source."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import relax as rb

from service.spec import CompileOptions
from tests.models import R, T, tvm
from worker.fmha_sm80 import render_sm80
from worker.partition import PATTERN_ORDER, PATTERNS, partition

OPTS = CompileOptions()


def interleaved_module(
    b: int,
    s: int,
    n: int,
    h: int,
    *,
    form: str = "split",
    dtype: str = "float16",
    order: str = "qkv",
    bias: bool = False,
    causal: str | None = None,
    leak: bool = False,
) -> Any:
    """``qkv[B, S, N*3H] -> reshape [B, S, N, 3H] (or [B, S, N, 3, H]) -> split | slices ->
    attention``: within each head's 3H columns, the roles sit in ``order``."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg("qkv", R.Tensor((b, s, n * 3 * h), dtype))
        bias_v = R.arg("bias", R.Tensor((b, n, s, s), dtype)) if bias else None
        with R.dataflow() as frame:
            if form == "split5":
                packed = R.emit(R.reshape(qkv, [b, s, n, 3, h]))
                parts = R.emit(R.split(packed, 3, axis=3))
                pieces = [R.emit(R.reshape(parts[i], [b, s, n, h])) for i in range(3)]
            elif form == "squeeze5":
                packed = R.emit(R.reshape(qkv, [b, s, n, 3, h]))
                parts = R.emit(R.split(packed, 3, axis=3))
                pieces = [R.emit(R.squeeze(parts[i], [3])) for i in range(3)]
            else:
                packed = R.emit(R.reshape(qkv, [b, s, n, 3 * h]))
                if form == "split":
                    parts = R.emit(R.split(packed, 3, axis=3))
                    pieces = [R.emit(parts[i]) for i in range(3)]
                else:
                    pieces = [
                        R.emit(R.strided_slice(packed, [3], [i * h], [(i + 1) * h]))
                        for i in range(3)
                    ]
            role = {r: pieces[i] for i, r in enumerate(order)}
            out = R.emit(
                R.nn.attention(role["q"], role["k"], role["v"], bias_v, causal_mask=causal)
            )
            if leak:
                gv = R.emit(R.tuple(out, role["q"]))
                R.output(gv)
            else:
                R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def test_interleaved_patterns_rank_after_blocked_stacked_and_before_plain() -> None:
    names = [n for n in PATTERN_ORDER if PATTERNS[n].variant == "interleaved"]
    assert len(names) == 6
    first_plain = min(i for i, n in enumerate(PATTERN_ORDER) if PATTERNS[n].kind == "plain")
    assert all(PATTERN_ORDER.index(n) < first_plain for n in names)


@pytest.mark.parametrize(
    ("form", "pattern"),
    [
        ("split", "interleaved"),
        ("slice", "interleaved_slice"),
        ("split5", "interleaved_5d"),
        ("squeeze5", "interleaved_5d"),
    ],
)
def test_interleaved_forms_fuse_with_per_head_offsets(form: str, pattern: str) -> None:
    b, s, n, h = 2, 16, 4, 64
    res = partition(interleaved_module(b, s, n, h, form=form), OPTS)
    assert res.failures == []
    (m,) = res.match_entries()
    assert (m.kind, m.variant, m.pattern) == (
        "stacked",
        "interleaved",
        f"cutlass.stacked_attention.{pattern}",
    )
    row = n * 3 * h
    assert m.layout.model_dump() == {
        "source": "stacked",
        "q_offset": 0,
        "k_offset": h,
        "v_offset": 2 * h,
        "row_stride": {"q": row, "k": row, "v": row},
        "head_stride": {"q": 3 * h, "k": 3 * h, "v": 3 * h},
        "batch_stride": {"q": row * s, "k": row * s, "v": row * s},
        "order": "qkv",
        "packing": "per_head",
        "ragged": None,
    }
    # the kernel's operand is the packed [B, S, N, 3H] (or [B, S, N, 3, H]) view
    assert m.shapes["qkv"][:3] == [b, s, n]
    (fs,) = res.fused
    assert fs.analysis.spec is not None and fs.analysis.spec.packing == "per_head"


def test_interleaved_role_order_from_slices() -> None:
    res = partition(interleaved_module(2, 8, 2, 32, form="slice", order="kqv"), OPTS)
    (m,) = res.match_entries()
    assert (m.layout.k_offset, m.layout.q_offset, m.layout.v_offset) == (0, 32, 64)
    assert m.layout.order == "kqv"


def test_interleaved_with_bias_and_causal() -> None:
    res = partition(interleaved_module(2, 16, 4, 64, bias=True, causal="TopLeft"), OPTS)
    (m,) = res.match_entries()
    assert m.pattern == "cutlass.stacked_attention.interleaved_bias"
    assert m.bias and m.causal == "TopLeft"


def test_interleaved_leak_falls_back_to_plain_with_a_reason() -> None:
    res = partition(interleaved_module(2, 16, 4, 64, leak=True), OPTS)
    assert [f.pattern.kind for f in res.fused] == ["plain"]
    checks = {(f.pattern, f.check) for f in res.failures}
    assert ("cutlass.stacked_attention.interleaved", "no_leak") in checks


def test_spec_offsets_address_the_same_elements_as_the_graph() -> None:
    """Reading qkv at the spec's offsets/strides gives the q, k, v the graph computes."""
    b, s, n, h = 2, 5, 3, 8
    res = partition(interleaved_module(b, s, n, h, form="split5"), OPTS)
    spec = res.fused[0].analysis.spec
    assert spec is not None
    flat = np.arange(b * s * n * 3 * h, dtype=np.float64)
    packed = flat.reshape(b, s, n, 3, h)
    want = {"q": packed[:, :, :, 0], "k": packed[:, :, :, 1], "v": packed[:, :, :, 2]}
    bi, si, ni, hi = np.meshgrid(
        np.arange(b), np.arange(s), np.arange(n), np.arange(h), indexing="ij"
    )
    for role in "qkv":
        acc = getattr(spec, role)
        idx = acc.offset + bi * acc.row_stride * s + si * acc.row_stride + ni * acc.head_stride + hi
        np.testing.assert_array_equal(flat[idx], want[role])


def test_generated_source_reads_q_k_v_at_per_head_offsets() -> None:
    b, s, n, h = 2, 16, 4, 64
    res = partition(interleaved_module(b, s, n, h), OPTS)
    spec = res.fused[0].analysis.spec
    assert spec is not None
    src = render_sm80(spec, "stackfuse_atest", "sm_90").source
    row, head = n * 3 * h, 3 * h
    for line in (
        "p.query_ptr = data_of(a0) + 0;",
        f"p.key_ptr = data_of(a0) + {h};",
        f"p.value_ptr = data_of(a0) + {2 * h};",
        f"p.q_strideM = {row};",
        f"p.k_strideH = {head};",
        f"p.v_strideH = {head};",
        f"p.q_strideB = int64_t({row}) * seq_q;",
    ):
        assert line in src, line
    assert "/*is_aligned=*/true" in src


def test_unaligned_head_dim_is_refused_with_a_reason() -> None:
    res = partition(interleaved_module(2, 8, 2, 6, form="split"), OPTS)
    assert not any(f.pattern.kind == "stacked" for f in res.fused)
    assert any(f.check == "head_dim_alignment" for f in res.failures)


_ = T
