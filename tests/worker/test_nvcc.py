"""worker.nvcc: the one nvcc command line and the one kernel cache.

First without nvcc or a GPU (a fixed toolchain, nvcc replaced by a function): the command line,
cache keys that stay put, and the per-key lock. Then real nvcc, sharing the session cache.
"""

from __future__ import annotations

import dataclasses
import fcntl
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from service.errors import CompileError
from service.settings import Settings
from service.spec import CompileOptions
from tests.models import stacked_attention_module
from worker import nvcc, sandbox, selection
from worker.attention import AttentionSpec
from worker.kernel_source import KernelSource
from worker.partition import partition
from worker.toolchain import Toolchain

CHAIN = Toolchain(
    cuda_home=Path("/cuda"),
    nvcc=Path("/cuda/bin/nvcc"),
    nvcc_version="13.0.88",
    cudart_static=Path("/cuda/lib64/libcudart_static.a"),
    cudart_shared=None,
    cutlass_source=Path("/cutlass"),
    curand_include=Path("/cuda/include"),  # as in the CUDA wheels: the same dir as cuda_home's
    tvm_ffi_include=Path("/ffi/include"),
    dlpack_include=Path("/dlpack/include"),
)
UNIT = KernelSource(
    symbol="stackfuse_golden",
    source="// golden\n",
    family="cutlass_fmha_sm80",
    flags=("-gencode", "arch=compute_90,code=[sm_90,compute_90]"),
)
#: cache_key(UNIT, CHAIN), the key existing kernel caches file this unit under: a change here
#: means every cached object of every worker compiles again (~90 s each)
UNIT_KEY = "cbe56693f7bab05ac9137d9d8ecb164cd4d904d0cc8c683cd87adf0768ce5a95"


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fix the two inputs of cache keys that come from this checkout: our headers, CUTLASS."""
    monkeypatch.setattr(nvcc, "headers_digest", lambda: "0" * 64)
    monkeypatch.setattr("service.spec.toolchain_versions", lambda: {"nvidia-cutlass": "4.2.0.0"})


@pytest.fixture
def cache_settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", kernel_cache_dir=tmp_path / "kernels")


class FakeNvcc:
    """Stands in for :func:`worker.nvcc.run_nvcc`: records each run, writes ``out`` slowly."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay, self.fail = delay, fail
        self.calls: list[list[str]] = []
        self._lock = threading.Lock()

    def __call__(
        self,
        argv: list[str],
        src: Path,
        out: Path,
        *,
        settings: Settings,
        chain: Toolchain,
        what: str,
    ) -> sandbox.Completed:
        with self._lock:
            self.calls.append(argv)
        time.sleep(self.delay)
        if self.fail:
            raise CompileError(f"nvcc could not compile {what} (exit 1)")
        out.write_bytes(b"object of " + src.read_bytes())
        return sandbox.Completed(tuple(argv), 0, "", self.delay)


@pytest.fixture
def fake_nvcc(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvcc]:
    fake = FakeNvcc()
    monkeypatch.setattr(nvcc, "run_nvcc", fake)
    yield fake


def _argv(src: Path, out: Path) -> list[str]:
    return ["nvcc", "-o", str(out), str(src)]


# --- the command line ---------------------------------------------------------------------------
def test_nvcc_argv_is_the_one_command_line() -> None:
    argv = nvcc.nvcc_argv(UNIT, CHAIN, Path("/s/a.cu"), Path("/s/a.o"), "-Xptxas=-v")
    assert argv == [
        "/cuda/bin/nvcc",
        "-c",
        "-O3",
        "-std=c++17",
        "-Xcompiler=-fPIC",
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
        "-w",
        "-Xcompiler=-fvisibility=hidden",
        "-Xcompiler=-fvisibility-inlines-hidden",
        "-gencode",
        "arch=compute_90,code=[sm_90,compute_90]",
        # CUTLASS first, then the SM80 example, curand (= the CUDA include dir, named once),
        # TVM-FFI, dlpack
        "-I/cutlass/include",
        "-I/cutlass/tools/util/include",
        "-I/cutlass/examples/41_fused_multi_head_attention",
        "-I/cuda/include",
        "-I/ffi/include",
        "-I/dlpack/include",
        "-Xptxas=-v",
        "-o",
        "/s/a.o",
        "/s/a.cu",
    ]


