"""Attention in the forms upstream TVM's CUTLASS tests write it (apache/tvm
tests/python/relax/test_codegen_cutlass.py: the rewrite, fp16 rewrite, multi-query, sliding-window
and var-len modules), rebuilt here with our own builder code.

Each form is normalized, partitioned (sites found, fused stacked or plain) and, on the CPU, the
normalized module built with LLVM is checked against the original (or numpy, where TVM cannot
build the original). Forms TVM cannot build and no rewrite takes fail the job before codegen.
Var-len forms the ragged kernel takes have no CPU build: their numerics here are those of the
validation reference (nothing offloaded: the masked rewrite); ``test_ragged.py`` covers the
ragged sites themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tvm import relax
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import relax as rb

from service.errors import CompileError, TimeLimitExceeded
from service.settings import Settings
from service.spec import CompileOptions, Target
from tests.models import R, T, to_json, tvm
from worker.build import expand_kv_heads
from worker.normalize import normalize, partition_sites
from worker.partition import PartitionResult, partition
from worker.pipeline import REPORT_NAME, compile_module
from worker.selection import select_kernel
from worker.validate import reference_options

OPTS = CompileOptions()
#: what the validation reference is normalized with: nothing offloaded
REFERENCE = reference_options(OPTS)


def _run(mod: Any, args: list[np.ndarray]) -> np.ndarray:
    # TVM's own attention indexes K/V by the query head under GQA: build repeats them first
    exe = tvm.compile(expand_kv_heads(mod), target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    return out.astype("float32")


def _rnd(shape: Any, dtype: str = "float32", seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _ops(mod: Any) -> list[str]:
    ops: list[str] = []

    def visit(e: Any) -> None:
        if isinstance(e, relax.Call) and hasattr(e.op, "name"):
            ops.append(e.op.name)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return ops


def _rewrite(rewrites: list[Any], name: str) -> Any:
    (rw,) = [r for r in rewrites if r.rewrite == name]
    return rw


def _fused(result: PartitionResult, kind: str, bias: bool) -> Any:
    assert len(result.sites) == 1 and not result.unbuildable, result.failures
    (m,) = result.match_entries()
    assert (m.kind, m.bias) == (kind, bias), m
    return m


def _reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: str = "none",
    window: int | None = None,
    scale: float | None = None,
) -> np.ndarray:
    """softmax(scale q k^T, masked) v in float32 on ``[B, S, N, H]``; GQA heads in blocks. Key
    j is seen from query i when ``i + off - window < j <= i + off`` (off 0 for TopLeft,
    S_kv - S for BottomRight): flash-attention's left window, as upstream offloads it."""
    q, k, v = (x.astype("float32") for x in (q, k, v))
    r = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
    s, skv = q.shape[1], k.shape[1]
    scores = np.einsum("bsnh,btnh->bnst", q, k) * (scale or q.shape[3] ** -0.5)
    i, j = np.arange(s)[:, None], np.arange(skv)[None, :]
    off = skv - s if causal == "BottomRight" else 0
    seen = np.ones((s, skv), bool) if causal == "none" else j <= i + off
    if window is not None:
        seen &= j > i + off - window
    scores = np.where(seen, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bnst,btnh->bsnh", p / p.sum(-1, keepdims=True), v)


# --- test_attention_rewrite_offload: batch-merged 3-D matmuls ----------------------------------
def merged_module(
    b: int,
    s: int,
    skv: int,
    n: int | None,
    h: int,
    hv: int,
    bias: bool,
    scale: float,
    scale_last: bool = False,
) -> Any:
    """Upstream's rewrite form: q, k, v ``[B, S, N, H]`` (or ``[B, S, H]`` when ``n`` is None)
    merged to ``[B*N, S, H]`` by permute + reshape, ``q @ k^T * scale [+ bias]``, softmax,
    ``@ v``, split back to ``[B, S, N, Hv]``. ``scale_last``: ``(q @ k^T + bias) * scale``."""

    def shape(seq: int, d: int) -> list[int]:
        return [b, seq, n, d] if n else [b, seq, d]

    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor(shape(s, h), "float32"))
        k = R.arg("k", R.Tensor(shape(skv, h), "float32"))
        v = R.arg("v", R.Tensor(shape(skv, hv), "float32"))
        bias_shape = [b, n, s, skv] if n else [b, s, skv]
        bias_v = R.arg("bias", R.Tensor(bias_shape, "float32")) if bias else None
        with R.dataflow() as frame:

            def merge(x: Any, seq: int, d: int) -> Any:
                if not n:
                    return x
                x = R.emit(R.permute_dims(x, [0, 2, 1, 3]))
                return R.emit(R.reshape(x, [b * n, seq, d]))

            q3, k3, v3 = merge(q, s, h), merge(k, skv, h), merge(v, skv, hv)
            kt = R.emit(R.permute_dims(k3, [0, 2, 1]))
            scores = R.emit(R.matmul(q3, kt))
            if not scale_last:
                scores = R.emit(R.multiply(scores, R.const(scale, "float32")))
            if bias_v is not None:
                if n:
                    bias_v = R.emit(R.reshape(bias_v, [b * n, s, skv]))
                scores = R.emit(R.add(scores, bias_v))
            if scale_last:
                scores = R.emit(R.multiply(scores, R.const(scale, "float32")))
            out = R.emit(R.matmul(R.emit(R.nn.softmax(scores, axis=-1)), v3))
            if n:
                out = R.emit(R.reshape(out, [b, n, s, hv]))
                out = R.emit(R.permute_dims(out, [0, 2, 1, 3]))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [32, None])
