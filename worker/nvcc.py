"""The one nvcc command line and the one kernel cache.

Every object we compile (CUTLASS units from :class:`~worker.kernel_source.KernelSource`, TVM's
own CUDA kernels as fatbins) goes through :func:`cached_build`: an entry of the kernel cache
named by its key, built by sandboxed nvcc under a per-key file lock (concurrent workers never
compile the same entry twice) and written atomically (temp + rename). Kernel objects are keyed
by the sha256 of (source, flags, our headers, nvcc version, CUTLASS version): a second compile
of the same unit runs no nvcc.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from service.errors import CompileError
from service.settings import Settings, get_settings
from worker import sandbox
from worker.kernel_source import CompiledKernel, KernelSource
from worker.toolchain import Toolchain, find_toolchain

COMMON_FLAGS: tuple[str, ...] = (
    "-c",
    "-O3",
    "-std=c++17",
    "-Xcompiler=-fPIC",
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
    "-w",
    # Only the TVM-FFI entry points (explicitly default visibility) leave the library. Without
    # this, template statics and kernel stubs are unified across every library in a process
    # (STB_GNU_UNIQUE / interposition): a second model with the same Hopper kernel then skipped
    # its cudaFuncSetAttribute and failed to launch (seen on the H200).
    "-Xcompiler=-fvisibility=hidden",
    "-Xcompiler=-fvisibility-inlines-hidden",
)


def arch_number(arch: str) -> int:
    return int(arch.removeprefix("sm_").rstrip("a"))


def gencode(arch: str) -> tuple[str, ...]:
    n = arch_number(arch)
    return ("-gencode", f"arch=compute_{n},code=[sm_{n},compute_{n}]")


def run_nvcc(
    argv: list[str], src: Path, out: Path, *, settings: Settings, chain: Toolchain, what: str
) -> sandbox.Completed:
    """nvcc under the sandbox's limits; a failure becomes a CompileError whose excerpt holds
    only diagnostics about ``src`` (our own generated file)."""
    result = sandbox.run(
        argv,
        limits=sandbox.Limits(
            timeout_s=settings.nvcc_timeout_s,
            cpu_s=settings.nvcc_timeout_s * 2,
            memory_bytes=settings.nvcc_memory_bytes,
            file_bytes=settings.max_output_file_bytes,
        ),
        cwd=src.parent,
        env=sandbox.clean_env({"PATH": f"{chain.cuda_home / 'bin'}:{os.environ.get('PATH', '')}"}),
        what="nvcc",
    )
    if result.returncode != 0 or not out.exists():
        raise CompileError(
            f"nvcc could not compile {what} (exit {result.returncode})",
            excerpt=sandbox.excerpt(result.output, [src], limit=settings.error_excerpt_chars),
        )
    return result


def include_flags(chain: Toolchain) -> list[str]:
    dirs = [
        *chain.cutlass_includes,
        chain.fmha_sm80_dir,
        chain.curand_include,
        chain.tvm_ffi_include,
        chain.dlpack_include,
        chain.cuda_home / "include",
    ]
    out: list[str] = []
    for d in dirs:
        flag = f"-I{d}"
        if flag not in out:
            out.append(flag)
    return out


def nvcc_argv(
    ks: KernelSource, chain: Toolchain, src: Path, out: Path, *extra: str, warnings: bool = False
) -> list[str]:
    """The command that compiles ``ks`` (in ``src``) to ``out``: what the kernel cache runs, and
    what tests and benchmarks that read nvcc's own output (``extra``: e.g. ``-Xptxas=-v``) must
    run too. ``warnings`` drops ``-w``, which also silences ptxas's warnings (its "Potential
    Performance Loss" ones included); the generated code is the same either way."""
    common = [f for f in COMMON_FLAGS if not (warnings and f == "-w")]
    return [
        str(chain.nvcc),
        *common,
        *ks.flags,
        *include_flags(chain),
        *extra,
        "-o",
        str(out),
        str(src),
    ]


_OUR_HEADERS = Path(__file__).resolve().parent / "kernels"


