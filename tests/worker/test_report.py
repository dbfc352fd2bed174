"""The report a person reads: the user's names per site, verdicts, a cached job's view (no nvcc)."""

from __future__ import annotations

import json
from typing import Any

from tvm.script import relax as R
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import relax as rb

from service.spec import CompileOptions
from tests.models import stacked_attention_module, tvm
from worker import gemm_partition, partition, provenance
from worker.report import (
    SCHEMA_VERSION,
    KernelChoice,
    Library,
    Report,
    cached_view,
    fill_verdicts,
    layer_of,
    names_for,
    origins_of,
    with_origins,
)

#: what `stackfuse import` of a GPT-2 block calls its weights (torch.export's placeholder names,
#: made code names) and where they came from (the manifest's origins)
GPT2 = {
    "p_transformer_h_3_attn_c_attn_weight": "transformer.h.3.attn.c_attn.weight",
    "p_transformer_h_3_attn_c_attn_bias": "transformer.h.3.attn.c_attn.bias",
    "p_transformer_h_3_attn_c_proj_weight": "transformer.h.3.attn.c_proj.weight",
}


def projected_attention_module(b: int = 2, s: int = 16, n: int = 4, h: int = 64) -> Any:
    """``x @ W_qkv + b_qkv -> split -> reshape x3 -> attention -> reshape -> @ W_proj``, with
    GPT-2's weight names; ``x`` is the one user input (``num_input`` 1)."""
    d = n * h
    w_qkv, b_qkv, w_proj = GPT2
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((b, s, d), "float16"))
        w = R.arg(w_qkv, R.Tensor((d, 3 * d), "float16"))
        bias = R.arg(b_qkv, R.Tensor((3 * d,), "float16"))
        wp = R.arg(w_proj, R.Tensor((d, d), "float16"))
        R.func_attr({"num_input": 1})
        with R.dataflow() as frame:
            qkv = R.emit(R.add(R.emit(R.matmul(x, w)), bias))
            parts = R.emit(R.split(qkv, [d, 2 * d], axis=2))
            q = R.emit(R.reshape(parts[0], [b, s, n, h]))
            k = R.emit(R.reshape(parts[1], [b, s, n, h]))
            v = R.emit(R.reshape(parts[2], [b, s, n, h]))
            att = R.emit(R.reshape(R.nn.attention(q, k, v), [b, s, d]))
            out = R.emit(R.matmul(att, wp))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def test_attention_weights_are_its_qkv_projection_and_a_gemm_its_own() -> None:
    mod = projected_attention_module()
    att = provenance.weights_by_site(mod)
    assert att == {
        "0": ["p_transformer_h_3_attn_c_attn_weight", "p_transformer_h_3_attn_c_attn_bias"]
    }
    gemms = provenance.weights_by_site(mod, gemm=True)
    assert gemms == {
        "0": ["p_transformer_h_3_attn_c_attn_weight"],
        "1": ["p_transformer_h_3_attn_c_proj_weight"],
    }
    # the ids agree with the partitioners' own
    _, sites = partition.tag_sites(mod)
    assert set(sites) == set(att)
    res = gemm_partition.partition_gemms(mod, CompileOptions(), "sm_90")
    assert set(res.sites) == set(gemms)


def test_a_module_without_weights_has_no_names() -> None:
    assert provenance.weights_by_site(stacked_attention_module(2, 16, 4, 64)) == {"0": []}


def test_names_from_the_manifest() -> None:
    weights = list(GPT2)[:2]
    names = names_for(weights, GPT2, "attention")
    assert names.module == "transformer.h.3.attn"  # the module above its one projection
    assert names.projections == ["transformer.h.3.attn.c_attn"] and names.layer == 3
    llama = {
        "q": "model.layers.12.self_attn.q_proj.weight",
        "k": "model.layers.12.self_attn.k_proj.weight",
        "v": "model.layers.12.self_attn.v_proj.weight",
    }
    names = names_for(["q", "k", "v"], llama, "attention")
    assert names.module == "model.layers.12.self_attn" and names.layer == 12
    assert len(names.projections) == 3
    gemm = names_for(["p_transformer_h_3_attn_c_proj_weight"], GPT2, "gemm")
    assert gemm.module == "transformer.h.3.attn.c_proj"
    combined = names_for(["q", "k", "v"], llama, "gemm")  # combine_projections' one GEMM
    assert combined.module == "model.layers.12.self_attn" and len(combined.projections) == 3
    assert names_for(["onnx::MatMul_7"], {"onnx::MatMul_7": "onnx::MatMul_7"}, "gemm").layer is None
    assert layer_of("p_transformer_h_3_attn_c_attn_weight") == 3 and layer_of("x") is None
    manifest = {"params": [{"name": "a", "origin": "m.0.w"}, {"name": "b", "origin": ""}]}
    assert origins_of(manifest) == {"a": "m.0.w"}


