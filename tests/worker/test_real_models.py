"""Real architectures (transformers configs, random weights, no downloads) through
`stackfuse import` -> normalize -> partition: every attention site fuses as stacked attention.

The normalized modules are also run on the CPU (LLVM) against PyTorch eager: the rewrites keep
the model's meaning, whatever the GPU kernels later do (benchmarks/models_gpu.py checks those).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from service.errors import InputError
from service.spec import CompileOptions
from tests.hf_models import build, example_ids
from worker.importers import import_any, import_model, load_params
from worker.normalize import normalize
from worker.partition import partition
from worker.toolchain import import_tvm

tvm = import_tvm()
OPTS = CompileOptions()
LAYERS = 2


def _compiled(name: str, route: str, tmp: Path | None = None) -> tuple[Any, Any, list[Any]]:
    model = build(name)
    ids = example_ids(name, 2, 16)
    if route == "onnx":
        import torch

        assert tmp is not None
        path = tmp / "model.onnx"
        torch.onnx.export(model, (ids,), str(path), dynamo=True, input_names=["ids"])
        imported = import_any(path)
    else:
        imported = import_any(model, example_inputs=(ids,))
    mod, rewrites = normalize(imported.mod, OPTS)
    return imported, (mod, rewrites, partition(mod, OPTS)), [model, ids]


EXPECT = {
    # name: (route, variant, rewrites that must have fired); torch.export's constant masks are
    # taken as the causal flag at import, so normalize's constant_mask fires only for ONNX
    "gpt2": ("torch", "split", {"transpose_pairs", "integer_power"}),
    "bert": ("torch", "split", {"transpose_pairs", "combine_qkv"}),
    "neox": ("torch", "interleaved", {"transpose_pairs", "empty_concat"}),
    "gpt2_onnx": ("onnx", "split", {"decomposed_attention", "constant_mask", "transpose_pairs"}),
}


@pytest.mark.parametrize("case", list(EXPECT))
def test_every_attention_site_fuses_stacked(case: str, tmp_path: Path) -> None:
    route, variant, must = EXPECT[case]
    name = case.removesuffix("_onnx")
    imported, (mod, rewrites, res), (model, ids) = _compiled(name, route, tmp_path)
    assert len(res.sites) == LAYERS
    assert len(res.fused) == LAYERS
    assert res.failures == []
    assert res.reasons == []  # every site fused stacked: nothing to explain
    matches = res.match_entries()
    assert [m.kind for m in matches] == ["stacked"] * LAYERS
    assert {m.variant for m in matches} == {variant}
    assert must <= {r.rewrite for r in rewrites}
    if route == "torch":
        assert any("mask(s) taken as the attention's causal flag" in n for n in imported.notes)
        assert "constant_mask" not in {r.rewrite for r in rewrites}
    sites = {r.where.site for r in rewrites if r.where is not None}
    assert sites <= {f"main/attention#{i}" for i in range(LAYERS)}
    if name in ("gpt2", "neox"):
        assert {m.causal for m in matches} == {"TopLeft"}
        assert not any(m.bias for m in matches)
    if variant == "interleaved":
        h = 64
        assert (matches[0].layout.k_offset, matches[0].layout.v_offset) == (h, 2 * h)
        assert matches[0].layout.head_stride["q"] == 3 * h

    # the normalized module still computes the model (CPU, LLVM, float32)
    import torch
    from tvm import relax

    with torch.no_grad():
        want = model(ids).numpy()
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [ids.numpy(), *imported.params.values()]
    got = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_rotary_neox_is_found_but_fuses_plain() -> None:
    """Known gap: rotary embeddings compute q and k, so only plain attention can be offloaded."""
    _, (_, _, res), _ = _compiled("neox_rotary", "torch")
    assert len(res.sites) == LAYERS
    assert [f.pattern.kind for f in res.fused] == ["plain"] * LAYERS
    # ... and the report says why, per site
    assert [r.outcome for r in res.reasons] == ["fused_plain"] * LAYERS
    assert [r.where.site for r in res.reasons if r.where] == [
        f"main/attention#{i}" for i in range(LAYERS)
    ]
    for r in res.reasons:
        assert "q passes through" in r.reason and "k passes through" in r.reason
        assert "`multiply`" in r.reason and "after the split" in r.reason
        assert "v passes" not in r.reason


def test_import_model_writes_json_weights_and_manifest(tmp_path: Path) -> None:
    import json

    model = build("gpt2")
    out = import_model(
        model, example_inputs=(example_ids("gpt2", 2, 16),), out=tmp_path / "gpt2.json"
    )
    doc = json.loads((tmp_path / "gpt2.inputs.json").read_text())
    assert doc["inputs"] == [{"name": "ids", "shape": [2, 16], "dtype": "int64"}]
    assert doc["num_input"] == 1
    weights = load_params(out)
    assert len(weights) == len(doc["params"]) == len(list(model.parameters()))
    assert all(p["origin"] for p in doc["params"])
    # weights are parameters, not constants: the JSON stays small
    assert out.stat().st_size < 400_000 < sum(w.nbytes for w in weights)
    from worker.ingest import load_module

    mod = load_module(out.read_bytes(), "tvm-json")
    assert len(mod["main"].params) == 1 + len(weights)


def test_import_model_leaves_the_callers_model_as_it_was(tmp_path: Path) -> None:
    import torch

    model = build("gpt2").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    import_model(
        model,
        example_inputs=(example_ids("gpt2", 1, 8),),
        out=tmp_path / "gpt2.json",
        dtype="float16",
    )
    after = model.state_dict()
    assert model.training
    assert {v.dtype for v in after.values() if v.is_floating_point()} == {torch.float32}
    assert all(torch.equal(before[k], after[k]) for k in before)


# --- ONNX external data ------------------------------------------------------------------------
def _onnx_with_external(tmp_path: Path, location: str) -> Path:
    import onnx
    from onnx import TensorProto, helper

    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4])
    weight.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "64")):
        entry = weight.external_data.add()
        entry.key, entry.value = k, v
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [weight],
    )
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return path


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../secret.bin"])
def test_onnx_external_data_outside_the_folder_is_refused(tmp_path: Path, location: str) -> None:
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    path = _onnx_with_external(tmp_path, location)
    with pytest.raises(InputError, match=r"external data|outside the model's folder"):
        import_any(path)


def test_onnx_external_data_through_a_link_out_is_refused(tmp_path: Path) -> None:
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    path = _onnx_with_external(tmp_path, "w.bin")
    (path.parent / "w.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(InputError, match="outside the model's folder"):
        import_any(path)


def test_onnx_external_data_inside_the_folder_loads(tmp_path: Path) -> None:
    path = _onnx_with_external(tmp_path, "w.bin")
    (path.parent / "w.bin").write_bytes(np.eye(4, dtype="float32").tobytes())
    imported = import_any(path)
    (w,) = imported.params.values()
    np.testing.assert_array_equal(w, np.eye(4, dtype="float32"))


def test_equal_input_free_values_fold_to_one_constant() -> None:
    """Exporters rebuild the same mask per layer; folded, the JSON must hold it once."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import relax as rb
    from tvm.script.parser import relax as R

    from worker.importers import fold_input_free

    relax = tvm.relax
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((64, 64), "float32"))
        with R.dataflow() as frame:
            outs = x
            for _ in range(3):  # the same input-free chain, three times
                ramp = R.emit(R.arange(0, 64, 1, "float32"))
                row = R.emit(R.reshape(ramp, (1, 64)))
                outs = R.emit(R.add(outs, R.broadcast_to(row, (64, 64))))
            other = R.emit(R.arange(1, 65, 1, "float32"))  # a different value stays its own
            out = R.emit(R.add(outs, R.reshape(other, (1, 64))))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    folded, n = fold_input_free(mod)
    assert n >= 4
    const_type = type(relax.const(0.0))
    consts: list[Any] = []
    relax.analysis.post_order_visit(
        folded["main"], lambda e: consts.append(e) if isinstance(e, const_type) else None
    )
    assert len(consts) >= 2 and len({c.value.numpy().tobytes() for c in consts}) == 2
    # one stored tensor per distinct value, however many uses
    assert tvm.ir.save_json(folded).count('"ffi.Tensor"') == 2
    x_np = np.random.default_rng(0).standard_normal((64, 64)).astype("float32")
    dev = tvm.cpu()

    def run(m: Any) -> np.ndarray:
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), dev)
        return vm["main"](tvm.runtime.tensor(x_np, dev)).numpy()

    np.testing.assert_allclose(run(folded), run(mod), rtol=1e-6)
