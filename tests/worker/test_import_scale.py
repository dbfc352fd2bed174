"""Imports at real sizes fit the service: constant masks are never stored, input-free chains of
scans (``cumsum``) are folded at any size, and a module over the body limit is explained by its
largest constants.

Mask and position constants grow with batch and sequence, not with layers, so the size tests
use real widths and real shapes with two layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.wire import largest_constants
from worker.importers import (
    fold_input_free,
    import_any,
    import_model,
    mask_form,
    over_limit_message,
)
from worker.toolchain import import_tvm

tvm = import_tvm()
MB = 1_000_000
LOW = float(np.finfo(np.float16).min)


def _causal(b: int, s: int, skv: int | None = None, *, bottom: bool = False) -> np.ndarray:
    skv = skv or s
    i = np.arange(s)[:, None] + ((skv - s) if bottom else 0)
    keep = np.arange(skv)[None, :] <= i
    return np.broadcast_to(np.where(keep, 0.0, LOW), (b, 1, s, skv)).astype(np.float16)


def test_mask_form_reads_causal_all_true_and_refuses_biases() -> None:
    assert mask_form(_causal(2, 8)) == "TopLeft"
    assert mask_form(_causal(2, 4, 8, bottom=True)) == "BottomRight"
    assert mask_form(np.zeros((2, 1, 8, 8), np.float16)) == "none"
    assert mask_form(np.zeros((2, 1, 8, 8), np.float16), "TopLeft") == "TopLeft"
    assert mask_form(_causal(2, 8), "TopLeft") == "TopLeft"
    alibi = _causal(1, 8) + np.arange(8, dtype=np.float16)[None, None, None, :]
    assert mask_form(alibi) is None
    padded = _causal(2, 8).copy()
    padded[1, :, :, 0] = LOW  # one batch entry has a padded key: not a causal mask
    assert mask_form(padded) is None
    assert mask_form(_causal(1, 8)[0]) is None  # rank 3


def _module(build: Any) -> Any:
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import relax as rb
    from tvm.script.parser import relax as R

    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((2, 64, 4, 16), "float32"))
        with R.dataflow() as frame:
            out = R.emit(build(R, x))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def _ops(mod: Any) -> set[str]:
    ops: set[str] = set()
    tvm.relax.analysis.post_order_visit(
        mod["main"],
        lambda e: (
            ops.add(e.op.name)
            if isinstance(e, tvm.relax.Call) and isinstance(e.op, tvm.ir.Op)
            else None
        ),
    )
    return ops


def _run(mod: Any, x: np.ndarray) -> np.ndarray:
    vm = tvm.relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _causal_chain(R: Any, x: Any) -> Any:
    """transformers' mask chain in miniature: arange, compare, where, broadcast to [B,1,S,S]."""
    rows = R.reshape(R.arange(0, 64, 1, "int64"), (64, 1))
    cols = R.reshape(R.arange(0, 64, 1, "int64"), (1, 64))
    keep = R.broadcast_to(R.reshape(R.less_equal(cols, rows), (1, 1, 64, 64)), (2, 1, 64, 64))
    bias = R.where(keep, R.const(0.0, "float32"), R.const(-3.0e38, "float32"))
    return R.nn.attention(x, x, x, bias, scale=0.25)


def test_a_constant_causal_mask_becomes_the_causal_flag_and_is_not_stored() -> None:
    mod = _module(_causal_chain)
    folded, n = fold_input_free(mod)
    assert n >= 1
    assert _ops(folded) == {"relax.nn.attention"}
    assert '"ffi.Tensor"' not in tvm.ir.save_json(folded)
    assert "TopLeft" in folded["main"].script()
    x = np.random.default_rng(0).standard_normal((2, 64, 4, 16)).astype("float32")
    np.testing.assert_allclose(_run(folded, x), _run(mod, x), rtol=1e-5, atol=1e-5)


def test_a_large_cumsum_chain_is_folded_whatever_its_size(monkeypatch: Any) -> None:
    """The packed-sequence check of transformers' masks: ``cumsum`` over positions, then a
    large value. The service takes a scan only over a known shape, so it is folded even above
    the size cut."""
    import worker.importers as importers

    monkeypatch.setattr(importers, "FOLD_MAX_BYTES", 64)  # every value here is "large"

    def chain(R: Any, x: Any) -> Any:
        steps = R.cumsum(R.ones((2, 64, 4, 16), "float32"), axis=1)
        return R.add(x, steps)

    mod = _module(chain)
    folded, _ = fold_input_free(mod)
    assert "relax.cumsum" not in _ops(folded)
    x = np.zeros((2, 64, 4, 16), "float32")
    np.testing.assert_allclose(_run(folded, x), _run(mod, x))


