"""Partitioning: patterns, their order, every check, and the report entries they produce."""

from __future__ import annotations

from typing import Any

import pytest

from service.spec import CompileOptions
from tests.models import (
    R,
    attention_module,
    custom_attention_module,
    packed_mqa_module,
    stacked_attention_module,
)
from worker.partition import PATTERN_ORDER, PATTERNS, partition
from worker.toolchain import import_tvm

import_tvm()
from tvm import relax  # noqa: E402

OPTS = CompileOptions()

# apache/tvm tests/python/relax/test_codegen_cutlass.py: stacked_attention_size
UPSTREAM = [
    # B, S, N, (H, H_v), bias_shape, scale, single_shape
    (4, 8, 32, (64, 32), None, None, False),
    (4, 8, 32, (64, 32), (4, 32, 8, 8), 0.5, False),
    (4, 8, 32, (64, 64), None, None, True),
]


@pytest.mark.parametrize("op", ["split", "strided_slice"])
@pytest.mark.parametrize("params", UPSTREAM, ids=["hv32", "bias_scale", "single_shape"])
def test_upstream_stacked_parametrizations_fuse_as_stacked(
    op: str, params: tuple[Any, ...]
) -> None:
    b, s, n, (h, h_v), bias_shape, scale, single = params
    dtype = "float16" if op == "split" else "float32"  # as upstream
    mod = stacked_attention_module(
        b, s, n, h, h_v, op=op, dtype=dtype, bias_shape=bias_shape, scale=scale, single_shape=single
    )
    res = partition(mod, OPTS)
    assert res.failures == []
    assert len(res.fused) == 1
    (m,) = res.match_entries()
    assert m.kind == "stacked"
    assert m.variant == op
    assert m.bias is (bias_shape is not None)
    assert m.pattern == f"cutlass.stacked_attention.{op}" + ("_bias" if bias_shape else "")
    assert m.dtype == dtype
    assert m.scale == pytest.approx(scale if scale else 1 / h**0.5)
    row = 2 * n * h + n * h_v
    assert m.layout.model_dump() == {
        "source": "stacked",
        "q_offset": 0,
        "k_offset": n * h,
        "v_offset": 2 * n * h,
        "row_stride": {"q": row, "k": row, "v": row},
        "head_stride": {"q": h, "k": h, "v": h_v},
        "batch_stride": {"q": row * s, "k": row * s, "v": row * s},
        "order": "qkv",
        "packing": "blocked",
        "ragged": None,
    }
    assert m.shapes["qkv"] == [b, s, row]
    assert m.shapes["out"] == [b, s, n, h_v]
    assert m.where.function == "main" and m.where.site == "main/attention#0"
    # the split/slices, the three reshapes and the attention are all covered
    assert len(m.bindings) >= 7
    # the fused module keeps no split/slice/reshape for the site in main
    main_ops = _ops(res.mod["main"])
    assert not main_ops & {"relax.split", "relax.strided_slice", "relax.reshape"}


def _ops(func: Any) -> set[str]:
    ops: set[str] = set()

    def visit(e: Any) -> None:
        if isinstance(e, relax.Call) and hasattr(e.op, "name"):
            ops.add(e.op.name)

    relax.analysis.post_order_visit(func.body, visit)
    return ops


def test_pattern_order_stacked_before_plain() -> None:
    kinds = [PATTERNS[n].kind for n in PATTERN_ORDER]
    assert kinds == sorted(kinds, key=lambda k: k != "stacked")


def test_order_matters_plain_first_claims_the_attention_alone() -> None:
    """The #14608 review question: with plain attention first, the stacked form is lost."""
    mod = stacked_attention_module(4, 8, 32, 64, 64)
    pats = [
        relax.transform.FusionPattern(n, PATTERNS[n].pattern, PATTERNS[n].annotations)
        for n in reversed(PATTERN_ORDER)
    ]
    plain_first = relax.transform.FuseOpsByPattern(pats, annotate_codegen=True)(mod)
    comps = _composites(plain_first)
    assert comps == ["cutlass.attention"]
    assert {"relax.split", "relax.reshape"} <= _ops(plain_first["main"])
    ours = partition(mod, OPTS)
    assert [f.pattern.name for f in ours.fused] == ["cutlass.stacked_attention.split"]


