"""Stacked attention three (or four) ways, side by side, in one run on one GPU.

    python -m benchmarks.attention_bench build OUT_DIR   # here: builds the libraries
    python -m benchmarks.attention_bench run OUT_DIR     # on the GPU: times them, writes results
    python -m benchmarks.attention_bench build-grid OUT_DIR   # the generated grid: ours only
    python -m benchmarks.attention_bench grid OUT_DIR         # on the GPU: ours vs SDPA's fastest

Per shape (fp16, stacked ``qkv[B, S, 3*N*H]``):
- ``stackfuse``: our library, kernel chosen by the selector (options.kernel="auto");
- ``stackfuse_sm80``: our library forced onto the SM80-class CUTLASS kernel;
- ``tvm_unfused``: the same module compiled by TVM alone (split + reshape + attention);
- ``sdpa``: PyTorch SDPA on views of the same stacked tensor, default backend, and ``sdpa_best``:
  the fastest of its backends (flash, efficient, cudnn, math) for that shape: their best path.

Two times per way: *call* latency as a user calls it (CUDA events around back-to-back calls, the
median of repeats) and *kernel* time from the profiler (sum of GPU kernel durations per call),
the median of ROUNDS rounds that each time every way once (order rotated). In a round, a way
runs back to back for about PREROLL_S untimed, then 20 timed calls (*kernel_s*, its own steady
state); the first 20 calls of that stream, right after the way before it, are kept too
(*kernel_s_after_switch*, what the harness timed before commit 3718d26). At the long shapes
both kernels run at the card's power limit, and calls timed right after a lighter way borrow its
power headroom: such rounds spread by up to 12% by predecessor.
FLOPs = 4*B*S*S*N*H (halved for causal). Results: benchmarks/results/attention_bench.{json,md}.

``grid``: the shapes of ``grid_shapes()`` (fp16 and bf16, head dims 64 to 256, causal, GQA and
MQA: shapes the selector was not tuned on), ours beside SDPA's fastest only, in the same harness.
Results: attention_grid.{json,md}.

    python -m benchmarks.attention_bench power OUT_DIR [SHAPES]   # on the GPU, long shapes

``power``: ours and SDPA (default, cuDNN) under sustained load: each after an idle pause, the
time of every launch for a second (how clocks move), then alternating windows of a few seconds
with NVML's energy counter (time and energy per launch). Results: attention_power.{json,md}.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.hopper_kernel import ROUNDS, rotated_rounds, warm_clocks

CALLS = 20  # timed calls per way per round
PREROLL_S = 0.2  # untimed calls before them, in seconds of that way's work ...
PREROLL_MAX_CALLS = 400  # ... at most this many (short shapes are launch-bound, not power-bound)
SLOW_CALL_S = 0.05  # a way slower than this per call (not offloaded) is timed once, not in rounds

SHAPES: list[dict[str, Any]] = [
    {"name": "b8_s2048_n16_h128", "b": 8, "s": 2048, "n": 16, "h": 128},
    {"name": "b4_s4096_n32_h128", "b": 4, "s": 4096, "n": 32, "h": 128},
    {"name": "b2_s8192_n16_h64", "b": 2, "s": 8192, "n": 16, "h": 64},
    {
        "name": "b8_s2048_n16_h128_causal",
        "b": 8,
        "s": 2048,
        "n": 16,
        "h": 128,
        "causal": "BottomRight",
    },
    {"name": "bert_base_b32_s128_n12_h64", "b": 32, "s": 128, "n": 12, "h": 64},
    {"name": "b4_s128_n12_h64", "b": 4, "s": 128, "n": 12, "h": 64},
    {"name": "b8_s2048_q32_kv8_h128_gqa", "b": 8, "s": 2048, "n": 32, "h": 128, "n_kv": 8},
    {"name": "b32_s256_q16_kv4_h64_gqa", "b": 32, "s": 256, "n": 16, "h": 64, "n_kv": 4},
    {"name": "b16_s256_n12_h64", "b": 16, "s": 256, "n": 12, "h": 64},
    # the three-warpgroup causal kernel, head dim 256 with our first-block softmax, one short
    # head-dim-128 sequence in 64-row tiles, and Llama-3-8B's attention over one 1024-token
    # prompt
    {
        "name": "b8_s2048_n16_h64_causal",
        "b": 8,
        "s": 2048,
        "n": 16,
        "h": 64,
        "causal": "BottomRight",
    },
    {"name": "b4_s2048_n8_h256", "b": 4, "s": 2048, "n": 8, "h": 256},
    {"name": "b1_s512_n16_h128", "b": 1, "s": 512, "n": 16, "h": 128},
    {
        "name": "b1_s1024_q32_kv8_h128_gqa_causal",
        "b": 1,
        "s": 1024,
        "n": 32,
        "h": 128,
        "n_kv": 8,
        "causal": "BottomRight",
    },
    # causal launches of a few waves, balanced by the host's chunk of heads: one
    # 2048-token prompt at head dim 128 (pingpongk_128x128) and two at head dim 64 (192-row
    # blocks, one chunk of all 32 heads)
    {
        "name": "b1_s2048_n16_h128_causal",
        "b": 1,
        "s": 2048,
        "n": 16,
        "h": 128,
        "causal": "BottomRight",
    },
    {
        "name": "b2_s2048_n16_h64_causal",
        "b": 2,
        "s": 2048,
        "n": 16,
        "h": 64,
        "causal": "BottomRight",
    },
]

#: the generated grid (``grid``): every head dim x causal x dtype cell gets two sizes, taken in turn
#: from GRID_SIZES (batch, length, query heads), with K/V heads taken in turn from MHA, groups of 4
#: and MQA; none of these is a row the selector was tuned on. GRID_NAMED: the shapes where
#: SDPA led in an outside measurement (BERT-large-like, diffusion-model-like), appended as is.
GRID_HEAD_DIMS = (64, 80, 96, 128, 256)
GRID_SIZES = [
    (1, 4096, 32),
    (2, 2048, 16),
    (4, 1024, 16),
    (16, 512, 16),
    (32, 256, 12),
    (1, 512, 16),
    (2, 4096, 10),
    (64, 197, 12),
    (1, 8192, 16),
    (8, 1024, 20),
    (8, 128, 12),
    (4, 2048, 32),
    (1, 1024, 8),
]
GRID_NAMED = [(16, 512, 16, 16, 64, False, "float16"), (2, 4096, 10, 10, 64, False, "float16")]
#: sliding windows (bottom-right causal, window W), beside the grid: (B, S, Nq, Nkv, H, W, dtype).
#: Mistral-7B's attention at 8k tokens with its 4096 window, a 1024 window at 4k, and a short
#: window at head dim 64. PyTorch's peers are SDPA with the window as a boolean mask and
#: FlexAttention (compiled) with a sliding-window block mask.
GRID_WINDOWS = [
    (1, 8192, 32, 8, 128, 4096, "bfloat16"),
    (4, 4096, 32, 8, 128, 1024, "float16"),
    (2, 4096, 16, 16, 64, 256, "float16"),
]


#: ragged batches (``attention_var_len``, packed ``qkv[1, T, 3 N H]`` + int32 lengths, seqstart
#: computed in the graph): (lengths, N, H, causal, dtype). A serving prefill batch of 8 prompts
#: (4096 tokens, Llama-class heads), and 32 BERT-length sequences. Peers: SDPA on a nested
#: (jagged) tensor of the same tokens, FlexAttention with a document mask, and SDPA on the
#: batch padded to its longest sequence with a key-padding mask.
GRID_RAGGED = [
    ([1800, 1024, 512, 300, 200, 150, 90, 20], 32, 128, True, "bfloat16"),
    ([128, 97, 64, 120, 33, 128, 71, 100] * 4, 12, 64, False, "float16"),
]


def _grid_shape(
    stem: str,
    dtype: str,
    *,
    b: int,
    s: int,
    n: int,
    h: int,
    n_kv: int | None = None,
    causal: bool = False,
) -> dict[str, Any]:
    """One grid row: its name (``stem`` and the dtype's short name) and dims; ``n_kv`` only
    where it differs from ``n``, causal masks bottom-right."""
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    shape: dict[str, Any] = {"name": f"{stem}_{short}", "b": b, "s": s, "n": n, "h": h}
    shape["dtype"] = dtype
    if n_kv is not None and n_kv != n:
        shape["n_kv"] = n_kv
    if causal:
        shape["causal"] = "BottomRight"
    return shape


def grid_shapes() -> list[dict[str, Any]]:
    """The grid's shapes, in a fixed order (batch x length x heads x head dim x causal x GQA x
    dtype, sampled as GRID_SIZES says)."""
    picked: list[tuple[int, int, int, int, int, bool, str]] = []
    i = 0
    for h, causal, dtype in itertools.product(
        GRID_HEAD_DIMS, (False, True), ("float16", "bfloat16")
    ):
        for _ in range(2):
            b, s, n = GRID_SIZES[i % len(GRID_SIZES)]
            n_kv = (n, n // 4, 1)[i % 3]
            picked.append((b, s, n, n_kv, h, causal, dtype))
            i += 1
    shapes = []
    for b, s, n, n_kv, h, causal, dtype in picked + GRID_NAMED:
        stem = f"b{b}_s{s}_q{n}_kv{n_kv}_h{h}{'_causal' if causal else ''}"
        shapes.append(_grid_shape(stem, dtype, b=b, s=s, n=n, h=h, n_kv=n_kv, causal=causal))
    for b, s, n, n_kv, h, w, dtype in GRID_WINDOWS:
        stem = f"b{b}_s{s}_q{n}_kv{n_kv}_h{h}_window{w}"
        shape = _grid_shape(stem, dtype, b=b, s=s, n=n, h=h, n_kv=n_kv, causal=True)
        shapes.append(shape | {"window": w})
    for lengths, n, h, causal, dtype in GRID_RAGGED:
        t = sum(lengths)
        stem = f"ragged{len(lengths)}_t{t}_q{n}_h{h}{'_causal' if causal else ''}"
        shape = _grid_shape(stem, dtype, b=1, s=t, n=n, h=h, causal=causal)
        shapes.append(shape | {"lengths": lengths})
    return shapes


WAYS: dict[str, dict[str, Any]] = {
    "stackfuse": {"kernel": "auto"},
    "stackfuse_sm80": {"kernel": "sm80"},
    "tvm_unfused": {"fuse_stacked": False, "offload_plain": False},
}


def flops(shape: dict[str, Any]) -> float:
    """4 B N H x (query, key) pairs computed: S^2, half of it causal, a window's band."""
    if "lengths" in shape:  # a ragged batch: each sequence attends to its own keys
        one = {k: v for k, v in shape.items() if k != "lengths"}
        return sum(flops(one | {"s": n}) for n in shape["lengths"])
    s, w = shape["s"], shape.get("window")
    if w is not None and w < s:  # rows see min(i + 1, W) keys
        pairs = w * (w + 1) / 2 + (s - w) * w
    else:
        pairs = s * s / 2 if shape.get("causal") else s * s
    return 4.0 * shape["b"] * shape["n"] * shape["h"] * pairs


