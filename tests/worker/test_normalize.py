"""Graph normalization: each rewrite fires on the exported form it targets, is reported, keeps
the function's meaning (checked by running both versions on the CPU with LLVM) and lets the
stacked patterns match."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tvm_ffi
from tvm import relax
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import relax as rb

from service.spec import CompileOptions
from tests.models import R, T, tvm
from worker.normalize import normalize
from worker.partition import partition

OPTS = CompileOptions()
B, S, N, H = 2, 8, 2, 16
C = N * H


def _ops(mod: Any) -> list[str]:
    ops: list[str] = []

    def visit(e: Any) -> None:
        if isinstance(e, relax.Call) and hasattr(e.op, "name"):
            ops.append(e.op.name)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return ops


def _run(mod: Any, args: list[np.ndarray]) -> np.ndarray:
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _same_meaning(before: Any, after: Any, args: list[np.ndarray]) -> None:
    np.testing.assert_allclose(_run(after, args), _run(before, args), rtol=1e-4, atol=1e-5)


def _rnd(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _names(rewrites: list[Any]) -> list[str]:
    return [r.rewrite for r in rewrites]


# --- exported SDPA: transposes around attention --------------------------------------------
def sdpa_export_module(mask: np.ndarray | None = None) -> Any:
    """What ``torch.export`` + our SDPA converter emit for GPT-2: split -> reshape ->
    transpose [B,N,S,H] -> transpose back -> attention(+ constant mask) -> transposes."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg("qkv", R.Tensor((B, S, 3 * C), "float32"))
        with R.dataflow() as frame:
            parts = R.emit(R.split(qkv, [C, 2 * C], axis=2))
            heads = []
            for i in range(3):
                r = R.emit(R.reshape(parts[i], [B, S, N, H]))
                t = R.emit(R.permute_dims(r, [0, 2, 1, 3]))  # torch layout
                heads.append(R.emit(R.permute_dims(t, [0, 2, 1, 3])))  # converter's
            bias = R.const(mask) if mask is not None else None
            out = R.emit(R.nn.attention(*heads, bias))
            t = R.emit(R.permute_dims(out, [0, 2, 1, 3]))
            back = R.emit(R.permute_dims(t, [0, 2, 1, 3]))
            res = R.emit(R.reshape(back, [B, S, C]))
            R.output(res)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def _causal(offset: int = 0, sq: int = S, skv: int = S) -> np.ndarray:
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    m = np.where(j <= i + offset, 0.0, np.finfo(np.float32).min).astype("float32")
    return np.broadcast_to(m, (B, 1, sq, skv)).copy()


def test_transpose_pairs_cancel_and_the_site_fuses_stacked() -> None:
    mod = sdpa_export_module()
    out, rewrites = normalize(mod, OPTS)
    assert "relax.permute_dims" not in _ops(out)
    assert "transpose_pairs" in _names(rewrites)
    res = partition(out, OPTS)
    assert [f.pattern.name for f in res.fused] == ["cutlass.stacked_attention.split"]
    _same_meaning(mod, out, [_rnd(B, S, 3 * C)])


def test_constant_causal_mask_becomes_causal_attention() -> None:
    mod = sdpa_export_module(_causal())
    out, rewrites = normalize(mod, OPTS)
    (rw,) = [r for r in rewrites if r.rewrite == "constant_mask"]
    assert "causal (TopLeft)" in rw.message
    assert rw.where is not None and rw.where.site == "main/attention#0"
    (m,) = partition(out, OPTS).match_entries()
    assert (m.kind, m.bias, m.causal) == ("stacked", False, "TopLeft")
    _same_meaning(mod, out, [_rnd(B, S, 3 * C)])


def test_all_true_mask_is_dropped() -> None:
    out, rewrites = normalize(sdpa_export_module(np.zeros((B, 1, S, S), "float32")), OPTS)
    assert any("attends everywhere" in r.message for r in rewrites)
    assert "relax.nn.attention_bias" not in _ops(out)


def test_a_real_additive_bias_is_kept() -> None:
    alibi = _rnd(B, 1, S, S) * 0.1
    mod = sdpa_export_module(alibi)
    out, rewrites = normalize(mod, OPTS)
    assert "constant_mask" not in _names(rewrites)
    assert "relax.nn.attention_bias" in _ops(out)
    _same_meaning(mod, out, [_rnd(B, S, 3 * C)])