@functools.cache
def headers_digest(root: Path = _OUR_HEADERS) -> str:
    """sha256 over the headers we ship (``worker/kernels``): the generated units include them,
    so an object built before an edit to them must not be served after it."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(ks: KernelSource, chain: Toolchain) -> str:
    from service.spec import toolchain_versions

    doc = json.dumps(
        {
            "source": ks.source,
            "flags": [*COMMON_FLAGS, *ks.flags],
            "headers": headers_digest(),
            "nvcc": chain.nvcc_version,
            "cutlass": toolchain_versions().get("nvidia-cutlass", "?"),
        },
        sort_keys=True,
    )
    return hashlib.sha256(doc.encode()).hexdigest()


def cache_entry(settings: Settings, kind: str, key: str, suffix: str) -> Path:
    """Where the kernel cache keeps the ``kind`` (``objects``, ``fatbins``) entry ``key``."""
    return settings.resolved_kernel_cache_dir() / kind / key[:2] / f"{key}{suffix}"


def cached_path(ks: KernelSource, settings: Settings, chain: Toolchain) -> tuple[str, Path]:
    """(cache key, where the object of ``ks`` alone lives in the kernel cache)."""
    key = cache_key(ks, chain)
    return key, cache_entry(settings, "objects", key, ".o")


def is_cached(ks: KernelSource, settings: Settings, chain: Toolchain) -> bool:
    """Whether ``ks``'s object (not what it needs) is in the kernel cache already."""
    return cached_path(ks, settings, chain)[1].exists()


def cached_build(
    entry: Path,
    source: str,
    argv: Callable[[Path, Path], list[str]],
    *,
    settings: Settings,
    chain: Toolchain,
    what: str,
    keep_source: bool = False,
) -> sandbox.Completed | None:
    """Make sure the cache entry ``entry`` (from :func:`cache_entry`) exists: None when it did
    (or another worker built it while we waited for its lock), else nvcc's run.

    Under the entry's file lock, ``source`` is written next to it and nvcc runs
    ``argv(source_path, temp_output)``; the output lands by rename. ``keep_source`` leaves the
    source beside the entry as ``<key>.cu`` (kernel objects keep theirs); else it is removed."""
    shard = entry.parent
    shard.mkdir(parents=True, exist_ok=True)
    if entry.exists():
        return None
    key = entry.stem
    with open(shard / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.exists():  # another worker finished it while we waited
            return None
        pid = os.getpid()
        # One name per key (we hold its lock), whatever the process: nvcc puts the source's
        # name into the object (__FILE__ strings), so a pid or a directory in it would make two
        # compiles of one unit differ.
        src = shard / f"{key}.cu"
        tmp_src = shard / f"{key}.{pid}.cu.tmp"
        tmp_src.write_text(source)
        os.replace(tmp_src, src)
        tmp = shard / f"{key}.{pid}{entry.suffix}.tmp"
        try:
            # named relative to nvcc's working directory (the shard, see run_nvcc): the object
            # then holds no path of this machine's cache
            rel = argv(Path(src.name), Path(tmp.name))
            result = run_nvcc(rel, src, tmp, settings=settings, chain=chain, what=what)
            os.replace(tmp, entry)
        finally:
            tmp.unlink(missing_ok=True)
            if not keep_source:
                src.unlink(missing_ok=True)
    return result


def compile_object(
    ks: KernelSource,
    *,
    settings: Settings | None = None,
    chain: Toolchain | None = None,
) -> CompiledKernel:
    """The object file for ``ks`` and those of what it needs: each from the cache, or compiled
    by nvcc and then cached."""
    settings = settings or get_settings()
    chain = chain or find_toolchain(settings)
    started = time.monotonic()
    needs = [compile_object(dep, settings=settings, chain=chain) for dep in ks.needs]
    obj, key, hit = _compile_one(ks, settings, chain)
    paths: list[Path] = []
    for dep in needs:
        paths.extend(p for p in dep.objects if p not in paths)
    return CompiledKernel(
        ks.symbol,
        obj,
        key,
        hit and all(d.cache_hit for d in needs),
        time.monotonic() - started,
        tuple(paths),
    )


def _compile_one(ks: KernelSource, settings: Settings, chain: Toolchain) -> tuple[Path, str, bool]:
    """(object path, cache key, cache hit) for ``ks`` alone."""
    key, obj = cached_path(ks, settings, chain)
    result = cached_build(
        obj,
        ks.source,
        lambda src, out: nvcc_argv(ks, chain, src, out),
        settings=settings,
        chain=chain,
        what=f"the {ks.family} kernel",
        keep_source=True,
    )
    if result is None:
        return obj, key, True
    meta = {
        "symbol": ks.symbol,
        "family": ks.family,
        "seconds": result.seconds,
        "nvcc": chain.nvcc_version,
        "config": ks.config,
    }
    (obj.parent / f"{key}.json").write_text(json.dumps(meta, sort_keys=True))
    return obj, key, False
