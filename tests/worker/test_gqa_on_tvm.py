"""GQA/MQA attention left to TVM: K and V repeated up to the query heads (worker/build.py).

TVM's own attention reads K and V by the query head; with fewer key/value heads its results
were wrong (relative error ~1) on every GQA site we did not offload and in the validation
reference. Checked here on the CPU (llvm) against numpy; on the GPU by benchmarks/gpu_cases.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.models import stacked_attention_module, tvm
from worker.build import expand_kv_heads

relax = tvm.relax


def _reference(qkv: np.ndarray, n: int, n_kv: int, h: int, causal: bool) -> np.ndarray:
    b, s, _ = qkv.shape
    q = qkv[..., : n * h].reshape(b, s, n, h)
    k = qkv[..., n * h : (n + n_kv) * h].reshape(b, s, n_kv, h)
    v = qkv[..., (n + n_kv) * h :].reshape(b, s, n_kv, h)
    k, v = (np.repeat(t, n // n_kv, axis=2) for t in (k, v))  # query head i -> kv head i // g
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(h)
    if causal:
        scores = np.where(np.tril(np.ones((s, s), dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v)


def _run(mod: object, qkv: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(qkv)).numpy()


@pytest.mark.parametrize(
    ("n_kv", "causal"), [(2, None), (1, None), (2, "BottomRight")], ids=["gqa", "mqa", "causal"]
)
def test_grouped_attention_on_tvm_matches_numpy(n_kv: int, causal: str | None) -> None:
    n, h = 4, 8
    mod = stacked_attention_module(2, 16, n, h, n_kv=n_kv, dtype="float32", causal=causal)
    qkv = np.random.default_rng(0).standard_normal((2, 16, (n + 2 * n_kv) * h)).astype("float32")
    want = _reference(qkv, n, n_kv, h, causal is not None)
    assert np.abs(_run(expand_kv_heads(mod), qkv) - want).max() < 1e-5
    # what TVM computes without the rewrite: this test can fail
    assert np.abs(_run(mod, qkv) - want).max() > 0.1


def test_equal_heads_are_left_alone() -> None:
    mod = stacked_attention_module(2, 16, 4, 8, dtype="float32")
    tvm.ir.assert_structural_equal(expand_kv_heads(mod), mod)