def _masked_module(mask: np.ndarray) -> Any:
    """Attention over q [B, Sq, N, H], k and v [B, S, N, H] in the mask's dtype, with the
    constant additive ``mask`` ([B, 1, Sq, S])."""
    sq, skv = mask.shape[2:]
    dtype = str(mask.dtype)
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((B, sq, N, H), dtype))
        k = R.arg("k", R.Tensor((B, skv, N, H), dtype))
        v = R.arg("v", R.Tensor((B, skv, N, H), dtype))
        with R.dataflow() as frame:
            out = R.emit(R.nn.attention(q, k, v, R.const(mask)))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def _band_module(keep: np.ndarray) -> Any:
    """float16, the additive mask that keeps ``keep`` ([Sq, S]): how transformers exports
    Mistral's window."""
    mask = np.where(keep, 0.0, np.finfo(np.float16).min).astype("float16")
    return _masked_module(np.broadcast_to(mask, (B, 1, *keep.shape)).copy())


def _band(sq: int, skv: int, w: int) -> np.ndarray:
    i, j = np.arange(sq)[:, None], np.arange(skv)[None, :]
    off = skv - sq
    return (j <= i + off) & (j > i + off - w)


@pytest.mark.parametrize(("sq", "w", "causal"), [(S, 3, "TopLeft"), (4, 2, "BottomRight")])
def test_a_constant_band_is_read_as_a_window_where_a_kernel_reads_one(
    sq: int, w: int, causal: str
) -> None:
    """sm_90: the band becomes causal_mask + window_size, no bias (the Hopper kernel reads it);
    sm_80, no window kernel: the constant mask stays."""
    mod = _band_module(_band(sq, S, w))
    out, rewrites = normalize(mod, OPTS, "sm_90")
    (rw,) = [r for r in rewrites if r.rewrite == "constant_mask"]
    assert f"is a sliding window of {w} keys ({causal})" in rw.message
    (m,) = partition(out, OPTS, "sm_90").match_entries()
    assert (m.bias, m.causal) == (False, causal)
    kept, rewrites = normalize(mod, OPTS, "sm_80")
    assert "constant_mask" not in _names(rewrites)
    assert "relax.nn.attention_bias" in _ops(kept)


def test_a_band_with_a_hole_stays_a_mask() -> None:
    keep = _band(S, S, 3)
    keep[5, 4] = False
    out, rewrites = normalize(_band_module(keep), OPTS, "sm_90")
    assert "constant_mask" not in _names(rewrites)
    assert "relax.nn.attention_bias" in _ops(out)


def test_bottom_right_mask_is_recognised() -> None:
    sq, skv = 4, S
    mod = _masked_module(_causal(skv - sq, sq, skv))
    out, rewrites = normalize(mod, OPTS)
    assert any("BottomRight" in r.message for r in rewrites)
    args = [_rnd(B, sq, N, H, seed=1), _rnd(B, skv, N, H, seed=2), _rnd(B, skv, N, H, seed=3)]
    _same_meaning(mod, out, args)


