"""One test model per architecture family (transformers configs, random weights, no
downloads): imported as the GPU build imports it (float16, normalized and partitioned for
sm_90, no kernels compiled), every attention site's outcome and, for each site not fused
stacked, the words of its reason; then the normalized float32 module on the CPU (LLVM) against
PyTorch eager. Each family also goes through the ONNX route (dynamo export, float32): all of
them export and import today. The ``*_padded`` cases pass a key-padding ``attention_mask``
input with some padded keys (0/1 integers or booleans, as tokenizers give it).

The table in docs/models.md is this file's expectations, with the H200 numerics of
benchmarks/models_gpu.py beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from service.spec import CompileOptions
from tests.hf_models import build, example_ids, example_mask
from worker.importers import import_any
from worker.normalize import normalize
from worker.partition import PartitionResult, partition
from worker.selection import select_kernel
from worker.toolchain import import_tvm

tvm = import_tvm()
OPTS = CompileOptions()
ARCH = "sm_90"
LAYERS = 2
#: rotary embeddings: q and k computed after the split (rotate_half: negate, concat, scale)
ROTARY = ["q passes through", "k passes through", "`multiply`", "after the split", "rotary"]


@dataclass
class Family:
    model: str
    #: tokens per sequence (ViT: patches, the class token comes on top)
    seq: int
    #: per site: "stacked" or "plain"; empty: no site at all
    outcomes: list[str]
    #: words every reason of a site not fused stacked (or chain not seen) must contain
    words: list[str] = field(default_factory=list)
    #: words no reason may contain
    not_words: list[str] = field(default_factory=list)
    #: rewrites that must fire in the float16 sm_90 import
    rewrites: set[str] = field(default_factory=set)
    #: chains computing attention that are not sites (report.summary.not_attention)
    not_attention: int = 0
    #: every fused site's causal flag (encoders: none)
    causal: str = "TopLeft"
    #: the words of the float32 imports' reasons, where they differ (no grouped_kv there)
    words_f32: list[str] | None = None
    #: the kernel family every fused site gets on sm_90 (worker.selection)
    kernel: str = "hopper"
    #: the dtype of an ``attention_mask`` input (example_mask) passed beside the ids
    mask: str | None = None
    #: every fused site reads a bias tensor (a padding mask, ALiBi)
    bias: bool = False
    #: words that some normalization's message must contain
    messages: list[str] = field(default_factory=list)
    #: the float32 imports' outcomes, where they differ (the Hopper kernel reads no float32)
    outcomes_f32: list[str] | None = None


STACKED = ["stacked"] * LAYERS
PLAIN = ["plain"] * LAYERS
FAMILIES = {
    "gpt2": Family("gpt2", 16, STACKED, rewrites={"transpose_pairs", "integer_power"}),
    "bert": Family("bert", 16, STACKED, rewrites={"combine_qkv"}, causal="none"),
    "vit": Family("vit", 256, STACKED, rewrites={"combine_qkv"}, causal="none"),
    "neox_rotary": Family("neox_rotary", 16, PLAIN, ROTARY, ["v passes"]),
    # GQA 8/2: the K/V heads are read as they are (grouped_kv), so only rotary is left
    "llama": Family(
        "llama_small",
        16,
        PLAIN,
        ROTARY,
        ["v passes", "broadcast_to", "bias"],
        {"grouped_kv", "rms_norm", "combine_projections"},
    ),
    # sliding window 4096, longer than the sequence: the mask is plain causal
    "mistral": Family(
        "mistral",
        16,
        PLAIN,
        ROTARY,
        ["v passes", "broadcast_to", "bias"],
        {"grouped_kv", "rms_norm", "combine_projections"},
    ),
    # window 32 of 48 tokens: a constant banded mask, read in float16 on sm_90 as the window
    # it is (constant_mask: causal_mask and window_size=32, no bias) by the Hopper kernel, GQA
    # 4/2 read grouped; in float32 (no window kernel) the mask stays a bias, K/V repeated
    "mistral_window": Family(
        "mistral_window",
        48,
        PLAIN,
        ROTARY,
        ["sliding-window mask", "bias"],
        {"constant_mask", "grouped_kv"},
        messages=["is a sliding window of 32 keys (TopLeft)"],
        words_f32=[*ROTARY, "sliding-window mask", "last 32 keys", "k and v repeated"],
    ),
    "qwen2": Family(
        "qwen2",
        16,
        PLAIN,
        ROTARY,
        ["v passes", "broadcast_to", "bias"],
        {"grouped_kv", "combine_projections"},
    ),
    # one qkv_proj already: nothing to combine; partial rotary factor 1: an empty pass-through
    "phi3": Family(
        "phi3", 16, PLAIN, ROTARY, ["v passes", "broadcast_to"], {"grouped_kv", "empty_concat"}
    ),
    # multi-query: c_attn gives [q | k | v] with one K/V head, unsqueezed before the split and
    # k, v transposed in their size-1 axes; unit_axes makes them split -> reshape, grouped_kv
    # drops the repeat: stacked, read in place by the Hopper kernel (GQA 4/1). In float32 the
    # heads stay repeated (no Hopper kernel for float32): plain
    "gpt_bigcode": Family(
        "gpt_bigcode",
        16,
        STACKED,
        rewrites={"grouped_kv", "unit_axes", "transpose_pairs"},
        words_f32=["k and v repeated", "`broadcast_to`", "float16", "equal head counts only"],
        outcomes_f32=PLAIN,
    ),
    # ALiBi: 3-D scores + a [B*N, 1, S] per-head position bias, + the causal mask on their 4-D
    # view: one attention with a [B, N, 1, S] bias and causal_mask, q, k, v picked (`take`) out
    # of the per-head interleaved [B, S, N, 3, H] view: stacked; the bias keeps the SM80 kernel
    "bloom": Family(
        "bloom",
        16,
        STACKED,
        rewrites={"decomposed_attention"},
        bias=True,
        kernel="sm80",
        messages=["softmax on its 4-D view", "[2, 4, 1, 16] bias", "ALiBi", "causal_mask=TopLeft"],
    ),
    # key-padding masks as inputs: the [B, 1, S, S] additive mask built from them (with the
    # causal mask in GPT-2's) is the attention's bias, read by the SM80 kernel
    "bert_padded": Family(
        "bert",
        16,
        STACKED,
        rewrites={"combine_qkv"},
        causal="none",
        kernel="sm80",
        mask="int64",
        bias=True,
    ),
    "gpt2_padded": Family(
        "gpt2",
        16,
        STACKED,
        rewrites={"transpose_pairs"},
        causal="none",
        kernel="sm80",
        mask="bool",
        bias=True,
    ),
    # ALiBi and padding: the position bias is then computed from the mask (cumsum), not folded
    "bloom_padded": Family(
        "bloom",
        16,
        STACKED,
        rewrites={"decomposed_attention"},
        causal="none",
        kernel="sm80",
        mask="int64",
        bias=True,
        messages=["ALiBi"],
    ),
}


def _imported(fam: Family, dtype: str | None, route: str = "torch", tmp: Path | None = None) -> Any:
    """(model, its inputs, the import)."""
    model = build(fam.model)
    x = example_ids(fam.model, 2, fam.seq)
    inputs = (x,) if fam.mask is None else (x, example_mask(2, fam.seq, fam.mask))
    if route == "onnx":
        import torch

        assert tmp is not None
        path = tmp / "model.onnx"
        torch.onnx.export(model, inputs, str(path), dynamo=True, input_names=["ids"])
        return model, inputs, import_any(path)
    return model, inputs, import_any(model, example_inputs=inputs, dtype=dtype)


def _check_outcomes(fam: Family, res: PartitionResult, float16: bool = True) -> None:
    outcomes = fam.outcomes if float16 or fam.outcomes_f32 is None else fam.outcomes_f32
    assert len(res.sites) == len(outcomes)
    assert [f.pattern.kind for f in res.fused] == outcomes  # nothing left to TVM
    assert res.unbuildable == []
    sites = [r for r in res.reasons if r.outcome != "not_attention"]
    assert [r.outcome for r in sites] == ["fused_plain" for o in outcomes if o == "plain"]
    assert [r.where.site for r in sites if r.where] == [
        f"main/attention#{i}" for i, o in enumerate(outcomes) if o == "plain"
    ]
    assert len(res.reasons) - len(sites) == fam.not_attention
    words = fam.words if float16 or fam.words_f32 is None else fam.words_f32
    for r in res.reasons:
        for w in words:
            assert w in r.reason, (w, r.reason)
        for w in fam.not_words if float16 else []:
            assert w not in r.reason, (w, r.reason)


@pytest.mark.parametrize("case", list(FAMILIES))
def test_sites_and_reasons_float16_sm90(case: str) -> None:
    """As ``benchmarks/models_gpu.py build`` imports it: float16, normalized for sm_90."""
    fam = FAMILIES[case]
    _, _, imported = _imported(fam, "float16")
    mod, rewrites = normalize(imported.mod, OPTS, ARCH)
    assert fam.rewrites <= {r.rewrite for r in rewrites}
    for w in fam.messages:
        assert any(w in r.message for r in rewrites), (w, [r.message for r in rewrites])
    res = partition(mod, OPTS, ARCH)
    _check_outcomes(fam, res)
    if case == "mistral_window":
        assert all(not m.bias and m.causal == "TopLeft" for m in res.match_entries())
        for ff in res.functions:
            spec = ff.analysis.spec
            assert spec is not None and spec.window == 32 and spec.num_kv_heads == 2
            assert "sliding window of 32 keys" in select_kernel(spec, ARCH)[1]
    elif fam.outcomes:
        assert {m.causal for m in res.match_entries()} == {fam.causal}
        assert [m.bias for m in res.match_entries()] == [fam.bias] * len(fam.outcomes)
    if fam.model == "bloom":  # the per-head interleaved [B, S, N, 3, H] view, read in place
        assert {f.pattern.name for f in res.fused} == {
            "cutlass.stacked_attention.interleaved_5d_bias"
        }
    if case == "gpt_bigcode":  # [q | k | v] of 4 + 1 + 1 heads of 64, read in place
        assert {f.pattern.name for f in res.fused} == {"cutlass.stacked_attention.split"}
        for m in res.match_entries():
            assert m.shapes["qkv"] == [2, fam.seq, 384]
            assert m.shapes["k"] == m.shapes["v"] == [2, fam.seq, 1, 64]
            lay = m.layout
            assert (lay.q_offset, lay.k_offset, lay.v_offset) == (0, 256, 320)
            assert lay.row_stride == {"q": 384, "k": 384, "v": 384}
            assert lay.head_stride == {"q": 64, "k": 64, "v": 64}
            assert lay.batch_stride == {r: 384 * fam.seq for r in "qkv"}
            assert (lay.source, lay.packing, lay.order) == ("stacked", "blocked", "qkv")
        for ff in res.functions:
            assert ff.analysis.spec is not None
            assert (ff.analysis.spec.num_q_heads, ff.analysis.spec.num_kv_heads) == (4, 1)
            assert "GQA 4/1" in select_kernel(ff.analysis.spec, ARCH)[1]
    if fam.bias:  # one bias row per batch entry (padding) or per head (ALiBi), one per key
        for m in res.match_entries():
            b, n, sq, skv = m.shapes["bias"]
            assert skv == fam.seq and (b, n) in ((2, 1), (2, 4)), m.shapes["bias"]
            assert sq in (1, fam.seq)
    # each fused site has a kernel on sm_90 (rendered, not compiled)
    for ff in res.functions:
        assert ff.analysis.spec is not None
        _, why = select_kernel(ff.analysis.spec, ARCH)
        assert why.startswith("Hopper FMHA" if fam.kernel == "hopper" else "SM80-class"), why


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89"])
def test_gpt_bigcode_float16_before_sm90(arch: str) -> None:
    """No kernel of ours reads MQA before sm_90: grouped_kv keeps the repeated K/V heads, the
    site is fused plain with q, k, v in memory, and the reason says why."""
    fam = FAMILIES["gpt_bigcode"]
    _, _, imported = _imported(fam, "float16")
    mod, rewrites = normalize(imported.mod, OPTS, arch)
    assert "grouped_kv" not in {r.rewrite for r in rewrites}
    res = partition(mod, OPTS, arch)
    assert [f.pattern.name for f in res.fused] == ["cutlass.attention"] * LAYERS
    assert [r.outcome for r in res.reasons] == ["fused_plain"] * LAYERS
    for r in res.reasons:
        for w in ("k and v repeated", "`broadcast_to`", "only on sm_90", "equal head counts"):
            assert w in r.reason, (w, r.reason)
    for ff in res.functions:
        assert ff.analysis.spec is not None
        assert ff.analysis.spec.num_kv_heads == ff.analysis.spec.num_q_heads == 4
        assert select_kernel(ff.analysis.spec, arch)[1].startswith("SM80-class")


def test_a_padded_bloom_passes_the_service_checks() -> None:
    """Its ALiBi positions are a cumsum of the padding mask, computed in the graph (int64):
    the service's ingest takes the scan."""
    from service.settings import Settings
    from worker.ingest import load_module

    _, _, imported = _imported(FAMILIES["bloom_padded"], "float16")
    text = tvm.ir.save_json(imported.mod)
    assert '"relax.cumsum"' in text
    load_module(text, "tvm-json", Settings())


