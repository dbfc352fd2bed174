"""The import graph of service/, worker/ and stackfuse/ (the client), read with ``ast``.

- No cycles, counting every import: at module level, inside functions (the lazy ones that used to
  hide loops) and under ``TYPE_CHECKING``.
- The API process never imports TVM: importing any service module loads neither TVM nor a worker
  module that loads it, and the service modules besides the CLI (whose handlers run the
  compiler) import only worker modules that never reach TVM at all.
- The Python client (``stackfuse``) reaches no worker module, TVM or torch by any import path,
  lazy ones included: it runs wherever httpx does.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "worker", "stackfuse")
TVM = ("tvm", "tvm_ffi")
#: service modules allowed to import TVM-loading worker modules inside a function
COMPILER_ENTRY_POINTS = frozenset({"service.cli"})


@dataclass
class Module:
    name: str
    #: intra-package modules imported anywhere in the file
    imports: set[str] = field(default_factory=set)
    #: those imported while the module itself is imported (not in a function or TYPE_CHECKING)
    at_import: set[str] = field(default_factory=set)
    #: TVM itself (``import tvm``, ``import_tvm()``) anywhere / while importing
    tvm: bool = False
    tvm_at_import: bool = False
    #: top-level names of the other packages it imports anywhere (``torch``, ``httpx``...)
    foreign: set[str] = field(default_factory=set)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, known: set[str]) -> tuple[set[str], bool]:
    """(our modules ``node`` imports, whether it imports TVM)."""
    return _targets_and_foreign(node, known)[:2]


def _targets_and_foreign(
    node: ast.Import | ast.ImportFrom, known: set[str]
) -> tuple[set[str], bool, set[str]]:
    """(our modules ``node`` imports, whether it imports TVM, the other top-level packages)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        assert node.level == 0 and node.module, "relative imports: resolve them here first"
        names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    ours = set()
    for name in names:
        # `import worker.x.y` runs worker, worker.x and worker.x.y
        parts = name.split(".")
        ours |= {m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in known}
    tops = {n.split(".")[0] for n in names}
    return ours, bool(tops & set(TVM)), tops - set(PACKAGES)


def _scan(module: Module, body: list[ast.stmt], known: set[str], at_import: bool) -> None:
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            ours, tvm, foreign = _targets_and_foreign(stmt, known)
            # itself, and its own packages: Python imports those before the module, always
            parts = module.name.split(".")
            ours -= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
            module.foreign |= foreign
            module.imports |= ours
            module.tvm |= tvm
            if at_import:
                module.at_import |= ours
                module.tvm_at_import |= tvm
            continue
        calls_import_tvm = (
            isinstance(stmt, ast.Expr | ast.Assign)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name)
            and stmt.value.func.id == "import_tvm"
        )
        if calls_import_tvm:
            module.tvm = True
            module.tvm_at_import |= at_import
        # what runs now: module-level blocks and class bodies; later: functions, TYPE_CHECKING
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            _scan(module, stmt.body, known, at_import=False)
        elif isinstance(stmt, ast.If) and _is_type_checking(stmt):
            _scan(module, stmt.body, known, at_import=False)
            _scan(module, stmt.orelse, known, at_import)
        else:
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.stmt):
                    _scan(module, [child], known, at_import)
                elif isinstance(child, ast.ExceptHandler | ast.match_case):
                    _scan(module, child.body, known, at_import)


def import_graph(root: Path = REPO) -> dict[str, Module]:
    paths = {
        _module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))
    }
    known = set(paths)
    graph = {}
    for name, path in paths.items():
        module = Module(name)
        _scan(module, ast.parse(path.read_text(), filename=str(path)).body, known, at_import=True)
        graph[name] = module
    return graph


def _closure(graph: dict[str, Module], start: str, *, at_import: bool) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        m = graph[name]
        todo.extend(m.at_import if at_import else m.imports)
    return seen