def test_attention_rewrite_offload(n: int | None, bias: bool) -> None:
    """Upstream's four parametrizations (B4, S16/8, N32 or no heads axis, H8/16, scale 0.5);
    the numerics at 4 heads (LLVM's build time grows with the unrolled head count)."""
    b, s, skv, h, hv = 4, 16, 8, 8, 16
    out, rewrites = normalize(merged_module(b, s, skv, n, h, hv, bias, 0.5), OPTS)
    rw = _rewrite(rewrites, "decomposed_attention")
    assert rw.where is not None and rw.where.site == "main/attention#0"
    assert ("batch 4, 32 heads" if n else "one head per entry") in rw.message
    assert "relax.softmax" not in _ops(out) and "relax.matmul" not in _ops(out)
    m = _fused(partition(out, OPTS), "plain", bias)
    assert m.scale == 0.5
    # the heads are read where they lie: q is the parameter itself, not a copy
    assert m.shapes["q"] == ([b, s, n, h] if n else [b, s, 1, h])
    n = 4 if n else None
    mod = merged_module(b, s, skv, n, h, hv, bias, 0.5)
    out, _ = normalize(mod, OPTS)
    args = [_rnd([b, s, n, h] if n else [b, s, h], seed=1)]
    args += [_rnd([b, skv, n, d] if n else [b, skv, d], seed=i + 2) for i, d in enumerate((h, hv))]
    if bias:
        args.append(_rnd([b, n, s, skv] if n else [b, s, skv], seed=5))
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-4, atol=1e-5)


def test_a_scale_outside_the_bias_scales_the_bias() -> None:
    b, s, skv, n, h = 2, 16, 8, 4, 8
    mod = merged_module(b, s, skv, n, h, h, True, 0.5, scale_last=True)
    out, rewrites = normalize(mod, OPTS)
    assert "scale 0.5 -> mask" in _rewrite(rewrites, "decomposed_attention").message
    assert _fused(partition(out, OPTS), "plain", True).scale == 0.5
    args = [_rnd(x, seed=i) for i, x in enumerate([(b, s, n, h), *[(b, skv, n, h)] * 2])]
    args.append(_rnd((b, n, s, skv), seed=5))
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-4, atol=1e-5)


# --- test_attention_rewrite_fp16 ----------------------------------------------------------------
def fp16_module(n: int) -> Any:
    """Upstream's fp16 rewrite module (B4, S16/8, H8/16, a [B, N, S, S_kv] bias): the scale a
    float32 constant cast to float16, casts around the softmax, the result cast to float32."""
    b, s, skv, h, hv = 4, 16, 8, 8, 16
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((b, s, n, h), "float16"))
        k = R.arg("k", R.Tensor((b, skv, n, h), "float16"))
        v = R.arg("v", R.Tensor((b, skv, n, hv), "float16"))
        bias = R.arg("bias", R.Tensor((b, n, s, skv), "float16"))
        with R.dataflow() as frame:

            def merge(x: Any, seq: int, d: int) -> Any:
                return R.emit(R.reshape(R.emit(R.permute_dims(x, [0, 2, 1, 3])), [b * n, seq, d]))

            q3, k3, v3 = merge(q, s, h), merge(k, skv, h), merge(v, skv, hv)
            kt = R.emit(R.permute_dims(k3, [0, 2, 1]))
            scores = R.emit(R.matmul(q3, kt, out_dtype="float16"))
            half = R.emit(R.astype(R.const(0.5, "float32"), "float16"))
            scores = R.emit(R.multiply(scores, half))
            scores = R.emit(R.add(scores, R.emit(R.reshape(bias, [b * n, s, skv]))))
            probs = R.emit(R.nn.softmax(R.emit(R.astype(scores, "float16")), axis=2))
            o3 = R.emit(R.matmul(R.emit(R.astype(probs, "float16")), v3, out_dtype="float16"))
            o = R.emit(R.permute_dims(R.emit(R.reshape(o3, [b, n, s, hv])), [0, 2, 1, 3]))
            res = R.emit(R.astype(o, "float32"))
            R.output(res)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def test_attention_rewrite_fp16() -> None:
    out, rewrites = normalize(fp16_module(32), OPTS, "sm_90")
    assert "scale 0.5 -> mask" in _rewrite(rewrites, "decomposed_attention").message
    m = _fused(partition(out, OPTS, "sm_90"), "plain", True)
    assert (m.scale, m.dtype, m.shapes["bias"]) == (0.5, "float16", [4, 32, 16, 8])
    mod = fp16_module(4)
    out, _ = normalize(mod, OPTS, "sm_90")
    args = [
        _rnd(s, "float16", seed=i)
        for i, s in enumerate([(4, 16, 4, 8), (4, 8, 4, 8), (4, 8, 4, 16), (4, 4, 16, 8)])
    ]
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-2, atol=1e-2)


