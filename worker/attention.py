"""The attention workload a kernel must implement, and where its operands live in memory.

``partition`` produces an :class:`AttentionSpec` from a matched site; ``fmha_sm80`` or
``hopper`` renders a kernel from it; the report shows its layout. It holds numbers and enums
only: nothing the client named ever reaches generated source through it. No TVM import.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal

DType = Literal["float16", "bfloat16", "float32"]
Causal = Literal["none", "TopLeft", "BottomRight"]

#: bits per element of each supported dtype
DTYPE_BITS: dict[str, int] = {"float16": 16, "bfloat16": 16, "float32": 32}
#: an additive bias at or below this is "masked out": exp(-1e4) underflows to 0 in fp32
MASKED = -1.0e4


@dataclass(frozen=True)
class TensorAccess:
    """How one of Q/K/V is read: from operand ``operand`` (an index into the kernel's arguments),
    starting ``offset`` elements past its base pointer, with ``row_stride`` elements between
    sequence positions and ``head_stride`` between heads. The batch stride is
    ``row_stride * seq_len`` of that operand, known at run time."""

    operand: int
    offset: int
    row_stride: int
    head_stride: int


@dataclass(frozen=True)
class BiasSpec:
    """An additive bias of rank 4, ``[B|1, N|1, S|1, S_kv]``; broadcast dims get stride 0."""

    operand: int
    shape: tuple[int | str, int | str, int | str, int | str]


DYNAMIC = "?"


@dataclass(frozen=True)
class RaggedSpec:
    """Sequences of different lengths packed one after another along the token axis of a batch
    of one (``[1, T, ...]``), each attending to its own keys only; causal masks apply within
    each sequence. ``seqstart_q`` and ``seqstart_k`` are the operands (int32 ``[B+1]``: each
    sequence's first token, then the total) the kernel reads at run time; one operand when
    queries and keys share it. The grid covers T query rows per sequence (``max_seqlen`` is a
    device tensor, not read on the host): blocks past a sequence's end exit at once."""

    seqstart_q: int
    seqstart_k: int


@dataclass(frozen=True)
class AttentionSpec:
    """One attention site: ``out[b, s, n, :] = softmax(scale * q k^T + bias, mask) v``.

    Dims are ints when static; the string ``"?"`` marks a dim read from the operand's shape at
    run time (only batch and sequence lengths may be dynamic; the client's names for them stay
    in the report, never here). ``num_operands`` counts kernel arguments before the output.
    The output is one more
    argument after them, compact ``[B, S, Nq, Hv]``.
    """

    dtype: DType
    batch: int | str
    seq_q: int | str
    seq_kv: int | str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    scale: float
    causal: Causal
    q: TensorAccess
    k: TensorAccess
    v: TensorAccess
    num_operands: int
    bias: BiasSpec | None = None
    packing: Literal["blocked", "per_head", "separate"] = "blocked"
    #: one entry per kernel argument before the output, in order: the shape of a tensor operand
    #: (checked at run time), or None for an argument the kernel ignores (TVM passes symbolic
    #: reshape targets as R.Shape arguments; a ragged site's max_seqlen tensors)
    operand_shapes: tuple[tuple[int | str, ...] | None, ...] = field(default_factory=tuple)
    #: a sliding window of W keys (with a causal mask): key j is seen from query i iff
    #: ``i + off - W < j <= i + off``, ``off`` 0 (TopLeft) or ``S_kv - S`` (BottomRight);
    #: flash-attention's ``window_size_left = W - 1``, ``right = 0``. None: no window
    window: int | None = None
    #: set for ``attention_var_len``: ``batch`` is then 1 and ``seq_q`` / ``seq_kv`` count the
    #: packed tokens of all sequences
    ragged: RaggedSpec | None = None

    @property
    def elem_bits(self) -> int:
        return DTYPE_BITS[self.dtype]

    def fingerprint(self) -> str:
        """Identical workloads share one kernel object: this names it. ``window`` and ``ragged``
        count only where set: a spec with neither keeps the name it had before specs could hold
        them, so the symbols (and cached objects) of other sites do not depend on them."""
        fields = asdict(self)
        for optional in ("window", "ragged"):
            if fields[optional] is None:
                del fields[optional]
        blob = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()


def stacked_spec(
    *,
    dtype: DType,
    nq: int,
    nkv: int,
    h: int,
    causal: Causal = "none",
    batch: int | str = DYNAMIC,
    seq: int | str = DYNAMIC,
    window: int | None = None,
) -> AttentionSpec:
    """The spec of stacked attention straight from ``qkv[B, S, (Nq + 2 Nkv) H]`` (q|k|v blocks
    in order, one operand): for benchmarks and tests that drive a kernel without a module."""
    c = (nq + 2 * nkv) * h
    return AttentionSpec(
        dtype=dtype,
        batch=batch,
        seq_q=seq,
        seq_kv=seq,
        num_q_heads=nq,
        num_kv_heads=nkv,
        head_dim=h,
        head_dim_v=h,
        scale=1.0 / (h**0.5),
        causal=causal,
        q=TensorAccess(0, 0, c, h),
        k=TensorAccess(0, nq * h, c, h),
        v=TensorAccess(0, (nq + nkv) * h, c, h),
        num_operands=1,
        operand_shapes=((batch, seq, c),),
        window=window,
    )