def _composites(mod: Any) -> list[str]:
    out = []
    for _, f in mod.functions.items():

        def visit(e: Any) -> None:
            if isinstance(e, relax.Function) and e.attrs is not None and "Composite" in e.attrs:
                out.append(str(e.attrs["Composite"]))

        if isinstance(f, relax.Function):
            relax.analysis.post_order_visit(f.body, visit)
    return out


def test_symbolic_batch_is_handled_at_run_time() -> None:
    res = partition(stacked_attention_module("b", 64, 8, 64), OPTS)
    (fs,) = res.fused
    spec = fs.analysis.spec
    assert spec is not None and spec.batch == "?" and spec.seq_q == 64
    (m,) = res.match_entries()
    assert m.shapes["qkv"][0] != 64 and isinstance(m.shapes["qkv"][0], str)


def test_other_slice_orders_are_fused_with_their_offsets() -> None:
    res = partition(
        stacked_attention_module(2, 16, 4, 64, op="strided_slice", slice_order="vkq"), OPTS
    )
    (m,) = res.match_entries()
    assert m.layout.order == "vkq"
    assert (m.layout.v_offset, m.layout.k_offset, m.layout.q_offset) == (0, 256, 512)


def test_causal_dtype_and_kv_head_dim_are_reported() -> None:
    res = partition(
        stacked_attention_module(2, 16, 4, 64, 128, dtype="bfloat16", causal="BottomRight"), OPTS
    )
    (m,) = res.match_entries()
    assert (m.causal, m.dtype) == ("BottomRight", "bfloat16")
    assert m.layout.head_stride == {"q": 64, "k": 64, "v": 128}


def test_epilogue_and_two_sites_each_fused() -> None:
    mod = stacked_attention_module(2, 16, 4, 64, epilogue=True)
    res = partition(mod, OPTS)
    assert [f.pattern.kind for f in res.fused] == ["stacked"]
    assert "relax.add" in _ops(res.mod["main"])


# --------------------------------------------------------------------------------------------
# every check has a negative case: failure recorded with expected/actual/message, and plain
# attention still offloads the attention alone where it can
# --------------------------------------------------------------------------------------------
def _split_axis1(qkv: Any) -> Any:
    parts = R.emit(R.split(qkv, 3, axis=1))
    return [R.emit(R.reshape(parts[i], [2, 8, 4, 64])) for i in range(3)]


def _split_rank4(qkv: Any) -> Any:
    parts = R.emit(R.split(qkv, 3, axis=2))
    return [R.emit(R.reshape(parts[i], [2, 8, 4, 64])) for i in range(3)]


def _split_four(qkv: Any) -> Any:
    parts = R.emit(R.split(qkv, [256, 512, 640], axis=2))
    return (
        R.emit(R.reshape(parts[0], [2, 8, 4, 64])),
        R.emit(R.reshape(parts[1], [2, 8, 4, 64])),
        R.emit(R.reshape(parts[2], [2, 8, 2, 64])),
    )


def _slice(
    qkv: Any,
    begins: list[int],
    ends: list[int],
    strides: list[int] | None = None,
    axis: int = 2,
    shape: list[int] | None = None,
) -> Any:
    out = []
    for i, (b, e) in enumerate(zip(begins, ends, strict=True)):
        st = [strides[i]] if strides else [1]
        out.append(
            R.emit(R.reshape(R.strided_slice(qkv, [axis], [b], [e], st), shape or [2, 8, 4, 64]))
        )
    return out


