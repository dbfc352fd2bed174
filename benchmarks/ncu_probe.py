"""Run one benchmark shape's kernels a few times, for Nsight Compute to profile (H200).

    ncu -k regex:'device_kernel|cudnn|short_seq' -c 8 --section SpeedOfLight ... \\
        python3 benchmarks/ncu_probe.py --dir .gpu/hk7 --shape b32_s128_n12_h64_bert \\
        --variant pingpong_128x128

Calls our variant's symbol (from a ``hopper_kernel.py build`` library) and SDPA's cuDNN backend
on views of the same stacked tensor, twice each, so that ncu sees one warm launch of each. Why:
the kernel benchmark says how long each takes; ncu says where the time goes (occupancy, DRAM
and tensor-pipe throughput, warp stalls), which is what decides the next kernel change.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hopper_kernel import ALL_SHAPES, LIB_NAME, _bench_slots, _setup_runtime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--shape", required=True, choices=sorted(ALL_SHAPES))
    ap.add_argument("--variant", action="append", required=True)
    args = ap.parse_args()
    torch, tvm_ffi = _setup_runtime()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = ALL_SHAPES[args.shape]
    _name, b, s, nq, nkv, h, causal, dtype = shape
    manifest = json.loads((args.dir / "manifest.json").read_text())
    mod = tvm_ffi.load_module(str(args.dir / LIB_NAME))
    dt = torch.float16 if dtype == "float16" else torch.bfloat16
    qkv = torch.randn(b, s, (nq + 2 * nkv) * h, device="cuda").to(dt)
    out = torch.empty(b, s, nq, h, dtype=dt, device="cuda")
    q = qkv[..., : nq * h].view(b, s, nq, h).transpose(1, 2)
    k = qkv[..., nq * h : (nq + nkv) * h].view(b, s, nkv, h).transpose(1, 2)
    v = qkv[..., (nq + nkv) * h :].view(b, s, nkv, h).transpose(1, 2)
    with tvm_ffi.use_torch_stream():
        for slot in _bench_slots(manifest, shape):
            if slot["variant"] in args.variant:
                for _ in range(2):
                    mod[slot["symbol"]](qkv, out)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for _ in range(2):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=nkv != nq)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