def build(out_dir: Path, names: list[str] | None = None, *, grid: bool = False) -> None:
    """Compile each shape's libraries: every way for SHAPES, ours alone for the grid."""
    from service.settings import get_settings
    from service.spec import CompileOptions, Target
    from tests.models import ragged_attention_module, stacked_attention_module, to_json
    from worker.pipeline import compile_module

    ways = {"stackfuse": WAYS["stackfuse"]} if grid else WAYS
    for shape in grid_shapes() if grid else SHAPES:
        if names and shape["name"] not in names:
            continue
        if "lengths" in shape:
            mod = ragged_attention_module(
                shape["n"], shape["h"], dtype=shape["dtype"], causal=shape.get("causal")
            )
        else:
            mod = stacked_attention_module(
                shape["b"],
                shape["s"],
                shape["n"],
                shape["h"],
                dtype=shape.get("dtype", "float16"),
                causal=shape.get("causal"),
                n_kv=shape.get("n_kv"),
                window=shape.get("window"),
            )
        for way, opts in ways.items():
            t0 = time.monotonic()
            res = compile_module(
                to_json(mod),
                target=Target(arch="sm_90"),
                options=CompileOptions(validate_on_gpu="never", **opts),
                out_dir=out_dir / shape["name"] / way,
                settings=get_settings(),
            )
            kernels = sorted({m.kernel.family for m in res.report.matches if m.kernel})
            # the Hopper variant, or the family of a kernel that has no variants (SM80-class)
            variants = sorted(
                {
                    str(m.kernel.config.get("variant") or m.kernel.family)
                    for m in res.report.matches
                    if m.kernel
                }
            )
            (out_dir / shape["name"] / way / "meta.json").write_text(
                json.dumps({"shape": shape, "kernels": kernels, "variants": variants})
            )
            print(
                f"built {shape['name']}/{way} {kernels} in {time.monotonic() - t0:.1f}s", flush=True
            )


