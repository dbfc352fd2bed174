"""TVM compile, link and export: a partitioned module plus kernel objects -> one ``.so``.

- Fused functions that need the same kernel share one symbol (one object, one call target).
- ``relax.ext.cutlass`` is ours: the PyPI wheel ships no CUTLASS codegen. It hands TVM the
  cached kernel objects as static libraries, linked into the final library.
- TVM's own CUDA kernels (everything that is not attention) go through our
  ``tvm_callback_cuda_compile``: sandboxed nvcc, fatbins in the one kernel cache of
  :mod:`worker.nvcc` (same directory, same per-key lock), an explicit arch. The library
  therefore carries machine code, never CUDA source to JIT at load time.
- The final link runs g++ in the sandbox. cudart comes after the objects (TVM's own helper puts
  options first, so an archive there is dropped). By default the library needs
  ``libcudart.so.13``, which TVM's CUDA runtime (libtvm_runtime_cuda.so) already needs and has
  loaded; ``link_cudart="static"`` embeds it instead (+1.5 MB, symbols hidden).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from service.errors import CompileError
from service.settings import Settings, get_settings
from worker import nvcc, sandbox
from worker.toolchain import Toolchain, find_toolchain, import_tvm

import_tvm()

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm import ir, relax  # noqa: E402
from tvm.s_tir import dlight as dl  # noqa: E402

#: symbol -> object path, consulted by our relax.ext.cutlass during one build
_OBJECTS: dict[str, Path] = {}
#: objects the kernels above call into (shared Hopper configurations), linked once each
_NEEDS: list[Path] = []
#: the arch TVM's CUDA kernels are compiled for during one build
_ARCH: list[str] = []
_SETTINGS: list[Settings] = []


@tvm_ffi.register_global_func("relax.ext.cutlass", override=True)
def _cutlass_codegen(functions: Any, options: Any, constant_names: Any) -> list[Any]:
    """Our relax.ext.cutlass: one static-library module per kernel symbol."""
    mods = []
    seen: set[str] = set()
    for func in functions:
        symbol = str(func.attrs["global_symbol"])
        if symbol in seen:
            continue
        seen.add(symbol)
        obj = _OBJECTS.get(symbol)
        if obj is None:
            raise CompileError(f"internal: no compiled kernel for fused function {symbol}")
        mods.append(tvm.runtime.load_static_library(str(obj), [symbol]))
    return mods


@tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
def _cuda_compile(code: str, *_: Any) -> bytearray:
    """Compile a TVM-generated CUDA kernel to a fatbin: sandboxed, cached, explicit arch."""
    settings = _SETTINGS[-1] if _SETTINGS else get_settings()
    chain = find_toolchain(settings)
    arch = _ARCH[-1] if _ARCH else "sm_90"
    flags = [
        "--fatbin",
        "-O3",
        *nvcc.gencode(arch),
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT162_OPERATORS__",
        "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        # no --use_fast_math (TVM's default): it turns powf(x, 3) into exp2(3*log2(x)), NaN for
        # every negative x; it broke GPT-2's GELU on the H200
    ]
    key = hashlib.sha256(f"{code}\0{flags}\0{chain.nvcc_version}".encode()).hexdigest()
    out = nvcc.cache_entry(settings, "fatbins", key, ".fatbin")
    nvcc.cached_build(
        out,
        code,
        lambda src, tmp: [str(chain.nvcc), *flags, "-o", str(tmp), str(src)],
        settings=settings,
        chain=chain,
        what="TVM's CUDA kernels",
    )
    return bytearray(out.read_bytes())


def share_kernels(mod: tvm.IRModule, symbol_of: dict[str, str]) -> tvm.IRModule:
    """Name each fused function by its kernel symbol; functions with equal symbols become one.

    ``symbol_of`` maps fused function names to kernel symbols.
    """
    canonical: dict[str, ir.GlobalVar] = {}
    redirect: dict[ir.GlobalVar, ir.GlobalVar] = {}
    out = tvm.IRModule({}, attrs=mod.attrs) if mod.attrs is not None else tvm.IRModule({})
    for gv, func in mod.functions.items():
        sym = symbol_of.get(gv.name_hint)
        if sym is None:
            continue
        if sym in canonical:
            redirect[gv] = canonical[sym]
            continue
        canonical[sym] = gv
        out[gv] = func.with_attr("global_symbol", sym)

    @relax.expr_functor.mutator
    class _Redirect(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            call = super().visit_call_(call)
            if isinstance(call.op, ir.GlobalVar) and call.op in redirect:
                return relax.Call(redirect[call.op], call.args, call.attrs, call.ty_args, call.span)
            return call

    for gv, func in mod.functions.items():
        if gv.name_hint in symbol_of:
            continue
        if isinstance(func, relax.Function):
            func = _Redirect(mod).visit_expr(func)
        out[gv] = func
    return out


def _heads(expr: relax.Expr) -> int | None:
    """The head count (axis 2 of ``[B, S, N, H]``) of an attention operand, when static."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    values = getattr(shape, "values", None)
    if values is None or len(values) != 4 or not isinstance(values[2], tvm.tirx.IntImm):
        return None
    return int(values[2])


