"""Where the CUDA toolchain and the headers we compile against live, and how to import TVM.

Facts this module encodes (docs/field-notes.md has the long form):
- the ``nvcc`` first on PATH may be a wrapper script outside the CUDA home, so the home is
  located explicitly (settings, $CUDA_HOME, /usr/local/cuda*, or the PyPI CUDA wheels);
- CUTLASS sources come from ``nvidia-cutlass`` (``cutlass_library/source``), curand headers from
  ``nvidia-curand``, TVM-FFI headers from ``apache-tvm-ffi``;
- without ``libcuda.so.1`` TVM silently skips ``libtvm_runtime_cuda.so`` and would emit CUDA
  *source* to be JIT-compiled at load time. On a build host with no driver we load a stub
  ``libcuda.so.1`` (every entry point returns CUDA_ERROR_NO_DEVICE) before importing TVM, so
  TVM compiles kernels to machine code ahead of time.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from service.errors import ToolchainError
from service.settings import Settings, get_settings

# Driver entry points libtvm_runtime_cuda.so imports; the stub defines each one.
_DRIVER_SYMBOLS = (
    "cuDeviceGetName",
    "cuFuncSetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuLaunchKernelEx",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuTensorMapEncodeTiled",
)
_CUDA_ERROR_NO_DEVICE = 100


@dataclass(frozen=True)
class Toolchain:
    cuda_home: Path
    nvcc: Path
    nvcc_version: str
    cudart_static: Path
    cudart_shared: Path | None
    cutlass_source: Path
    curand_include: Path
    tvm_ffi_include: Path
    dlpack_include: Path

    @property
    def cutlass_includes(self) -> list[Path]:
        src = self.cutlass_source
        return [
            src / "include",
            src / "tools" / "util" / "include",
        ]

    @property
    def fmha_sm80_dir(self) -> Path:
        return self.cutlass_source / "examples" / "41_fused_multi_head_attention"

    @property
    def fmha_hopper_dir(self) -> Path:
        return self.cutlass_source / "examples" / "88_hopper_fmha"


def _site_dirs() -> list[Path]:
    seen: list[Path] = []
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key])
        if p not in seen:
            seen.append(p)
    for entry in sys.path:
        p = Path(entry)
        if p.name == "site-packages" and p not in seen:
            seen.append(p)
    return seen


def _find_in_site(*parts: str) -> Path | None:
    for site in _site_dirs():
        cand = site.joinpath(*parts)
        if cand.exists():
            return cand
    return None


def _is_cuda_home(path: Path) -> bool:
    nvcc = path / "bin" / "nvcc"
    return nvcc.is_file() and (path / "include" / "cuda_runtime.h").is_file()


def find_cuda_home(settings: Settings | None = None) -> Path:
    """The CUDA toolkit root: settings, $CUDA_HOME/$CUDA_PATH, /usr/local/cuda*, PyPI wheels."""
    settings = settings or get_settings()
    candidates: list[Path] = []
    if settings.cuda_home:
        candidates.append(Path(settings.cuda_home))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    candidates.append(Path("/usr/local/cuda"))
    candidates.extend(sorted(Path("/usr/local").glob("cuda-*"), reverse=True))
    wheel = _find_in_site("nvidia", "cu13")
    if wheel:
        candidates.append(wheel)
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path).resolve().parent.parent)
    for cand in candidates:
        if _is_cuda_home(cand):
            return cand.resolve()
    raise ToolchainError(
        "no CUDA toolkit found: install CUDA 13.0 (or `pip install stackfuse[cuda]`) "
        "or set STACKFUSE_CUDA_HOME",
        searched=[str(c) for c in candidates],
    )


@functools.lru_cache(maxsize=4)
def _nvcc_version(nvcc: Path) -> str:
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"nvcc at {nvcc} does not run: {exc}") from exc
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def _first(paths: list[Path], what: str) -> Path:
    for p in paths:
        if p.exists():
            return p
    raise ToolchainError(f"{what} not found (looked in {', '.join(map(str, paths))})")


@functools.lru_cache(maxsize=4)
def _find(cuda_home_setting: str | None) -> Toolchain:
    settings = get_settings()
    if cuda_home_setting is not None:
        settings = settings.model_copy(update={"cuda_home": Path(cuda_home_setting)})
    home = find_cuda_home(settings)
    nvcc = home / "bin" / "nvcc"
    libdirs = [home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib"]
    cudart_static = _first([d / "libcudart_static.a" for d in libdirs], "libcudart_static.a")
    cudart_shared = next(
        (d / "libcudart.so.13" for d in libdirs if (d / "libcudart.so.13").exists()), None
    )
    cutlass = _find_in_site("cutlass_library", "source")
    if cutlass is None:
        raise ToolchainError("CUTLASS sources not found: install nvidia-cutlass==4.2.0.0")
    curand = None
    for cand in (
        home / "include",
        _find_in_site("nvidia", "cu13", "include"),
        _find_in_site("nvidia", "curand", "include"),
    ):
        if cand is not None and (cand / "curand_kernel.h").exists():
            curand = cand
            break
    if curand is None:
        raise ToolchainError("curand headers not found: install nvidia-curand")
    import tvm_ffi.libinfo as ffi_info

    return Toolchain(
        cuda_home=home,
        nvcc=nvcc,
        nvcc_version=_nvcc_version(nvcc),
        cudart_static=cudart_static,
        cudart_shared=cudart_shared,
        cutlass_source=cutlass,
        curand_include=curand,
        tvm_ffi_include=Path(ffi_info.find_include_path()),
        dlpack_include=Path(ffi_info.find_dlpack_include_path()),
    )


def find_toolchain(settings: Settings | None = None) -> Toolchain:
    settings = settings or get_settings()
    return _find(str(settings.cuda_home) if settings.cuda_home else None)


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return True


def _driver_stub(directory: Path) -> Path:
    """Build (once) a stub libcuda.so.1 in ``directory``; atomic so concurrent workers agree."""
    stub = directory / "libcuda.so.1"
    if stub.exists():
        return stub
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / f"cuda_stub.{os.getpid()}.c"
    src.write_text(
        "".join(f"int {s}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}\n" for s in _DRIVER_SYMBOLS)
    )
    tmp = directory / f"libcuda.so.1.{os.getpid()}.tmp"
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise ToolchainError("no C compiler (gcc) to build the CUDA driver stub")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    os.replace(tmp, stub)
    src.unlink(missing_ok=True)
    return stub


@functools.lru_cache(maxsize=1)
def has_gpu() -> bool:
    """True when a CUDA driver is present and reports at least one device.

    Asked in a child process: initializing CUDA here would break every later fork (RQ forks a
    work-horse per job).
    """
    probe = (
        "import ctypes,sys\n"
        "try: lib=ctypes.CDLL('libcuda.so.1')\n"
        "except OSError: sys.exit(1)\n"
        "n=ctypes.c_int(0)\n"
        "ok=lib.cuInit(0)==0 and lib.cuDeviceGetCount(ctypes.byref(n))==0\n"
        "sys.exit(0 if ok and n.value>0 else 1)\n"
    )
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _load_cudart(settings: Settings) -> None:
    """Make libcudart.so.13 resolvable for libtvm_runtime_cuda.so (it is not on the default path
    everywhere): the system's, the CUDA home's, or the PyPI wheel's (torch ships one)."""
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    candidates: list[Path] = []
    try:
        shared = find_toolchain(settings).cudart_shared
        if shared is not None:
            candidates.append(shared)
    except ToolchainError:
        pass
    for parts in (("nvidia", "cu13", "lib"), ("nvidia", "cuda_runtime", "lib")):
        found = _find_in_site(*parts, "libcudart.so.13")
        if found is not None:
            candidates.append(found)
    for cand in candidates:
        try:
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


def import_tvm(settings: Settings | None = None) -> ModuleType:
    """Import TVM so that CUDA works: kernels compile ahead of time on a build host without a
    driver, and a runtime-only TVM (no libtvm_compiler.so) still gets its CUDA runtime.

    Idempotent. Must run before anything else imports ``tvm`` in this process.
    """
    if getattr(import_tvm, "_done", False):
        return sys.modules["tvm"]
    settings = settings or get_settings()
    if not _driver_present():
        stub_dir = settings.resolved_kernel_cache_dir() / "stub"
        ctypes.CDLL(str(_driver_stub(stub_dir)), mode=ctypes.RTLD_GLOBAL)
    _load_cudart(settings)
    import tvm

    if not tvm.runtime.enabled("cuda"):
        # runtime-only TVM does not load its CUDA sidecar on import: load it by hand
        lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
        try:
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise ToolchainError(f"TVM's CUDA runtime does not load: {exc}") from exc
    if not tvm.runtime.enabled("cuda"):
        raise ToolchainError("TVM's CUDA runtime (libtvm_runtime_cuda.so) did not register")
    import_tvm._done = True  # type: ignore[attr-defined]
    return tvm