def _report() -> Report:
    """A report as the pipeline writes it for the projected module (no nvcc: kernels filled in
    by hand)."""
    from worker.report import Layout, Match, UserNames, Where

    where = Where(function="main", site="main/attention#0", binding="lv5")
    kernel = KernelChoice(
        family="cutlass_fmha_hopper", symbol="k0", reason="r", compile_s=23.85, cached=False
    )
    layout = Layout(
        source="stacked", q_offset=0, k_offset=256, v_offset=512,
        row_stride={}, head_stride={}, batch_stride={},
    )  # fmt: skip
    match = Match(
        where=where, pattern="p", kind="stacked", variant="split", bias=False, causal="none",
        dtype="float16", shapes={}, bindings=["lv2", "lv5"], scale=0.125, layout=layout,
        kernel=kernel, names=UserNames(weights=list(GPT2)[:2], layer=3),
    )  # fmt: skip
    report = Report(
        input_sha256="0" * 64,
        target={"arch": "sm_90"},
        matches=[match],
        compile_s=30.0,
        timings={"codegen_s": 24.0},
        library=Library(sha256="1" * 64, size_bytes=10, file="stackfuse-first.so"),
    )
    fill_verdicts(report, [(where, match.names)])
    return report


def test_verdicts_say_what_happened_per_site() -> None:
    report = _report()
    (site,) = report.sites
    assert site.verdict == report.matches[0].verdict
    assert site.verdict.startswith("Fused stacked-QKV attention (layer 3)")
    assert "Hopper FMHA kernel, compiled in 23.9 s" in site.verdict
    named = with_origins(report, GPT2)
    assert named.sites[0].names.module == "transformer.h.3.attn"
    assert "(layer 3, transformer.h.3.attn)" in named.sites[0].verdict


def test_a_cached_job_says_so_and_keeps_the_original_compile_time_apart() -> None:
    raw = _report().model_dump_json().encode()
    doc = json.loads(cached_view(raw, "second", "first"))
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["cached"] is True and doc["original_job"] == "first"
    assert doc["compile_s"] == 0.0 and doc["original_compile_s"] == 30.0
    kernel = doc["matches"][0]["kernel"]
    assert kernel["cached"] is True and kernel["compile_s"] == 0.0
    assert kernel["original_compile_s"] == 23.85
    assert "from the kernel cache" in doc["sites"][0]["verdict"]
    assert doc["library"]["file"] == "stackfuse-second.so"
    assert "cache_hit" not in json.dumps(doc)
    assert all(k.endswith("_s") for k in doc["timings"])


def test_an_imported_gpt2_gets_its_module_paths_and_layers() -> None:
    """Through `stackfuse import` (torch.export) and normalization, as the service sees it."""
    import pytest

    pytest.importorskip("transformers")
    from tests.hf_models import build, example_ids
    from worker.importers import import_any
    from worker.normalize import normalize

    imported = import_any(build("gpt2"), example_inputs=(example_ids("gpt2", 2, 16),))
    mod, _ = normalize(imported.mod, CompileOptions(), "sm_90")
    att = provenance.weights_by_site(mod)
    names = [names_for(att[sid], imported.origins, "attention") for sid in sorted(att, key=int)]
    assert [(n.layer, n.module) for n in names] == [(0, "m.h.0.attn"), (1, "m.h.1.attn")]
    assert names[1].projections == ["m.h.1.attn.c_attn"]
    gemms = provenance.weights_by_site(mod, gemm=True)
    modules = {names_for(w, imported.origins, "gemm").module for w in gemms.values()}
    assert {"m.h.0.attn.c_attn", "m.h.0.attn.c_proj", "m.h.1.mlp.c_fc"} <= modules
