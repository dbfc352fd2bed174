"""What a compile job asks for: the target and the options, and the key that names the result.

Shared by the API (validates cheaply, computes the cache key), the worker and the CLI. No TVM.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Architectures the codegen builds for. SM80-class kernels run on all of them; sm_90 also
#: gets the Hopper kernel where the selector prefers it.
SUPPORTED_ARCHS: tuple[str, ...] = ("sm_80", "sm_86", "sm_89", "sm_90")
Arch = Literal["sm_80", "sm_86", "sm_89", "sm_90"]


class Target(BaseModel):
    """The GPU the library is built for."""

    model_config = ConfigDict(extra="forbid")

    arch: Arch = Field(default="sm_90", description="CUDA compute capability, e.g. sm_90.")


class CompileOptions(BaseModel):
    """Knobs a client may set per job; anything else is refused (extra="forbid")."""

    model_config = ConfigDict(extra="forbid")

    fuse_stacked: bool = Field(
        default=True, description="Fuse stacked QKV -> split/slice -> reshape -> attention."
    )
    offload_plain: bool = Field(
        default=True, description="Offload attention alone where the stacked fusion cannot apply."
    )
    kernel: Literal["auto", "sm80", "hopper"] = Field(
        default="auto", description="Attention kernel family; auto picks per shape."
    )
    offload_gemm: bool = Field(
        default=True,
        description="Offload float16/bfloat16 matmuls (with bias, activation and residual "
        "epilogues) to CUTLASS GEMMs (sm_90: CUTLASS 3.x Hopper GEMMs; sm_80/86/89: CUTLASS 2.x).",
    )
    allow_tf32: bool = Field(
        default=False,
        description="Offload float32 matmuls as TF32 GEMMs (10-bit mantissa inputs, float32 "
        "accumulation: ~1e-3 relative error; sm_90). Off: float32 matmuls stay in TVM.",
    )
    lift_params: bool = Field(
        default=True,
        description="Lift computations on weights alone (transposes, concatenations, casts) "
        "into main_transform_params, run once at load instead of at every call.",
    )
    normalize: bool = Field(
        default=True,
        description="Rewrite exporter forms (transposes, decomposed attention) before matching.",
    )
    validate_on_gpu: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Run the built library against a reference: auto = when the worker has a GPU.",
    )


def cache_key(module_sha256: str, target: Target, options: CompileOptions, toolchain: str) -> str:
    """Names a compile result: same module, target, options and toolchain -> same artifact."""
    doc = {
        "module": module_sha256,
        "target": target.model_dump(mode="json"),
        "options": options.model_dump(mode="json"),
        "toolchain": toolchain,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


#: Bumped whenever generated code or the pipeline changes in a way that alters artifacts.
CODEGEN_REVISION = 19

_TOOLCHAIN_PACKAGES = ("stackfuse", "apache-tvm", "apache-tvm-ffi", "nvidia-cutlass")


def toolchain_versions() -> dict[str, str]:
    """Installed versions of what shapes an artifact, read without importing any of it."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {"codegen_revision": str(CODEGEN_REVISION)}
    for name in _TOOLCHAIN_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not-installed"
    return out


def toolchain_fingerprint() -> str:
    return json.dumps(toolchain_versions(), sort_keys=True)
