"""worker.sandbox: limits bite, the whole process tree dies, no secret reaches a tool, and what a
client sees of compiler output holds no line of any file but the job's own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.errors import TimeLimitExceeded
from worker import sandbox
from worker.sandbox import Limits

REPO = Path(__file__).resolve().parents[2]


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie waiting for init counts as dead


def _wait_dead(pid: int, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if _dead(pid):
            return True
        time.sleep(0.05)
    return _dead(pid)


def test_runs_a_tool_and_returns_its_output(tmp_path: Path) -> None:
    done = sandbox.run(
        ["sh", "-c", "echo out; echo err >&2; exit 3"], limits=Limits(10), cwd=tmp_path
    )
    assert done.returncode == 3 and done.describe() == "exit 3"
    assert "out" in done.output and "err" in done.output
    assert done.argv == ("sh", "-c", "echo out; echo err >&2; exit 3")


def test_timeout_kills_the_whole_group_grandchildren_included(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded) as info:
        sandbox.run(
            ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; sleep 300"],
            limits=Limits(timeout_s=1),
            what="the test tool",
        )
    assert time.monotonic() - started < 10
    assert "the test tool ran past its 1 s limit" in info.value.message
    assert _wait_dead(int(pidfile.read_text()))


def test_a_background_grandchild_dies_when_the_tool_exits(tmp_path: Path) -> None:
    """It also holds the output pipe open; run() must not wait for it."""
    pidfile = tmp_path / "grandchild.pid"
    started = time.monotonic()
    done = sandbox.run(
        ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; echo done"], limits=Limits(timeout_s=60)
    )
    assert done.returncode == 0 and "done" in done.output
    assert time.monotonic() - started < 10
    assert _wait_dead(int(pidfile.read_text()))


def test_the_tool_dies_with_the_worker_that_started_it(tmp_path: Path) -> None:
    """A worker SIGKILLed mid-job leaves no nvcc behind (PR_SET_PDEATHSIG)."""
    pidfile = tmp_path / "tool.pid"
    code = (
        "from worker import sandbox\n"
        f"sandbox.run(['sh', '-c', 'echo $$ > {pidfile}; exec sleep 300'],"
        " limits=sandbox.Limits(timeout_s=300))\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        end = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < end, "the tool never started"
            time.sleep(0.05)
        tool = int(pidfile.read_text())
        assert not _dead(tool)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert _wait_dead(tool)
    finally:
        worker.kill()


def test_cpu_limit_stops_a_spinning_tool() -> None:
    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded) as info:
        sandbox.run_python("while True: pass", limits=Limits(timeout_s=60, cpu_s=1))
    assert time.monotonic() - started < 20
    assert "CPU time" in info.value.message


def test_memory_limit_bites() -> None:
    done = sandbox.run_python(
        "b = bytearray(1024 * 1024 * 1024)",
        limits=Limits(timeout_s=60, memory_bytes=512 * 1024 * 1024),
    )
    assert done.returncode != 0
    assert "MemoryError" in done.output


def test_file_size_limit_bites(tmp_path: Path) -> None:
    out = tmp_path / "big"
    done = sandbox.run(
        ["sh", "-c", f"exec head -c 8000000 /dev/zero > {out}"],
        limits=Limits(timeout_s=30, file_bytes=1024 * 1024),
    )
    assert done.returncode == -signal.SIGXFSZ
    assert "file size limit" in done.describe()
    assert out.stat().st_size <= 1024 * 1024


def test_output_is_capped_head_and_tail() -> None:
    done = sandbox.run_python(
        "import sys\nsys.stdout.write('HEAD' + 'x' * 5_000_000 + 'TAIL')",
        limits=Limits(timeout_s=60, output_bytes=64 * 1024),
    )
    assert done.returncode == 0
    assert done.output.startswith("HEAD") and done.output.endswith("TAIL")
    assert "bytes of output dropped" in done.output
    assert len(done.output) < 70 * 1024


def test_environment_holds_no_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "REDIS_URL",
        "STACKFUSE_REDIS_URL",
        "AWS_SECRET_ACCESS_KEY",
        "LD_PRELOAD",
        "PYTHONPATH",
        "GITHUB_TOKEN",
    ):
        monkeypatch.setenv(name, "secret-value" if name != "LD_PRELOAD" else "/nonexistent.so")
    done = sandbox.run(["env"], limits=Limits(10), cwd=tmp_path)
    env = dict(line.split("=", 1) for line in done.output.splitlines() if "=" in line)
    assert "secret-value" not in done.output and "LD_PRELOAD" not in env
    assert env["HOME"] == str(tmp_path)
    assert env["PATH"] == os.environ["PATH"]
    assert set(env) <= {
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "CUDA_VISIBLE_DEVICES",
        "PWD",
        "SHLVL",
        "_",
    }


def test_process_attributes(tmp_path: Path) -> None:
    done = sandbox.run(
        [
            "sh",
            "-c",
            "grep NoNewPrivs /proc/self/status; ulimit -c; ulimit -n; touch f; "
            "stat -c %a f; ps -o pid=,pgid=,sid= -p $$",
        ],
        limits=Limits(10, open_files=256),
        cwd=tmp_path,
    )
    lines = done.output.split("\n")
    assert lines[0].split() == ["NoNewPrivs:", "1"]
    assert lines[1] == "0"  # no core dumps
    assert lines[2] == "256"
    assert lines[3] == "600"  # umask 077
    pid, pgid, sid = lines[4].split()
    assert pid == pgid == sid  # its own session and process group


def test_run_python_is_isolated_but_imports_the_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONSTARTUP", "/nonexistent")
    done = sandbox.run_python(
        "import sys, service.wire\nprint(sys.flags.isolated, sys.argv[1:])",
        ["a", "b"],
        limits=Limits(30),
    )
    assert done.returncode == 0, done.output
    assert done.output.strip() == "1 ['a', 'b']"


# --- excerpt -----------------------------------------------------------------------------------

OURS = Path("/data/kernels/ab/ab12cd.cu")

NVCC_OUTPUT = f"""\
/etc/passwd(1): error: this declaration has no storage class or type specifier
  root:x:0:0:root:/root:/bin/bash
  ^

