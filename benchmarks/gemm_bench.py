"""Our CUTLASS GEMM configurations against cuBLAS (torch.matmul / F.linear / addmm) on the same
tensors, at every GEMM shape of the whole-model benchmark's models and a grid of shapes no
configuration was picked on.

Two halves, like :mod:`benchmarks.models_gpu`:

    python -m benchmarks.gemm_bench build .gpu/gemm [--acts none gelu_tanh ...]   # here: nvcc
    python -m benchmarks.gemm_bench run .gpu/gemm OUT_DIR                          # there: GPU

``build`` compiles each configuration (the objects the pipeline ships, from the same kernel
cache) and links them with a small C entry per configuration into ``libgemm_bench.so``; ``run``
calls them through ctypes on torch's stream. Each way is timed in its own steady state: per
round it runs ~100 ms untimed, then ``CALLS`` back-to-back calls between two CUDA events; the
figure is the median over rounds. Ratios are ours / cuBLAS's time inverted (> 1: we are faster).

Epilogue peers get their best path: bias through cuBLASLt's bias epilogue (``F.linear`` /
``addmm``), GELU through ``torch._addmm_activation`` (cuBLASLt's GELU epilogue) where it
applies, residual as ``addmm`` + ``add``.

The paired SwiGLU (``swiglu``: gate and up projections as one GEMM of N = 2I on weights
interleaved in blocks of 8 rows, ``silu(gate) * up`` written as ``[M, I]``) has rows of its own
(``--shapes glu``), against cuBLAS's two ways to the same result: one GEMM on the concatenated
``[2I, K]`` weight then ``F.silu(g) * u`` on its halves, and two GEMMs
``F.silu(x @ Wg.T) * (x @ Wu.T)``; the faster is the row's cuBLAS time:

    python -m benchmarks.gemm_bench build .gpu/glu --acts swiglu --source-c no \
        --tiles pingpong_128x128_c1x2 coop_128x256 pingpong_128x192 --shapes glu
    python -m benchmarks.gemm_bench run .gpu/glu OUT_DIR --shapes glu --epilogues swiglu
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: (name, M, N, K): the models of benchmarks/models_gpu.py, then an untuned grid
MODEL_SHAPES: list[tuple[str, int, int, int]] = [
    ("gpt2_qkv", 8192, 2304, 768),
    ("gpt2_proj", 8192, 768, 768),
    ("gpt2_fc", 8192, 3072, 768),
    ("gpt2_fc2", 8192, 768, 3072),
    ("bert_qkv", 4096, 2304, 768),
    ("bert_proj", 4096, 768, 768),
    ("bert_fc", 4096, 3072, 768),
    ("bert_fc2", 4096, 768, 3072),
    ("llama_qkv", 2048, 3072, 2048),
    ("llama_q", 2048, 2048, 2048),
    ("llama_kv", 2048, 512, 2048),
    ("llama_o", 2048, 2048, 2048),
    ("llama_gate", 2048, 5632, 2048),
    ("llama_up", 2048, 5632, 2048),
    ("llama_down", 2048, 2048, 5632),
]
GRID_SHAPES: list[tuple[str, int, int, int]] = [
    (f"grid_m{m}_n{n}_k{k}", m, n, k)
    for m in (512, 16384)
    for n, k in ((1024, 4096), (4096, 1024), (8192, 8192))
]
#: (name, M, N = 2I, K) of the paired SwiGLU rows: Llama-style gate + up (I 5632, K 2048)
GLU_SHAPES: list[tuple[str, int, int, int]] = [("llama_gate_up", 2048, 2 * 5632, 2048)]
SHAPES = {"all": MODEL_SHAPES + GRID_SHAPES, "models": MODEL_SHAPES, "glu": GLU_SHAPES}
#: epilogue -> (activation, bias, residual)
EPILOGUES: dict[str, tuple[str, bool, bool]] = {
    "none": ("none", False, False),
    "bias": ("none", True, False),
    "bias_residual": ("none", True, True),
    "bias_gelu_tanh": ("gelu_tanh", True, False),
    "bias_gelu": ("gelu", True, False),
    "residual": ("none", False, True),
    "silu": ("silu", False, False),
    # SwiGLU's up projection: silu(C) * (A @ B), C the gate projection's output
    "silu_gate": ("silu_gate", False, True),
    # gate and up projections as one GEMM, silu(gate) * up paired in registers ([M, N/2])
    "swiglu": ("swiglu", False, False),
}
#: ``--epilogues as-used``: each model GEMM with the weight layout and epilogue its library
#: runs (GPT-2's Conv1D weights and BERT's concatenated QKV are [K, N]; nn.Linear's [N, K])
AS_USED: dict[str, tuple[str, str]] = {
    "gpt2_qkv": ("n_major", "bias"),
    "gpt2_proj": ("n_major", "bias_residual"),
    "gpt2_fc": ("n_major", "bias_gelu_tanh"),
    "gpt2_fc2": ("n_major", "bias_residual"),
    "bert_qkv": ("n_major", "bias"),
    "bert_proj": ("k_major", "bias_residual"),
    "bert_fc": ("k_major", "bias_gelu"),
    "bert_fc2": ("k_major", "bias_residual"),
    "llama_qkv": ("k_major", "none"),  # q/k/v as one GEMM (normalize's combine_projections)
    "llama_o": ("k_major", "residual"),
    "llama_gate": ("k_major", "none"),
    "llama_up": ("k_major", "silu_gate"),
    "llama_down": ("k_major", "residual"),
}
CALLS = 20
PREROLL_S = 0.1


# --------------------------------------------------------------------------------------------
# build (here)
# --------------------------------------------------------------------------------------------
def build(
    out_dir: Path,
    acts: list[str],
    dtypes: list[str],
    tiles: list[str] | None,
    source_c: list[bool],
    emit: bool = False,
    shapes: str = "all",
) -> None:
    """Compile every (dtype, B layout, activation, with/without C, tile) configuration and link
    ``libgemm_bench.so``; with ``emit``, write the sources and ``build.sh`` instead, to compile
    on a machine with more cores (``bash DIR/build.sh`` there, CUTLASS under ``.gpu/cutlass``)."""
    import shlex
    import subprocess

    from service.settings import get_settings
    from worker import gemm_sm90
    from worker.kernel_source import KernelSource
    from worker.nvcc import compile_object, nvcc_argv
    from worker.toolchain import find_toolchain

    settings = get_settings()
    chain = find_toolchain(settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    #: (symbol, tile name) -> the way: swizzled tiles share their base tile's configuration
    ways: dict[tuple[str, str], dict[str, Any]] = {}
    units: dict[str, KernelSource] = {}
    if tiles == ["selected"] and acts == ["as-used"]:  # as-used alone builds the picks
        tiles = None
    elif tiles == ["selected"]:  # the tiles the selector picks for the shapes ``run`` times
        tiles = sorted(
            {
                _selected_tile(dtype, m, n, k, kmajor, act)
                for _, m, n, k in SHAPES[shapes]
                for dtype in dtypes
                for kmajor in (True, False)
                for act in acts
            }
        )
    if acts == ["as-used"]:  # each model GEMM's own epilogue and layout, nothing else
        combos = []
        for name, m, n, k in MODEL_SHAPES:
            if name not in AS_USED:  # a shape of the sweep no library runs as such
                continue
            layout, epi = AS_USED[name]
            act, _, has_c = EPILOGUES[epi]
            for dtype in dtypes:
                kmajor = layout == "k_major"
                # the tile the selector picks (what the libraries link), or every tile given
                for tile in tiles or [_selected_tile(dtype, m, n, k, kmajor, act)]:
                    combos.append((dtype, kmajor, act, has_c, tile))
    else:
        combos = [
            (dtype, kmajor, act, has_c, name)
            for dtype in dtypes
            for kmajor in (True, False)
            for act in acts
            for has_c in source_c
            if (act, has_c) in gemm_sm90.EPILOGUE_VARIANTS
            for name in tiles or list(gemm_sm90.TILES)
        ]
    for dtype, kmajor, act, has_c, name in combos:
        ks = gemm_sm90.render_configuration(dtype, name, kmajor, act, has_c)
        units.setdefault(ks.symbol, ks)
        ways.setdefault(
            (ks.symbol, name),
            {
                "symbol": ks.symbol,
                "tile": name,
                "dtype": dtype,
                "b_kmajor": kmajor,
                "activation": act,
                "source_c": has_c,
                "swizzle": gemm_sm90.TILES[name].swizzle,
            },
        )
    decls = "\n".join(f"Status {sym}(Problem const&, cudaStream_t, cudaError_t*);" for sym in units)
    entries = "\n".join(
        f"""extern "C" __attribute__((visibility("default"))) int bench_{sym}(
    const void* a, const void* b, const void* c, const void* bias, void* d, int m, int n, int k,
    float beta, int swizzle, void* stream) {{
  return call(&{sym}, a, b, c, bias, d, m, n, k, beta, swizzle, stream);
}}"""
        for sym in units
    )
    source = f"""// Generated by benchmarks/gemm_bench.py: a C entry per GEMM configuration.
