"""The GEMM workload a kernel must implement, and where its operands live.

``gemm_partition`` produces a :class:`GemmSpec` from a matched matmul site; ``gemm_sm90`` renders
a kernel from it; the report shows it. Numbers and enum tokens only: nothing the client named
reaches generated source through it. No TVM import.

The computation is ``out = act(A @ B + bias)``, ``out = A @ B + bias + residual`` or, for a gated
unit (SwiGLU), ``out = silu(gate) * (A @ B)``, or, for a paired SwiGLU (``paired_glu``: the gate
and up projections as one GEMM on weights interleaved in blocks of 8 columns),
``out[:, 8j + i] = silu(Y[:, 16j + i]) * Y[:, 16j + 8 + i]`` with ``Y = A @ B`` of N = 2I columns
and ``out`` of I, with A
``[..., M, K]`` (leading dims folded into M when B is a 2-D weight), B ``[K, N]`` as stored or
``[N, K]`` read transposed (a ``permute_dims`` folded into the layout, never copied), bias
``[N]``, and the residual or gate shaped like the output. Accumulation is float32; float32
operands multiply as TF32 (only when the client sets ``allow_tf32``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal

GemmDType = Literal["float16", "bfloat16", "float32"]
Activation = Literal["none", "relu", "gelu", "gelu_tanh", "silu"]

ACTIVATIONS: tuple[Activation, ...] = ("none", "relu", "gelu", "gelu_tanh", "silu")
#: the Relax operator of each activation the GEMM patterns fuse
ACTIVATION_OPS: dict[str, str] = {
    "relu": "relax.nn.relu",
    "gelu": "relax.nn.gelu",
    "gelu_tanh": "relax.nn.gelu_tanh",
    "silu": "relax.nn.silu",
}
#: TMA moves 16-byte rows: K and N must be multiples of 16 bytes' worth of elements
ALIGN_BYTES = 16
ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def align_elems(dtype: str) -> int:
    return ALIGN_BYTES // ELEMENT_BYTES[dtype]


DYNAMIC = "?"
#: the epilogue of a paired SwiGLU (``GemmSpec.paired_glu``): silu(gate) * up, gate and up
#: projections as one GEMM, columns paired in registers
SWIGLU = "swiglu"


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM site. ``m`` is ``"?"`` when read at run time (a symbolic batch or sequence);
    ``batch`` is the L of a batched matmul (both operands batched), 1 otherwise.

    ``a``, ``b``, ``bias``, ``residual`` and ``gate`` index the kernel's arguments (-1: absent;
    a residual and a gate never both);
    ``operand_shapes`` has one entry per argument before the output: a tensor's shape, or None
    for a non-tensor argument TVM passes along (a symbolic reshape target).

    ``paired_glu``: SwiGLU's gate and up projections as one GEMM (``n`` = 2I, the weight's
    width) whose epilogue pairs gate column ``16j + i`` with up column ``16j + 8 + i`` in
    registers and writes ``silu(gate) * up``: ``out_shape`` ends in I = ``n // 2``.
    """

    dtype: GemmDType
    m: int | str
    n: int
    k: int
    b_kmajor: bool
    activation: Activation
    a: int
    b: int
    bias: int = -1
    residual: int = -1
    gate: int = -1
    batch: int | str = 1
    batched: bool = False
    num_operands: int = 2
    operand_shapes: tuple[tuple[int | str, ...] | None, ...] = field(default_factory=tuple)
    out_shape: tuple[int | str, ...] = ()
    paired_glu: bool = False

    @property
    def has_bias(self) -> bool:
        return self.bias >= 0

    @property
    def has_residual(self) -> bool:
        return self.residual >= 0

    @property
    def has_gate(self) -> bool:
        return self.gate >= 0

    @property
    def c_operand(self) -> int:
        """The argument the kernel reads as C: the residual or the gate (-1: none)."""
        return self.residual if self.has_residual else self.gate

    def epilogue(self) -> list[str]:
        """What the epilogue fuses, in order: e.g. ``["bias", "gelu_tanh"]``."""
        out = []
        if self.has_bias:
            out.append("bias")
        if self.activation != "none":
            out.append(self.activation)
        if self.has_residual:
            out.append("residual")
        if self.has_gate:
            out.append("silu_gate")
        if self.paired_glu:
            out.append(SWIGLU)
        return out

    @property
    def out_n(self) -> int:
        """The output's last dim: N, or I = N / 2 for a paired SwiGLU."""
        return self.n // 2 if self.paired_glu else self.n

    def flops(self, m: int | None = None) -> int:
        rows = m if m is not None else (self.m if isinstance(self.m, int) else 0)
        batch = self.batch if isinstance(self.batch, int) else 1
        return 2 * batch * rows * self.n * self.k

    def fingerprint(self) -> str:
        doc = asdict(self)
        if not self.paired_glu:  # the fingerprint of every other site, as before the field
            del doc["paired_glu"]
        blob = json.dumps(doc, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()


def weight_spec(
    *,
    dtype: GemmDType,
    m: int | str,
    n: int,
    k: int,
    b_kmajor: bool,
    activation: Activation = "none",
    bias: bool = False,
    residual: bool = False,
    gate: bool = False,
    paired_glu: bool = False,
) -> GemmSpec:
    """A ``[M, K] x weight`` spec with operands in order (a, b, bias?, residual? | gate?): for
    benchmarks and tests that drive a kernel without a module. ``paired_glu``: ``n`` is 2I
    (the interleaved weight's width), the output ``[M, I]``."""
    shapes: list[tuple[int | str, ...]] = [(m, k), (n, k) if b_kmajor else (k, n)]
    idx_bias = idx_res = idx_gate = -1
    if bias:
        idx_bias = len(shapes)
        shapes.append((n,))
    if residual:
        idx_res = len(shapes)
        shapes.append((m, n))
    if gate:
        idx_gate = len(shapes)
        shapes.append((m, n))
    return GemmSpec(
        dtype=dtype,
        m=m,
        n=n,
        k=k,
        b_kmajor=b_kmajor,
        activation=activation,
        a=0,
        b=1,
        bias=idx_bias,
        residual=idx_res,
        gate=idx_gate,
        num_operands=len(shapes),
        operand_shapes=tuple(shapes),
        out_shape=(m, n // 2 if paired_glu else n),
        paired_glu=paired_glu,
    )