# --- test_attention_rewrite_multi_query: K/V repeated to every head -----------------------------
def multi_query_module(form: str, n: int = 32) -> Any:
    """Upstream's multi-query module: one K/V head repeated to all ``n`` (``R.repeat``, or
    ``broadcast_to``), the softmax in float32 between casts, batch-merged 3-D matmuls."""
    b, s, h = 4, 16, 16
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((b, s, n, h), "float16"))
        k1 = R.arg("k_single", R.Tensor((b, s, 1, h), "float16"))
        v1 = R.arg("v_single", R.Tensor((b, s, 1, h), "float16"))
        with R.dataflow() as frame:

            def rep(x: Any) -> Any:
                if form == "repeat":
                    return R.emit(R.repeat(x, n, axis=2))
                return R.emit(R.broadcast_to(x, R.shape([b, s, n, h])))

            def merge(x: Any) -> Any:
                x = R.emit(R.permute_dims(x, [0, 2, 1, 3]))
                return R.emit(R.reshape(x, [b * n, s, h]))

            q3, k3, v3 = merge(q), merge(rep(k1)), merge(rep(v1))
            kt = R.emit(R.permute_dims(k3, [0, 2, 1]))
            scores = R.emit(R.matmul(q3, kt, out_dtype="float16"))
            scores = R.emit(R.multiply(scores, R.astype(R.const(0.25, "float32"), "float16")))
            probs = R.emit(R.nn.softmax(R.emit(R.astype(scores, "float32")), axis=2))
            o3 = R.emit(R.matmul(R.emit(R.astype(probs, "float16")), v3, out_dtype="float16"))
            o = R.emit(R.permute_dims(R.emit(R.reshape(o3, [b, n, s, h])), [0, 2, 1, 3]))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize(
    ("form", "arch"), [("repeat", "sm_90"), ("broadcast_to", "sm_90"), ("repeat", "sm_80")]
)
def test_attention_rewrite_multi_query(form: str, arch: str) -> None:
    """On sm_90 the one K/V head is read as MQA (the Hopper kernel); elsewhere the repeated
    heads stay and the site fuses as multi-head attention."""
    out, rewrites = normalize(multi_query_module(form), OPTS, arch)
    assert "scale 0.25" in _rewrite(rewrites, "decomposed_attention").message
    gqa = arch == "sm_90"
    assert any(r.rewrite == "grouped_kv" for r in rewrites) is gqa
    m = _fused(partition(out, OPTS, arch), "plain", False)
    assert m.shapes["k"] == [4, 16, 1 if gqa else 32, 16]
    mod = multi_query_module(form, 4)
    out, _ = normalize(mod, OPTS, arch)
    args = [
        _rnd(s, "float16", seed=i) for i, s in enumerate([(4, 16, 4, 16), *[(4, 16, 1, 16)] * 2])
    ]
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-2, atol=1e-2)


