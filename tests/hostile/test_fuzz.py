"""Bounded fuzzing of ingest: mutated real modules (byte flips, truncation, node-type swaps,
index corruption, field loss) and mutated TVMScript (hostile fragments spliced in).

Only StackfuseError subclasses may come out, and nothing may create the sentinel file. The wire
check runs in this process (pure Python). Anything it accepts goes on to TVM in a child process,
since a TVM crash would be a segfault, not an exception: the child must survive every example.

CI runs a fixed, derandomized set (well under a minute); set STACKFUSE_FUZZ_EXAMPLES to run more.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import wire
from service.errors import StackfuseError
from tests.hostile import hostile_kit as hk
from worker import tvmscript_allowlist

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("STACKFUSE_FUZZ_EXAMPLES", "0"))
SENTINEL = hk.sentinel()

_FUZZ = settings(
    max_examples=EXAMPLES or 150,
    deadline=None,
    derandomize=not EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

_CHILD = r"""
import json, struct, sys
from worker.toolchain import import_tvm
import_tvm()
from service.errors import StackfuseError
from service.settings import Settings
from worker import ingest
settings = Settings()
out = sys.stdout
out.write("ready\n"); out.flush()
while True:
    head = sys.stdin.buffer.read(5)
    if len(head) < 5:
        break
    fmt = "tvm-json" if head[:1] == b"j" else "tvmscript"
    payload = sys.stdin.buffer.read(struct.unpack("<I", head[1:])[0])
    try:
        ingest.load_module(payload, fmt, settings)
        result = {"ok": True}
    except StackfuseError as exc:
        result = {"ok": False, "type": exc.type}
    except BaseException as exc:
        result = {"escaped": type(exc).__name__, "message": str(exc)[:500]}
    out.write(json.dumps(result) + "\n"); out.flush()
"""


class TVMChild:
    """One long-lived process running ingest.load_module on each payload it is sent."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == b"ready"
        self.seen = 0

    def load(self, payload: bytes, fmt: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(
            (b"j" if fmt == "tvm-json" else b"s") + struct.pack("<I", len(payload)) + payload
        )
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            (REPO / "fuzz-crash.bin").write_bytes(payload)
            pytest.fail(f"TVM died on a payload (exit {self.proc.wait()}); saved to fuzz-crash.bin")
        self.seen += 1
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tvm_child() -> Iterator[TVMChild]:
    child = TVMChild()
    yield child
    child.close()
    assert child.seen >= 20, f"only {child.seen} examples reached TVM: the fuzzing is too shallow"
    assert not SENTINEL.exists()


# --- mutations ---------------------------------------------------------------------------------


def _flip(text: str, data: st.DataObject) -> bytes:
    raw = bytearray(text.encode())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.sampled_from(b'{}[]",:0123456789-.eE\\ntfaN\x00\xff'))
    return bytes(raw)


def _truncate(text: str, data: st.DataObject) -> bytes:
    return text.encode()[: data.draw(st.integers(0, len(text) - 1))]


def _graph_edit(text: str, data: st.DataObject) -> bytes:
    doc = json.loads(text)
    nodes = doc["nodes"]
    types = sorted({n["type"] for n in nodes})
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(nodes) - 1))
        node = nodes[i]
        payload = node.get("data")
        edit = data.draw(st.sampled_from(["type", "ref", "field", "value", "swap", "root"]))
        if edit == "type":
            node["type"] = data.draw(st.sampled_from(types))
        elif edit == "ref" and isinstance(payload, dict) and payload:
            key = data.draw(st.sampled_from(sorted(payload)))
            payload[key] = data.draw(st.integers(-2, len(nodes) + 2))
        elif edit == "ref" and isinstance(payload, list) and payload:
            j = data.draw(st.integers(0, len(payload) - 1))
            payload[j] = data.draw(st.integers(-2, len(nodes) + 2))
        elif edit == "field" and isinstance(payload, dict) and payload:
            del payload[data.draw(st.sampled_from(sorted(payload)))]
        elif edit == "field" and isinstance(payload, list) and payload:
            payload.pop() if data.draw(st.booleans()) else payload.append(payload[0])
        elif edit == "value":
            node["data"] = data.draw(
                st.one_of(
                    st.none(),
                    st.booleans(),
                    st.integers(-(2**63), 2**63 - 1),
                    st.floats(),
                    st.text(max_size=20),
                    st.lists(st.integers(0, i), max_size=4),
                )
            )
        elif edit == "swap":
            j = data.draw(st.integers(0, len(nodes) - 1))
            nodes[i], nodes[j] = nodes[j], nodes[i]
        elif edit == "root":
            doc["root_index"] = data.draw(st.integers(-1, len(nodes)))
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


_MUTATIONS = {"flip": _flip, "truncate": _truncate, "graph": _graph_edit}
_JSON_SAMPLES = list(hk.SAMPLES)


@st.composite
def mutated_json(draw: st.DrawFn) -> bytes:
    data = draw(st.data())
    text = hk.saved(draw(st.sampled_from(_JSON_SAMPLES)))
    return _MUTATIONS[draw(st.sampled_from(sorted(_MUTATIONS)))](text, data)


_FRAGMENTS = [
    f'__import__("os").system("touch {SENTINEL}")',
    f'open("{SENTINEL}", "w")',
    f"\"__import__('os').system('touch {SENTINEL}')\"",
    "().__class__.__base__.__subclasses__()",
    "lambda: 0",
    "[i for i in x]",
    "R.__dict__",
    "x",
    "R.add(x, x)",
    "R.nn",
    "T.int64()",
    "n",
    "(",
    ")",
    ",",
    ":",
    "\n",
    "    ",
    "=",
    "@",
    "metadata",
    "cls.main",
    '"float16"',
    "0",
    "-1",
    "2**64",
    "R.call_packed",
    "R.cumsum(x, axis=-9)",
    'R.cumprod(x, axis=0, dtype="bool")',
    "R.cumsum(x, axis=None, exclusive=True)",
    "**x",
    "*x",
]


@st.composite
def mutated_script(draw: st.DrawFn) -> bytes:
    text = draw(st.sampled_from([hk.SCRIPT_MODULE, hk.stacked_attention().script()]))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 12))
        text = text[:i] + draw(st.sampled_from(_FRAGMENTS)) + text[i + cut :]
    return text.encode()


# --- properties --------------------------------------------------------------------------------


def _wire_only(payload: bytes) -> bool:
    """True when the wire check accepts ``payload``; any non-Stackfuse exception fails."""
    try:
        wire.check_module_json(payload, hk.settings())
    except StackfuseError as exc:
        assert exc.type and exc.message
        return False
    return True


@_FUZZ
@given(payload=mutated_json())
def test_wire_check_raises_only_stackfuse_errors(payload: bytes) -> None:
    _wire_only(payload)
    assert not SENTINEL.exists()


@_FUZZ
@given(payload=mutated_json())
def test_tvm_survives_what_the_wire_check_accepts(payload: bytes, tvm_child: TVMChild) -> None:
    if _wire_only(payload):
        result = tvm_child.load(payload, "tvm-json")
        assert "escaped" not in result, result
    assert not SENTINEL.exists()


@_FUZZ
@given(payload=mutated_script())
def test_tvmscript_ingest_raises_only_stackfuse_errors(payload: bytes, tvm_child: TVMChild) -> None:
    try:
        tvmscript_allowlist.validate_tvmscript(payload.decode(), hk.settings())
    except StackfuseError:
        assert not SENTINEL.exists()
        return
    result = tvm_child.load(payload, "tvmscript")
    assert "escaped" not in result, result
    assert not SENTINEL.exists()
