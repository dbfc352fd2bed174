"""Relax modules for tests and benchmarks, built with TVM's IRBuilder (trusted local code).

`stacked_attention_module` follows apache/tvm's test_codegen_cutlass.py
(`get_relax_stacked_attention_module`), extended with causal masks, dtypes, a symbolic batch,
slice orders and the knobs the negative checks need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.toolchain import import_tvm

tvm = import_tvm()

from tvm.script import relax as R  # noqa: E402
from tvm.script import tirx as T  # noqa: E402
from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import relax as rb  # noqa: E402


def stacked_attention_module(
    b: int | str,
    s: int,
    n: int,
    h: int,
    h_v: int | None = None,
    *,
    op: str = "split",
    dtype: str = "float16",
    bias_shape: Sequence[int | str] | None = None,
    causal: str | None = None,
    scale: float | None = None,
    single_shape: bool = False,
    split_axis: int = 2,
    slice_order: str = "qkv",
    slice_stride: int = 1,
    leak: bool = False,
    epilogue: bool = False,
    n_kv: int | None = None,
    extra_cols: int = 0,
    window: int | None = None,
) -> Any:
    """``qkv[B, S, N*H + Nkv*H + Nkv*H_v] -> split|strided_slice -> reshape x3 -> attention``.

    ``b`` may be a string: a symbolic batch. ``leak`` also returns the q reshape (an
    intermediate used outside the pattern); ``epilogue`` adds an op after attention.
    """
    h_v = h if h_v is None else h_v
    n_kv = n if n_kv is None else n_kv
    widths = {"q": n * h, "k": n_kv * h, "v": n_kv * h_v}
    total = sum(widths.values()) + extra_cols
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        bdim = tvm.tirx.Var(b, "int64") if isinstance(b, str) else b
        qkv = R.arg("qkv", R.Tensor((bdim, s, total), dtype))
        bias = (
            R.arg("bias", R.Tensor(tuple(bdim if d == "b" else d for d in bias_shape), dtype))
            if bias_shape
            else None
        )
        qk_shape: Any = [bdim, s, n, h]
        kk_shape: Any = [bdim, s, n_kv, h]
        v_shape: Any = [bdim, s, n_kv, h_v]
        if single_shape:
            qk_shape = kk_shape = v_shape = R.shape([bdim, s, n, h])
        with R.dataflow() as frame:
            if op == "split":
                parts = R.emit(
                    R.split(qkv, [widths["q"], widths["q"] + widths["k"]], axis=split_axis)
                )
                q = R.emit(R.reshape(parts[0], qk_shape))
                k = R.emit(R.reshape(parts[1], kk_shape))
                v = R.emit(R.reshape(parts[2], v_shape))
            else:
                begin = {}
                pos = 0
                for role in slice_order:
                    begin[role] = pos
                    pos += widths[role]

                def sl(role: str) -> Any:
                    return R.strided_slice(
                        qkv, [2], [begin[role]], [begin[role] + widths[role]], [slice_stride]
                    )

                q = R.emit(R.reshape(sl("q"), qk_shape))
                k = R.emit(R.reshape(sl("k"), kk_shape))
                v = R.emit(R.reshape(sl("v"), v_shape))
            scale_imm = T.FloatImm("float32", scale) if scale is not None else None
            out = R.emit(
                R.nn.attention(q, k, v, bias, scale_imm, causal_mask=causal, window_size=window)
            )
            if epilogue:
                out = R.emit(R.add(out, out))
            if leak:
                gv = R.emit(R.tuple(out, q))
                R.output(gv)
            else:
                R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def attention_module(
    b: int,
    s: int,
    s_kv: int,
    n: int,
    h: int,
    h_v: int | None = None,
    *,
    dtype: str = "float16",
    bias_shape: Sequence[int] | None = None,
    causal: str | None = None,
    n_kv: int | None = None,
) -> Any:
    """Plain ``R.nn.attention(q, k, v[, bias])`` on separate tensors."""
    h_v = h if h_v is None else h_v
    n_kv = n if n_kv is None else n_kv
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((b, s, n, h), dtype))
        k = R.arg("k", R.Tensor((b, s_kv, n_kv, h), dtype))
        v = R.arg("v", R.Tensor((b, s_kv, n_kv, h_v), dtype))
        bias = R.arg("bias", R.Tensor(tuple(bias_shape), dtype)) if bias_shape else None
        with R.dataflow() as frame:
            out = R.emit(R.nn.attention(q, k, v, bias, causal_mask=causal))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def packed_mqa_module(
    b: int | str, s: int, n: int, n_kv: int, h: int, *, dtype: str = "float16"
) -> Any:
    """GPTBigCode's multi-query packing as ``torch.export`` leaves it once K/V are no longer
    repeated: ``qkv[B, S, N*H + 2*Nkv*H] -> expand_dims(1) -> split(axis 3)``, q reshaped to
    ``[B, S, N, H]``; one K/V head transposed in its size-1 axes (``[B, 1, S, H] ->
    [B, S, 1, H]``), grouped ones (Nkv > 1) reshaped to ``[B, S, Nkv, H]``."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        bdim = tvm.tirx.Var(b, "int64") if isinstance(b, str) else b
        qkv = R.arg("qkv", R.Tensor((bdim, s, (n + 2 * n_kv) * h), dtype))
        with R.dataflow() as frame:
            wide = R.emit(R.expand_dims(qkv, [1]))
            parts = R.emit(R.split(wide, [n * h, (n + n_kv) * h], axis=3))
            q = R.emit(R.reshape(parts[0], [bdim, s, n, h]))

            def kv(i: int) -> Any:
                if n_kv == 1:
                    return R.emit(R.permute_dims(parts[i], [0, 2, 1, 3]))
                return R.emit(R.reshape(parts[i], [bdim, s, n_kv, h]))

            out = R.emit(R.nn.attention(q, kv(1), kv(2), causal_mask="TopLeft"))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def ragged_attention_module(
    n: int,
    h: int,
    *,
    n_kv: int | None = None,
    dtype: str = "float16",
    causal: str | None = None,
    layout: str = "split",
    seqstart: str = "cumsum",
    seqstart_k: bool = False,
    window: int | None = None,
    tokens: int | str = "tokens",
) -> Any:
    """A ragged batch: sequences of different lengths packed along the tokens of a batch of
    one, then ``R.nn.attention_var_len``.

    ``layout``: ``split`` or ``strided_slice`` (one packed ``qkv[1, T, (N + 2 Nkv) H]`` cut
    into views) or ``separate`` (``q``, ``k``, ``v`` inputs ``[1, T, N|Nkv, H]``). ``seqstart``:
    ``cumsum`` (serving platforms' form: int32 ``lengths[B]`` in,
    ``seqstart = concat([0], cumsum(lengths))`` and ``max_seqlen = max(lengths)`` in the
    graph) or ``input`` (``seqstart[starts]`` and ``max_seqlen[]`` inputs, ``starts = B + 1``).
    ``seqstart_k``: keys delimited by an offsets tensor of their own (``lengths_k`` /
    ``seqstart_k``; with ``separate``, K and V then have their own token count ``tokens_k``).
    """
    n_kv = n if n_kv is None else n_kv
    widths = {"q": n * h, "k": n_kv * h, "v": n_kv * h}
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        t = tvm.tirx.Var(tokens, "int64") if isinstance(tokens, str) else tokens
        tk = tvm.tirx.Var("tokens_k", "int64") if seqstart_k and layout == "separate" else t
        if layout == "separate":
            qkv = None
            q = R.arg("q", R.Tensor((1, t, n, h), dtype))
            k = R.arg("k", R.Tensor((1, tk, n_kv, h), dtype))
            v = R.arg("v", R.Tensor((1, tk, n_kv, h), dtype))
        else:
            qkv = R.arg("qkv", R.Tensor((1, t, sum(widths.values())), dtype))
        roles = ("", "_k") if seqstart_k else ("",)
        if seqstart == "cumsum":
            b = tvm.tirx.Var("batch", "int64")
            lengths = [R.arg(f"lengths{r}", R.Tensor((b,), "int32")) for r in roles]
        else:  # B + 1 offsets: a dim of its own (a module defines each symbolic dim by one)
            b1 = tvm.tirx.Var("starts", "int64")
            starts = [R.arg(f"seqstart{r}", R.Tensor((b1,), "int32")) for r in roles]
            longest = [R.arg(f"max_seqlen{r}", R.Tensor((), "int32")) for r in roles]
        with R.dataflow() as frame:
            if seqstart == "cumsum":
                starts, longest = [], []
                for ln in lengths:
                    ends = R.emit(R.cumsum(ln, axis=0))
                    zero = R.zeros(R.shape([1]), "int32")
                    starts.append(R.emit(R.concat((zero, ends), axis=0)))
                    longest.append(R.emit(R.max(ln)))
            if qkv is not None:
                shapes = [[1, t, n, h], [1, t, n_kv, h], [1, t, n_kv, h]]
                if layout == "split":
                    parts = R.emit(R.split(qkv, [widths["q"], widths["q"] + widths["k"]], axis=2))
                    pieces = [parts[i] for i in range(3)]
                else:
                    bounds = [0, widths["q"], widths["q"] + widths["k"], sum(widths.values())]
                    pieces = [
                        R.strided_slice(qkv, [2], [bounds[i]], [bounds[i + 1]]) for i in range(3)
                    ]
                q, k, v = (
                    R.emit(R.reshape(p, R.shape(sh))) for p, sh in zip(pieces, shapes, strict=True)
                )
            out = R.emit(
                R.nn.attention_var_len(
                    q,
                    k,
                    v,
                    starts[0],
                    longest[0],
                    starts[-1] if seqstart_k else None,
                    longest[-1] if seqstart_k else None,
                    causal_mask=causal,
                    window_size=window,
                )
            )
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def to_json(mod: Any) -> str:
    return tvm.ir.save_json(mod)