def _time_calls(fn: Any, torch: Any, *, reps: int, inner: int) -> float:
    """Median seconds per call over ``reps`` batches of ``inner`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(samples)


def _gpu_events(prof: Any) -> list[tuple[float, float]]:
    """(start us, duration us) of every GPU activity the profiler saw (kernels, copies)."""
    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type):
            dur = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
            out.append((float(evt.time_range.start), float(dur)))
    return out


def first_and_last(
    events: list[tuple[float, float]], total_calls: int, calls: int
) -> tuple[float, float]:
    """GPU seconds per call of the first and of the last ``calls`` of ``total_calls`` calls
    made back to back, from their GPU events (any number per call, the same for each)."""
    if not events or total_calls < calls:
        raise ValueError(f"{len(events)} GPU events for {total_calls} calls")
    ev = sorted(events)
    n = max(1, round(len(ev) * calls / total_calls))
    return (
        sum(d for _, d in ev[:n]) / calls / 1e6,
        sum(d for _, d in ev[-n:]) / calls / 1e6,
    )


def preroll_calls(call_s: float) -> int:
    """Untimed calls before a way's timed ones: about PREROLL_S of its work, at least CALLS."""
    return max(CALLS, min(PREROLL_MAX_CALLS, math.ceil(PREROLL_S / max(call_s, 1e-7))))


def _kernel_time(fn: Any, torch: Any, calls: int = 5) -> float:
    """Seconds of GPU kernel time per call, from the profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(d for _, d in _gpu_events(prof)) / 1e6 / calls


def _kernel_stream(fn: Any, torch: Any, pre: int) -> tuple[float, float]:
    """(after switch, steady): GPU seconds per call of the first and the last CALLS calls of
    ``pre`` + CALLS made back to back in one profiled stream, with no sync between them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(pre + CALLS):
            fn()
        torch.cuda.synchronize()
    return first_and_last(_gpu_events(prof), pre + CALLS, CALLS)


def _kernel_rounds(
    ways: dict[str, Any], call_s: dict[str, float], torch: Any
) -> dict[str, dict[str, list[float]]]:
    """Per way, ROUNDS samples of (``after_switch``, ``steady``) GPU seconds per call, in the
    kernel benchmark's order (``rotated_rounds``), after its warm-up (``warm_clocks``)."""
    warm_clocks(torch, [lambda _i, fn=fn: fn() for fn in ways.values()])
    out: dict[str, dict[str, list[float]]] = {n: {"after_switch": [], "steady": []} for n in ways}
    for _rnd, name in rotated_rounds(list(ways)):
        first, last = _kernel_stream(ways[name], torch, preroll_calls(call_s[name]))
        out[name]["after_switch"].append(first)
        out[name]["steady"].append(last)
    return out


def _stacked_input(shape: dict[str, Any], torch: Any) -> Any:
    n_kv = shape.get("n_kv", shape["n"])
    cols = (shape["n"] + 2 * n_kv) * shape["h"]
    dtype = getattr(torch, shape.get("dtype", "float16"))
    return (torch.randn(shape["b"], shape["s"], cols, device="cuda") * 0.5).to(dtype)


def _module_call(lib: Path, qkv: Any, tvm: Any, dev: Any, *more: Any) -> Any:
    """A compiled library's ``main`` on ``qkv`` (and ``more`` inputs), as a user calls it."""
    from tvm.runtime.vm import VirtualMachine

    fn = VirtualMachine(tvm.runtime.load_module(str(lib)), dev)["main"]
    args = [tvm.runtime.from_dlpack(x) for x in (qkv, *more)]
    return lambda: fn(*args)