def test_repeat_kv_in_the_merged_form_is_grouped_query() -> None:
    """transformers' ``repeat_kv`` (``[B, Nkv, S, H]`` -> expand_dims -> broadcast_to ->
    reshape) ahead of batch-merged matmuls: GQA 8/2 on sm_90."""
    b, s, n, nkv, h = 2, 16, 8, 2, 16
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((b, n, s, h), "float16"))
        k = R.arg("k", R.Tensor((b, nkv, s, h), "float16"))
        v = R.arg("v", R.Tensor((b, nkv, s, h), "float16"))
        with R.dataflow() as frame:

            def repeat_kv(x: Any) -> Any:
                e = R.emit(R.expand_dims(x, [2]))
                r = R.emit(R.broadcast_to(e, R.shape([b, nkv, n // nkv, s, h])))
                return R.emit(R.reshape(r, [b, n, s, h]))

            q3, k3, v3 = (
                R.emit(R.reshape(x, [b * n, s, h])) for x in (q, repeat_kv(k), repeat_kv(v))
            )
            scores = R.emit(R.matmul(q3, R.emit(R.permute_dims(k3, [0, 2, 1]))))
            scores = R.emit(R.multiply(scores, R.const(np.float16(0.25))))
            o = R.emit(R.matmul(R.emit(R.nn.softmax(scores, axis=-1)), v3))
            o = R.emit(R.reshape(o, [b, n, s, h]))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    out, rewrites = normalize(mod, OPTS, "sm_90")
    assert f"batch {b}, {n} heads" in _rewrite(rewrites, "decomposed_attention").message
    assert f"from {nkv} to {n} heads" in _rewrite(rewrites, "grouped_kv").message
    m = _fused(partition(out, OPTS, "sm_90"), "plain", False)
    assert m.shapes["k"] == [b, s, nkv, h]
    args = [_rnd(x, "float16", seed=i) for i, x in enumerate([(b, n, s, h), *[(b, nkv, s, h)] * 2])]
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-2, atol=1e-2)


def test_one_kv_head_broadcast_by_the_matmuls_is_multi_query() -> None:
    """4-D decomposed attention whose K/V have one head, broadcast by the matmuls."""
    b, s, n, h = 2, 16, 4, 16
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((b, n, s, h), "float16"))
        k = R.arg("k", R.Tensor((b, 1, s, h), "float16"))
        v = R.arg("v", R.Tensor((b, 1, s, h), "float16"))
        with R.dataflow() as frame:
            scores = R.emit(R.matmul(q, R.emit(R.permute_dims(k, [0, 1, 3, 2]))))
            scores = R.emit(R.divide(scores, R.const(np.float16(4.0))))
            o = R.emit(R.matmul(R.emit(R.nn.softmax(scores, axis=-1)), v))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    for arch, heads in (("sm_80", n), ("sm_90", 1)):
        out, rewrites = normalize(mod, OPTS, arch)
        assert "scale 0.25" in _rewrite(rewrites, "decomposed_attention").message
        m = _fused(partition(out, OPTS, arch), "plain", False)
        assert m.shapes["k"] == [b, s, heads, h]
    args = [_rnd(x, "float16", seed=i) for i, x in enumerate([(b, n, s, h), *[(b, 1, s, h)] * 2])]
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-2, atol=1e-2)


# --- merged form from a stacked qkv, the scale folded before the merge -----------------------
def test_merged_form_from_stacked_qkv_fuses_stacked() -> None:
    b, s, n, h = 2, 16, 4, 16
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg("qkv", R.Tensor((b, s, 3 * n * h), "float32"))
        with R.dataflow() as frame:
            parts = R.emit(R.split(qkv, 3, axis=2))
            q, k, v = (R.emit(R.reshape(parts[i], [b, s, n, h])) for i in range(3))
            q = R.emit(R.multiply(q, R.const(np.float32(h**-0.5))))  # scale on q, still 4-D

            def merge(x: Any) -> Any:
                x = R.emit(R.permute_dims(x, [0, 2, 1, 3]))
                return R.emit(R.reshape(x, [b * n, s, h]))

            kt = R.emit(R.permute_dims(merge(k), [0, 2, 1]))
            probs = R.emit(R.nn.softmax(R.emit(R.matmul(merge(q), kt)), axis=-1))
            o = R.emit(R.reshape(R.emit(R.matmul(probs, merge(v))), [b, n, s, h]))
            o = R.emit(R.reshape(R.emit(R.permute_dims(o, [0, 2, 1, 3])), [b, s, n * h]))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    out, rewrites = normalize(mod, OPTS)
    assert "batch 2, 4 heads" in _rewrite(rewrites, "decomposed_attention").message
    m = _fused(partition(out, OPTS), "stacked", False)
    assert m.scale == pytest.approx(h**-0.5)
    args = [_rnd((b, s, 3 * n * h))]
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-4, atol=1e-5)


# --- test_sliding_window: window_size -> the Hopper kernel's window, or an explicit mask -------
def window_module(
    s: int | None,
    skv: int | None,
    causal: str | None,
    window: int,
    n: int = 16,
    h: int = 8,
    nkv: int | None = None,
) -> Any:
    """``R.nn.attention(q, k, v, causal_mask=causal, window_size=window)``; a length of None is
    symbolic (one name for queries and keys); ``nkv`` K/V heads (GQA) when given."""
    nkv = nkv or n
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        sym = T.int64()
        sq, sk = s if s is not None else sym, skv if skv is not None else sym
        q = R.arg("q", R.Tensor((1, sq, n, h), "float16"))
        k = R.arg("k", R.Tensor((1, sk, nkv, h), "float16"))
        v = R.arg("v", R.Tensor((1, sk, nkv, h), "float16"))
        with R.dataflow() as frame:
            o = R.emit(R.nn.attention(q, k, v, causal_mask=causal, window_size=window))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize(
    ("s", "skv", "causal", "symbolic"),
    [(64, 64, "BottomRight", False), (64, 64, "TopLeft", True), (16, 40, "BottomRight", False)],
)
def test_sliding_window_becomes_a_mask_tvm_builds(
    s: int, skv: int, causal: str, symbolic: bool
) -> None:
    """Upstream's test_sliding_window (1 x 64 x 16 x 8, window 8, BottomRight) and two more:
    TopLeft with a symbolic length, and fewer queries than keys. Before sm_90 no kernel reads a
    window: normalize writes it as a mask."""
    sq, sk = (None, None) if symbolic else (s, skv)
    out, rewrites = normalize(window_module(sq, sk, causal, 8), OPTS, "sm_80")
    rw = _rewrite(rewrites, "sliding_window")
    assert f"window_size=8 ({causal})" in rw.message
    assert "no kernel reads one on sm_80" in rw.message
    assert rw.where is not None and rw.where.site == "main/attention#0"
    result = partition(out, OPTS, "sm_80")
    m = _fused(result, "plain", True)
    assert m.causal == causal
    assert not any(f.check == "sliding_window" for f in result.failures)
    assert not result.rewrites
    out, _ = normalize(window_module(sq, sk, causal, 8, n=4), OPTS, "sm_80")
    q, k, v = (_rnd((1, n, 4, 8), "float16", seed=i) for i, n in enumerate((s, skv, skv)))
    np.testing.assert_allclose(
        _run(out, [q, k, v]), _reference(q, k, v, causal, 8), rtol=1e-2, atol=1e-2
    )