#include "gemm_api.h"
namespace stackfuse {{ namespace gemm {{
{decls}
}} }}
using namespace stackfuse::gemm;
static void* alloc(size_t bytes, int, void* stream) {{
  void* p = nullptr;
  return cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)) == cudaSuccess ? p : nullptr;
}}
static void release(void* p, int, void* stream) {{
  cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
}}
static int call(LaunchFn fn, const void* a, const void* b, const void* c, const void* bias, void* d,
                int m, int n, int k, float beta, int swizzle, void* stream) {{
  Problem p{{}};
  p.a = a; p.b = b; p.c = c; p.bias = bias; p.d = d; p.m = m; p.n = n; p.k = k; p.l = 1;
  p.batch_stride_b = 0; p.beta = beta; p.swizzle = swizzle; cudaGetDevice(&p.device_id);
  p.alloc = &alloc; p.free = &release; p.alloc_ctx = stream;
  cudaError_t e = cudaSuccess;
  return static_cast<int>(fn(p, static_cast<cudaStream_t>(stream), &e));
}}
{entries}
"""
    entry_ks = KernelSource(
        symbol="gemm_bench_entries",
        source=source,
        family="bench",
        flags=(gemm_sm90.GENCODE, f"-I{gemm_sm90.KERNELS_DIR}"),
    )
    (out_dir / "manifest.json").write_text(json.dumps({"configs": list(ways.values())}, indent=2))
    lib = out_dir / "libgemm_bench.so"
    if emit:
        src_dir = out_dir / "src"
        src_dir.mkdir(exist_ok=True)
        here = {
            str(chain.cutlass_source): ".gpu/cutlass",
            str(gemm_sm90.KERNELS_DIR): "worker/kernels",
            str(chain.cuda_home): "/usr/local/cuda",
        }
        lines = [
            "#!/usr/bin/env bash",
            "# Generated by benchmarks/gemm_bench.py build --emit",
            "set -euo pipefail",
            'cd "$(dirname "$0")/../.."',
            "compile() {",
        ]
        cmds = []
        for ks in [*units.values(), entry_ks]:
            (src_dir / f"{ks.symbol}.cu").write_text(ks.source)
            argv = nvcc_argv(ks, chain, src_dir / f"{ks.symbol}.cu", src_dir / f"{ks.symbol}.o")
            argv[0] = "nvcc"
            fixed = []
            for a in argv:
                for old, new in here.items():
                    a = a.replace(old, new)
                fixed.append(a.replace(str(Path.cwd()) + "/", ""))
            cmds.append(" ".join(shlex.quote(a) for a in fixed))
        lines += ["  case $1 in"]
        lines += [f"    {i}) {c} ;;" for i, c in enumerate(cmds)]
        lines += [
            "  esac",
            "}",
            "export -f compile",
            f"seq 0 {len(cmds) - 1} | xargs -P \"$(nproc)\" -I{{}} bash -c 'compile {{}}'",
            f"g++ -shared -fPIC -o {lib} {src_dir}/*.o -L/usr/local/cuda/lib64 -lcudart",
        ]
        (out_dir / "build.sh").write_text("\n".join(lines) + "\n")
        print(f"wrote {out_dir}/build.sh: {len(cmds)} units ({len(units)} configurations)")
        return
    objects = []
    for ks in units.values():
        t0 = time.monotonic()
        ck = compile_object(ks, settings=settings, chain=chain)
        print(
            f"{ks.config['type']}: "
            + ("cached" if ck.cache_hit else f"{time.monotonic() - t0:.0f} s"),
            flush=True,
        )
        objects.append(ck.object_path)
    entry = compile_object(entry_ks, settings=settings, chain=chain).object_path
    subprocess.run(
        [
            "g++",
            "-shared",
            "-fPIC",
            "-o",
            str(lib),
            str(entry),
            *map(str, objects),
            f"-L{chain.cudart_static.parent}",
            "-l:libcudart.so.13",
        ],
        check=True,
    )
    print(f"wrote {lib} ({lib.stat().st_size / 1e6:.1f} MB, {len(units)} configurations)")


# --------------------------------------------------------------------------------------------
# run (GPU)
# --------------------------------------------------------------------------------------------
def _launch_args(
    a: Any, w: Any, c: Any, bias: Any, d: Any, mnk: tuple[int, int, int], swizzle: int,
    stream: int,
) -> tuple[Any, ...]:  # fmt: skip
    """The ``bench_<symbol>`` arguments (``kernels/gemm_api.h``'s Problem, flattened): C (a
    residual; beta 1) and the bias may be absent."""
    return (
        ctypes.c_void_p(a.data_ptr()),
        ctypes.c_void_p(w.data_ptr()),
        ctypes.c_void_p(c.data_ptr() if c is not None else 0),
        ctypes.c_void_p(bias.data_ptr() if bias is not None else 0),
        ctypes.c_void_p(d.data_ptr()),
        *mnk,
        ctypes.c_float(1.0 if c is not None else 0.0),
        swizzle,
        ctypes.c_void_p(stream),
    )


def _time_config(
    fn: Any, args: tuple[Any, ...], d: Any, ref: Any, t_peer: float, flops: int, torch: Any,
    rounds: int,
) -> dict[str, Any]:  # fmt: skip
    """One configuration on one row: its status if it refused, else its time, TFLOP/s, ratio to
    cuBLAS and max error (D is filled with NaN first: an element never written shows as NaN)."""
    d.fill_(float("nan"))
    status = fn(*args)
    torch.cuda.synchronize()
    if status != 0:
        return {"status": status}
    err = float((d.float() - ref).abs().max())
    t = _steady(lambda: fn(*args), torch, rounds)
    return {"s": t, "max_abs_error": err, "vs_cublas": t_peer / t, "tflops": flops / t / 1e12}


def _close_row(row: dict[str, Any], chosen: str | None, t_peer: float, flops: int) -> None:
    """The row's best tile, the selector's tile, both against cuBLAS, and cuBLAS's TFLOP/s."""
    timed = {t: v for t, v in row["ours"].items() if "s" in v}
    if timed:
        best = min(timed, key=lambda t: timed[t]["s"])
        row["best_tile"] = best
        row["best_vs_cublas"] = timed[best]["vs_cublas"]
    if chosen in timed:
        row["selected_vs_cublas"] = timed[chosen]["vs_cublas"]
    row["cublas_tflops"] = flops / t_peer / 1e12


