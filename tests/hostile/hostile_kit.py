"""Real Relax modules and helpers shared by the hostile-input tests.

The modules are what Stackfuse is built to accept (stacked QKV attention, exporter-style
decomposed attention, symbolic shapes, constants, control flow); every hostile case starts from
one of them, so a refusal proves the check, not a broken fixture.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from service.settings import Settings


def settings(**overrides: Any) -> Settings:
    """Default limits, with ``overrides``; never read from the environment of the test run."""
    return Settings.model_construct(**overrides)


def tvm() -> ModuleType:
    from worker.toolchain import import_tvm

    return import_tvm()


def sentinel() -> Path:
    """A path a payload tries to create; it must not exist after the payload was handled."""
    return Path(f"/tmp/stackfuse-pwned-{uuid.uuid4().hex}")


def stacked_attention(
    name: str = "main", qkv_name: str = "qkv", batch: int | str = 4, out_name: str | None = None
) -> Any:
    """qkv[B,S,3NH] -> split -> reshape x3 -> R.nn.attention, the shape the compiler fuses.

    ``batch`` may be a string: a symbolic batch dim of that name. ``out_name`` names the
    attention result's variable (TVM accepts any string as a name)."""
    t = tvm()
    from tvm.script import relax as R
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import relax as rb

    b_dim: Any = t.tirx.Var(batch, "int64") if isinstance(batch, str) else batch
    with IRBuilder() as b, rb.function():
        R.func_name(name)
        qkv = R.arg(qkv_name, R.Tensor((b_dim, 8, 5120), "float16"))
        with R.dataflow() as frame:
            parts = R.emit(R.split(qkv, [2048, 4096], axis=2))
            q = R.emit(R.reshape(parts[0], [b_dim, 8, 32, 64]))
            k = R.emit(R.reshape(parts[1], [b_dim, 8, 32, 64]))
            v = R.emit(R.reshape(parts[2], [b_dim, 8, 32, 32]))
            out = R.emit(R.nn.attention(q, k, v))
            if out_name is not None:
                IRBuilder.name(out_name, out)
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return t.IRModule({name: b.get()})


def decomposed_attention() -> Any:
    """An exporter-style block: embedding, RMSNorm, QKV matmul with weights, strided slices,
    permutes, scaled softmax(QK^T + mask) V, SiLU MLP; symbolic sequence length."""
    tvm()
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    s = tirx.Var("seq_len", "int64")
    ids = relax.Var("input_ids", relax.TensorType([1, s], "int64"))
    mask = relax.Var("mask", relax.TensorType([1, 1, s, s], "float32"))
    rng = np.random.default_rng(0)

    def const(*shape: int) -> Any:
        return relax.const(rng.standard_normal(shape).astype("float32"))

    op = relax.op
    with bb.function("main", [ids, mask], attrs={"num_input": 2}):
        with bb.dataflow():
            x = bb.emit(op.take(const(64, 128), ids, axis=0))
            h = bb.emit(op.nn.rms_norm(x, const(128), axes=[-1], epsilon=1e-6))
            qkv = bb.emit(op.matmul(h, const(128, 384)))
            q = bb.emit(op.strided_slice(qkv, axes=[2], begin=[0], end=[128]))
            k = bb.emit(op.strided_slice(qkv, axes=[2], begin=[128], end=[256]))
            v = bb.emit(op.strided_slice(qkv, axes=[2], begin=[256], end=[384]))
            heads = []
            for part in (q, k, v):
                r = bb.emit(op.reshape(part, relax.ShapeExpr([1, s, 4, 32])))
                heads.append(bb.emit(op.permute_dims(r, [0, 2, 1, 3])))
            kt = bb.emit(op.permute_dims(heads[1], [0, 1, 3, 2]))
            scores = bb.emit(op.matmul(heads[0], kt))
            scores = bb.emit(op.multiply(scores, relax.const(0.17677669, "float32")))
            scores = bb.emit(op.add(scores, mask))
            probs = bb.emit(op.nn.softmax(scores, axis=-1))
            ctx = bb.emit(op.matmul(probs, heads[2]))
            ctx = bb.emit(op.permute_dims(ctx, [0, 2, 1, 3]))
            ctx = bb.emit(op.reshape(ctx, relax.ShapeExpr([1, s, 128])))
            up = bb.emit(op.matmul(ctx, const(128, 256)))
            act = bb.emit(op.nn.silu(up))
            down = bb.emit(op.matmul(act, const(256, 128)))
            out = bb.emit(op.add(down, x))
            norm = bb.emit(op.nn.layer_norm(out, const(128), const(128), axes=[-1]))
            gelu = bb.emit(op.nn.gelu(norm))
            half = bb.emit(op.astype(gelu, "float16"))
            gv = bb.emit_output(half)
        bb.emit_func_output(gv)
    return bb.get()