/etc/passwd(2): error: expected a ";"
  daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
        ^

/venv/cutlass_library/source/include/cutlass/gemm.h(120): error: SECRET_HEADER_LINE
      int SECRET_HEADER_LINE = 42;
      ^
          detected during instantiation of "void f<T>() [with T=int]" at line 12 of {OURS}

{OURS}(12): error: identifier "undefined_thing" is undefined
    float x = undefined_thing;
              ^

"/etc/shadow", line 3: error: root:$6$hash
  root:$6$saltsalt$hash:19000:0:99999:7:::

4 errors detected in the compilation of "{OURS}".
"""

GCC_OUTPUT = f"""\
In file included from {OURS}:3:
/etc/passwd:1:5: error: expected '=', ',', ';', 'asm' or '__attribute__' before ':' token
    1 | root:x:0:0:root:/root:/bin/bash
      |     ^
\x1b[01m\x1b[K{OURS}:7:1:\x1b[m\x1b[K error: unknown type name 'oops'
    7 | oops x;
      | ^~~~
compilation terminated.
"""


def test_excerpt_drops_every_line_of_other_files() -> None:
    for output in (NVCC_OUTPUT, GCC_OUTPUT):
        text = sandbox.excerpt(output, [OURS])
        for secret in (
            "root:",
            "daemon:",
            "SECRET_HEADER_LINE",
            "$6$",
            "/etc",
            "cutlass",
            "/data/kernels",
            "\x1b",
        ):
            assert secret not in text, (secret, text)
        assert text.startswith("ab12cd.cu:")


def test_excerpt_keeps_diagnostics_about_our_file() -> None:
    text = sandbox.excerpt(NVCC_OUTPUT, [OURS])
    assert 'ab12cd.cu:12: error: identifier "undefined_thing" is undefined' in text
    assert "float x = undefined_thing;" in text
    assert "omitted" in text
    gcc = sandbox.excerpt(GCC_OUTPUT, [OURS])
    assert "ab12cd.cu:7: error: unknown type name 'oops'" in gcc and "oops x;" in gcc


def test_excerpt_matches_paths_exactly() -> None:
    other = "/elsewhere/ab12cd.cu(3): error: leak\n  LEAKED LINE\n"
    assert "LEAKED" not in sandbox.excerpt(other, [OURS])
    bare = "ab12cd.cu(3): error: mine\n  my line\n"
    assert "my line" in sandbox.excerpt(bare, [OURS])


def test_excerpt_keeps_at_most_two_quoted_lines() -> None:
    output = f"{OURS}(1): error: x\n  code\n  ^\n  third line from elsewhere\n"
    text = sandbox.excerpt(output, [OURS])
    assert "code" in text and "third line" not in text


def test_excerpt_is_bounded() -> None:
    output = "".join(f"{OURS}({i}): error: {'y' * 500}\n" for i in range(100))
    text = sandbox.excerpt(output, [OURS], limit=1000)
    assert len(text) <= 1000
    assert all(len(line) <= 300 for line in text.splitlines())


def test_excerpt_with_nothing_of_ours() -> None:
    assert sandbox.excerpt("/usr/bin/ld: cannot find -lfoo\n", [OURS]) == (
        "(no diagnostics about the generated source)"
    )


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_real_compiler_including_a_server_file(tmp_path: Path) -> None:
    """A generated file that #includes /etc/passwd (what a hostile name would try): gcc quotes
    the file's lines; the excerpt a client sees holds none of them."""
    src = tmp_path / "gen.c"
    src.write_text('int ok = 1;\n#include "/etc/passwd"\n')
    done = sandbox.run(
        ["gcc", "-c", str(src), "-o", str(tmp_path / "gen.o")],
        limits=Limits(timeout_s=60, memory_bytes=2 << 30),
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "root:" in done.output  # the compiler did quote the server file...
    text = sandbox.excerpt(done.output, [src])
    assert "root:" not in text and "/etc/passwd" not in text  # ...the client does not see it


@pytest.mark.nvcc
def test_real_nvcc_including_a_server_file(tmp_path: Path) -> None:
    from worker.toolchain import find_toolchain

    chain = find_toolchain()
    src = tmp_path / "gen.cu"
    src.write_text('__global__ void k() {}\n#include "/etc/passwd"\n')
    done = sandbox.run(
        [str(chain.nvcc), "-c", str(src), "-o", str(tmp_path / "gen.o")],
        limits=Limits(timeout_s=300),
        cwd=tmp_path,
        env=sandbox.clean_env({"PATH": f"{chain.cuda_home / 'bin'}:/usr/bin:/bin"}),
    )
    assert done.returncode != 0
    assert "root:" in done.output
    text = sandbox.excerpt(done.output, [src])
    assert "root:" not in text and "passwd" not in text