def _ragged_calls(shape: dict[str, Any], qkv: Any) -> tuple[Any, dict[str, Any]]:
    """PyTorch on a ragged batch packed in ``qkv[1, T, 3 N H]``: SDPA on the batch padded to
    its longest sequence with a key-padding mask (``sdpa``: every backend takes it, so it is
    also the reference); and alone: SDPA on nested (jagged) tensors of the sequences
    (``NESTED``) and FlexAttention with a document mask over the packed tokens (``FLEX``).
    Each returns ``[1, N, T, H]``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths, n, h = shape["lengths"], shape["n"], shape["h"]
    t, causal = sum(lengths), shape.get("causal") is not None
    dev = qkv.device
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], device=dev, dtype=torch.int64)
    lens = torch.tensor(lengths, device=dev)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lens)

    def views() -> tuple[Any, Any, Any]:
        q, k, v = (x.view(t, n, h) for x in qkv[0].split(n * h, dim=1))
        return q, k, v

    def nested() -> Any:  # jagged tensors need compact values: the copies are theirs
        q, k, v = (
            torch.nested.nested_tensor_from_jagged(x.contiguous(), offsets).transpose(1, 2)
            for x in views()
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out.transpose(1, 2).values().view(1, t, n, h).transpose(1, 2)

    def band(_b: Any, _h: Any, qi: Any, ki: Any) -> Any:
        same = doc[qi] == doc[ki]
        return same & (ki <= qi) if causal else same

    block_mask = create_block_mask(band, None, None, t, t, device=dev)
    compiled = torch.compile(flex_attention, dynamic=False)

    def flex() -> Any:
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in views())
        return compiled(q, k, v, block_mask=block_mask)

    longest, count = max(lengths), len(lengths)
    pos = torch.arange(t, device=dev) - offsets[doc]
    keep = torch.arange(longest, device=dev)[None, :] < lens[:, None]
    mask = keep[:, None, None, :]
    if causal:
        i = torch.arange(longest, device=dev)
        mask = mask & (i[None, :] <= i[:, None])[None, None]

    def padded() -> Any:
        outs = []
        for x in views():
            pad = x.new_zeros(count, longest, n, h)
            pad[doc, pos] = x
            outs.append(pad.transpose(1, 2))
        q, k, v = outs
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2)[doc, pos].unsqueeze(0).transpose(1, 2)

    return padded, {"NESTED": nested, "FLEX": flex}


def _sdpa_calls(shape: dict[str, Any], qkv: Any) -> tuple[Any, dict[str, Any]]:
    """SDPA on views of ``qkv`` (split and view in the call, as a user writes it): its default
    backend, and each of flash, efficient and cuDNN forced alone, by backend name. A window
    (bottom-right causal, S = S_kv) goes to SDPA as a boolean mask, which flash refuses, and
    to FlexAttention, compiled, with the same band as a block mask (``FLEX``)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, n, h = shape["b"], shape["s"], shape["n"], shape["h"]
    n_kv = shape.get("n_kv", n)
    causal = shape.get("causal") is not None
    window = shape.get("window")
    mask = None
    if window is not None:
        i = torch.arange(s, device=qkv.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)

    def views() -> tuple[Any, Any, Any]:
        q, k, v = qkv.split([n * h, n_kv * h, n_kv * h], dim=2)
        q = q.view(b, s, n, h).transpose(1, 2)
        k, v = (t.view(b, s, n_kv, h).transpose(1, 2) for t in (k, v))
        return q, k, v

    def sdpa() -> Any:
        q, k, v = views()
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_kv != n)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=n_kv != n)

    forced: dict[str, Any] = {}
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ):

        def alone(backend: Any = backend) -> Any:
            with sdpa_kernel([backend]):
                return sdpa()

        forced[backend.name] = alone
    if window is not None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def band(_b: Any, _h: Any, qi: Any, ki: Any) -> Any:
            return (ki <= qi) & (ki > qi - window)

        block_mask = create_block_mask(band, None, None, s, s, device=qkv.device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex() -> Any:
            q, k, v = views()
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=n_kv != n)

        forced["FLEX"] = flex
    return sdpa, forced