def _run_cpu(model: Any, inputs: Any, imported: Any, mod: Any) -> None:
    import torch
    from tvm import relax

    with torch.no_grad():
        want = model(*inputs).numpy()
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [*(x.numpy() for x in inputs), *imported.params.values()]
    got = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("case", list(FAMILIES))
def test_normalized_module_matches_pytorch_on_cpu(case: str) -> None:
    fam = FAMILIES[case]
    model, inputs, imported = _imported(fam, None)
    mod, _ = normalize(imported.mod, OPTS, ARCH)
    # float32: no GQA rewrite (that is float16-only), the same sites otherwise
    _check_outcomes(fam, partition(mod, OPTS, ARCH), float16=False)
    _run_cpu(model, inputs, imported, mod)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in FAMILIES if c != "gpt2" and not FAMILIES[c].mask])
def test_onnx_route(case: str, tmp_path: Path) -> None:
    """The dynamo ONNX export of each family (GPT-2's is in test_real_models): decomposed
    attention recovered, the same sites, outcomes and reasons as the float32 torch.export."""
    fam = FAMILIES[case]
    model, inputs, imported = _imported(fam, None, "onnx", tmp_path)
    mod, rewrites = normalize(imported.mod, OPTS, ARCH)
    if fam.outcomes:
        assert "decomposed_attention" in {r.rewrite for r in rewrites}
    _check_outcomes(fam, partition(mod, OPTS, ARCH), float16=False)
    _run_cpu(model, inputs, imported, mod)