def test_a_grouped_query_window_runs_on_the_kernel_that_reads_masks() -> None:
    """Mistral-style: 8 query heads on 2 K/V heads with a window, before sm_90. The SM80-class
    kernel reads a mask but not GQA: K/V are repeated for it."""
    out, rewrites = normalize(window_module(32, 32, "BottomRight", 8, n=8, nkv=2), OPTS, "sm_80")
    assert "grouped_kv" not in [r.rewrite for r in rewrites]
    m = _fused(partition(out, OPTS, "sm_80"), "plain", True)
    assert m.shapes["k"][2] == 8
    q, k, v = (_rnd((1, 32, n, 8), "float16", seed=i) for i, n in enumerate((8, 2, 2)))
    np.testing.assert_allclose(
        _run(out, [q, k, v]), _reference(q, k, v, "BottomRight", 8), rtol=1e-2, atol=1e-2
    )


def test_the_gpu_cases_window_reference_agrees_with_the_masked_form() -> None:
    """``benchmarks/gpu_cases.py``'s window check, on its bf16 GQA bottom-right case: the module
    as a user sends it, written as a mask by normalize (before sm_90 no kernel reads a window)
    and built with LLVM, against the GPU check's PyTorch reference on the same inputs. Both
    readings of W must agree, or the H200 numerics would check the wrong band. (bf16: LLVM's
    fp16 code for the same module takes ~10x longer on the CPU.)"""
    torch = pytest.importorskip("torch")
    from benchmarks.gpu_cases import CASES, TOLERANCE, _inputs, module_for, reference

    name = "window_bf16_gqa_q16_kv4_s700_w100_h64_bottomright"
    (case,) = [c for c in CASES if c.name == name]
    out, rewrites = normalize(module_for(case), reference_options(OPTS), "sm_80")
    assert "sliding_window" in [r.rewrite for r in rewrites]
    vm = relax.VirtualMachine(tvm.compile(expand_kv_heads(out), target="llvm"), tvm.cpu())
    inputs = _inputs(case, torch, "cpu")
    got = torch.from_dlpack(vm["main"](*[tvm.runtime.from_dlpack(t) for t in inputs])).float()
    (want,) = reference(case, inputs)
    assert got.shape == want.shape == (case.b, case.s, case.n, case.h)
    rel = float((got - want.float()).norm() / want.float().norm())
    assert rel <= TOLERANCE[case.module.get("dtype", "float16")], rel


def test_a_window_without_a_causal_mask_fails_up_front() -> None:
    out, rewrites = normalize(window_module(32, 32, None, 8), OPTS, "sm_90")
    assert "sliding_window" not in [r.rewrite for r in rewrites]
    result = partition(out, OPTS, "sm_90")
    (f,) = result.unbuildable
    assert (f.check, f.where.site) == ("sliding_window", "main/attention#0")
    assert "needs a causal mask" in f.message and f in result.failures


@pytest.mark.parametrize(
    ("s", "skv", "causal", "nkv"),
    [(64, 64, "BottomRight", None), (None, None, "TopLeft", None), (16, 40, "BottomRight", 4)],
)
def test_a_window_on_sm90_runs_on_the_hopper_kernel_with_no_mask(
    s: int | None, skv: int | None, causal: str, nkv: int | None
) -> None:
    """sm_90: normalize leaves the window; partition gives it to the Hopper kernel's window
    variant, which skips the key tiles outside it: no mask tensor, GQA read as it is."""
    out, rewrites = normalize(window_module(s, skv, causal, 8, nkv=nkv), OPTS, "sm_90")
    assert "sliding_window" not in [r.rewrite for r in rewrites]
    result = partition(out, OPTS, "sm_90")
    m = _fused(result, "plain", False)
    assert m.causal == causal and not result.rewrites and not result.failures
    spec = result.fused[0].analysis.spec
    assert spec is not None and spec.window == 8 and spec.num_kv_heads == (nkv or 16)
    ks, reason = select_kernel(spec, "sm_90")
    assert ks.family == "cutlass_fmha_hopper" and ks.config["variant"] == "pingpongk_128x128"
    assert "sliding window of 8 keys" in reason and "/*window=*/8" in ks.source


@pytest.mark.parametrize(
    ("h", "options", "words"),
    [
        (256, OPTS, "tile head dim 256"),
        (8, CompileOptions(kernel="sm80"), "options.kernel is sm80"),
    ],
)
def test_a_window_the_hopper_kernel_does_not_take_is_a_mask_with_the_reason(
    h: int, options: CompileOptions, words: str
) -> None:
    """sm_90, but a site the Hopper kernel refuses (no window variant at head dim 256), or the
    SM80-class kernel asked for: the window becomes the mask the SM80-class kernel reads (in
    partition, by normalize's rewrite, where partition finds the refusal; else in normalize),
    the reason in the rewrite; nothing is left that TVM cannot build."""
    out, rewrites = normalize(window_module(64, 64, "TopLeft", 8, n=4, h=h), options, "sm_90")
    result = partition_sites(out, options, "sm_90")
    m = _fused(result, "plain", True)
    assert m.causal == "TopLeft" and not result.unbuildable
    (rw,) = [r for r in [*rewrites, *result.rewrites] if r.rewrite == "sliding_window"]
    assert words in rw.message and "window_size=8 (TopLeft)" in rw.message
    assert rw.where is not None and rw.where.site == "main/attention#0"
    spec = result.fused[0].analysis.spec
    assert spec is not None and spec.window is None and spec.bias is not None
    assert select_kernel(spec, "sm_90", options.kernel)[1].startswith("SM80-class")