CHECK_CASES: dict[str, tuple[Any, str]] = {
    "stacked_ndim": (
        lambda: custom_attention_module((2, 8, 3, 256), _split_rank4),
        "stacked tensor has rank 4",
    ),
    "split_axis": (
        lambda: custom_attention_module((2, 24, 256), _split_axis1),
        "split axis is 1; stacked fusion needs axis 2",
    ),
    "split_sections": (lambda: custom_attention_module((2, 8, 768), _split_four), "exactly 3"),
    "slice_axis": (
        lambda: custom_attention_module(
            (2, 24, 256), lambda x: _slice(x, [0, 8, 16], [8, 16, 24], axis=1)
        ),
        "axes [1]",
    ),
    "slice_stride": (
        lambda: custom_attention_module(
            (2, 8, 1024),
            lambda x: _slice(x, [0, 512, 768], [512, 768, 1024], [2, 1, 1], shape=None),
        ),
        "stride 2",
    ),
    "slice_bounds": (
        lambda: custom_attention_module(
            (2, 8, 768), lambda x: _slice(x, [-768, 256, 512], [-512, 512, 768])
        ),
        "negative",
    ),
    "reshape_shape": (
        lambda: custom_attention_module(
            (2, 8, 768), lambda x: _slice(x, [0, 256, 512], [256, 512, 768], shape=[1, 16, 4, 64])
        ),
        "changes batch or sequence",
    ),
    "no_leak": (
        lambda: stacked_attention_module(2, 8, 4, 64, leak=True),
        "also used outside the attention pattern",
    ),
    "dtype": (lambda: stacked_attention_module(2, 8, 4, 64, dtype="float64"), "float64"),
    "num_heads": (lambda: stacked_attention_module(2, 8, 8, 64, n_kv=2), "need the Hopper kernel"),
    "head_dim_max": (lambda: stacked_attention_module(2, 8, 2, 512), "maximum of 256"),
    "head_dim_alignment": (lambda: stacked_attention_module(2, 8, 4, 30), "multiples of 4"),
    "scale": (lambda: stacked_attention_module(2, 8, 4, 64, scale=0.0), "non-zero"),
}


def test_a_window_without_its_kernel_reports_why() -> None:
    """A stacked window before sm_90 with normalize off (with it on, normalize writes the
    window as a mask; tests/worker/test_attention_forms.py)."""
    mod = custom_attention_module(
        (2, 8, 768),
        lambda x: _slice(x, [0, 256, 512], [256, 512, 768]),
        causal="BottomRight",
        window_size=4,
    )
    res = partition(mod, CompileOptions(normalize=False), arch="sm_80")
    assert not res.fused
    hits = [f for f in res.failures if f.check == "sliding_window" and f.pattern != "tvm.legalize"]
    assert hits and all("needs the Hopper kernel, and target arch sm_80" in f.message for f in hits)


@pytest.mark.parametrize("check", sorted(CHECK_CASES))
def test_each_check_reports_a_reason(check: str) -> None:
    make, phrase = CHECK_CASES[check]
    mod = make()
    res = partition(mod, OPTS, arch="sm_80")  # SM80: the strictest kernel set
    assert not any(f.pattern.kind == "stacked" for f in res.fused)
    hits = [f for f in res.failures if f.check == check]
    assert hits, f"no {check} failure in {[(f.check, f.message) for f in res.failures]}"
    f = hits[0]
    assert f.expected and f.actual and phrase in f.message
    assert f.where.function == "main" and f.where.site == "main/attention#0"


def test_split_axis_message_names_the_axis() -> None:
    res = partition(custom_attention_module((2, 24, 256), _split_axis1), OPTS)
    (f,) = [f for f in res.failures if f.check == "split_axis"]
    assert (f.expected, f.actual) == ("2", "1")
    assert f.message.startswith("split axis is 1; stacked fusion needs axis 2")


def test_bias_shape_must_broadcast_over_the_scores() -> None:
    # [B, N, 1, S_kv] broadcasts over queries: fused; its report keeps the bias shape
    ok = partition(stacked_attention_module(2, 8, 4, 64, bias_shape=(2, 4, 1, 8)), OPTS)
    assert [f.pattern.name for f in ok.fused] == ["cutlass.stacked_attention.split_bias"]
    assert ok.match_entries()[0].shapes["bias"] == [2, 4, 1, 8]


def test_stacked_failure_falls_back_to_plain_and_reports_both() -> None:
    res = partition(stacked_attention_module(2, 8, 4, 64, leak=True), OPTS)
    assert [f.pattern.kind for f in res.fused] == ["plain"]
    assert [f.check for f in res.failures] == ["no_leak"]
    (m,) = res.match_entries()
    assert m.kind == "plain" and m.layout.source == "separate"
    assert m.where == res.failures[0].where


def test_fallback_can_be_switched_off() -> None:
    mod = stacked_attention_module(2, 8, 4, 64, leak=True)
    res = partition(mod, CompileOptions(offload_plain=False))
    assert res.fused == []
    assert len(res.sites) == 1


def test_fuse_stacked_off_uses_plain() -> None:
    res = partition(stacked_attention_module(2, 8, 4, 64), CompileOptions(fuse_stacked=False))
    assert [f.pattern.kind for f in res.fused] == ["plain"]