# --- decomposed attention --------------------------------------------------------------------
def decomposed_module(scale_on: str, mask: bool, safe: bool) -> Any:
    """ONNX-export style: q, k^T transposed (k through a batch-merged 3-D transpose), scaled,
    masked, softmax (optionally PyTorch's NaN-safe form), times v, transposed back."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg("qkv", R.Tensor((B, S, 3 * C), "float32"))
        mask_v = R.arg("mask", R.Tensor((B, 1, S, S), "float32")) if mask else None
        with R.dataflow() as frame:
            parts = R.emit(R.split(qkv, 3, axis=2))
            q4, k4, v4 = (R.emit(R.reshape(parts[i], [B, S, N, H])) for i in range(3))
            q = R.emit(R.permute_dims(q4, [0, 2, 1, 3]))
            k = R.emit(R.permute_dims(k4, [0, 2, 1, 3]))
            k3 = R.emit(R.reshape(k, [B * N, S, H]))
            kt3 = R.emit(R.permute_dims(k3, [0, 2, 1]))
            kt = R.emit(R.reshape(kt3, [B, N, H, S]))
            v = R.emit(R.permute_dims(v4, [0, 2, 1, 3]))
            half = R.const(np.float32(H**-0.25))
            if scale_on == "qk":
                q = R.emit(R.multiply(q, half))
                kt = R.emit(R.multiply(kt, half))
            scores = R.emit(R.matmul(q, kt))
            if scale_on == "scores":
                scores = R.emit(R.divide(scores, R.const(np.float32(H**0.5))))
            if mask_v is not None:
                scores = R.emit(R.add(scores, mask_v))
            p = R.emit(R.nn.softmax(scores, axis=-1))
            if safe:
                nan = R.emit(R.isnan(p))
                p = R.emit(R.where(nan, R.const(np.float32(0.0)), p))
            o = R.emit(R.matmul(p, v))
            o4 = R.emit(R.permute_dims(o, [0, 2, 1, 3]))
            res = R.emit(R.reshape(o4, [B, S, C]))
            R.output(res)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize(
    ("scale_on", "mask", "safe"),
    [("qk", True, True), ("scores", False, False), ("scores", True, False)],
)
def test_decomposed_attention_is_recovered(scale_on: str, mask: bool, safe: bool) -> None:
    mod = decomposed_module(scale_on, mask, safe)
    out, rewrites = normalize(mod, OPTS)
    ops = _ops(out)
    assert "relax.nn.softmax" not in ops and "relax.matmul" not in ops
    (rw,) = [r for r in rewrites if r.rewrite == "decomposed_attention"]
    assert f"scale {H**-0.5:.6g}" in rw.message
    assert ("NaN-safe" in rw.message) is safe
    (m,) = partition(out, OPTS).match_entries()
    assert m.kind == "stacked" and m.bias is mask
    assert m.scale == pytest.approx(H**-0.5)
    args = [_rnd(B, S, 3 * C)] + ([_rnd(B, 1, S, S, seed=5)] if mask else [])
    _same_meaning(mod, out, args)


def test_decomposed_attention_with_constant_causal_mask_ends_causal() -> None:
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((B, N, S, H), "float32"))
        k = R.arg("k", R.Tensor((B, N, S, H), "float32"))
        v = R.arg("v", R.Tensor((B, N, S, H), "float32"))
        with R.dataflow() as frame:
            kt = R.emit(R.permute_dims(k, [0, 1, 3, 2]))
            s = R.emit(R.multiply(R.matmul(q, kt), R.const(np.float32(0.25))))
            s = R.emit(R.add(s, R.const(_causal())))
            o = R.emit(R.matmul(R.nn.softmax(s, axis=-1), v))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    out, rewrites = normalize(mod, OPTS)
    assert {"decomposed_attention", "constant_mask"} <= set(_names(rewrites))
    (m,) = partition(out, OPTS).match_entries()
    assert (m.causal, m.bias, m.scale) == ("TopLeft", False, 0.25)
    args = [_rnd(B, N, S, H, seed=i) for i in range(3)]
    _same_meaning(mod, out, args)


def bloom_module(alpha: float, beta: float) -> Any:
    """Bloom's attention as ``torch.export`` writes it: q, k, v picked (``take``) out of the
    per-head interleaved ``[B, S, N, 3, H]`` view, batch-merged 3-D scores ``baddbmm(alibi, q,
    kT, beta, alpha)`` with ALiBi ``[B*N, 1, S]``, viewed 4-D for the causal mask, softmax,
    viewed 3-D again, times v."""
    slopes = np.tile(2.0 ** -np.arange(1, N + 1), B)
    alibi = (slopes[:, None, None] * np.arange(S)[None, None, :]).astype("float32")
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg("qkv", R.Tensor((B, S, 3 * C), "float32"))
        with R.dataflow() as frame:
            x5 = R.emit(R.reshape(qkv, [B, S, N, 3, H]))
            q3, k3, v3 = (
                R.emit(
                    R.reshape(
                        R.permute_dims(R.take(x5, R.const(i, "int64"), axis=3), [0, 2, 1, 3]),
                        [B * N, S, H],
                    )
                )
                for i in range(3)
            )
            kt = R.emit(R.permute_dims(k3, [0, 2, 1]))
            scores = R.emit(R.multiply(R.matmul(q3, kt), R.const(np.float32(alpha))))
            ali = R.emit(R.multiply(R.const(alibi), R.const(np.float32(beta))))
            s4 = R.emit(R.reshape(R.add(ali, scores), [B, N, S, S]))
            p = R.emit(R.nn.softmax(R.add(s4, R.const(_causal())), axis=-1))
            o = R.emit(R.matmul(R.reshape(p, [B * N, S, S]), v3))
            o4 = R.emit(R.permute_dims(R.reshape(o, [B, N, S, H]), [0, 2, 1, 3]))
            res = R.emit(R.reshape(o4, [B, S, C]))
            R.output(res)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def test_alibi_becomes_one_attention_with_a_per_head_bias_and_the_causal_flag() -> None:
    mod = bloom_module(alpha=0.25, beta=0.5)
    out, rewrites = normalize(mod, OPTS)
    assert "relax.nn.softmax" not in _ops(out) and "relax.take" not in _ops(out)
    (rw,) = [r for r in rewrites if r.rewrite == "decomposed_attention"]
    assert "ALiBi" in rw.message and "causal_mask=TopLeft" in rw.message
    (m,) = partition(out, OPTS).match_entries()
    assert m.pattern == "cutlass.stacked_attention.interleaved_5d_bias"
    assert (m.causal, m.scale, m.shapes["bias"]) == ("TopLeft", 0.25, [B, N, 1, S])
    _same_meaning(mod, out, [_rnd(B, S, 3 * C)])


# --- separate q/k/v projections (BERT) ----------------------------------------------------------
def bert_like_module(bias: bool = True) -> Any:
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((B, S, C), "float32"))
        ws = [R.arg(f"w{r}", R.Tensor((C, C), "float32")) for r in "qkv"]
        bs = [R.arg(f"b{r}", R.Tensor((C,), "float32")) for r in "qkv"] if bias else []
        with R.dataflow() as frame:
            heads = []
            for i in range(3):
                x2 = R.emit(R.reshape(x, [B * S, C]))
                wt = R.emit(R.permute_dims(ws[i], [1, 0]))
                y = R.emit(R.matmul(x2, wt))
                if bias:
                    y = R.emit(R.add(bs[i], y))
                heads.append(R.emit(R.reshape(y, [B, S, N, H])))
            out = R.emit(R.nn.attention(*heads))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize("bias", [True, False])
def test_separate_projections_become_one_stacked_projection(bias: bool) -> None:
    mod = bert_like_module(bias)
    out, rewrites = normalize(mod, OPTS)
    assert _ops(out).count("relax.matmul") == 1
    (rw,) = [r for r in rewrites if r.rewrite == "combine_qkv"]
    assert rw.where is not None and rw.where.site == "main/attention#0"
    (m,) = partition(out, OPTS).match_entries()
    assert (m.kind, m.variant) == ("stacked", "split")
    args = [_rnd(B, S, C)] + [_rnd(C, C, seed=i) * 0.2 for i in range(3)]
    args += [_rnd(C, seed=10 + i) for i in range(3)] if bias else []
    _same_meaning(mod, out, args)


def test_combine_is_off_when_stacked_fusion_is_off() -> None:
    out, rewrites = normalize(bert_like_module(), CompileOptions(fuse_stacked=False))
    assert "combine_qkv" not in _names(rewrites)
    assert _ops(out).count("relax.matmul") == 3


# --- partial rotary with no rotary dims -----------------------------------------------------
def test_zero_width_concat_operands_are_dropped() -> None:
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((B, S, C), "float32"))
        with R.dataflow() as frame:
            empty = R.emit(R.strided_slice(x, [2], [0], [0]))
            rot = R.emit(R.negative(empty))
            y = R.emit(R.concat([rot, x], axis=-1))
            R.output(y)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    out, rewrites = normalize(mod, OPTS)
    assert "empty_concat" in _names(rewrites)
    assert "relax.concat" not in _ops(out)


def test_integer_power_becomes_multiplies() -> None:
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((B, S, C), "float32"))
        with R.dataflow() as frame:
            y = R.emit(R.power(x, R.const(np.float32(3.0))))
            R.output(y)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    out, rewrites = normalize(mod, OPTS)
    assert "integer_power" in _names(rewrites)
    assert "relax.power" not in _ops(out)
    _same_meaning(mod, out, [_rnd(B, S, C)])


def test_a_plain_module_is_left_alone() -> None:
    from tests.models import stacked_attention_module

    mod = stacked_attention_module(2, 8, 4, 64)
    out, rewrites = normalize(mod, OPTS)
    assert rewrites == []
    assert tvm_ffi.structural_equal(out, mod)


_ = T


# --- repeated K/V (GQA as transformers' repeat_kv writes it) -------------------------------
NQ, NKV = 4, 2


def repeated_kv_module(form: str, dtype: str = "float16") -> Any:
    """q ``[B, S, NQ, H]``; k and v ``[B, S, NKV, H]`` repeated up to NQ heads by ``form``:
    ``repeat_kv`` (transformers: [B, N, S, H], expand_dims, broadcast_to, reshape), ``repeat``
    (``R.repeat`` on the heads axis) or ``tile`` (heads interleaved: not grouped-query)."""
    r = NQ // NKV
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((B, S, NQ, H), dtype))
        k = R.arg("k", R.Tensor((B, S, NKV, H), dtype))
        v = R.arg("v", R.Tensor((B, S, NKV, H), dtype))
        with R.dataflow() as frame:

            def rep(x: Any) -> Any:
                if form == "repeat":
                    return R.emit(R.repeat(x, r, axis=2))
                t = R.emit(R.permute_dims(x, [0, 2, 1, 3]))  # [B, NKV, S, H]
                if form == "repeat_kv":
                    e = R.emit(R.expand_dims(t, [2]))
                    b = R.emit(R.broadcast_to(e, R.shape([B, NKV, r, S, H])))
                else:
                    e = R.emit(R.expand_dims(t, [1]))
                    b = R.emit(R.broadcast_to(e, R.shape([B, r, NKV, S, H])))
                m = R.emit(R.reshape(b, [B, NQ, S, H]))
                return R.emit(R.permute_dims(m, [0, 2, 1, 3]))

            out = R.emit(R.nn.attention(q, rep(k), rep(v), causal_mask="TopLeft"))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize("form", ["repeat_kv", "repeat"])
def test_repeated_kv_is_read_as_grouped_query_attention(form: str) -> None:
    from worker.build import expand_kv_heads

    mod = repeated_kv_module(form)
    out, rewrites = normalize(mod, OPTS, "sm_90")
    (rw,) = [r for r in rewrites if r.rewrite == "grouped_kv"]
    assert rw.where is not None and rw.where.site == "main/attention#0"
    assert f"from {NKV} to {NQ} heads" in rw.message
    ops = _ops(out)
    assert "relax.broadcast_to" not in ops and "relax.repeat" not in ops, ops
    (m,) = partition(out, OPTS, "sm_90").match_entries()
    assert m.shapes["k"][2] == NKV, m.shapes
    # TVM's path (the validation reference, and sites no kernel takes) repeats them again
    args = [
        a.astype("float16")
        for a in (_rnd(B, S, NQ, H), _rnd(B, S, NKV, H, seed=1), _rnd(B, S, NKV, H, seed=2))
    ]
    np.testing.assert_allclose(
        _run(expand_kv_heads(out), args).astype("float32"),
        _run(mod, args).astype("float32"),
        atol=2e-3,
    )


@pytest.mark.parametrize(
    ("form", "arch", "dtype"),
    [
        ("tile", "sm_90", "float16"),
        ("repeat_kv", "sm_80", "float16"),
        ("repeat_kv", "sm_90", "float32"),
    ],
)
def test_repeated_kv_stays_where_no_kernel_reads_grouped_heads(
    form: str, arch: str, dtype: str
) -> None:
    """Interleaved heads are not GQA; on sm_80, and in float32, the other kernels need the
    repeated heads."""
    out, rewrites = normalize(repeated_kv_module(form, dtype), OPTS, arch)
    assert "grouped_kv" not in _names(rewrites)
    assert "relax.broadcast_to" in _ops(out)


# --- RMSNorm ------------------------------------------------------------------------------
def rms_norm_module(dtype: str, weight_first: bool = True, axis: int = -1) -> Any:
    """transformers' LlamaRMSNorm: ``w * cast(x32 * rsqrt(mean(x32 * x32, -1) + eps))`` with
    ``x32 = cast(x, float32)`` (no casts in float32)."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((B, S, C), dtype))
        w = R.arg("w", R.Tensor((C,), dtype))
        with R.dataflow() as frame:
            x32 = R.emit(R.astype(x, "float32")) if dtype != "float32" else x
            sq = R.emit(R.multiply(x32, x32))
            mean = R.emit(R.mean(sq, axis=[axis], keepdims=True))
            r = R.emit(R.rsqrt(R.add(mean, R.const(1e-6, "float32"))))
            y = R.emit(R.multiply(x32, r))
            if dtype != "float32":
                y = R.emit(R.astype(y, dtype))
            out = R.emit(R.multiply(w, y) if weight_first else R.multiply(y, w))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize(("dtype", "weight_first"), [("float16", True), ("float32", False)])