def test_warnings_drops_only_dash_w() -> None:
    """ptxas's warnings are silenced by -w; benchmarks that read them ask for them back."""
    quiet = nvcc.nvcc_argv(UNIT, CHAIN, Path("a.cu"), Path("a.o"))
    loud = nvcc.nvcc_argv(UNIT, CHAIN, Path("a.cu"), Path("a.o"), warnings=True)
    assert "-w" in quiet and "-w" not in loud
    assert [a for a in quiet if a != "-w"] == loud


def test_gencode_names_the_arch_without_its_suffix() -> None:
    assert nvcc.gencode("sm_80") == ("-gencode", "arch=compute_80,code=[sm_80,compute_80]")
    assert nvcc.gencode("sm_90a") == ("-gencode", "arch=compute_90,code=[sm_90,compute_90]")
    assert nvcc.arch_number("sm_86") == 86


# --- cache keys ---------------------------------------------------------------------------------
def test_cache_key_is_the_one_before_the_split(pinned: None) -> None:
    assert nvcc.cache_key(UNIT, CHAIN) == UNIT_KEY


def test_cache_key_follows_what_reaches_the_object(
    pinned: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Source, flags, nvcc, our headers and CUTLASS name an object; what only the report shows
    (config, workspace) does not."""
    base = nvcc.cache_key(UNIT, CHAIN)
    changed = {
        nvcc.cache_key(dataclasses.replace(UNIT, source="// other\n"), CHAIN),
        nvcc.cache_key(dataclasses.replace(UNIT, flags=nvcc.gencode("sm_80")), CHAIN),
        nvcc.cache_key(UNIT, dataclasses.replace(CHAIN, nvcc_version="13.1.0")),
    }
    monkeypatch.setattr(nvcc, "headers_digest", lambda: "1" * 64)
    changed.add(nvcc.cache_key(UNIT, CHAIN))
    monkeypatch.setattr(nvcc, "headers_digest", lambda: "0" * 64)
    monkeypatch.setattr("service.spec.toolchain_versions", lambda: {"nvidia-cutlass": "4.3.0.0"})
    changed.add(nvcc.cache_key(UNIT, CHAIN))
    assert base not in changed and len(changed) == 5
    monkeypatch.setattr("service.spec.toolchain_versions", lambda: {"nvidia-cutlass": "4.2.0.0"})
    same = dataclasses.replace(UNIT, config={"tile": 128}, workspace_bytes=4096)
    assert nvcc.cache_key(same, CHAIN) == base


def test_objects_live_under_their_key(pinned: None, cache_settings: Settings) -> None:
    key, path = nvcc.cached_path(UNIT, cache_settings, CHAIN)
    assert key == UNIT_KEY
    assert path == cache_settings.kernel_cache_dir / "objects" / key[:2] / f"{key}.o"  # type: ignore[operator]
    assert not nvcc.is_cached(UNIT, cache_settings, CHAIN)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert nvcc.is_cached(UNIT, cache_settings, CHAIN)


# --- the lock -----------------------------------------------------------------------------------
def test_concurrent_builds_of_one_entry_run_nvcc_once(
    cache_settings: Settings, fake_nvcc: FakeNvcc
) -> None:
    fake_nvcc.delay = 0.3
    entry = nvcc.cache_entry(cache_settings, "objects", "ab" * 32, ".o")

    def build(_: int) -> sandbox.Completed | None:
        return nvcc.cached_build(
            entry, "// unit\n", _argv, settings=cache_settings, chain=CHAIN, what="a unit"
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(build, range(4)))
    assert len(fake_nvcc.calls) == 1
    assert sum(r is not None for r in results) == 1
    assert entry.read_bytes() == b"object of // unit\n"


def test_a_build_waits_for_the_worker_holding_the_lock(
    cache_settings: Settings, fake_nvcc: FakeNvcc
) -> None:
    """Another worker is compiling this entry: we wait, then take its object, running no nvcc."""
    entry = nvcc.cache_entry(cache_settings, "fatbins", "cd" * 32, ".fatbin")
    entry.parent.mkdir(parents=True)
    results: list[sandbox.Completed | None] = []
    with open(entry.parent / f"{'cd' * 32}.lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        waiting = threading.Thread(
            target=lambda: results.append(
                nvcc.cached_build(
                    entry, "// k\n", _argv, settings=cache_settings, chain=CHAIN, what="k"
                )
            )
        )
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and fake_nvcc.calls == []
        entry.write_bytes(b"the other worker's")
    waiting.join(timeout=10)
    assert results == [None] and fake_nvcc.calls == []
    assert entry.read_bytes() == b"the other worker's"


@pytest.mark.parametrize("keep_source", [True, False])
def test_a_failed_build_leaves_no_entry_and_is_retried(
    cache_settings: Settings, fake_nvcc: FakeNvcc, keep_source: bool
) -> None:
    key = uuid.uuid4().hex * 2
    entry = nvcc.cache_entry(cache_settings, "objects", key, ".o")
    fake_nvcc.fail = True
    with pytest.raises(CompileError):
        nvcc.cached_build(
            entry,
            "bad",
            _argv,
            settings=cache_settings,
            chain=CHAIN,
            what="k",
            keep_source=keep_source,
        )
    assert not entry.exists()
    assert not [p for p in entry.parent.iterdir() if p.name.endswith(".tmp")]
    fake_nvcc.fail = False
    assert nvcc.cached_build(
        entry,
        "good",
        _argv,
        settings=cache_settings,
        chain=CHAIN,
        what="k",
        keep_source=keep_source,
    )
    left = sorted(p.name for p in entry.parent.iterdir())
    # kernel objects keep their source beside them; fatbins leave only the entry and its lock
    assert left == sorted([f"{key}.o", f"{key}.lock", *([f"{key}.cu"] if keep_source else [])])


def test_compile_object_caches_each_unit_and_lists_needs_once(
    pinned: None, cache_settings: Settings, fake_nvcc: FakeNvcc
) -> None:
    lib = dataclasses.replace(UNIT, symbol="stackfuse_lib", source="// lib\n")
    user = dataclasses.replace(UNIT, symbol="stackfuse_user", needs=(lib, lib), config={"x": 1})
    first = nvcc.compile_object(user, settings=cache_settings, chain=CHAIN)
    assert not first.cache_hit and len(fake_nvcc.calls) == 2
    assert first.needs == (nvcc.cached_path(lib, cache_settings, CHAIN)[1],)
    assert first.objects == (first.object_path, *first.needs)
    meta = first.object_path.with_suffix(".json").read_text()
    assert '"symbol": "stackfuse_user"' in meta and '"config": {"x": 1}' in meta
    # what ran is the one command line, on the cached source
    src = first.object_path.with_suffix(".cu")
    assert src.read_text() == user.source
    tmp = fake_nvcc.calls[-1][-2]
    # named relative to the shard nvcc runs in: no path of this cache enters the object
    assert fake_nvcc.calls[-1] == nvcc.nvcc_argv(user, CHAIN, Path(src.name), Path(tmp))
    assert "/" not in tmp
    again = nvcc.compile_object(user, settings=cache_settings, chain=CHAIN)
    assert again.cache_hit and again.objects == first.objects and len(fake_nvcc.calls) == 2


def test_tvm_fatbins_share_the_cache_and_its_lock(
    cache_settings: Settings, fake_nvcc: FakeNvcc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """build.py's callback for TVM's own CUDA kernels goes through the same cache and lock."""
    from worker import build

    monkeypatch.setattr(build, "find_toolchain", lambda settings=None: CHAIN)
    monkeypatch.setattr(build, "_SETTINGS", [cache_settings])
    monkeypatch.setattr(build, "_ARCH", ["sm_90"])
    fake_nvcc.delay = 0.3
    code = 'extern "C" __global__ void k() {}\n'
    with ThreadPoolExecutor(max_workers=3) as pool:
        outs = list(pool.map(lambda _: build._cuda_compile(code), range(3)))
    assert len(fake_nvcc.calls) == 1 and outs == [bytearray(b"object of " + code.encode())] * 3
    # the fatbin key formula, pinned: fatbins already in a cache stay hits
    key = "6373705ae65f9ae8180ce3d56bbd15ca3ca4d3ef7c35607c7e2a477c308cb03c"
    shard = cache_settings.kernel_cache_dir / "fatbins" / key[:2]  # type: ignore[operator]
    assert sorted(p.name for p in shard.iterdir()) == [f"{key}.fatbin", f"{key}.lock"]
    assert fake_nvcc.calls[0][:5] == ["/cuda/bin/nvcc", "--fatbin", "-O3", *nvcc.gencode("sm_90")]


# --- real nvcc (shares the session kernel cache) ------------------------------------------------
def spec_of(mod: object) -> AttentionSpec:
    (fs,) = partition(mod, CompileOptions()).fused
    assert fs.analysis.spec is not None
    return fs.analysis.spec


@pytest.mark.nvcc
def test_cache_key_follows_the_headers_we_ship(
    kernel_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an edit to worker/kernels/*.cuh must not be answered with an object built before it
    root = tmp_path / "kernels"
    root.mkdir()
    (root / "a.cuh").write_text("int x;")
    before = nvcc.headers_digest.__wrapped__(root)
    (root / "a.cuh").write_text("int y;")
    assert nvcc.headers_digest.__wrapped__(root) != before
    assert nvcc.headers_digest() == nvcc.headers_digest.__wrapped__(nvcc._OUR_HEADERS)

    from worker.toolchain import find_toolchain

    chain = find_toolchain(kernel_settings)
    spec = spec_of(stacked_attention_module(4, 8, 32, 64, 32))
    ks, _ = selection.select_kernel(spec, "sm_90", "auto")
    keys = set()
    for digest in ("one", "two"):
        monkeypatch.setattr(nvcc, "headers_digest", lambda d=digest: d)
        keys.add(nvcc.cache_key(ks, chain))
    assert len(keys) == 2


def test_compile_then_cache_hit_runs_no_nvcc(kernel_settings: Settings, tmp_path: Path) -> None:
    spec = spec_of(stacked_attention_module(4, 8, 32, 64, 32))
    ks, _ = selection.select_kernel(spec, "sm_90", "auto")
    first = nvcc.compile_object(ks, settings=kernel_settings)
    assert first.object_path.exists() and first.object_path.stat().st_size > 10_000
    data = first.object_path.read_bytes()
    assert f"__tvm_ffi_{ks.symbol}".encode() in data
    # a toolchain whose nvcc does not exist: a cache hit must not need it
    from worker.toolchain import find_toolchain

    broken = dataclasses.replace(find_toolchain(kernel_settings), nvcc=tmp_path / "no-such-nvcc")
    again = nvcc.compile_object(ks, settings=kernel_settings, chain=broken)
    assert again.cache_hit and again.object_path == first.object_path
    # what the unit needs (a Hopper site's configuration; nothing here: head_dim_v differs, so
    # the SM80-class kernel) comes back with it, from the cache as well
    assert len(first.needs) == len(ks.needs) and all(p.exists() for p in first.needs)
    assert again.objects == (first.object_path, *first.needs)


@pytest.mark.nvcc
def test_needs_compile_apart_are_cached_and_listed_once(kernel_settings: Settings) -> None:
    """What a unit needs is its own cached object: listed once however often it is needed,
    and a hit only when every part is one."""
    token = uuid.uuid4().hex  # a cold cache for this run's sources
    lib = KernelSource(
        symbol="stackfuse_lib",
        family=selection.FAMILY_SM80,
        source=f'// {token}\nextern "C" int stackfuse_lib(int a) {{ return a + 1; }}\n',
    )

    def user(name: str, needs: tuple[KernelSource, ...]) -> KernelSource:
        return KernelSource(
            symbol=name,
            family=selection.FAMILY_SM80,
            source=f'// {token}\nextern "C" int stackfuse_lib(int);\n'
            f'extern "C" int {name}(int v) {{ return stackfuse_lib(v); }}\n',
            needs=needs,
        )

    a = nvcc.compile_object(user("use_a", (lib,)), settings=kernel_settings)
    assert not a.cache_hit and len(a.needs) == 1
    b = nvcc.compile_object(user("use_b", (lib, lib)), settings=kernel_settings)
    assert b.needs == a.needs  # the same object, once
    assert not b.cache_hit  # its own unit was compiled, though its need was cached
    again = nvcc.compile_object(user("use_a", (lib,)), settings=kernel_settings)
    assert again.cache_hit and again.objects == a.objects


@pytest.mark.nvcc
def test_nvcc_failure_is_a_compile_error_with_a_trimmed_excerpt(kernel_settings: Settings) -> None:
    bad = KernelSource(
        symbol="stackfuse_broken",
        family=selection.FAMILY_SM80,
        source="#include <tvm/ffi/function.h>\nthis is not c++;\n",
        flags=nvcc.gencode("sm_90"),
    )
    with pytest.raises(CompileError) as err:
        nvcc.compile_object(bad, settings=kernel_settings)
    excerpt = err.value.detail["excerpt"]
    assert "error" in excerpt and ".cu:" in excerpt
    assert "/usr/" not in excerpt and "site-packages" not in excerpt
