"""The `stackfuse` command: serve (the README's first command), submit, compile."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, ApiProcess, WorkerPool, free_port, pid_alive, wait_for, wait_job


def stackfuse(
    *args: str, env: dict[str, str], timeout: float = 300, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.nvcc
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_brings_its_own_redis_and_a_worker_and_stops_them_all(
    tmp_path: Path, service_env: dict[str, str], module_json: str, stop_signal: signal.Signals
) -> None:
    redis_port, api_port = free_port(), free_port()
    env = {
        **service_env,
        "STACKFUSE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",  # nothing answers there
        "STACKFUSE_DATA_DIR": str(tmp_path / "data"),
        "STACKFUSE_API_PORT": str(api_port),
    }
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{api_port}"
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, "stackfuse serve to be ready (redis, worker, API)")
        assert json.loads((tmp_path / "data" / "serve.json").read_text())["url"] == url
        children = subprocess.run(
            ["pgrep", "-P", str(serve.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 2  # redis-server and the worker
        assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()  # AOF on
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/optimize", json={"module": module_json + "\n\n\n"})
            assert r.status_code == 202
            assert wait_job(c, r.json()["id"], timeout=300)["status"] == "succeeded"
    finally:
        serve.send_signal(stop_signal)
        serve.wait(60)
    assert serve.returncode == 0
    wait_for(lambda: not any(pid_alive(int(p)) for p in children), 30, "serve's children to exit")
    said = (tmp_path / "serve.log").read_text()
    assert f"no Redis at redis://127.0.0.1:{redis_port}/0" in said
    assert f"data dir {tmp_path / 'data'}" in said
    assert f"export STACKFUSE_URL={url}" in said
    assert not (tmp_path / "data" / "serve.json").exists()  # removed on the way out


def test_compile_refuses_bad_input_with_one_line_and_status_2(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    missing = stackfuse(
        "compile", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o"), env=service_env
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "cannot read" in missing.stderr

    bad_arch = tmp_path / "m.json"
    bad_arch.write_text("{}")
    r = stackfuse(
        "compile", str(bad_arch), "--out", str(tmp_path / "o"), "--arch", "sm_75", env=service_env
    )
    assert r.returncode == 2 and "sm_80" in r.stderr, r.stderr  # says what is supported

    r = stackfuse("compile", str(bad_arch), "--out", str(tmp_path / "o"), env=service_env)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("stackfuse: error: invalid-module")


@pytest.mark.slow
@pytest.mark.nvcc
def test_compile_locally_prints_a_summary(
    tmp_path: Path, service_env: dict[str, str], module_json: str
) -> None:
    model = tmp_path / "model.json"
    model.write_text(module_json)
    r = stackfuse("compile", str(model), "--out", str(tmp_path / "out"), env=service_env)
    assert r.returncode == 0, r.stderr
    assert "1 fused stacked" in r.stdout and "library:" in r.stdout
    assert "validation: not_run" in r.stdout
    assert (tmp_path / "out" / "model.so").stat().st_size > 0
    assert "codegen" in r.stderr  # progress lines for the slow steps


@pytest.mark.slow
@pytest.mark.nvcc
def test_submit_waits_and_downloads(
    api: ApiProcess,
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    tmp_path: Path,
    service_env: dict[str, str],
) -> None:
    model = tmp_path / "model.json"
    model.write_text(fresh_module())
    out = tmp_path / "out"
    r = stackfuse(
        "submit", str(model), "--url", api.url, "--wait", "--out", str(out), env=service_env
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.split()[1]
    assert (out / f"stackfuse-{job}.so").stat().st_size > 0 and (out / "report.json").is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["library"]["file"] == f"stackfuse-{job}.so" and report["cached"] is False
    assert "succeeded" in r.stderr  # the progress display reached the end
    assert re.search(r"^\[ *\d+\.\ds\] ", r.stderr, re.M), r.stderr  # with elapsed seconds
    assert "1 fused stacked" in r.stdout and "Fused stacked-QKV attention" in r.stdout

    # --wait alone waits and summarizes, and writes nothing into the working directory
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    again = stackfuse("submit", str(model), "--url", api.url, "--wait", env=service_env, cwd=cwd)
    assert again.returncode == 0, again.stderr
    assert "(cached)" in again.stdout and "cached: built by job " + job in again.stdout
    assert "not downloaded (pass --out DIR)" in again.stdout
    assert list(cwd.iterdir()) == []


def test_submit_out_needs_wait(tmp_path: Path, service_env: dict[str, str]) -> None:
    model = tmp_path / "model.json"
    model.write_text("{}")
    r = stackfuse("submit", str(model), "--out", str(tmp_path / "o"), env=service_env)
    assert r.returncode == 2 and "needs --wait" in r.stderr
    assert not (tmp_path / "o").exists()


def test_submit_finds_the_api_serve_started_or_stackfuse_url(
    api: ApiProcess, tmp_path: Path, service_env: dict[str, str]
) -> None:
    """`serve --port 8001` writes its URL into the data dir; `submit` (no --url) goes there, and
    $STACKFUSE_URL wins over it. Reaching the API shows as its refusal of sm_75."""
    from service.cli import write_serve_state
    from service.settings import Settings

    model = tmp_path / "model.json"
    model.write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    env = {**service_env, "STACKFUSE_DATA_DIR": str(data), "STACKFUSE_API_PORT": "1"}
    env.pop("STACKFUSE_URL", None)
    nowhere = stackfuse("submit", str(model), "--arch", "sm_75", env=env)
    assert (
        nowhere.returncode == 3 and "cannot reach the API at http://127.0.0.1:1" in nowhere.stderr
    )
    state = write_serve_state(Settings(data_dir=data), api.url)  # as by a live serve: this pid
    r = stackfuse("submit", str(model), "--arch", "sm_75", env=env)
    assert r.returncode == 2 and "Unknown target" in r.stderr, r.stderr
    state.write_text(json.dumps({"url": api.url, "pid": 2**22 + 1}))  # serve is gone
    assert stackfuse("submit", str(model), "--arch", "sm_75", env=env).returncode == 3
    r = stackfuse("submit", str(model), "--arch", "sm_75", env={**env, "STACKFUSE_URL": api.url})
    assert r.returncode == 2 and "Unknown target" in r.stderr


def test_serve_redacts_every_redis_credential_form() -> None:
    """`serve` prints the Redis URL with the API's redaction (service.settings.redact_url):
    a password in the userinfo or in the query string alike."""
    from service import cli, settings

    assert cli.redact_url is settings.redact_url
    assert cli.redact_url("redis://:s3cret@db:6380/2") == "redis://***@db:6380/2"
    assert "s3cret" not in cli.redact_url("redis://db:6380/2?password=s3cret")
    assert cli.redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_submit_reports_a_refusal_with_status_2(
    api: ApiProcess, tmp_path: Path, service_env: dict[str, str]
) -> None:
    model = tmp_path / "model.json"
    model.write_text("{}")
    r = stackfuse("submit", str(model), "--url", api.url, "--arch", "sm_75", env=service_env)
    assert r.returncode == 2 and "Unknown target" in r.stderr


def test_help_lists_the_subcommands() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "service.cli", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    for cmd in ("api", "worker", "serve", "submit", "compile"):
        assert cmd in r.stdout
    for sub, words in (("compile", ("TVM JSON", "sm_90, Hopper")), ("submit", ("seconds",))):
        h = subprocess.run(
            [sys.executable, "-m", "service.cli", sub, "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ},
        ).stdout
        assert all(w in " ".join(h.split()) for w in words), h


def test_prebuild_lists_the_selected_configurations_and_refuses_bad_input(
    service_env: dict[str, str],
) -> None:
    r = stackfuse("prebuild", "--list", "--dtype", "float16", env=service_env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    attention = [line for line in lines if line.startswith("stackfuse_hcfg_")]
    gemm = [line for line in lines if line.startswith("stackfuse_gcfg_")]
    assert len(attention) >= 10 and len(gemm) >= 12 and len(attention) + len(gemm) == len(lines)
    assert all(line.split()[1] in ("cached", "missing") for line in lines)
    assert all("cutlass::half_t" in line for line in lines)
    assert any("KernelTmaWarpSpecializedPingpong" in line for line in attention)
    for act in ("GELU_taylor", "GELU", "SiLu", "ReLu", "Identity"):
        assert any(f"thread::{act}," in g for g in gemm), act
    one = stackfuse(
        "prebuild",
        "--list",
        "--dtype",
        "bfloat16",
        "--only",
        "Cooperative, stackfuse::hopper::CausalMode::kNone",
        env=service_env,
        timeout=120,
    )
    assert one.returncode == 0 and 1 <= len(one.stdout.strip().splitlines()) < len(lines)
    bad = stackfuse(
        "prebuild", "--list", "--arch", "sm_86", "--dtype", "float32", env=service_env, timeout=120
    )
    assert bad.returncode == 2 and "float16 and bfloat16" in bad.stderr
    # TF32 on Hopper: GEMM configurations only (the attention kernel takes 16-bit types)
    tf32 = stackfuse("prebuild", "--list", "--dtype", "float32", env=service_env, timeout=120)
    assert tf32.returncode == 0, tf32.stderr
    tf32_lines = tf32.stdout.strip().splitlines()
    assert tf32_lines and all(line.startswith("stackfuse_gcfg_") for line in tf32_lines)
    assert all("Config<float, " in line for line in tf32_lines)
    ampere = stackfuse("prebuild", "--list", "--arch", "sm_86", env=service_env, timeout=120)
    assert ampere.returncode == 0, ampere.stderr
    assert all("stackfuse::gemm::sm80::Config<" in line for line in ampere.stdout.splitlines())