def test_rms_norm_chain_becomes_one_operator(dtype: str, weight_first: bool) -> None:
    mod = rms_norm_module(dtype, weight_first)
    out, rewrites = normalize(mod, OPTS)
    assert "rms_norm" in _names(rewrites)
    ops = _ops(out)
    assert ops.count("relax.nn.rms_norm") == 1
    assert "relax.mean" not in ops and "relax.rsqrt" not in ops, ops
    # inputs whose squares overflow float16: the operator computes in float32 as the chain did
    args = [(_rnd(B, S, C) * 300).astype(dtype), (1 + 0.1 * _rnd(C, seed=1)).astype(dtype)]
    got, ref = _run(out, args).astype("float32"), _run(mod, args).astype("float32")
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-3 if dtype == "float16" else 1e-5, atol=2e-3)


def test_a_mean_over_another_axis_is_not_rms_norm() -> None:
    out, rewrites = normalize(rms_norm_module("float32", axis=1), OPTS)
    assert "rms_norm" not in _names(rewrites)
    assert "relax.mean" in _ops(out)


# --- q/k/v projections reaching attention through other operators -------------------------
def rotary_gqa_module(cross: bool = False) -> Any:
    """Llama-like: three projections of one x, q and k scaled by a constant table on the way
    (a stand-in for rotary), K/V with NKV heads; ``cross``: K/V project another input."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((B * S, C), "float32"))
        mem = R.arg("mem", R.Tensor((B * S, C), "float32")) if cross else x
        wq = R.arg("wq", R.Tensor((NQ * H, C), "float32"))
        wk = R.arg("wk", R.Tensor((NKV * H, C), "float32"))
        wv = R.arg("wv", R.Tensor((NKV * H, C), "float32"))
        table = R.const(np.linspace(0.5, 1.5, H, dtype="float32"))
        with R.dataflow() as frame:

            def proj(w: Any, heads: int, rotate: bool) -> Any:
                src = x if heads == NQ else mem
                y = R.emit(R.matmul(src, R.emit(R.permute_dims(w, [1, 0]))))
                y = R.emit(R.reshape(y, [B, S, heads, H]))
                return R.emit(R.multiply(y, table)) if rotate else y

            q, k, v = proj(wq, NQ, True), proj(wk, NKV, True), proj(wv, NKV, False)
            out = R.emit(R.nn.attention(q, k, v))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def test_projections_behind_other_operators_become_one_matmul() -> None:
    from worker.build import expand_kv_heads

    mod = rotary_gqa_module()
    out, rewrites = normalize(mod, OPTS)
    (rw,) = [r for r in rewrites if r.rewrite == "combine_projections"]
    assert f"({NQ * H}+{NKV * H}+{NKV * H} columns)" in rw.message
    assert _ops(out).count("relax.matmul") == 1
    assert _ops(out).count("relax.strided_slice") >= 3
    args = [_rnd(B * S, C)] + [_rnd(n * H, C, seed=i) * 0.2 for i, n in enumerate((NQ, NKV, NKV))]
    _same_meaning(expand_kv_heads(mod), expand_kv_heads(out), args)


def test_projections_of_different_inputs_stay_apart() -> None:
    """Cross-attention: q from one input, k and v from another."""
    out, rewrites = normalize(rotary_gqa_module(cross=True), OPTS)
    assert "combine_projections" not in _names(rewrites)
    assert _ops(out).count("relax.matmul") == 3


# --- unit axes (GPTBigCode's multi-query packing) ------------------------------------------
def test_transpose_of_a_reshape_that_splits_axes_is_kept() -> None:
    """``unit_axes`` writes a transpose as a reshape only where a reshape gave a split piece
    extent-1 axes and nothing else (packed_mqa_module's one K/V head). At S = 1 a GPT-2 style
    ``reshape([B, 1, C] -> [B, 1, N, H]) -> permute -> [B, N, 1, H]`` moves only the unit axis
    too, but the reshape splits C into heads: left to transpose_pairs."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg("qkv", R.Tensor((B, 1, 3 * C), "float16"))
        with R.dataflow() as frame:
            parts = R.emit(R.split(qkv, 3, axis=2))
            q = R.emit(R.reshape(parts[0], [B, 1, N, H]))
            out = R.emit(R.permute_dims(q, [0, 2, 1, 3]))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    out, rewrites = normalize(mod, OPTS, "sm_90")
    assert "unit_axes" not in _names(rewrites)
    assert "relax.permute_dims" in _ops(out)