def _steady(fn: Any, torch: Any, rounds: int) -> float:
    """Median seconds per call over ``rounds``, each after ~PREROLL_S of untimed calls."""
    times = []
    for _ in range(rounds):
        t_end = time.perf_counter() + PREROLL_S
        while time.perf_counter() < t_end:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(CALLS):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000.0 / CALLS)
    return statistics.median(times)


def _peer(epi: str, kmajor: bool, a: Any, w: Any, bias: Any, res: Any) -> Any:
    """cuBLAS's best path for one epilogue: cuBLASLt's bias and GELU(tanh) epilogues where they
    apply (``F.linear`` / ``addmm`` / ``_addmm_activation``), else a separate elementwise op."""
    import torch
    import torch.nn.functional as F

    wt = w.t() if kmajor else w  # [K, N] either way; a view for K-major weights

    def linear() -> Any:
        return F.linear(a, w, bias) if kmajor else torch.addmm(bias, a, w)

    if epi == "bias_gelu_tanh":
        return lambda: torch._addmm_activation(bias, a, wt, use_gelu=True)
    if epi == "bias_gelu":
        return lambda: F.gelu(linear())
    if epi == "bias_residual":
        return lambda: linear().add_(res)
    if epi == "bias":
        return linear
    if epi == "residual":  # cuBLAS's own C input (beta = 1)
        return lambda: torch.addmm(res, a, wt)
    if epi == "silu":
        return lambda: F.silu(torch.matmul(a, wt))
    if epi == "silu_gate":
        return lambda: F.silu(res) * torch.matmul(a, wt)
    return lambda: torch.matmul(a, wt)


