"""Which attention kernel serves a site, and the symbol its object exports.

The renderers (:mod:`worker.fmha_sm80`, :mod:`worker.hopper`) say what they can take; this
module picks among them per site and names the pick for the report. GEMM sites are chosen by
:func:`worker.gemm_sm90.select_kernel`.
"""

from __future__ import annotations

import hashlib

from worker import fmha_sm80, hopper
from worker.attention import AttentionSpec
from worker.kernel_source import KernelSource

FAMILY_SM80 = fmha_sm80.FAMILY
FAMILY_HOPPER = hopper.FAMILY


def kernel_symbol(family: str, spec: AttentionSpec, arch: str, variant: str = "") -> str:
    digest = hashlib.sha256(f"{family}|{arch}|{variant}|{spec.fingerprint()}".encode()).hexdigest()
    return f"stackfuse_{'h' if family == FAMILY_HOPPER else 'a'}{digest[:24]}"


def select_kernel(
    spec: AttentionSpec, arch: str, preference: str = "auto"
) -> tuple[KernelSource, str]:
    """The kernel for one site and the reason it was chosen (shown in the report).

    On sm_90 the Hopper FMHA (TMA, warp-specialized, wgmma) wins every shape it can take
    (measured: ~3x the SM80 kernel at long sequences, 4x at BERT-base); the SM80-class kernel
    serves other archs and what the Hopper kernel refuses (bias, fp32, head_dim_v != head_dim).
    """
    why_not = hopper.supports(spec, arch) if preference != "sm80" else "options.kernel is sm80"
    if why_not is None:
        variant = hopper.variants(spec)[0]
        symbol = kernel_symbol(FAMILY_HOPPER, spec, arch, variant)
        tile, causal, size = hopper.shape_class(spec)
        grouped = (
            f", GQA {spec.num_q_heads}/{spec.num_kv_heads}"
            if spec.num_q_heads != spec.num_kv_heads
            else ""
        )
        words = hopper.VARIANTS[variant].words(causal, spec.window)
        if spec.window is not None:
            reason = (
                f"Hopper FMHA {variant} ({words}, sm_90a): the variant built with a sliding "
                f"window at head dim {tile}{grouped}"
            )
        else:
            reason = (
                f"Hopper FMHA {variant} ({words}, sm_90a): the H200-measured pick for head dim "
                f"{tile}, {'causal' if causal else 'non-causal'}, {size} launches{grouped}"
            )
        return hopper.render(spec, symbol, variant), reason
    if spec.window is not None:  # partition's _kernel_check keeps such a site from codegen
        raise ValueError(f"window_size={spec.window} needs the Hopper kernel, and {why_not}")
    if preference == "hopper":
        why_not = f"Hopper kernel requested but {why_not}"
    reason = f"SM80-class CUTLASS fMHA (kernel_forward.h) on {arch}: {why_not}"
    symbol = kernel_symbol(FAMILY_SM80, spec, arch)
    return fmha_sm80.render_sm80(spec, symbol, arch), reason


def kernel_gap(spec: AttentionSpec, arch: str, preference: str = "auto") -> str | None:
    """Why no kernel can run ``spec`` (GQA/MQA and a sliding window need the Hopper kernel),
    or None."""
    if spec.num_q_heads == spec.num_kv_heads and spec.window is None:
        return None
    if preference == "sm80":
        if spec.window is not None:
            return "options.kernel is sm80, which reads no sliding window"
        return "options.kernel is sm80, which needs equal head counts"
    return hopper.supports(spec, arch)