def test_without_normalize_a_window_runs_only_where_a_kernel_reads_it() -> None:
    """options.normalize off: the window reaches partition as it is. sm_90: the Hopper kernel
    takes it; before sm_90 the job fails up front with the reason (TVM cannot build it)."""
    options = CompileOptions(normalize=False)
    mod = window_module(64, 64, "BottomRight", 8)
    taken = partition(mod, options, "sm_90")
    spec = _fused(taken, "plain", False)
    assert taken.fused[0].analysis.spec.window == 8  # type: ignore[union-attr]
    assert spec.causal == "BottomRight"
    refused = partition(mod, options, "sm_80")
    assert not refused.fused and not refused.rewrites
    assert any("needs the Hopper kernel" in f.message for f in refused.failures)
    (f,) = refused.unbuildable
    assert "options.normalize is off" in f.message


# --- test_batched_var_len_*: ragged batches ------------------------------------------------------
def var_len_module(nq: int, nkv: int, h: int, window: int | None) -> Any:
    """Upstream's var-len modules, ``seqstart`` given as an input (upstream computes it with
    thrust through ``call_dps_packed``, which a service refuses): packed ``[T, N*H]`` tokens,
    reshaped to ``[1, T, N, H]``, ``attention_var_len`` BottomRight."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        t, ns = T.int64(), T.int64()
        q = R.arg("queries", R.Tensor((t, nq * h), "float16"))
        k = R.arg("keys", R.Tensor((t, nkv * h), "float16"))
        v = R.arg("values", R.Tensor((t, nkv * h), "float16"))
        start = R.arg("seqstart", R.Tensor((ns,), "int32"))
        longest = R.arg("max_seqlen", R.Tensor((), "int32"))
        with R.dataflow() as frame:
            q4 = R.emit(R.reshape(q, R.shape([1, t, nq, h])))
            k4 = R.emit(R.reshape(k, R.shape([1, t, nkv, h])))
            v4 = R.emit(R.reshape(v, R.shape([1, t, nkv, h])))
            o = R.emit(
                R.nn.attention_var_len(
                    q4, k4, v4, start, longest, causal_mask="BottomRight", window_size=window
                )
            )
            o = R.emit(R.reshape(o, R.shape([t, nq * h])))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize(
    ("lens", "nq", "nkv", "window"),
    [([5, 3, 8], 8, 8, None), ([5, 3, 8], 8, 1, None), ([64, 64, 64], 4, 4, 8)],
    ids=["var_len", "var_len_multi_query", "var_len_sliding_window"],
)
def test_upstream_var_len_forms(lens: list[int], nq: int, nkv: int, window: int | None) -> None:
    """Upstream's three var-len tests (lengths 5/3/8 and 64 x 3, BottomRight, GQA, window 8),
    at 8 heads in place of 128 (LLVM's build time grows with the unrolled head count): the
    ragged kernel takes the first two (the multi-query one with K/V repeated: that kernel reads
    equal head counts only), a window becomes one masked attention. The numerics are the
    masked form's, which the validation reference runs."""
    h = 32
    mod = var_len_module(nq, nkv, h, window)
    out, rewrites = normalize(mod, OPTS, "sm_90")
    if window is None:
        assert "var_len" not in [r.rewrite for r in rewrites]
        assert ("ragged_operands" in [r.rewrite for r in rewrites]) == (nkv != nq)
        m = _fused(partition(out, OPTS, "sm_90"), "plain", False)
        assert m.pattern == "cutlass.attention_var_len" and m.layout.ragged is not None
    else:
        rw = _rewrite(rewrites, "var_len")
        assert "block-diagonal mask" in rw.message and "sliding-window" in rw.message
        assert rw.where is not None and rw.where.site == "main/attention#0"
        assert "relax.nn.attention_var_len" not in _ops(out)
        # the Hopper kernel takes no mask: the SM80-class kernel runs it
        m = _fused(partition(out, OPTS, "sm_90"), "plain", True)
    assert m.shapes["k"][2] == nq
    out, rewrites = normalize(mod, REFERENCE, "sm_90")
    assert "options.offload_plain is off" in _rewrite(rewrites, "var_len").message
    seqs = [
        [_rnd((1, s, n, h), "float16", seed=10 * i + j) for j, n in enumerate((nq, nkv, nkv))]
        for i, s in enumerate(lens)
    ]
    packed = [np.vstack([seq[j].reshape(seq[j].shape[1], -1) for seq in seqs]) for j in range(3)]
    start = np.concatenate([[0], np.cumsum(lens)]).astype("int32")
    got = _run(out, [*packed, start, np.array(max(lens), "int32")])
    want = np.vstack(
        [
            _reference(seq[0], seq[1], seq[2], "BottomRight", window).reshape(len(seq[0][0]), -1)
            for seq in seqs
        ]
    )
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


# --- ragged batches as serving platforms send them: seqstart computed by R.cumsum ---------------
RAGGED_N, RAGGED_H = 4, 16


def ragged_module(window: int | None) -> Any:
    """Packed stacked QKV ``[1, T, 3NH]`` of every sequence's tokens and the sequences'
    ``lengths`` (int32 ``[B]``, both dims symbolic); ``seqstart = concat([0], cumsum(lengths))``,
    ``max_seqlen = max(lengths)``, then ``attention_var_len`` BottomRight."""
    n, h = RAGGED_N, RAGGED_H
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        t, b = tvm.tirx.Var("tokens", "int64"), tvm.tirx.Var("batch", "int64")
        qkv = R.arg("qkv", R.Tensor((1, t, 3 * n * h), "float16"))
        lengths = R.arg("lengths", R.Tensor((b,), "int32"))
        with R.dataflow() as frame:
            ends = R.emit(R.cumsum(lengths, axis=0))
            start = R.emit(R.concat((R.zeros(R.shape([1]), "int32"), ends), axis=0))
            longest = R.emit(R.max(lengths))
            parts = R.emit(R.split(qkv, 3, axis=2))
            q, k, v = (R.emit(R.reshape(parts[i], R.shape([1, t, n, h]))) for i in range(3))
            o = R.emit(
                R.nn.attention_var_len(
                    q, k, v, start, longest, causal_mask="BottomRight", window_size=window
                )
            )
            o = R.emit(R.reshape(o, R.shape([1, t, n * h])))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


#: the same module as a client writes it in TVMScript (window None)
RAGGED_SCRIPT = """
@I.ir_module
class Module:
    @R.function
    def main(
        qkv: R.Tensor((1, "tokens", 192), "float16"), lengths: R.Tensor(("batch",), "int32")
    ) -> R.Tensor((1, "tokens", 64), "float16"):
        tokens = T.int64()
        with R.dataflow():
            ends = R.cumsum(lengths, axis=0)
            seqstart = R.concat((R.zeros(R.shape([1]), "int32"), ends), axis=0)
            longest = R.max(lengths)
            parts = R.split(qkv, 3, axis=2)
            q = R.reshape(parts[0], R.shape([1, tokens, 4, 16]))
            k = R.reshape(parts[1], R.shape([1, tokens, 4, 16]))
            v = R.reshape(parts[2], R.shape([1, tokens, 4, 16]))
            o = R.nn.attention_var_len(q, k, v, seqstart, longest, causal_mask="BottomRight")
            out = R.reshape(o, R.shape([1, tokens, 64]))
            R.output(out)
        return out
"""


@pytest.mark.parametrize(
    ("lens", "window"), [([5, 3, 8], None), ([6, 10, 16], 4)], ids=["causal", "window"]
)
def test_a_ragged_batch_with_seqstart_from_cumsum(lens: list[int], window: int | None) -> None:
    """Ingest (the service's checks) -> normalize -> partition on sm_90 and sm_80: the
    ragged kernel reads the packed stacked tensor and the computed seqstart; with a window, one
    masked attention (``var_len``). Then the masked form (the validation reference's) -> LLVM
    build, against softmax attention of each sequence over its own tokens."""
    from worker import selection
    from worker.ingest import load_module

    n, h = RAGGED_N, RAGGED_H
    mod = load_module(to_json(ragged_module(window)), "tvm-json", Settings())
    out, rewrites = normalize(mod, OPTS, "sm_90")
    assert "relax.cumsum" in _ops(out)  # TVM runs the scan
    if window is None:
        assert "var_len" not in [r.rewrite for r in rewrites]
        pattern, bias, causal = "cutlass.stacked_attention_var_len.split", False, "BottomRight"
        reasons = {"sm_90": "a ragged batch (seqstart)", "sm_80": "is not sm_90"}
    else:
        rw = _rewrite(rewrites, "var_len")
        assert rw.where is not None and rw.where.site == "main/attention#0"
        assert "block-diagonal mask computed from seqstart" in rw.message
        assert f"window_size={window}" in rw.message
        assert "relax.nn.attention_var_len" not in _ops(out)
        pattern, bias, causal = "cutlass.stacked_attention.split_bias", True, "TopLeft"
        reasons = {"sm_90": "an additive bias is present", "sm_80": "is not sm_90"}
    # one stacked site; the Hopper kernel takes neither a mask nor a ragged batch
    for arch, why in reasons.items():
        result = partition(out, OPTS, arch)
        m = _fused(result, "stacked", bias)
        assert (m.pattern, m.causal) == (pattern, causal)
        (ff,) = result.functions
        ks, reason = selection.select_kernel(ff.analysis.spec, arch, OPTS.kernel)  # type: ignore[arg-type]
        assert ks.family == "cutlass_fmha_sm80" and why in reason, reason
    out, _ = normalize(mod, REFERENCE, "sm_90")
    seqs = [_rnd((1, s, 3 * n * h), "float16", seed=i) for i, s in enumerate(lens)]
    got = _run(out, [np.concatenate(seqs, axis=1), np.array(lens, "int32")])
    want = []
    for seq in seqs:
        q, k, v = (seq[..., j * n * h : (j + 1) * n * h].reshape(1, -1, n, h) for j in range(3))
        want.append(_reference(q, k, v, "BottomRight", window).reshape(1, -1, n * h))
    np.testing.assert_allclose(got, np.concatenate(want, axis=1), rtol=1e-2, atol=1e-2)


# --- through the pipeline: refused before codegen, or rewritten and fused ------------------------
def _compile(mod: Any, tmp_path: Path, **opts: Any) -> Any:
    # a fresh kernel cache and no time for nvcc: a job that reaches codegen stops there
    settings = Settings(data_dir=tmp_path / "d", kernel_cache_dir=tmp_path / "k", nvcc_timeout_s=0)
    return compile_module(
        to_json(mod),
        target=Target(arch="sm_90"),
        options=CompileOptions(validate_on_gpu="never", **opts),
        out_dir=tmp_path / "out",
        settings=settings,
    )


def _report(tmp_path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    return doc


@pytest.mark.parametrize("what", ["sliding_window", "var_len"])
def test_unbuildable_attention_fails_the_job_before_codegen(what: str, tmp_path: Path) -> None:
    """A window (at head dim 256: no Hopper variant takes a window there), or var-len attention
    with a window (no kernel takes one), with normalize off."""
    if what == "sliding_window":
        mod = window_module(64, 64, "BottomRight", 8, n=4, h=256)
    else:
        mod = var_len_module(8, 8, 16, 8)
    with pytest.raises(CompileError) as err:
        _compile(mod, tmp_path, normalize=False)
    assert "TVM cannot build it" in err.value.message
    assert "options.normalize is off" in err.value.message
    doc = _report(tmp_path)
    assert doc["error"]["type"] == "compile-failed"
    assert "codegen" not in doc["timings"] and "build" not in doc["timings"]
    (f,) = [f for f in doc["check_failures"] if f["pattern"] == "tvm.legalize"]
    assert f["check"] == what


@pytest.mark.parametrize("what", ["sliding_window", "var_len"])
def test_the_rewritten_site_is_fused_by_the_pipeline(what: str, tmp_path: Path) -> None:
    """sm_90; the window at head dim 256, which the Hopper kernel refuses: partition hands it
    back to normalize's rewrite, and the report lists that rewrite with the normalizer's."""
    if what == "sliding_window":
        mod, causal = window_module(64, 64, "BottomRight", 8, n=4, h=256), "BottomRight"
    else:
        mod, causal = var_len_module(8, 8, 16, 8), "TopLeft"
    with pytest.raises(TimeLimitExceeded):  # nvcc had no time: the job got to codegen
        _compile(mod, tmp_path)
    doc = _report(tmp_path)
    assert "codegen_s" in doc["timings"] and "build_s" not in doc["timings"]
    assert what in [r["rewrite"] for r in doc["normalizations"]]
    assert doc["summary"]["fused_plain"] == 1 and doc["summary"]["not_offloaded"] == 0
    assert not [f for f in doc["check_failures"] if f["pattern"] == "tvm.legalize"]
    (m,) = doc["matches"]
    assert (m["bias"], m["causal"]) == (True, causal)


def test_a_window_the_hopper_kernel_takes_reaches_codegen_without_a_mask(tmp_path: Path) -> None:
    mod = window_module(64, 64, "BottomRight", 8, nkv=4)
    with pytest.raises(TimeLimitExceeded):  # nvcc had no time: the job got to codegen
        _compile(mod, tmp_path)
    doc = _report(tmp_path)
    assert "sliding_window" not in [r["rewrite"] for r in doc["normalizations"]]
    assert doc["summary"]["fused_plain"] == 1 and not doc["check_failures"]
    (m,) = doc["matches"]
    assert (m["bias"], m["causal"]) == (False, "BottomRight")


@pytest.mark.parametrize("fmt", ["tvm-json", "tvmscript"])
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_a_ragged_batch_is_fused_by_the_pipeline(arch: str, fmt: str, tmp_path: Path) -> None:
    """The report of a ragged batch whose seqstart is ``R.cumsum`` of its lengths, sent as
    TVM JSON or TVMScript: no rewrite, the site fused stacked on the ragged kernel."""
    payload = to_json(ragged_module(None)) if fmt == "tvm-json" else RAGGED_SCRIPT
    settings = Settings(data_dir=tmp_path / "d", kernel_cache_dir=tmp_path / "k", nvcc_timeout_s=0)
    with pytest.raises(TimeLimitExceeded):  # nvcc had no time: the job got to codegen
        compile_module(
            payload,
            target=Target.model_validate({"arch": arch}),
            options=CompileOptions(validate_on_gpu="never"),
            out_dir=tmp_path / "out",
            settings=settings,
            fmt=fmt,
        )
    doc = _report(tmp_path)
    assert doc["normalizations"] == []
    assert doc["summary"]["fused_stacked"] == 1 and doc["summary"]["not_offloaded"] == 0
    assert not doc["check_failures"] and not doc["site_reasons"]
    (m,) = doc["matches"]
    assert (m["pattern"], m["bias"], m["causal"]) == (
        "cutlass.stacked_attention_var_len.split",
        False,
        "BottomRight",
    )
    assert "bias" not in m["shapes"]  # no tokens x tokens mask
    assert m["layout"]["ragged"]["sequences"] == "batch"
    (site,) = doc["sites"]
    assert site["offloaded"] and site["verdict"].startswith("Fused stacked-QKV attention")
