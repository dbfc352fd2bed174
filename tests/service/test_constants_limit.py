"""The 413 for a module whose constants pass ``max_constant_bytes`` names the largest ones
(the variable that uses each, shape, dtype, bytes), read from the JSON alone: the API never
imports TVM. Checked on the wire check and through a running API."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from service.errors import LimitExceeded
from service.settings import Settings
from service.wire import check_module_json, largest_constants
from tests.conftest import ApiProcess
from worker.toolchain import import_tvm


def _module_with_constants() -> str:
    """x + c0 -> @ c1 -> + c2, with c1 ([256, 512] float16, 256 KiB) the largest."""
    tvm = import_tvm()
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 256), "float16"))
    ones = np.ones
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, relax.const(ones((4, 256), "float16"))), "shifted")
            b = bb.emit(relax.op.matmul(a, relax.const(ones((256, 512), "float16"))), "proj")
            c = bb.emit(relax.op.add(b, relax.const(ones((512,), "float16"))), "biased")
            out = bb.emit_output(c)
        bb.emit_func_output(out)
    text: str = tvm.ir.save_json(bb.get())
    return text


LARGEST = [
    {
        "name": "proj",
        "op": "relax.matmul",
        "shape": [256, 512],
        "dtype": "float16",
        "bytes": 262144,
    },
    {"name": "shifted", "op": "relax.add", "shape": [4, 256], "dtype": "float16", "bytes": 2048},
    {"name": "biased", "op": "relax.add", "shape": [512], "dtype": "float16", "bytes": 1024},
]


def test_the_constants_limit_names_the_largest_constants() -> None:
    with pytest.raises(LimitExceeded) as err:
        check_module_json(_module_with_constants(), Settings(max_constant_bytes=100_000))
    assert err.value.status == 413
    detail = err.value.detail
    assert detail["largest_constants"] == LARGEST
    # the total counts every constant, also those after the one that passed the limit
    assert detail["actual"] == 262144 + 2048 + 1024 and detail["limit"] == 100_000
    assert "[256, 512] float16 (256.0 KiB) used by relax.matmul in 'proj'" in err.value.message
    # the same list, for a module too large to send at all (stackfuse submit, import)
    assert largest_constants(_module_with_constants()) == LARGEST


def test_the_api_413_names_them_too(start_api: Callable[..., ApiProcess]) -> None:
    small = start_api(STACKFUSE_MAX_CONSTANT_BYTES="100000")
    with small.client() as c:
        r = c.post("/optimize", json={"module": _module_with_constants()})
    assert r.status_code == 413
    problem = r.json()
    assert problem["type"].endswith("/limit-exceeded")
    assert problem["setting"] == "max_constant_bytes"
    assert problem["largest_constants"] == LARGEST
    assert "largest: [256, 512] float16 (256.0 KiB) used by relax.matmul" in problem["detail"]


def test_submit_names_them_when_the_body_is_refused_unread(
    start_api: Callable[..., ApiProcess], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over the body limit the API reads nothing (413 payload-too-large); ``stackfuse submit``
    lists the module's largest constants itself, from the file it sent."""
    from service.cli import main

    small = start_api(STACKFUSE_MAX_BODY_BYTES="100000")
    model = tmp_path / "model.json"
    model.write_text(_module_with_constants())
    assert main(["submit", str(model), "--url", small.url]) == 2
    err = capsys.readouterr().err
    assert "Request body too large" in err
    assert "largest constants: [256, 512] float16 (256.0 KiB) used by relax.matmul" in err