def biased_attention() -> Any:
    """R.nn.attention with an additive bias, an explicit scale and a causal mask."""
    tvm()
    from tvm import relax

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([2, 16, 4, 64], "float16"))
    k = relax.Var("k", relax.TensorType([2, 16, 4, 64], "float16"))
    v = relax.Var("v", relax.TensorType([2, 16, 4, 64], "float16"))
    bias = relax.Var("bias", relax.TensorType([2, 4, 16, 16], "float16"))
    with bb.function("main", [q, k, v, bias]):
        with bb.dataflow():
            out = bb.emit(relax.op.nn.attention(q, k, v, bias, scale=0.125, causal_mask="TopLeft"))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def ragged_attention() -> Any:
    """A ragged batch as serving platforms pack it: stacked QKV ``[1, T, 3NH]`` of every
    sequence's tokens and the sequences' ``lengths``; ``seqstart`` is ``[0] + cumsum(lengths)``,
    then ``R.nn.attention_var_len`` (causal BottomRight)."""
    tvm()
    from tvm import relax

    op = relax.op
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType([1, 16, 3 * 4 * 8], "float16"))
    lengths = relax.Var("lengths", relax.TensorType([3], "int32"))
    with bb.function("main", [qkv, lengths]):
        with bb.dataflow():
            ends = bb.emit(op.cumsum(lengths, axis=0))
            start = bb.emit(op.concat([op.zeros(relax.ShapeExpr([1]), "int32"), ends], axis=0))
            longest = bb.emit(op.max(lengths))
            parts = bb.emit(op.split(qkv, 3, axis=2))
            q, k, v = (
                bb.emit(op.reshape(relax.TupleGetItem(parts, i), [1, 16, 4, 8])) for i in range(3)
            )
            out = bb.emit(
                op.nn.attention_var_len(q, k, v, start, longest, causal_mask="BottomRight")
            )
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def scan(
    op: str = "cumsum",
    axis: int | None = 0,
    dtype: str | None = None,
    in_dtype: str = "int32",
    shape: tuple[int, ...] | None = (3,),
    exclusive: bool = False,
) -> Any:
    """``op(x, axis, dtype)`` of one tensor (``shape`` None: a rank-1 tensor of unknown shape),
    built by TVM, whose type inference takes any axis and result dtype."""
    tvm()
    from tvm import relax

    bb = relax.BlockBuilder()
    ty = (
        relax.TensorType(None, in_dtype, ndim=1)
        if shape is None
        else relax.TensorType(list(shape), in_dtype)
    )
    x = relax.Var("x", ty)
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(getattr(relax.op, op)(x, axis=axis, dtype=dtype, exclusive=exclusive))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    return bb.get()


SCRIPT_MODULE = """
@I.ir_module
class Module:
    @R.function
    def helper(x: R.Tensor(("n", 64), "float32")) -> R.Tensor(("n", 64), "float32"):
        n = T.int64()
        y = R.nn.relu(x)
        return y

    @R.function
    def main(
        x: R.Tensor(("n", 64), "float32"), c: R.Tensor((), "bool")
    ) -> R.Tensor(("n * 2", 64), "float32"):
        n = T.int64()
        R.func_attr({"global_symbol": "main", "num_input": 1})
        cls = Module
        with R.dataflow():
            a = cls.helper(x)
            b = R.concat((a, a), axis=0)
            p = R.prim_value(T.int64(3))
            parts = R.split(b, 2, axis=0)
            first = parts[0]
            R.output(b, first)
        if c:
            r = R.add(b, R.const(1.0, "float32"))
        else:
            r = R.multiply(b, R.const(2.0, "float32"))
        z = R.match_cast(r, R.Tensor((n * 2, 64), "float32"))
        return z
"""


