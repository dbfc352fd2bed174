"""When each CTA of a warp-specialized Hopper kernel starts, works and ends (H200).

    python3 benchmarks/timeline_probe.py --dir .gpu/tl14 --out $OUT/timeline \\
        --probe 1:b16_s256_n16_h128 --probe 2:b16_s256_n16_h128

Each ``N:shape`` runs the library's object built with ``-DSTACKFUSE_TIMELINE=N``
(``hopper_kernel.py``'s catalog) at a benchmark shape: the kernel writes %globaltimer stamps at
each CTA's start and around each consumer warpgroup's tiles into a buffer set with
``stackfuse_timeline_set_N`` (worker/kernels/hopper_kernel_ws.cuh). Why: Nsight Compute says how
many cycles each SM was active, not whether the idle ones were idle at the start of the launch
or at its end, nor how long each tile took; that decides whether a scheduler or the tile's own
latency is the next thing to change. Writes ``<out>.json`` (summaries of every run, one run's
stamps) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hopper_kernel import ALL_SHAPES, LIB_NAME, _setup_runtime

K_TILES = 20  # timeline::kTiles
PER_WG = 2 + 2 * K_TILES
PER_CTA = 2 + 3 * PER_WG
MAX_CTAS = 8192
RUNS = 7


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]


def summarize(raw: list[int], wgs: int) -> dict[str, Any]:
    """Microsecond figures of one launch from its stamps (ns)."""
    ctas: list[dict[str, Any]] = []
    for c in range(len(raw) // PER_CTA):
        row = raw[c * PER_CTA : (c + 1) * PER_CTA]
        if row[0] == 0:
            continue
        per_wg: list[dict[str, Any]] = []
        for w in range(wgs):
            base = 2 + w * PER_WG
            n = row[base]
            tiles = [(row[base + 2 + 2 * i], row[base + 3 + 2 * i]) for i in range(min(n, K_TILES))]
            per_wg.append({"tiles": n, "exit": row[base + 1], "stamps": tiles})
        ctas.append({"cta": c, "start": row[0], "sm": row[1], "wgs": per_wg})
    t0 = min(c["start"] for c in ctas)
    end = max(w["exit"] for c in ctas for w in c["wgs"])
    span = (end - t0) / 1e3
    starts = [(c["start"] - t0) / 1e3 for c in ctas]
    ends = [(max(w["exit"] for w in c["wgs"]) - t0) / 1e3 for c in ctas]
    busy = sum(e - s for s, e in zip(starts, ends, strict=True))
    first_tile_end = [
        (c["wgs"][0]["stamps"][0][1] - t0) / 1e3 for c in ctas if c["wgs"][0]["stamps"]
    ]
    by_round: dict[int, list[float]] = {}
    for cta in ctas:
        for i, (b, e) in enumerate(cta["wgs"][0]["stamps"]):
            by_round.setdefault(i, []).append((e - b) / 1e3)
    tiles = [c["wgs"][0]["tiles"] for c in ctas]
    late = sorted(ctas, key=lambda c: -max(w["exit"] for w in c["wgs"]))[:5]
    return {
        "ctas": len(ctas),
        "span_us": round(span, 2),
        "idle_fraction": round(1 - busy / (len(ctas) * span), 3),
        "start_us": {
            q: round(_pct(starts, p), 2)
            for q, p in (("min", 0), ("p50", 0.5), ("p90", 0.9), ("max", 1))
        },
        "end_us": {
            q: round(_pct(ends, p), 2)
            for q, p in (("min", 0), ("p10", 0.1), ("p50", 0.5), ("max", 1))
        },
        "first_tile_end_us": {
            q: round(_pct(first_tile_end, p), 2) for q, p in (("min", 0), ("p50", 0.5), ("max", 1))
        },
        "tile_us_by_round": {
            i: {
                "n": len(v),
                "p50": round(statistics.median(v), 2),
                "min": round(min(v), 2),
                "max": round(max(v), 2),
            }
            for i, v in sorted(by_round.items())
        },
        "tiles_per_cta": {str(n): tiles.count(n) for n in sorted(set(tiles))},
        "latest": [
            {
                "cta": c["cta"],
                "sm": c["sm"],
                "tiles": c["wgs"][0]["tiles"],
                "start_us": round((c["start"] - t0) / 1e3, 2),
                "end_us": round((max(w["exit"] for w in c["wgs"]) - t0) / 1e3, 2),
            }
            for c in late
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--probe", action="append", required=True, help="N:shape")
    args = ap.parse_args()
    torch, tvm_ffi = _setup_runtime()
    manifest = json.loads((args.dir / "manifest.json").read_text())
    lib_path = args.dir / LIB_NAME
    mod = tvm_ffi.load_module(str(lib_path))
    lib = ctypes.CDLL(str(lib_path))
    buf = torch.zeros(MAX_CTAS * PER_CTA, dtype=torch.int64, device="cuda")
    results = []
    for probe in args.probe:
        n, shape_name = probe.split(":")
        _name, b, s, nq, nkv, h, _causal, dtype = ALL_SHAPES[shape_name]
        slot = next(
            (
                x
                for x in manifest
                if f"timeline{n}_" in x["symbol"]
                and x["kind"] == "stacked"
                and (x["nq"], x["nkv"], x["head_dim"]) == (nq, nkv, h)
            ),
            None,
        )
        if slot is None:
            raise SystemExit(f"{probe}: no timeline object {n} for Nq {nq}, Nkv {nkv}, H {h}")
        wgs = 2  # every probed kernel has two consumer warpgroups
        dt = torch.float16 if dtype == "float16" else torch.bfloat16
        qkv = torch.randn(b, s, (nq + 2 * nkv) * h, device="cuda").to(dt)
        out = torch.empty(b, s, nq, h, dtype=dt, device="cuda")
        setter = getattr(lib, f"stackfuse_timeline_set_{n}")
        setter.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        fn = mod[slot["symbol"]]
        runs = []
        raw_kept: list[int] = []
        with tvm_ffi.use_torch_stream():
            assert setter(None, 0) == 0
            for _ in range(5):
                fn(qkv, out)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn(qkv, out)
            stop.record()
            torch.cuda.synchronize()
            event_us = start.elapsed_time(stop) * 1e3 / 20
            assert setter(ctypes.c_void_p(buf.data_ptr()), MAX_CTAS) == 0
            for r in range(RUNS):
                buf.zero_()
                for _ in range(3):  # the last of a few back-to-back launches, as in the benchmark
                    fn(qkv, out)
                torch.cuda.synchronize()
                raw = buf.cpu().tolist()
                runs.append(summarize(raw, wgs))
                if r == RUNS // 2:
                    raw_kept = raw
            assert setter(None, 0) == 0
        ncta = runs[0]["ctas"]
        results.append(
            {
                "probe": probe,
                "symbol": slot["symbol"],
                "variant": slot["variant"],
                "event_us_unstamped": round(event_us, 2),
                "runs": runs,
                "stamps_one_run": raw_kept[: ncta * PER_CTA],
            }
        )
        print(probe, slot["variant"], json.dumps(runs[RUNS // 2])[:600], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results))
    lines = ["# Timeline probe (per-CTA %globaltimer stamps)", ""]
    lines.append(
        "| probe | variant | event us | span us | idle | start p50/max | end min/p10/p50 "
        "| first tile end p50 | tile us by round (p50) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for run in res["runs"]:
            tr = ", ".join(f"{v['p50']}" for v in run["tile_us_by_round"].values())
            lines.append(
                f"| {res['probe']} | {res['variant']} | {res['event_us_unstamped']} | "
                f"{run['span_us']} | "
                f"{run['idle_fraction']} | {run['start_us']['p50']}/{run['start_us']['max']} | "
                f"{run['end_us']['min']}/{run['end_us']['p10']}/{run['end_us']['p50']} | "
                f"{run['first_tile_end_us']['p50']} | {tr} |"
            )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
