"""RMSNorm as the libraries run it (TVM's own kernel, scheduled by dlight) against PyTorch.

The Llama-style decoder spends ~7% of its GPU time in RMSNorm. ``worker.build`` schedules TVM's
kernels with dlight rules; this compares the RMSNorm kernel of TVM's default rules (its match is
``GeneralReduction``) with ours (``RMSNorm`` first), and with PyTorch: eager
``F.rms_norm`` and ``torch.compile`` of it. Shapes: the whole-model benchmark's decoder
(2048 rows x 2048) and sizes it was not chosen on.

    python -m benchmarks.norm_bench build .gpu/norm     # here: TVM + nvcc
    python -m benchmarks.norm_bench run .gpu/norm OUT   # there: GPU

The kernels take 10-50 us, less than a Python call of a TVM VM function costs on the host, so
call-to-call wall time measures the host: two byte-identical libraries differed by 1.37x in it.
The figure compared is each way's GPU time per call, the kernels' device time under
torch.profiler (median of ``--rounds`` profiles of ``PROFILED_CALLS`` calls, after its own
steady state); wall time per call (CUDA events around ``CALLS`` back-to-back calls) is kept
beside it. Numerics against float32 PyTorch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: (name, batch, seq, hidden), as a decoder's hidden states [batch, seq, hidden]
SHAPES: list[tuple[str, int, int, int]] = [
    ("llama_b1_s2048", 1, 2048, 2048),
    ("llama7b_b1_s4096", 1, 4096, 4096),
    ("b8_s1024_h4096", 8, 1024, 4096),
    ("b4_s512_h5120", 4, 512, 5120),
    ("b16_s128_h1024", 16, 128, 1024),
    ("rows_2d_b2048_h2048", 0, 2048, 2048),
]
EPS = 1e-6
CALLS = 50


def _dims(batch: int, seq: int, hidden: int) -> tuple[int, ...]:
    """The input's shape; batch 0: a 2-D [rows, hidden] input."""
    return (seq, hidden) if batch == 0 else (batch, seq, hidden)


def _module(shape: tuple[int, ...]) -> Any:
    from worker.toolchain import import_tvm

    tvm = import_tvm()
    from tvm.script import relax as R
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import relax as rb

    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor(shape, "float16"))
        w = R.arg("w", R.Tensor((shape[-1],), "float16"))
        with R.dataflow() as frame:
            y = R.emit(R.nn.rms_norm(x, w, axes=[-1], epsilon=EPS))
            R.output(y)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def build(out_dir: Path) -> None:
    from worker import build as tvm_build

    out_dir.mkdir(parents=True, exist_ok=True)
    ways = {"tvm_default": tvm_build.TVM_DEFAULT_RULES, "stackfuse": tvm_build.SCHEDULE_RULES}
    for name, batch, seq, hidden in SHAPES:
        for way, rules in ways.items():
            t0 = time.monotonic()
            tvm_build.build_library(
                _module(_dims(batch, seq, hidden)),
                {},
                arch="sm_90",
                out_path=out_dir / f"{name}.{way}.so",
                schedule_rules=rules,
            )
            print(f"{name} {way}: {time.monotonic() - t0:.1f} s", flush=True)
    (out_dir / "manifest.json").write_text(
        json.dumps({"shapes": SHAPES, "ways": {k: list(v) for k, v in ways.items()}})
    )