def test_plain_attention_with_bias_and_causal() -> None:
    mod = attention_module(2, 16, 24, 4, 64, 32, bias_shape=(2, 4, 16, 24), causal="BottomRight")
    (m,) = partition(mod, OPTS).match_entries()
    assert (m.kind, m.pattern, m.causal) == ("plain", "cutlass.attention_bias", "BottomRight")
    assert m.layout.row_stride == {"q": 256, "k": 256, "v": 128}


def test_gqa_is_fused_on_sm90_where_the_hopper_kernel_takes_it() -> None:
    mod = stacked_attention_module(2, 64, 8, 64, n_kv=2)
    res = partition(mod, OPTS, arch="sm_90")
    (m,) = res.match_entries()
    assert m.kind == "stacked" and res.failures == []
    assert (m.layout.k_offset, m.layout.v_offset) == (8 * 64, 10 * 64)
    refused = partition(mod, CompileOptions(kernel="sm80"), arch="sm_90")
    assert refused.fused == [] or refused.fused[0].pattern.kind == "plain"
    assert any(f.check == "num_heads" for f in refused.failures)


@pytest.mark.parametrize(("b", "n_kv"), [(2, 1), ("b", 1), (2, 2)], ids=["mqa", "mqa_dyn", "gqa"])
def test_packed_mqa_is_read_in_place_on_sm90(b: int | str, n_kv: int) -> None:
    """``[q | k | v]`` with fewer K/V heads, unsqueezed before the split (GPTBigCode):
    normalize's ``unit_axes`` makes q, k, v reshapes of one split, and on sm_90 the Hopper
    kernel reads them in place: k at N*H, v at (N + Nkv)*H, row stride (N + 2 Nkv)*H."""
    import numpy as np

    from worker.build import expand_kv_heads
    from worker.normalize import normalize
    from worker.selection import select_kernel
    from worker.toolchain import import_tvm

    n, h = 4, 64
    mod = packed_mqa_module(b, 16, n, n_kv, h)
    out, rewrites = normalize(mod, OPTS, "sm_90")
    assert "unit_axes" in {r.rewrite for r in rewrites}
    res = partition(out, OPTS, arch="sm_90")
    assert res.failures == [] and res.reasons == []
    (m,) = res.match_entries()
    assert (m.kind, m.pattern) == ("stacked", "cutlass.stacked_attention.split")
    row = (n + 2 * n_kv) * h
    assert m.layout.model_dump() == {
        "source": "stacked",
        "q_offset": 0,
        "k_offset": n * h,
        "v_offset": (n + n_kv) * h,
        "row_stride": {"q": row, "k": row, "v": row},
        "head_stride": {"q": h, "k": h, "v": h},
        "batch_stride": {r: row * 16 for r in "qkv"},
        "order": "qkv",
        "packing": "blocked",
        "ragged": None,
    }
    assert m.shapes["k"][2] == n_kv
    (ff,) = res.functions
    assert ff.analysis.spec is not None
    assert f"GQA {n}/{n_kv}" in select_kernel(ff.analysis.spec, "sm_90")[1]
    # the views are the same values: both modules on TVM (K/V repeated for its attention)
    if b == 2:
        tvm = import_tvm()
        x = np.random.default_rng(0).standard_normal((2, 16, row)).astype("float16")

        def run(mod: Any) -> Any:
            exe = tvm.compile(expand_kv_heads(mod), target="llvm")
            vm = relax.VirtualMachine(exe, tvm.cpu())
            return vm["main"](tvm.runtime.tensor(x)).numpy().astype("float32")

        np.testing.assert_allclose(run(out), run(mod), atol=1e-3)


def test_packed_mqa_before_sm90_is_left_to_tvm_with_the_reason() -> None:
    """No SM80-class MQA: the stacked and plain patterns both refuse one K/V head for four
    query heads (``num_heads``), and the site says why."""
    from worker.normalize import normalize

    out, _ = normalize(packed_mqa_module(2, 16, 4, 1, 64), OPTS, "sm_80")
    res = partition(out, OPTS, arch="sm_80")
    assert res.fused == []
    assert {(f.pattern, f.check) for f in res.failures} >= {
        ("cutlass.stacked_attention.split", "num_heads"),
        ("cutlass.attention", "num_heads"),
    }
    (r,) = res.reasons
    assert r.outcome == "not_offloaded"
    assert "need the Hopper kernel" in r.reason and "sm_80 is not sm_90" in r.reason