def script_module() -> Any:
    """Helper call, concat, a prim value, split+index, if/else, match_cast, symbolic dims."""
    t = tvm()
    from worker.ingest import tvmscript_namespace

    return t.script.from_source(SCRIPT_MODULE, extra_vars=tvmscript_namespace())


#: name -> builder; every one must pass ingest unchanged.
SAMPLES: dict[str, Callable[[], Any]] = {
    "stacked_attention": stacked_attention,
    "decomposed_attention": decomposed_attention,
    "biased_attention": biased_attention,
    "script_module": script_module,
    "ragged_attention": ragged_attention,
}


def saved(name: str) -> str:
    """The TVM JSON of sample ``name`` (cached: building takes TVM time)."""
    if name not in _SAVED:
        _SAVED[name] = tvm().ir.save_json(SAMPLES[name]())
    return _SAVED[name]


_SAVED: dict[str, str] = {}


def graph(name: str) -> dict[str, Any]:
    """A fresh, mutable copy of sample ``name``'s JSON graph."""
    doc: dict[str, Any] = json.loads(saved(name))
    return doc


def find(doc: dict[str, Any], type_key: str) -> int:
    """Index of the first node of ``type_key`` in ``doc``."""
    for i, node in enumerate(doc["nodes"]):
        if node["type"] == type_key:
            return i
    raise LookupError(type_key)


# --- modules that hold what Stackfuse refuses, built by TVM itself (trusted test code) --------

HOSTILE_SCRIPTS = {
    "call_packed": """
@I.ir_module
class Module:
    @R.function(pure=False)
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        y = R.call_packed("system", R.str("touch {S}"), ty_args=R.Object)
        return x
""",
    "call_pure_packed": """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        y = R.call_pure_packed("system", R.str("touch {S}"), ty_args=R.Object)
        return x
""",
    "call_dps_packed": """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        y = R.call_dps_packed("system", (x,), out_ty=R.Tensor((4,), "float32"))
        return y
""",
    "extern_func": """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Object:
        f = R.ExternFunc("system")
        return f
""",
    "call_extern_primfunc": """
@I.ir_module
class Module:
    @T.prim_func
    def evil(A: T.Buffer((4,), "float32")):
        T.evaluate(T.call_extern("int32", "system", "touch {S}"))

    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        cls = Module
        y = R.call_tir(cls.evil, (x,), out_ty=R.Tensor((4,), "float32"))
        return y
""",
    "print": """
@I.ir_module
class Module:
    @R.function(pure=False)
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        R.print(x, format="{{}}")
        return x
""",
    "codegen_attr": """
@I.ir_module
class Module:
    @R.function
    def fused(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        R.func_attr({{"Codegen": "cutlass", "global_symbol": "fused"}})
        y = R.add(x, x)
        return y

    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        cls = Module
        y = cls.fused(x)
        return y
""",
    "composite_attr": """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        R.func_attr({{"Composite": "cutlass.attention"}})
        y = R.add(x, x)
        return y
""",
    "hostile_global_symbol": """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        R.func_attr({{"global_symbol": "main\\n#include \\"/etc/passwd\\""}})
        y = R.add(x, x)
        return y
""",
}


def hostile_json(kind: str, sentinel_path: Path) -> str:
    """TVM JSON of a module using the refused construct ``kind`` (see HOSTILE_SCRIPTS)."""
    t = tvm()
    source = HOSTILE_SCRIPTS[kind].format(S=sentinel_path)
    mod = t.script.from_source(source, check_well_formed=False)
    return str(t.ir.save_json(mod))


def without_function(name: str) -> str:
    """script_module minus function ``name``, which main still calls (TVM does not object)."""
    mod = script_module()
    kept = {gv: f for gv, f in mod.functions.items() if gv.name_hint != name}
    return str(tvm().ir.save_json(tvm().IRModule(kept)))