def test_a_large_accepted_value_stays_computed_from_folded_inputs(monkeypatch: Any) -> None:
    import worker.importers as importers

    monkeypatch.setattr(importers, "FOLD_MAX_BYTES", 1024)

    def chain(R: Any, x: Any) -> Any:
        row = R.reshape(R.arange(0, 16, 1, "float32"), (1, 1, 1, 16))
        return R.add(x, R.broadcast_to(row, (2, 64, 4, 16)))

    mod = _module(chain)
    folded, n = fold_input_free(mod)
    assert n == 1 and "relax.broadcast_to" in _ops(folded)
    assert "relax.arange" not in _ops(folded)
    x = np.zeros((2, 64, 4, 16), "float32")
    np.testing.assert_allclose(_run(folded, x), _run(mod, x))


def test_over_the_limit_the_message_names_the_largest_constants() -> None:
    def chain(R: Any, x: Any) -> Any:
        return R.add(x, R.const(np.ones((2, 64, 4, 16), "float32")))

    text = tvm.ir.save_json(_module(chain))
    (biggest,) = largest_constants(text)
    assert biggest["bytes"] == 2 * 64 * 4 * 16 * 4 and biggest["op"] == "relax.add"
    msg = over_limit_message(text, 70 * 2**20)
    assert "over the service's 64 MiB body limit" in msg
    assert "[2, 64, 4, 16] float32" in msg and "relax.add" in msg


# --- real configurations -------------------------------------------------------------------
pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.hf_models import build, example_ids  # noqa: E402


def _import_size(tmp: Path, name: str, batch: int, seq: int, **config: Any) -> tuple[int, Any]:
    model = build(name, **config)
    out = import_model(
        model,
        example_inputs=(example_ids(name, batch, seq),),
        out=tmp / f"{name}.json",
        dtype="float16",
    )
    manifest = json.loads((tmp / f"{name}.inputs.json").read_text())
    return out.stat().st_size, manifest


def test_gpt2_small_at_b8_s1024_imports_under_5_mb(tmp_path: Path) -> None:
    """Was 30 MB (one shared 16 MiB float16 causal mask); 353 MB before that (one per layer)."""
    size, manifest = _import_size(tmp_path, "gpt2_small", 8, 1024, n_layer=2)
    assert size < 5 * MB
    assert any("[8, 1, 1024, 1024] mask is causal (TopLeft) x2" in n for n in manifest["notes"])


def test_rotary_neox_at_b4_s2048_imports(tmp_path: Path) -> None:
    """Failed with "operator 'relax.cumsum' is not accepted": the 32 MiB mask was over the fold's
    size cut, so the packed-sequence cumsum that builds it stayed in the module."""
    size, manifest = _import_size(tmp_path, "neox_rotary", 4, 2048)
    assert size < 5 * MB
    assert any("[4, 1, 2048, 2048] mask is causal" in n for n in manifest["notes"])


def test_pythia_410m_width_at_s2048_extrapolates_under_5_mb_at_24_layers(tmp_path: Path) -> None:
    """The Pythia-410m configuration (1024 wide, rotary_pct 0.25) at B4 S2048: JSON bytes of
    one and two layers, extrapolated to its 24."""
    one, _ = _import_size(tmp_path / "1", "pythia_410m", 4, 2048, num_hidden_layers=1)
    two, _ = _import_size(tmp_path / "2", "pythia_410m", 4, 2048, num_hidden_layers=2)
    assert one + 23 * (two - one) < 5 * MB


@pytest.mark.parametrize("name", ["neox_rotary", "gpt2"])
def test_the_imported_module_matches_pytorch(name: str) -> None:
    """Imported as is (no normalization): masks taken as the causal flag keep the meaning."""
    import torch

    model = build(name)
    ids = example_ids(name, 2, 32)
    imported = import_any(model, example_inputs=(ids,))
    assert any("taken as the attention's causal flag" in n for n in imported.notes)
    with torch.no_grad():
        want = model(ids).numpy()
    exe = tvm.compile(imported.mod, target="llvm")
    vm = tvm.relax.VirtualMachine(exe, tvm.cpu())
    args = [ids.numpy(), *imported.params.values()]
    got = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