def run(out_dir: Path, names: list[str] | None = None, *, grid: bool = False) -> dict[str, Any]:
    """Time every built way of each shape beside SDPA (the grid: ours alone beside SDPA)."""
    import torch

    from worker.toolchain import import_tvm

    tvm = import_tvm()
    import tvm_ffi

    dev = tvm.cuda(0)
    rows: list[dict[str, Any]] = []
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": (
            (f"STACKFUSE_BENCH_ROUNDS={ROUNDS} " if "STACKFUSE_BENCH_ROUNDS" in os.environ else "")
            + f"python -m benchmarks.attention_bench {'grid' if grid else 'run'} <libs>"
        ),
        "note": "ratio > 1 means faster than the peer; kernel time from torch.profiler (CUPTI)",
        "rows": rows,
    }
    stem, render = ("attention_grid", grid_markdown) if grid else ("attention_bench", to_markdown)

    def save(row: dict[str, Any]) -> None:
        """Add ``row`` and write the results so far: a run cut short keeps its rows."""
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=2))
        (out_dir / f"{stem}.md").write_text(render(doc))

    for shape in grid_shapes() if grid else SHAPES:
        if names and shape["name"] not in names:
            continue
        if grid and not (out_dir / shape["name"]).is_dir():  # the grid runs what was built
            continue
        b, s, n = shape["b"], shape["s"], shape["n"]
        big = b * s * s * n > 4e9
        qkv = _stacked_input(shape, torch)
        more = []
        if "lengths" in shape:  # the ragged batch's lengths: seqstart is computed in the graph
            more.append(torch.tensor(shape["lengths"], dtype=torch.int32, device="cuda"))
        ways: dict[str, Any] = {
            way: _module_call(out_dir / shape["name"] / way / "model.so", qkv, tvm, dev, *more)
            for way in (["stackfuse"] if grid else WAYS)
        }
        calls = _ragged_calls if "lengths" in shape else _sdpa_calls
        ways["sdpa"], forced = calls(shape, qkv)
        row: dict[str, Any] = {
            "shape": shape["name"],
            "dims": shape,
            "variants": json.loads(
                (out_dir / shape["name"] / "stackfuse" / "meta.json").read_text()
            ).get("variants", []),
            "flops": flops(shape),
            "rounds": ROUNDS,
            "calls": CALLS,
            "preroll_s": PREROLL_S,
        }
        with tvm_ffi.use_torch_stream():
            try:
                ref = ways["sdpa"]().transpose(1, 2)
            except Exception as exc:  # no reference: the row says why, the run goes on
                row["sdpa"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                save(row)
                continue
            usable: dict[str, Any] = {}  # fast ways that ran: timed in rounds below
            call_s: dict[str, float] = {}
            for way, fn in ways.items():
                try:
                    out = fn()
                    got = torch.from_dlpack(out) if way != "sdpa" else out.transpose(1, 2)
                    err = float((got.float() - ref.float()).abs().max())
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    # TVM alone, or a site the way could not offload (GQA on the SM80 kernel)
                    slow = way == "tvm_unfused" or time.perf_counter() - t0 > SLOW_CALL_S
                    reps, inner = (3, 1) if slow and big else (5, 3) if slow else (10, 20)
                    call = _time_calls(fn, torch, reps=reps, inner=inner)
                    row[way] = {"call_s": call, "max_abs_err_vs_sdpa": err}
                    if slow:  # far from the others: one measurement is enough
                        row[way]["kernel_s"] = _kernel_time(fn, torch, calls=1)
                    else:
                        usable[way], call_s[way] = fn, call
                except Exception as exc:
                    row[way] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            for name, fn in forced.items():
                try:
                    call_s[name] = _time_calls(fn, torch, reps=3, inner=5)
                    usable[name] = fn
                except Exception as exc:
                    row.setdefault("sdpa_backend_errors", {})[name] = str(exc)[:200]
            kernel = _kernel_rounds(usable, call_s, torch)
            for way, samples in kernel.items():
                if way in forced:
                    continue
                row[way].update(_kernel_fields(samples), preroll_calls=preroll_calls(call_s[way]))
            best: tuple[float, str] | None = None
            for name in forced:
                if name not in kernel:
                    continue
                k = statistics.median(kernel[name]["steady"])
                if best is None or k < best[0]:
                    best = (k, name)
                    t = _time_calls(forced[name], torch, reps=10, inner=20)
                    row["sdpa_best"] = {
                        "backend": name,
                        "call_s": t,
                        **_kernel_fields(kernel[name]),
                        "preroll_calls": preroll_calls(call_s[name]),
                        "call_tflops": row["flops"] / t / 1e12,
                    }
            for way in [*ways, "sdpa_best"]:
                r = row.get(way, {})
                if "kernel_s" in r:
                    r["call_tflops"] = row["flops"] / r["call_s"] / 1e12
                    k = r["kernel_s"]
                    r["kernel_tflops"] = row["flops"] / k / 1e12 if k else None
        add_ratios(row)
        save(row)
    print(render(doc))
    return doc


def _kernel_fields(samples: dict[str, list[float]]) -> dict[str, Any]:
    return {
        "kernel_s": statistics.median(samples["steady"]),
        "kernel_s_rounds": samples["steady"],
        "kernel_s_after_switch": statistics.median(samples["after_switch"]),
        "kernel_s_after_switch_rounds": samples["after_switch"],
    }


def sdpa_best_kernel_s(row: dict[str, Any], key: str = "kernel_s") -> float:
    """SDPA's fastest kernel time at a shape: its default or any backend forced alone."""
    return min(row[w][key] for w in ("sdpa", "sdpa_best") if key in row.get(w, {}))


def kernel_ratio(row: dict[str, Any], key: str = "kernel_s") -> float | None:
    """SDPA's fastest kernel time / ours (``key``: ``kernel_s`` or ``kernel_s_after_switch``)."""
    ours = row.get("stackfuse", {})
    if key not in ours or not any(key in row.get(w, {}) for w in ("sdpa", "sdpa_best")):
        return None
    return sdpa_best_kernel_s(row, key) / ours[key]


def add_ratios(row: dict[str, Any]) -> None:
    """Per way: SDPA's fastest kernel time / ours (steady, and right after a switch), and
    SDPA's default call latency / ours."""
    for way in ("stackfuse", "stackfuse_sm80", "tvm_unfused"):
        ours = row.get(way, {})
        for key, name in (
            ("kernel_s", "kernel_ratio_vs_sdpa_best"),
            ("kernel_s_after_switch", "kernel_ratio_after_switch_vs_sdpa_best"),
        ):
            if key in ours and key in row.get("sdpa", {}):
                ours[name] = sdpa_best_kernel_s(row, key) / ours[key]
        if "kernel_s" in ours and "kernel_s" in row.get("sdpa", {}):
            ours["call_ratio_vs_sdpa"] = row["sdpa"]["call_s"] / ours["call_s"]


def to_markdown(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    first = rows[0] if rows else {}
    steady = "preroll_s" in first  # results since commit 3718d26; older ones timed after a switch
    how = (
        f"the median of {first.get('rounds', '?')} rounds; in each round every way runs back to "
        f"back for ~{first.get('preroll_s', 0) * 1e3:.0f} ms untimed (at most "
        f"{PREROLL_MAX_CALLS} calls), then {first.get('calls', CALLS)} timed calls"
        if steady
        else f"the median of {first.get('rounds', '?')} rounds of 20 calls, each round timing "
        "every way once"
    )
    lines = [
        f"# Stacked attention on {doc['device']} ({doc['date']})",
        "",
        f"Command: `{doc['command']}` (torch {doc.get('torch', '?')}). fp16, stacked",
        "`qkv[B, S, (Nq + 2 Nkv) H]`. Each cell: kernel TFLOP/s (torch.profiler, CUPTI;",
        f"{how}) / call latency in us (CUDA events around back-to-back calls, as a user calls it).",
        "*kernel ratio* = SDPA's fastest kernel time (default or any backend forced alone) /",
        "ours; *call ratio* = SDPA default call latency / ours. > 1: we are faster.",
    ]
    if steady:
        lines += [
            "*after switch*: the kernel ratio over the first calls of each way's stream, right",
            "after the way before it in the round (all the harness timed until 2026-12-02). At",
            "the long shapes both kernels run at the card's power limit, and calls right after a",
            "lighter way run on its power headroom; each way's own steady state is the headline.",
        ]
    lines += [
        "",
        "| shape | stackfuse (chosen kernel) | stackfuse (SM80 kernel) | TVM unfused "
        "| SDPA default | SDPA forced backend | kernel ratio | after switch | call ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {"kernel_s": [], "kernel_s_after_switch": []}
    for r in rows:

        def cell(way: str, r: dict[str, Any] = r) -> str:
            x = r.get(way, {})
            if "error" in x or not x:
                return "error"
            kt = x.get("kernel_tflops")
            return f"{kt:.1f} / {x['call_s'] * 1e6:.1f}" if kt else f"- / {x['call_s'] * 1e6:.1f}"

        ours = r.get("stackfuse", {})
        kr = {key: kernel_ratio(r, key) for key in ratios}
        for key, x in kr.items():
            if x:
                ratios[key].append(x)
        cratio = r["sdpa"]["call_s"] / ours["call_s"] if "call_s" in ours else None
        backend = r.get("sdpa_best", {}).get("backend", "?").replace("_ATTENTION", "").lower()
        switch = kr["kernel_s_after_switch"]
        lines.append(
            f"| {r['shape']} | {cell('stackfuse')} | {cell('stackfuse_sm80')} | "
            f"{cell('tvm_unfused')} | {cell('sdpa')} | {cell('sdpa_best')} ({backend}) | "
            f"{kr['kernel_s']:.2f}x | {f'{switch:.2f}x' if switch else '-'} | {cratio:.2f}x |"
            if kr["kernel_s"] and cratio
            else f"| {r['shape']} | {cell('stackfuse')} | - | - | - | - | - | - | - |"
        )
    for key, label in (
        ("kernel_s", "Kernel-time geometric mean vs SDPA's fastest"),
        ("kernel_s_after_switch", "After a switch"),
    ):
        xs = ratios[key]
        if xs:
            geo = math.exp(sum(math.log(x) for x in xs) / len(xs))
            lines += [
                "",
                f"{label}: {geo:.3f}x (min {min(xs):.2f}x, max {max(xs):.2f}x, "
                f"{sum(x >= 1 for x in xs)} of {len(xs)} shapes >= 1.0x).",
            ]
    if ratios["kernel_s"]:
        lines += [
            "",
            "The SM80 kernel takes no GQA: forced onto it, the GQA site is not offloaded and that",
            "column is TVM alone (timed once, as TVM unfused is). Differences under ~3% are",
            "within run-to-run noise at the power-bound shapes.",
        ]
    runs = [(r["shape"], r["run"]) for r in rows if r.get("run")]
    if runs:  # a table merged from several runs (`markdown`): say which row came from which
        lines += ["", "Rows from more than one run (each row's ways side by side in one run):"]
        lines += [f"- {shape}: {run}" for shape, run in runs]
    return "\n".join(lines) + "\n"


def grid_markdown(doc: dict[str, Any]) -> str:
    """The grid's table: per shape, our kernel time beside SDPA's fastest backend, and the
    summary the issue's goal reads (every shape >= 1.0x, geometric mean >= 1.10x); then the
    sliding windows beside PyTorch's fastest (SDPA with a mask, FlexAttention)."""
    rows = doc["rows"]
    first = rows[0] if rows else {}
    lines = [
        f"# Stacked attention over a generated shape grid, {doc['device']} ({doc['date']})",
        "",
        "Command: `python -m benchmarks.attention_bench build-grid <libs>` (here), then",
        f"`{doc['command']}` (on the GPU; torch {doc.get('torch', '?')}). Shapes from",
        "`attention_bench.grid_shapes()`: head dims 64/80/96/128/256 x causal x fp16/bf16, two",
        "sizes each from a fixed rotation of batch x length x heads, K/V heads rotating through",
        "MHA, groups of 4 and MQA, plus two named shapes; stacked `qkv[B, S, (Nq + 2 Nkv) H]`,",
        "compiled through the pipeline as a user's module is (selector's pick). Kernel time:",
        f"torch.profiler (CUPTI), the median of {first.get('rounds', '?')} rounds, each way run",
        f"back to back ~{first.get('preroll_s', 0) * 1e3:.0f} ms untimed then "
        f"{first.get('calls', CALLS)} timed calls. SDPA's fastest: the fastest of its default",
        "and each backend forced alone (flash, efficient, cuDNN), on views of the same tensor.",
        "*ratio* = the peer's fastest kernel time / ours: > 1, we are faster. Causal masks are",
        "bottom-right (S = S_kv).",
    ]
    if doc.get("changed_since"):  # what the code does differently now at some of these rows
        lines += ["", f"Changed since this run: {doc['changed_since']}"]
    header = [
        "",
        "| shape | dtype | causal | heads q/kv | head dim | kernel | ours TFLOP/s "
        "| {peer} TFLOP/s (backend) | ratio | max abs err vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def table(group: list[dict[str, Any]], peer: str) -> list[float]:
        lines.extend(h.format(peer=peer) for h in header)
        ratios: list[float] = []
        for r in group:
            d = r.get("dims", {})
            ours = r.get("stackfuse", {})
            ratio = kernel_ratio(r)
            best_s = sdpa_best_kernel_s(r) if ratio else None
            backend = r.get("sdpa_best", {}).get("backend", "default").replace("_ATTENTION", "")
            if best_s is not None and r.get("sdpa", {}).get("kernel_s") == best_s:
                backend = "default"
            mask = (
                f"window {d['window']}" if d.get("window") else "yes" if d.get("causal") else "no"
            )
            head = (
                f"| {r['shape']} | {d.get('dtype', 'float16')} | {mask} "
                f"| {d.get('n')}/{d.get('n_kv', d.get('n'))} | {d.get('h')} "
                f"| {', '.join(r.get('variants') or []) or '-'} "
            )
            if ratio is None or best_s is None:
                lines.append(head + f"| {ours.get('error', 'error')} | - | - | - |")
                continue
            ratios.append(ratio)
            lines.append(
                head + f"| {ours['kernel_tflops']:.1f} | {r['flops'] / best_s / 1e12:.1f} "
                f"({backend.lower()}) | {ratio:.3f}x | {ours['max_abs_err_vs_sdpa']:.1e} |"
            )
        if ratios:
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            lines.extend(
                [
                    "",
                    f"Geometric mean {geo:.3f}x over {len(ratios)} shapes; min {min(ratios):.3f}x,"
                    f" max {max(ratios):.3f}x; {sum(x >= 1 for x in ratios)} of {len(ratios)}"
                    " shapes >= 1.0x.",
                ]
            )
        return ratios

    def kind(r: dict[str, Any]) -> str:
        d = r.get("dims", {})
        return "window" if d.get("window") else "ragged" if d.get("lengths") else "grid"

    table([r for r in rows if kind(r) == "grid"], "SDPA fastest")
    windows = [r for r in rows if kind(r) == "window"]
    if windows:
        lines += [
            "",
            "## Sliding windows",
            "",
            "Bottom-right causal with a window of W keys (Mistral's). Peers: SDPA with the window",
            "as a boolean `[S, S]` mask (flash takes no mask; efficient and cuDNN do) and",
            "FlexAttention compiled with the band as a block mask (`flex`). TFLOP/s count the",
            "band's (query, key) pairs only.",
        ]
        table(windows, "PyTorch fastest")
    ragged = [r for r in rows if kind(r) == "ragged"]
    if ragged:
        lines += [
            "",
            "## Ragged batches",
            "",
            "Sequences of different lengths packed in `qkv[1, T, 3 N H]`, int32 lengths in,",
            "`seqstart = concat([0], cumsum(lengths))` in the graph, `R.nn.attention_var_len`",
            "(ours: the SM80-class kernel's seqstart path). Peers: SDPA on the batch padded to",
            "its longest sequence with a key-padding mask, the padding copies included",
            "(`default`), SDPA on nested (jagged) tensors (`nested`) and FlexAttention with a",
            "document mask (`flex`). TFLOP/s count each sequence's own (query, key) pairs.",
        ]
        for r in ragged:
            lines.append(f"- `{r['shape']}`: lengths {r['dims']['lengths']}")
        table(ragged, "PyTorch fastest")
    return "\n".join(lines) + "\n"


POWER_SHAPES = ["b4_s4096_n32_h128", "b8_s2048_n16_h128", "b2_s8192_n16_h64"]
IDLE_S = 0.5  # pause before each trajectory: the card drops to idle clocks and cools its budget
TRAJECTORY_S = 1.0
BINS_MS = (0, 5, 20, 50, 100, 200, 500, 1000)
WINDOWS, WINDOW_S = 3, 2.0  # alternating windows per method for the energy counter


class Nvml:
    """The NVML readings the power probe needs, for GPU 0, through ctypes (no extra package)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit failed")
        self.dev = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.dev)) != 0:
            raise RuntimeError("no NVML handle for GPU 0")

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        self.lib.nvmlDeviceGetTotalEnergyConsumption(self.dev, ctypes.byref(v))
        return v.value

    def sm_mhz(self) -> int:
        v = ctypes.c_uint()
        self.lib.nvmlDeviceGetClockInfo(self.dev, 1, ctypes.byref(v))  # NVML_CLOCK_SM
        return v.value

    def power_w(self) -> float:
        v = ctypes.c_uint()
        self.lib.nvmlDeviceGetPowerUsage(self.dev, ctypes.byref(v))  # mW
        return v.value / 1000


def bin_medians(points: list[tuple[float, float]]) -> dict[str, float]:
    """Median value per time bin (BINS_MS) of (ms, value) points."""
    out = {}
    for lo, hi in itertools.pairwise(BINS_MS):
        vals = [v for t, v in points if lo <= t < hi]
        if vals:
            out[f"{lo}-{hi} ms"] = statistics.median(vals)
    return out


def _trajectory(fn: Any, torch: Any, nvml: Nvml, call_s: float) -> dict[str, Any]:
    """After IDLE_S idle, ~TRAJECTORY_S of back-to-back calls: each launch's time (CUDA
    events between calls) and the SM clock sampled on the side, both by time since the start."""
    import threading

    time.sleep(IDLE_S)
    n = max(CALLS, math.ceil(TRAJECTORY_S / call_s))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    clocks: list[tuple[float, float]] = []
    done = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        while not done.is_set():
            clocks.append(((time.perf_counter() - t0) * 1e3, float(nvml.sm_mhz())))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    events[0].record()
    for e in events[1:]:
        fn()
        e.record()
    events[-1].synchronize()
    done.set()
    sampler.join()
    at, launches = 0.0, []
    for a, b in itertools.pairwise(events):
        dt = a.elapsed_time(b)
        launches.append((at, dt * 1e3))
        at += dt
    return {
        "launches": n,
        "launch_us_by_time": bin_medians(launches),
        "sm_mhz_by_time": bin_medians(clocks),
    }


def _window(fn: Any, torch: Any, nvml: Nvml, chunk: int, seconds: float) -> dict[str, float]:
    """``fn`` back to back for ~``seconds``: time and energy per launch, median clock/power."""
    torch.cuda.synchronize()
    e0, t0, n = nvml.energy_mj(), time.perf_counter(), 0
    clocks, powers = [], []
    while time.perf_counter() - t0 < seconds:
        for _ in range(chunk):
            fn()
        torch.cuda.synchronize()
        n += chunk
        clocks.append(nvml.sm_mhz())
        powers.append(nvml.power_w())
    e1, t1 = nvml.energy_mj(), time.perf_counter()
    return {
        "launches": n,
        "us_per_launch": (t1 - t0) / n * 1e6,
        "mj_per_launch": (e1 - e0) / n,
        "sm_mhz_median": statistics.median(clocks),
        "power_w_median": statistics.median(powers),
    }


def power(out_dir: Path, names: list[str] | None = None) -> dict[str, Any]:
    """Ours (the module, chosen kernel) against SDPA's default and cuDNN under sustained load."""
    import torch

    from worker.toolchain import import_tvm

    tvm = import_tvm()
    import tvm_ffi

    nvml = Nvml()
    dev = tvm.cuda(0)
    rows = []
    for shape in (sh for sh in SHAPES if sh["name"] in (names or POWER_SHAPES)):
        qkv = _stacked_input(shape, torch)
        sdpa, forced = _sdpa_calls(shape, qkv)
        ways: dict[str, Any] = {
            "stackfuse": _module_call(
                out_dir / shape["name"] / "stackfuse" / "model.so", qkv, tvm, dev
            ),
            "sdpa": sdpa,
            "sdpa_cudnn": forced["CUDNN_ATTENTION"],
        }
        row: dict[str, Any] = {"shape": shape["name"], "flops": flops(shape)}
        with tvm_ffi.use_torch_stream():
            call_s = {w: _time_calls(fn, torch, reps=3, inner=10) for w, fn in ways.items()}
            chunk = max(1, math.ceil(0.02 / min(call_s.values())))  # ~20 ms between readings
            row["trajectories"] = [
                {"round": rnd, "way": w, **_trajectory(ways[w], torch, nvml, call_s[w])}
                for rnd, w in rotated_rounds(list(ways), rounds=2)
            ]
            for fn in ways.values():
                _window(fn, torch, nvml, chunk, 1.0)  # warm-up: clocks and temperature settle
            row["windows"] = [
                {"round": rnd, "way": w, **_window(ways[w], torch, nvml, chunk, WINDOW_S)}
                for rnd, w in rotated_rounds(list(ways), rounds=WINDOWS)
            ]
        row["summary"] = {
            w: {
                key: statistics.median(x[key] for x in row["windows"] if x["way"] == w)
                for key in ("us_per_launch", "mj_per_launch", "sm_mhz_median", "power_w_median")
            }
            for w in ways
        }
        rows.append(row)
        print(json.dumps({"shape": row["shape"], **row["summary"]}), flush=True)
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python -m benchmarks.attention_bench power <libs>",
        "idle_s": IDLE_S,
        "window_s": WINDOW_S,
        "rows": rows,
    }
    (out_dir / "attention_power.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "attention_power.md").write_text(power_markdown(doc))
    print(power_markdown(doc))
    return doc


def power_markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Sustained load: ours and SDPA on {doc['device']} ({doc['date']})",
        "",
        f"Command: `{doc['command']}` (torch {doc['torch']}). Per shape, after {doc['idle_s']} s",
        "idle, each way's launch time (median per time bin, us) and SM clock (MHz) over its",
        f"first second; then alternating {doc['window_s']} s windows per way, NVML energy.",
    ]
    for r in doc["rows"]:
        ways = list(r["summary"])
        bins = list(r["trajectories"][0]["launch_us_by_time"])
        lines += ["", f"## {r['shape']}", "", "| way | " + " | ".join(bins) + " |"]
        lines.append("|---" * (len(bins) + 1) + "|")
        for t in r["trajectories"]:
            cells = [
                f"{t['launch_us_by_time'].get(bn, 0):.0f} us, "
                f"{t['sm_mhz_by_time'].get(bn, 0):.0f} MHz"
                for bn in bins
            ]
            lines.append(f"| {t['way']} (round {t['round']}) | " + " | ".join(cells) + " |")
        lines += ["", "| way | us / launch | mJ / launch | SM MHz | W | TFLOP/s | vs ours |"]
        lines.append("|---|---|---|---|---|---|---|")
        ours = r["summary"][ways[0]]["us_per_launch"]
        for w in ways:
            x = r["summary"][w]
            lines.append(
                f"| {w} | {x['us_per_launch']:.1f} | {x['mj_per_launch']:.0f} | "
                f"{x['sm_mhz_median']:.0f} | {x['power_w_median']:.0f} | "
                f"{r['flops'] / x['us_per_launch'] / 1e6:.1f} | {x['us_per_launch'] / ours:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention_bench",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd, help_ in (
        ("build", "here: compile every way's library for the named shapes"),
        ("run", "on the GPU: time the built libraries, write attention_bench.{json,md}"),
        ("build-grid", "here: compile our library for the generated grid's shapes"),
        ("grid", "on the GPU: ours vs SDPA's fastest, write attention_grid.{json,md}"),
        ("power", "on the GPU: sustained load, write attention_power.{json,md}"),
    ):
        p = sub.add_parser(cmd, help=help_)
        p.add_argument("dir", type=Path, help="the libraries' folder")
        p.add_argument("shapes", nargs="*", help="shape names (default: all)")
    p = sub.add_parser("markdown", help="regenerate a table from a results file")
    p.add_argument("json", type=Path)
    p.add_argument("md", type=Path)
    args = parser.parse_args(argv)
    names = getattr(args, "shapes", None) or None
    if args.cmd == "build":
        build(args.dir, names)
    elif args.cmd == "build-grid":
        build(args.dir, names, grid=True)
    elif args.cmd == "grid":
        run(args.dir, names, grid=True)
    elif args.cmd == "power":
        power(args.dir, names)
    elif args.cmd == "markdown":
        doc = json.loads(args.json.read_text())
        render = grid_markdown if "grid" in doc["command"].split() else to_markdown
        args.md.write_text(render(doc))
    else:
        run(args.dir, names)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