def custom_attention_module(
    qkv_shape: Sequence[int],
    body: Any,
    *,
    dtype: str = "float16",
    causal: str | None = None,
    scale: float | None = None,
    window_size: int | None = None,
) -> Any:
    """``qkv -> body(qkv) = (q, k, v) -> attention``: negative cases build odd q/k/v with it.

    ``body`` gets the qkv var and emits with ``R.emit``; it returns q, k, v of rank 4.
    """
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg("qkv", R.Tensor(tuple(qkv_shape), dtype))
        with R.dataflow() as frame:
            q, k, v = body(qkv)
            scale_imm = T.FloatImm("float32", scale) if scale is not None else None
            out = R.emit(
                R.nn.attention(
                    q, k, v, None, scale_imm, causal_mask=causal, window_size=window_size
                )
            )
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def two_layer_module(b: int, s: int, n: int, h: int, *, dtype: str = "float16") -> Any:
    """Two stacked-attention layers of one config (kernel sharing), with an op between them."""
    width = 3 * n * h
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((b, s, width), dtype))
        with R.dataflow() as frame:
            cur = x
            for _ in range(2):
                parts = R.emit(R.split(cur, [n * h, 2 * n * h], axis=2))
                q = R.emit(R.reshape(parts[0], [b, s, n, h]))
                k = R.emit(R.reshape(parts[1], [b, s, n, h]))
                v = R.emit(R.reshape(parts[2], [b, s, n, h]))
                att = R.emit(R.reshape(R.nn.attention(q, k, v), [b, s, n * h]))
                cur = R.emit(R.concat([att, att, att], axis=2))
            R.output(cur)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})