def find_cycle(graph: dict[str, Module]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter({n: m.imports for n, m in graph.items()}).prepare()
    except graphlib.CycleError as err:
        return list(err.args[1])
    return None


GRAPH = import_graph()


def test_the_graph_sees_every_kind_of_import() -> None:
    """The scan itself: lazy imports and TYPE_CHECKING count as imports, not as import time."""
    assert "worker.partition" in GRAPH["worker.validate"].imports  # inside signature()
    assert "worker.partition" not in GRAPH["worker.validate"].at_import
    assert "worker.pipeline" in GRAPH["service.cli"].imports
    assert GRAPH["worker.build"].tvm_at_import  # import_tvm() then `import tvm`
    assert GRAPH["worker.toolchain"].tvm and not GRAPH["worker.toolchain"].tvm_at_import
    assert "worker.kernel_source" in GRAPH["worker.nvcc"].at_import


def test_no_import_cycles() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


def test_a_lazy_loop_is_a_cycle(tmp_path: Path) -> None:
    """What the graph calls a cycle: a loop through a function-level import one way and
    TYPE_CHECKING the other."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "worker" / "a.py").write_text("def f():\n    from worker import b\n")
    (tmp_path / "worker" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker.a import f\n"
    )
    assert sorted(set(find_cycle(import_graph(tmp_path)) or [])) == ["worker.a", "worker.b"]


def _tvm_at_import(graph: dict[str, Module], name: str) -> list[str]:
    """The modules that load TVM while ``name`` is imported."""
    return sorted(m for m in _closure(graph, name, at_import=True) if graph[m].tvm_at_import)


def _worker_imports_reaching_tvm(graph: dict[str, Module], name: str) -> list[str]:
    """The worker modules ``name`` imports (anywhere) from which some import path loads TVM."""
    return sorted(
        w
        for w in graph[name].imports
        if w.split(".")[0] == "worker"
        and any(graph[m].tvm for m in _closure(graph, w, at_import=False))
    )


SERVICE = sorted(n for n in GRAPH if n.split(".")[0] == "service")


@pytest.mark.parametrize("name", SERVICE)
def test_importing_a_service_module_loads_no_tvm(name: str) -> None:
    assert _tvm_at_import(GRAPH, name) == []


@pytest.mark.parametrize("name", [n for n in SERVICE if n not in COMPILER_ENTRY_POINTS])
def test_the_api_uses_no_worker_module_that_reaches_tvm(name: str) -> None:
    assert _worker_imports_reaching_tvm(GRAPH, name) == []


def test_the_tvm_checks_catch_a_tvm_import(tmp_path: Path) -> None:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "worker" / "heavy.py").write_text("from x import import_tvm\nimport_tvm()\n")
    (tmp_path / "worker" / "light.py").write_text("from worker import heavy\n")
    (tmp_path / "worker" / "lazy.py").write_text("def f():\n    import tvm\n")
    (tmp_path / "service" / "api.py").write_text(
        "import worker.light\ndef g():\n    from worker import lazy\n"
    )
    graph = import_graph(tmp_path)
    assert _tvm_at_import(graph, "service.api") == ["worker.heavy"]
    assert _worker_imports_reaching_tvm(graph, "service.api") == ["worker.lazy", "worker.light"]
    assert _tvm_at_import(graph, "worker.lazy") == []


def test_service_modules_import_without_tvm() -> None:
    """The same, by importing every service module in a fresh interpreter."""
    code = (
        "import importlib, sys\n"
        f"for name in {SERVICE!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


CLIENT = sorted(n for n in GRAPH if n.split(".")[0] == "stackfuse")


@pytest.mark.parametrize("name", CLIENT)
def test_the_client_reaches_no_worker_tvm_or_torch(name: str) -> None:
    reach = _closure(GRAPH, name, at_import=False)
    assert sorted(m for m in reach if m.split(".")[0] == "worker") == []
    heavy = {m: GRAPH[m].foreign & {*TVM, "torch"} for m in reach}
    assert {m: f for m, f in heavy.items() if f or GRAPH[m].tvm} == {}


def test_the_client_check_sees_a_lazy_worker_import(tmp_path: Path) -> None:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "stackfuse" / "client.py").write_text("def f():\n    from service import x\n")
    (tmp_path / "service" / "x.py").write_text("def g():\n    import worker.y\n")
    (tmp_path / "worker" / "y.py").write_text("import torch\n")
    graph = import_graph(tmp_path)
    reach = _closure(graph, "stackfuse.client", at_import=False)
    assert "worker.y" in reach and "torch" in graph["worker.y"].foreign


def test_the_client_imports_without_tvm_worker_or_torch() -> None:
    """The same, by using the client in a fresh interpreter."""
    code = (
        "import sys, stackfuse, stackfuse.errors\n"
        "stackfuse.default_url()\n"
        "stackfuse.Client('http://127.0.0.1:1').close()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tvm', 'tvm_ffi', 'torch', 'worker'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