def _selected_tile(
    dtype: str, m: int, n: int, k: int, kmajor: bool, activation: str = "none"
) -> str:
    """The tile worker.gemm_selection picks for this shape and epilogue activation (what a
    library built now runs)."""
    from worker.gemm import SWIGLU, weight_spec
    from worker.gemm_selection import pick

    if activation == SWIGLU:
        paired = weight_spec(dtype=dtype, m=m, n=n, k=k, b_kmajor=kmajor, paired_glu=True)  # type: ignore[arg-type]
        return pick(paired)[0]
    spec = weight_spec(
        dtype=dtype,  # type: ignore[arg-type]
        m=m,
        n=n,
        k=k,
        b_kmajor=kmajor,
        activation=activation,  # type: ignore[arg-type]
        bias=True,
    )
    return pick(spec)[0]


def run(
    build_dir: Path,
    out_dir: Path,
    rounds: int,
    epilogues: list[str],
    selected: bool = False,
    shapes: str = "all",
) -> None:
    """Time every configuration of ``build_dir`` that fits each row (``selected``: only the
    tile the selector picks for the row's shape) against cuBLAS's best path."""
    import torch
    import torch.nn.functional as F

    out_dir.mkdir(parents=True, exist_ok=True)
    lib = ctypes.CDLL(str(build_dir / "libgemm_bench.so"))
    configs = json.loads((build_dir / "manifest.json").read_text())["configs"]
    stream = torch.cuda.current_stream().cuda_stream
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    for name, m, n, k in SHAPES[shapes]:
        for dtype_name in sorted({c["dtype"] for c in configs}):
            dt = getattr(torch, dtype_name)
            # float32 configurations are TF32: cuBLAS's peer is its TF32 path
            torch.backends.cuda.matmul.allow_tf32 = dtype_name == "float32"
            a = (torch.randn(m, k, device="cuda") * 0.5).to(dt)
            w_nk = (torch.randn(n, k, device="cuda") / k**0.5).to(dt)
            w_kn = w_nk.t().contiguous()
            bias = (torch.randn(n, device="cuda") * 0.1).to(dt)
            res = torch.randn(m, n, device="cuda").to(dt)
            d = torch.empty(m, n, device="cuda", dtype=dt)
            ref_mm = a.float() @ w_nk.float().t()
            as_used = epilogues == ["as-used"]
            if as_used and name not in AS_USED:
                continue
            for epi in [AS_USED[name][1]] if as_used else epilogues:
                act, use_bias, use_res = EPILOGUES[epi]
                if (act == "swiglu") != (shapes == "glu"):  # paired rows: --shapes glu alone
                    continue
                if act == "swiglu":
                    rows += _swiglu_rows(
                        (name, m, n, k), dtype_name, a, configs, lib, stream, rounds, selected
                    )
                    continue
                ref = ref_mm + (bias.float() if use_bias else 0)
                if act == "gelu_tanh":
                    ref = F.gelu(ref, approximate="tanh")
                elif act == "gelu":
                    ref = F.gelu(ref)
                elif act == "silu":
                    ref = F.silu(ref)
                if act == "silu_gate":
                    ref = F.silu(res.float()) * ref
                elif use_res:
                    ref = ref + res.float()
                for kmajor in [AS_USED[name][0] == "k_major"] if as_used else [True, False]:
                    w = w_nk if kmajor else w_kn
                    layout = "k_major" if kmajor else "n_major"

                    peer = _peer(epi, kmajor, a, w, bias, res)
                    t_peer = _steady(peer, torch, rounds)
                    peer_err = float((peer().float() - ref).abs().max())
                    row: dict[str, Any] = {
                        "shape": name,
                        "m": m,
                        "n": n,
                        "k": k,
                        "dtype": dtype_name,
                        "b_layout": layout,
                        "epilogue": epi,
                        "cublas_s": t_peer,
                        "cublas_max_abs_error": peer_err,
                        "ours": {},
                    }
                    chosen = _selected_tile(dtype_name, m, n, k, kmajor, act)
                    row["selected_tile"] = chosen
                    pick = chosen if selected else None
                    for c in configs:
                        if (
                            c["dtype"] != dtype_name
                            or c["b_kmajor"] != kmajor
                            or c["activation"] != act
                            or c["source_c"] != use_res
                            or (pick is not None and c["tile"] != pick)
                        ):
                            continue
                        fn = getattr(lib, f"bench_{c['symbol']}")
                        args = _launch_args(
                            a, w, res if use_res else None, bias if use_bias else None, d,
                            (m, n, k), c["swizzle"], stream,
                        )  # fmt: skip
                        row["ours"][c["tile"]] = _time_config(
                            fn, args, d, ref, t_peer, 2 * m * n * k, torch, rounds
                        )
                    _close_row(row, chosen, t_peer, 2 * m * n * k)
                    rows.append(row)
                    print(
                        json.dumps(
                            {
                                k2: row[k2]
                                for k2 in (
                                    "shape",
                                    "dtype",
                                    "b_layout",
                                    "epilogue",
                                    "best_tile",
                                    "best_vs_cublas",
                                    "selected_tile",
                                    "selected_vs_cublas",
                                )
                                if k2 in row
                            }
                        ),
                        flush=True,
                    )
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rounds": rounds,
        "selected_only": selected,
        "calls_per_round": CALLS,
        "rows": rows,
    }
    (out_dir / "gemm_bench.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "gemm_bench.md").write_text(to_markdown(doc))


def _swiglu_rows(
    shape: tuple[str, int, int, int],
    dtype_name: str,
    a: Any,
    configs: list[dict[str, Any]],
    lib: Any,
    stream: int,
    rounds: int,
    selected: bool,
) -> list[dict[str, Any]]:
    """The paired SwiGLU's rows (N = 2I): ours on the interleaved weight against cuBLAS's one
    GEMM on the concatenated weight + ``silu(g) * u``, and its two GEMMs; error against the
    float32 reference ``silu(x Wg^T) * (x Wu^T)``."""
    import torch
    import torch.nn.functional as F

    name, m, n, k = shape
    i = n // 2
    dt = a.dtype
    wg = (torch.randn(i, k, device="cuda") / k**0.5).to(dt)
    wu = (torch.randn(i, k, device="cuda") / k**0.5).to(dt)
    # Wgu row 16j + r: Wg[8j + r] (r < 8), Wu[8j + r - 8] (8 <= r < 16)
    wgu_nk = torch.cat([wg.view(i // 8, 8, k), wu.view(i // 8, 8, k)], 1).reshape(n, k)
    wcat_nk = torch.cat([wg, wu], 0)
    d = torch.empty(m, i, device="cuda", dtype=dt)
    ref = F.silu(a.float() @ wg.float().t()) * (a.float() @ wu.float().t())
    rows = []
    for kmajor in (True, False):
        layout = "k_major" if kmajor else "n_major"
        wgu = wgu_nk if kmajor else wgu_nk.t().contiguous()
        wcat_t = wcat_nk.t() if kmajor else wcat_nk.t().contiguous()  # [K, 2I]
        wg_t = wg.t() if kmajor else wg.t().contiguous()
        wu_t = wu.t() if kmajor else wu.t().contiguous()

        def concat(wcat_t: Any = wcat_t) -> Any:
            y = torch.matmul(a, wcat_t)
            return F.silu(y[:, :i]) * y[:, i:]

        def two_gemms(wg_t: Any = wg_t, wu_t: Any = wu_t) -> Any:
            return F.silu(torch.matmul(a, wg_t)) * torch.matmul(a, wu_t)

        t_concat = _steady(concat, torch, rounds)
        t_two = _steady(two_gemms, torch, rounds)
        t_peer = min(t_concat, t_two)
        row: dict[str, Any] = {
            "shape": name,
            "m": m,
            "n": n,
            "k": k,
            "dtype": dtype_name,
            "b_layout": layout,
            "epilogue": "swiglu",
            "cublas_s": t_peer,
            "cublas_path": "concat + silu * up" if t_concat <= t_two else "two GEMMs",
            "cublas_concat_s": t_concat,
            "cublas_two_gemms_s": t_two,
            "cublas_max_abs_error": float((concat().float() - ref).abs().max()),
            "cublas_two_gemms_max_abs_error": float((two_gemms().float() - ref).abs().max()),
            "ours": {},
        }
        chosen = _selected_tile(dtype_name, m, n, k, kmajor, "swiglu")
        row["selected_tile"] = chosen
        for c in configs:
            if (
                c["dtype"] != dtype_name
                or c["b_kmajor"] != kmajor
                or c["activation"] != "swiglu"
                or (selected and c["tile"] != chosen)
            ):
                continue
            fn = getattr(lib, f"bench_{c['symbol']}")
            args = _launch_args(a, wgu, None, None, d, (m, n, k), c["swizzle"], stream)
            row["ours"][c["tile"]] = _time_config(
                fn, args, d, ref, t_peer, 2 * m * n * k, torch, rounds
            )
        _close_row(row, chosen, t_peer, 2 * m * n * k)
        rows.append(row)
        keys = ("shape", "b_layout", "cublas_path", "best_tile", "best_vs_cublas")
        print(json.dumps({k2: row[k2] for k2 in keys if k2 in row}), flush=True)
    return rows


def to_markdown(doc: dict[str, Any]) -> str:
    tiles = sorted({t for r in doc["rows"] for t in r["ours"]})
    head = [
        "shape",
        "M",
        "N",
        "K",
        "dtype",
        "B",
        "epilogue",
        "cuBLAS TFLOP/s",
        *tiles,
        "best / cuBLAS",
        "selected / cuBLAS",
        "max abs error (selected; cuBLAS)",
    ]
    lines = [
        "# CUTLASS GEMM configurations vs cuBLAS",
        "",
        f"{doc['device']}, torch {doc['torch']}, {doc['date']}; median of {doc['rounds']} rounds "
        f"of {doc['calls_per_round']} calls, each way in its own steady state. Tile columns: "
        "TFLOP/s of each configuration. Errors: against the float32 product of the same "
        "operands (float32 rows: TF32 on, as cuBLAS's peer runs). "
        "Command: `python -m benchmarks.gemm_bench run DIR OUT`.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in doc["rows"]:
        cells = [
            r["shape"],
            str(r["m"]),
            str(r["n"]),
            str(r["k"]),
            r["dtype"],
            r["b_layout"],
            r["epilogue"],
            f"{r['cublas_tflops']:.0f}",
        ]
        for t in tiles:
            v = r["ours"].get(t)
            cells.append(
                f"{v['tflops']:.0f}"
                if v and "tflops" in v
                else ("-" if not v else f"err {v.get('status')}")
            )
        cells.append(f"{r['best_vs_cublas']:.3f}x ({r['best_tile']})" if "best_tile" in r else "-")
        cells.append(
            f"{r['selected_vs_cublas']:.3f}x ({r['selected_tile']})"
            if "selected_vs_cublas" in r
            else "-"
        )
        sel = r["ours"].get(r.get("selected_tile", ""), {})
        cells.append(
            f"{sel['max_abs_error']:.1e}; {r['cublas_max_abs_error']:.1e}"
            if "max_abs_error" in sel
            else "-"
        )
        lines.append("| " + " | ".join(cells) + " |")
    for r in doc["rows"]:
        if "cublas_path" in r:
            lines.append(
                f"\n{r['shape']} ({r['b_layout']}, swiglu: N = 2I = {r['n']}, output "
                f"[{r['m']}, {r['n'] // 2}]): cuBLAS one GEMM on the concatenated weight + "
                f"silu(g) * u {r['cublas_concat_s'] * 1e6:.1f} us, two GEMMs "
                f"{r['cublas_two_gemms_s'] * 1e6:.1f} us (max abs error "
                f"{r['cublas_two_gemms_max_abs_error']:.1e}); the faster is the row's cuBLAS."
            )
    ratios = [r["best_vs_cublas"] for r in doc["rows"] if "best_vs_cublas" in r]
    if ratios:
        gm = statistics.geometric_mean(ratios)
        lines += [
            "",
            f"Best configuration vs cuBLAS: geometric mean {gm:.3f}x, minimum "
            f"{min(ratios):.3f}x over {len(ratios)} rows.",
        ]
    chosen = [r["selected_vs_cublas"] for r in doc["rows"] if "selected_vs_cublas" in r]
    if chosen:
        lines.append(
            f"The selector's tile vs cuBLAS: geometric mean "
            f"{statistics.geometric_mean(chosen):.3f}x, minimum {min(chosen):.3f}x over "
            f"{len(chosen)} rows; {sum(c >= 0.95 for c in chosen)} of them >= 0.95x."
        )
    return "\n".join(lines) + "\n"


def suggest(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per shape class of worker.gemm_selection: the geometric mean over the class's rows of
    each tile's speed against cuBLAS (the selection table takes the best)."""
    from worker.gemm import weight_spec
    from worker.gemm_selection import shape_class

    per: dict[str, dict[str, list[float]]] = {}
    for r in doc["rows"]:
        spec = weight_spec(dtype=r["dtype"], m=r["m"], n=r["n"], k=r["k"], b_kmajor=True)
        key = "/".join(shape_class(spec))
        for tile, v in r["ours"].items():
            if "vs_cublas" in v:
                per.setdefault(key, {}).setdefault(tile, []).append(v["vs_cublas"])
    return {
        key: {t: round(statistics.geometric_mean(v), 3) for t, v in sorted(tiles.items())}
        for key, tiles in sorted(per.items())
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemm_bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument(
        "--acts", nargs="+", default=["none"], help="activations, or as-used: each model GEMM's own"
    )
    b.add_argument("--dtypes", nargs="+", default=["float16"])
    b.add_argument(
        "--tiles",
        nargs="+",
        default=None,
        help="tile names, or 'selected': the selector's (with --acts as-used: each tile at "
        "each model GEMM's own epilogue)",
    )
    b.add_argument(
        "--source-c",
        nargs="+",
        choices=["yes", "no"],
        default=["no", "yes"],
        help="configurations without C (bias, activation) and/or with it (residual)",
    )
    b.add_argument("--emit", action="store_true", help="write sources + build.sh, compile nothing")
    b.add_argument("--shapes", choices=sorted(SHAPES), default="all")
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument(
        "--epilogues",
        nargs="+",
        default=["bias", "bias_residual"],
        help=f"of {sorted(EPILOGUES)}, or as-used: each model GEMM's own (with --shapes models)",
    )
    r.add_argument("--shapes", choices=sorted(SHAPES), default="all")
    r.add_argument(
        "--selected", action="store_true", help="per shape, only the tile the selector picks"
    )
    sg = sub.add_parser("suggest", help="per shape class, each tile's geomean vs cuBLAS")
    sg.add_argument("json", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "suggest":
        print(json.dumps(suggest(json.loads(args.json.read_text())), indent=1))
    elif args.cmd == "build":
        build(
            args.dir,
            args.acts,
            args.dtypes,
            args.tiles,
            [c == "yes" for c in args.source_c],
            args.emit,
            args.shapes,
        )
    else:
        run(args.dir, args.out, args.rounds, args.epilogues, args.selected, args.shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