def expand_kv_heads(mod: tvm.IRModule) -> tvm.IRModule:
    """Repeat K and V up to the query heads at every GQA/MQA attention left to TVM.

    TVM legalizes ``R.nn.attention`` as if K and V had as many heads as Q: with fewer (GQA/MQA)
    it reads past them and returns wrong values. Sites that our kernels took are extern calls by
    now; the rest (an arch or a check the GQA kernel lacks, and the validation reference, which
    is TVM alone) get ``repeat`` first: query head i reads key/value head i // (Nq / Nkv), as
    our Hopper kernel and PyTorch's ``enable_gqa`` do.
    """
    ops = {ir.Op.get("relax.nn.attention"), ir.Op.get("relax.nn.attention_bias")}

    @relax.expr_functor.mutator
    class _Expand(relax.PyExprMutator):
        def visit_call_(self, call: relax.Call) -> relax.Expr:
            call = super().visit_call_(call)
            if call.op not in ops:
                return call
            q, k, v, *rest = call.args
            nq, nk, nv = (_heads(x) for x in (q, k, v))
            if nq is None or nk is None or nv is None or (nk == nq and nv == nq):
                return call
            # TVM's shape inference has already refused head counts that do not divide
            k = self.builder_.emit(relax.op.repeat(k, nq // nk, axis=2))
            v = self.builder_.emit(relax.op.repeat(v, nq // nv, axis=2))
            return relax.Call(call.op, [q, k, v, *rest], call.attrs, call.ty_args, call.span)

    out = tvm.IRModule({}, attrs=mod.attrs) if mod.attrs is not None else tvm.IRModule({})
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and not (func.attrs and "Codegen" in func.attrs):
            func = _Expand(mod).visit_expr(func)
        out[gv] = func
    return out


def _linker(chain: Toolchain, settings: Settings) -> Callable[..., None]:
    def link(output: str, objects: list[str], **_: Any) -> None:
        cxx = os.environ.get("CXX", "g++")
        if settings.link_cudart == "static":
            cudart = [str(chain.cudart_static), "-Wl,--exclude-libs,ALL"]
        else:
            cudart = [f"-L{chain.cudart_static.parent}", "-l:libcudart.so.13"]
        argv = [
            cxx,
            "-shared",
            "-fPIC",
            # Reproducible: the static symbol table names nvcc's temporary host files
            # (tmpxft_<pid>_...cudafe1.cpp), different on every cold compile; the dynamic one
            # (the entry points TVM looks up) stays. The build id is then a hash of the rest.
            "-Wl,--strip-all",
            "-Wl,--build-id=sha1",
            "-o",
            output,
            *objects,
            *(str(p) for p in _NEEDS),
            *cudart,
            "-lpthread",
            "-ldl",
            "-lrt",
        ]
        result = sandbox.run(
            argv,
            limits=sandbox.Limits(
                timeout_s=settings.link_timeout_s,
                cpu_s=settings.link_timeout_s * 2,
                memory_bytes=settings.nvcc_memory_bytes,
                file_bytes=settings.max_output_file_bytes,
            ),
            what="the linker",
        )
        if result.returncode != 0:
            raise CompileError(
                f"linking the library failed (exit {result.returncode})",
                excerpt=sandbox.excerpt(
                    result.output,
                    [*(Path(o) for o in objects), *_NEEDS],
                    limit=settings.error_excerpt_chars,
                ),
            )

    return link


#: dlight rules that schedule TVM's own kernels, first match wins: TVM's CUDA default
#: (``tvm.relax.backend.cuda.pipeline.legalize_passes``), and ours, which tries the RMSNorm rule
#: first (one block per row, vectorized 8-wide; GeneralReduction, the default's match for an
#: RMSNorm, takes 1.4-1.7x its GPU time at rows of 1024-4096: benchmarks/results/norm_bench.md)
TVM_DEFAULT_RULES = ("Matmul", "GEMV", "Reduction", "GeneralReduction", "Fallback")
#: the longest row dlight's RMSNorm schedule compiles (512 threads x 8 elements)
RMSNORM_MAX_ROW = 4096
SCHEDULE_RULES = ("RMSNorm", *TVM_DEFAULT_RULES)


class GuardedRMSNorm(dl.gpu.RMSNorm):
    """dlight's RMSNorm rule raises on layouts it does not expect (a 2-D input) instead of
    declining, and its schedule of a row longer than 512 threads x 8 does not compile
    (float16x16 vectors): those it declines here, and the next rule schedules them."""

    def apply(self, func: Any, target: Any, tunable: bool) -> Any:
        shape = getattr(func.params[0], "shape", None) if func.params else None
        if not shape:
            return None
        row = shape[-1]
        if not isinstance(row, tvm.tirx.IntImm) or int(row) > RMSNORM_MAX_ROW:
            return None
        try:
            return super().apply(func, target, tunable)
        except Exception:  # any failure of the rule is a decline
            return None


def relax_pipeline(target: Any, rules: Sequence[str] = SCHEDULE_RULES) -> Any:
    """TVM's CUDA pipeline with ``rules`` in place of its dlight schedule."""
    from tvm.relax.backend.cuda import pipeline as cuda

    def rule(name: str) -> Any:
        return GuardedRMSNorm() if name == "RMSNorm" else getattr(dl.gpu, name)()

    legalize = cuda.legalize_passes(target)
    if not isinstance(legalize[-1], dl.ApplyDefaultSchedule):
        raise AssertionError("TVM's CUDA legalize passes no longer end in the dlight schedule")
    passes = [
        *cuda.library_dispatch_passes(target),
        *legalize[:-1],
        dl.ApplyDefaultSchedule(*(rule(r) for r in rules)),
        *cuda.dataflow_lower_passes(target),
        *cuda.finalize_passes(target),
    ]

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def build_library(
    mod: tvm.IRModule,
    objects: dict[str, Path],
    *,
    needs: Sequence[Path] = (),
    arch: str,
    out_path: Path,
    settings: Settings | None = None,
    on_stage: Callable[[str], None] | None = None,
    schedule_rules: Sequence[str] = SCHEDULE_RULES,
) -> Path:
    """Compile ``mod`` (fused functions already named by kernel symbol) into ``out_path``;
    ``objects`` maps kernel symbols to their objects, ``needs`` lists the objects those call
    into (each linked once, however many kernels share it); ``schedule_rules`` name the dlight
    rules that schedule TVM's own kernels."""
    settings = settings or get_settings()
    chain = find_toolchain(settings)
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")
    _OBJECTS.clear()
    _OBJECTS.update(objects)
    _NEEDS[:] = list(dict.fromkeys(needs))
    _ARCH.append(arch)
    _SETTINGS.append(settings)
    try:
        mod = expand_kv_heads(relax.transform.RunCodegen()(mod))
        with target:
            executable = tvm.compile(
                mod, target=target, relax_pipeline=relax_pipeline(target, schedule_rules)
            )
        if on_stage:
            on_stage("link")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
        executable.export_library(str(tmp), fcompile=_linker(chain, settings))
        os.replace(tmp, out_path)
    finally:
        _ARCH.pop()
        _SETTINGS.pop()
        _OBJECTS.clear()
        _NEEDS.clear()
    return out_path


__all__ = ["build_library", "expand_kv_heads", "share_kernels"]