def _steady(fn: Any, torch: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        for _ in range(10):
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


def _gpu_us(fn: Any, torch: Any, rounds: int) -> float:
    """Kernel device time per call (us), median over ``rounds`` profiles."""
    from benchmarks.models_gpu import gpu_breakdown

    for _ in range(10):
        fn()
    return statistics.median(gpu_breakdown(fn, torch)["total"] for _ in range(rounds))


def run(build_dir: Path, out_dir: Path, rounds: int) -> None:
    import torch
    import torch.nn.functional as F
    import tvm_ffi

    from worker.toolchain import import_tvm

    tvm = import_tvm()
    from tvm.runtime.vm import VirtualMachine

    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((build_dir / "manifest.json").read_text())
    rows_out: list[dict[str, Any]] = []
    torch.manual_seed(0)
    for name, batch, seq, hidden in manifest["shapes"]:
        rows = max(batch, 1) * seq
        x = torch.randn(*_dims(batch, seq, hidden), device="cuda").half()
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).half()
        ref = F.rms_norm(x.float(), (hidden,), w.float(), EPS)

        def eager(x: Any = x, w: Any = w, hidden: int = hidden) -> Any:
            return F.rms_norm(x, (hidden,), w, EPS)

        compiled = torch.compile(eager)
        row: dict[str, Any] = {"shape": name, "rows": rows, "hidden": hidden, "ways": {}}
        peers = {"torch_eager": eager, "torch_compile": compiled}
        for way, fn in peers.items():
            out = fn()
            row["ways"][way] = {
                "s": _steady(fn, torch, rounds),
                "gpu_us": _gpu_us(fn, torch, rounds),
                "max_abs_error": float((out.float() - ref).abs().max()),
            }
        for way in manifest["ways"]:
            vm = VirtualMachine(
                tvm.runtime.load_module(str(build_dir / f"{name}.{way}.so")), tvm.cuda(0)
            )
            args = [tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(w)]
            main = vm["main"]

            def ours(main: Any = main, args: Any = args) -> Any:
                with tvm_ffi.use_torch_stream():
                    return main(*args)

            out = torch.from_dlpack(ours())
            torch.cuda.synchronize()
            row["ways"][way] = {
                "s": _steady(ours, torch, rounds),
                "gpu_us": _gpu_us(ours, torch, rounds),
                "max_abs_error": float((out.float() - ref).abs().max()),
            }
        nbytes = 2 * 2 * rows * hidden  # read x, write y (float16)
        for v in row["ways"].values():
            v["gb_per_s"] = nbytes / (v["gpu_us"] * 1e-6) / 1e9
        ways_ = row["ways"]
        best_peer = min(ways_[p]["gpu_us"] for p in peers)
        row["stackfuse_vs_best_torch"] = best_peer / ways_["stackfuse"]["gpu_us"]
        row["stackfuse_vs_tvm_default"] = (
            ways_["tvm_default"]["gpu_us"] / ways_["stackfuse"]["gpu_us"]
        )
        row["wall_stackfuse_vs_tvm_default"] = ways_["tvm_default"]["s"] / ways_["stackfuse"]["s"]
        rows_out.append(row)
        keys = ("shape", "stackfuse_vs_best_torch", "stackfuse_vs_tvm_default")
        print(json.dumps({k: row[k] for k in keys}), flush=True)
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rounds": rounds,
        "command": "python -m benchmarks.norm_bench run DIR OUT",
        "rows": rows_out,
    }
    (out_dir / "norm_bench.json").write_text(json.dumps(doc, indent=1))
    ways = ["stackfuse", "tvm_default", "torch_eager", "torch_compile"]
    lines = [
        "# RMSNorm: TVM's kernel under our dlight rules and TVM's default, against PyTorch",
        "",
        f"{doc['device']}, torch {doc['torch']}, {doc['date']}; float16 in and out. GPU time "
        f"per call: kernel device time under torch.profiler, median of {rounds} profiles; wall "
        f"time per call: median of {rounds} rounds of {CALLS} calls (host-bound at these sizes). "
        "Command: `python -m benchmarks.norm_bench build DIR` (build host), then "
        "`python -m benchmarks.norm_bench run DIR OUT` (GPU).",
        "",
        "| shape | rows | hidden | "
        + " | ".join(f"{w} GPU us (GB/s)" for w in ways)
        + " | ours / best PyTorch (GPU) | ours / TVM default (GPU) | ours / TVM default (wall)"
        " | max abs error (ours) |",
        "|---" * (len(ways) + 7) + "|",
    ]
    for r in rows_out:
        cells = [f"{r['ways'][w]['gpu_us']:.1f} ({r['ways'][w]['gb_per_s']:.0f})" for w in ways]
        lines.append(
            f"| {r['shape']} | {r['rows']} | {r['hidden']} | "
            + " | ".join(cells)
            + f" | {r['stackfuse_vs_best_torch']:.2f}x | {r['stackfuse_vs_tvm_default']:.2f}x"
            f" | {r['wall_stackfuse_vs_tvm_default']:.2f}x"
            f" | {r['ways']['stackfuse']['max_abs_error']:.1e} |"
        )
    (out_dir / "norm_bench.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.norm_bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.dir)
    else:
        run(args.dir, args.out, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
