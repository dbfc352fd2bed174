"""The `stackfuse` command.

Subcommands are registered in :data:`SUBCOMMANDS` (name -> function adding its parser); a new one
(e.g. `import`) is one entry there. Each handler returns the exit status:

    0 success · 1 the job/compile failed · 2 bad input or usage · 3 infrastructure (no Redis,
    no toolchain, the server unreachable)

Heavy imports (uvicorn, RQ, TVM, httpx) happen inside the handlers, so `stackfuse --help` is fast
and `stackfuse api` never imports TVM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.errors import CompileError, InputError, RequestError, StackfuseError
from service.settings import Settings, get_settings, redact_url

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_INFRA = 0, 1, 2, 3

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _exit_code(err: StackfuseError) -> int:
    if isinstance(err, InputError | RequestError):
        return EXIT_INPUT
    if isinstance(err, CompileError):
        return EXIT_FAILED
    return EXIT_INFRA


def _fail(message: str, code: int) -> int:
    print(f"stackfuse: error: {message}", file=sys.stderr)
    return code


# --- api / worker / serve ---------------------------------------------------------------------
def _register_api(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("api", help="run the HTTP API (no TVM in this process)")
    p.add_argument("--host", help="bind address (default: STACKFUSE_API_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: STACKFUSE_API_PORT or 8000)")
    p.add_argument("--workers", type=int, help="processes (default: STACKFUSE_API_WORKERS or 1)")
    p.set_defaults(func=_cmd_api)


def _cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    from service.server import run_api

    run_api(settings, args.host, args.port, args.workers)
    return EXIT_OK


def _register_worker(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="run compile workers (one per GPU; one without a GPU)")
    p.add_argument("--count", type=int, help="number of workers (default: one per GPU)")
    p.add_argument("--burst", action="store_true", help="drain the queue, then exit")
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from service.server import redis_answers
    from worker.tasks import run_worker, run_workers

    if not redis_answers(settings.redis_url, 5.0):
        return _fail(f"no Redis answers at {redact_url(settings.redis_url)}", EXIT_INFRA)
    if args.burst:
        run_worker(settings, burst=True)
        return EXIT_OK
    return run_workers(settings, args.count)


def _register_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="API + one worker (+ a local Redis when none answers at REDIS_URL), one command",
    )
    p.add_argument("--host", help="API bind address")
    p.add_argument("--port", type=int, help="API port")
    p.set_defaults(func=_cmd_serve)


def _stop(proc: subprocess.Popen[bytes], grace_s: float, name: str) -> None:
    """SIGTERM (an RQ worker then finishes its job), again after ``grace_s`` (RQ: kill the job),
    then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        print(f"stackfuse serve: stopping {name} ({sig.name})", file=sys.stderr)
        proc.send_signal(sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def _cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from service.server import redis_answers, run_api, start_local_redis

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    redis_proc = None
    redis_shown = redact_url(settings.redis_url)
    if not redis_answers(settings.redis_url):
        print(
            f"stackfuse serve: no Redis at {redis_shown}; starting one in "
            f"{settings.data_dir / 'redis'}",
            file=sys.stderr,
        )
        try:
            redis_proc = start_local_redis(settings)
        except StackfuseError as err:
            return _fail(err.message, EXIT_INFRA)
    else:
        print(f"stackfuse serve: using the Redis already at {redis_shown}", file=sys.stderr)
    host = args.host or settings.api_host
    url = f"http://{host}:{args.port or settings.api_port}"
    _say_auth_mode(settings, host)
    print(f"stackfuse serve: data dir {settings.data_dir}", file=sys.stderr)
    print(
        f"stackfuse serve: API at {url} (`stackfuse submit` finds it; from elsewhere: "
        f"export STACKFUSE_URL={url})",
        file=sys.stderr,
    )
    state = write_serve_state(settings, url)
    env = {
        **os.environ,
        "STACKFUSE_REDIS_URL": settings.redis_url,
        "STACKFUSE_DATA_DIR": str(settings.data_dir),
    }
    # own sessions: Ctrl-C reaches only this process, which stops the others in order
    worker = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "worker", "--count", "1"],
        env=env,
        start_new_session=True,
    )

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    # uvicorn re-raises the signal that stopped it; as an exception, it lets `finally` run
    signal.signal(signal.SIGTERM, interrupt)
    try:
        run_api(settings, args.host, args.port)
    except KeyboardInterrupt:
        pass  # Ctrl-C or SIGTERM: a normal way to stop serve
    finally:
        clear_serve_state(state)
        _stop(worker, settings.shutdown_grace_s, "worker")
        if redis_proc is not None:
            _stop(redis_proc, 10.0, "redis-server")
    return EXIT_OK


def _say_auth_mode(settings: Settings, host: str) -> None:
    """Open (no keys) or keyed, said at start-up; an open API off loopback is warned about."""
    from redis import Redis
    from redis.exceptions import RedisError

    from service.tenancy import keys_configured

    try:
        with Redis.from_url(settings.redis_url, socket_connect_timeout=5) as conn:
            keyed = keys_configured(conn)
    except RedisError:
        keyed = False
    if keyed or settings.auth_required:
        print("stackfuse serve: API keys required (Authorization: Bearer <key>)", file=sys.stderr)
        return
    print(
        "stackfuse serve: no API keys configured: the API is OPEN (unauthenticated, one "
        "tenant 'local', no quotas); `stackfuse keys create --tenant NAME` turns keys on",
        file=sys.stderr,
    )
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"stackfuse serve: WARNING: open API bound to {host}: anyone who can reach it can "
            "submit and read every job",
            file=sys.stderr,
        )


# --- keys (service.tenancy) -------------------------------------------------------------------
def _register_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="create, list and revoke API keys (admin; talks to Redis)")
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    c = keys.add_parser("create", help="create a key for a tenant; it is printed once")
    c.add_argument("--tenant", required=True, help="tenant name (a-z, 0-9, '-', '_')")
    c.add_argument("--admin", action="store_true", help="may also read /metrics")
    c.add_argument("--json", action="store_true", help="print as JSON")
    c.set_defaults(func=_cmd_keys_create)
    ls = keys.add_parser("list", help="list keys (ids, tenants, flags; never the keys)")
    ls.add_argument("--json", action="store_true", help="print as JSON")
    ls.set_defaults(func=_cmd_keys_list)
    r = keys.add_parser("revoke", help="revoke a key by its id (it stays listed, revoked)")
    r.add_argument("key_id")
    r.set_defaults(func=_cmd_keys_revoke)


def _keys_conn(settings: Settings) -> Any:
    from redis import Redis

    return Redis.from_url(settings.redis_url, socket_connect_timeout=5)


def _cmd_keys_create(args: argparse.Namespace, settings: Settings) -> int:
    from dataclasses import asdict

    from redis.exceptions import RedisError

    from service.tenancy import create_key

    try:
        with _keys_conn(settings) as conn:
            token, info = create_key(conn, args.tenant, admin=args.admin)
    except RedisError as exc:
        return _fail(f"Redis does not answer ({type(exc).__name__})", EXIT_INFRA)
    if args.json:
        print(json.dumps({**asdict(info), "key": token}))
    else:
        print(f"key id: {info.key_id}\ntenant: {info.tenant}\nadmin:  {info.admin}")
        print(f"key:    {token}")
        print("(shown once: only its hash is stored)", file=sys.stderr)
    return EXIT_OK


def _cmd_keys_list(args: argparse.Namespace, settings: Settings) -> int:
    from dataclasses import asdict

    from redis.exceptions import RedisError

    from service.tenancy import list_keys

    try:
        with _keys_conn(settings) as conn:
            keys = list_keys(conn)
    except RedisError as exc:
        return _fail(f"Redis does not answer ({type(exc).__name__})", EXIT_INFRA)
    if args.json:
        print(json.dumps([asdict(k) for k in keys]))
        return EXIT_OK
    for k in keys:
        flags = ",".join(f for f, on in (("admin", k.admin), ("revoked", k.revoked)) if on)
        print(f"{k.key_id}  {k.tenant:<20} {k.created_at}  {flags or '-'}")
    return EXIT_OK


def _cmd_keys_revoke(args: argparse.Namespace, settings: Settings) -> int:
    from redis.exceptions import RedisError

    from service.tenancy import revoke_key

    try:
        with _keys_conn(settings) as conn:
            info = revoke_key(conn, args.key_id)
    except RedisError as exc:
        return _fail(f"Redis does not answer ({type(exc).__name__})", EXIT_INFRA)
    if info is None:
        return _fail(f"there is no key {args.key_id!r} (see `stackfuse keys list`)", EXIT_INPUT)
    print(f"revoked {info.key_id} (tenant {info.tenant})")
    return EXIT_OK


# --- where `serve` listens (so that `submit` and stackfuse.Client find it) --------------------


def write_serve_state(settings: Settings, url: str) -> Path:
    """``<data_dir>/serve.json``: the API URL of the running ``serve`` and its pid."""
    from stackfuse.client import SERVE_STATE

    path = settings.data_dir / SERVE_STATE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(tmp, path)
    return path


def clear_serve_state(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def api_url(explicit: str | None, settings: Settings) -> str:
    """--url, else $STACKFUSE_URL, else the URL `stackfuse serve` wrote, else
    http://STACKFUSE_API_HOST:STACKFUSE_API_PORT (the client's default, from ``settings``)."""
    from stackfuse.client import default_url

    return explicit or default_url(settings.data_dir, settings.api_host, settings.api_port)


# --- submit (HTTP client) ---------------------------------------------------------------------
def _register_submit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("submit", help="submit a model to a running API, optionally wait")
    p.add_argument("model", type=Path, help=MODEL_HELP)
    p.add_argument(
        "--url",
        default=None,
        help="API base URL (default: $STACKFUSE_URL, else the URL a running `stackfuse serve` "
        "wrote, else http://STACKFUSE_API_HOST:STACKFUSE_API_PORT)",
    )
    p.add_argument("--arch", default="sm_90", help=ARCH_HELP)
    p.add_argument("--format", default="tvm-json", choices=["tvm-json", "tvmscript"])
    p.add_argument("--options", default="{}", help="compile options as JSON")
    p.add_argument("--idempotency-key", help="make retries of this submit safe")
    p.add_argument(
        "--wait",
        action="store_true",
        help="poll until done with a progress bar, then print the fusion summary",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="with --wait: download the library (stackfuse-<job>.so) and report.json into this "
        "directory (nothing is downloaded without it)",
    )
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds --wait waits (default 3600)"
    )
    p.set_defaults(func=_cmd_submit)


def _too_large_hint(err: Any, text: str) -> str:
    """For a body the API refused unread (413 payload-too-large): the module's largest
    constants, read here from the JSON, so the user knows what to shrink."""
    if err.status != 413 or "largest_constants" in err.problem:
        return ""
    from service.wire import constant_text, largest_constants

    biggest = largest_constants(text, 3)
    return f"; largest constants: {'; '.join(map(constant_text, biggest))}" if biggest else ""


class _Bar:
    """A one-line progress bar on stderr (a plain line per stage when not a terminal)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""

    def show(self, p: Any) -> None:
        """``p``: a :class:`stackfuse.Progress`."""
        label = f"{p.status}: {p.stage} {p.detail}".strip()
        elapsed = f"{p.elapsed:6.1f}s"
        if self.tty:
            filled = int(p.fraction * 30)
            bar = "#" * filled + "-" * (30 - filled)
            sys.stderr.write(f"\r[{bar}] {p.fraction * 100:5.1f}% {elapsed} {label[:60]:<60}")
            sys.stderr.flush()
        elif label != self.last:
            print(f"[{elapsed}] {p.fraction * 100:5.1f}% {label}", file=sys.stderr)
        self.last = label

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    """`submit` is :class:`stackfuse.Client`'s submit, wait and download, with a progress bar
    and the fusion summary."""
    import stackfuse
    from stackfuse.client import read_module

    if args.out is not None and not args.wait:
        return _fail("--out downloads the finished job's files, so it needs --wait", EXIT_INPUT)
    try:
        text = read_module(args.model)
        options = json.loads(args.options)
    except stackfuse.StackfuseError as err:
        return _fail(err.message, EXIT_INPUT)
    except json.JSONDecodeError as exc:
        return _fail(f"--options is not JSON: {exc}", EXIT_INPUT)
    base = api_url(args.url, settings)
    try:
        with stackfuse.Client(base, timeout=60.0) as client:
            try:
                job = client.submit(
                    text.encode(),
                    target=args.arch,
                    options=options,
                    idempotency_key=args.idempotency_key,
                    format=args.format,
                )
            except stackfuse.APIError as err:
                code = EXIT_INPUT if err.status < 500 else EXIT_INFRA
                return _fail(err.message + _too_large_hint(err, text), code)
            print(f"job {job.id} {job.status}{' (cached)' if job.cached else ''}: {job.url}")
            if not args.wait:
                return EXIT_OK
            return _wait(job, args, base)
    except (stackfuse.errors.ConnectionError, stackfuse.errors.Timeout) as err:
        return _fail(err.message, EXIT_INFRA)


def _wait(job: Any, args: argparse.Namespace, base: str) -> int:
    import stackfuse

    bar = _Bar()
    try:
        job.wait(progress=bar.show, timeout=args.timeout)
    except stackfuse.JobFailed:
        pass  # its report (when partitioning ran) and error are shown below
    except stackfuse.errors.Timeout as err:
        return _fail(err.message, EXIT_INFRA)
    except stackfuse.APIError as err:
        return _fail(err.message, EXIT_INFRA)
    finally:
        bar.close()
    out: Path | None = args.out
    if job.status != "succeeded" or out is None:
        if job.links.get("report"):
            doc = job.report()
            report = _named_report(doc, args.model)
            if report is not None:
                print_summary(report)
                doc = report.model_dump(mode="json")
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / "report.json").write_text(json.dumps(doc, indent=2))
                print(f"report:  {out / 'report.json'}")
        if job.status != "succeeded":
            why = job.error or {}
            return _fail(f"job {job.status}: {why.get('type')}: {why.get('message')}", EXIT_FAILED)
        print(
            f"not downloaded (pass --out DIR): {base}{job.links['artifact']} and "
            f"{base}{job.links['report']}"
        )
        return EXIT_OK
    files = job.download(out)
    report = _named_report(json.loads(files.report.read_bytes()), args.model)
    if report is not None:
        print_summary(report)
        files.report.write_text(report.model_dump_json(indent=2))
    print(f"report:  {files.report}")
    size = files.library.stat().st_size
    print(f"library: {files.library} ({size} bytes, sha256 {job.artifact_sha256})")
    return EXIT_OK


# --- the fusion summary (compile and submit) --------------------------------------------------
MODEL_HELP = (
    "the module: TVM JSON (from `stackfuse import`, or tvm.ir.save_json of a Relax module), or "
    "TVMScript with --format tvmscript; a model.inputs.json beside it (written by `stackfuse "
    "import`) gives the report the model's own layer names"
)
ARCH_HELP = "target GPU architecture: sm_80, sm_86, sm_89 or sm_90 (default sm_90, Hopper)"
#: GEMM sites listed one per line up to this many; beyond, only those left to TVM
GEMM_LINES = 12


def manifest_of(model: Path) -> Path:
    """``model.inputs.json`` beside ``model.json``: the manifest `stackfuse import` writes."""
    stem = model.with_suffix("")
    return stem.with_name(stem.name + ".inputs.json")


def origins_beside(model: Path) -> dict[str, str]:
    from worker.report import origins_of

    try:
        return origins_of(json.loads(manifest_of(model).read_text()))
    except (OSError, ValueError, AttributeError):
        return {}


def _named_report(doc: dict[str, Any], model: Path) -> Any:
    """The downloaded report, with the model's own names when its manifest is beside it."""
    from pydantic import ValidationError

    from worker.report import Report, with_origins

    try:
        report = Report.model_validate(doc)
    except ValidationError:
        return None  # a report of another schema version: saved as it came
    origins = origins_beside(model)
    return with_origins(report, origins) if origins else report


def print_summary(report: Any) -> None:
    """What `compile` and `submit` print: counts, then one verdict per site."""
    s = report.summary
    print(
        f"{s.attention_sites} attention site(s): {s.fused_stacked} fused stacked, "
        f"{s.fused_plain} fused plain, {s.not_offloaded} left to TVM; "
        f"{s.gemm_sites} matmul(s): {s.gemm_offloaded} on CUTLASS"
    )
    gemms = [v for v in report.sites if v.kind == "gemm"]
    shown = [v for v in report.sites if v.kind == "attention"]
    shown += gemms if len(gemms) <= GEMM_LINES else [v for v in gemms if not v.offloaded]
    for v in shown:
        print(f"  {v.where.site}: {v.verdict}")
    if len(shown) < len(report.sites):
        print(f"  ({len(report.sites) - len(shown)} more offloaded matmul(s): see the report)")
    if report.cached:
        took = f" in {report.original_compile_s:.1f} s" if report.original_compile_s else ""
        print(f"cached: built by job {report.original_job or '?'}{took}; nothing compiled now")


# --- import (PyTorch / ONNX -> TVM JSON, on the user's machine) -------------------------------
def _register_import(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "import",
        help="PyTorch (.pt2 or module:function) or ONNX -> Relax TVM JSON for /optimize",
    )
    p.add_argument("model", help="an .onnx file, a torch.export .pt2 file, or pkg.module:function")
    p.add_argument("--out", type=Path, required=True, help="where to write the TVM JSON")
    p.add_argument("--dtype", choices=["float16", "float32"], help="cast floats first (PyTorch)")
    p.add_argument(
        "--dynamic",
        metavar="batch:MAX,seq:MAX",
        help="make the inputs' batch (axis 0) and/or sequence (axis 1) symbolic, up to MAX",
    )
    p.add_argument("--submit", metavar="URL", help="then POST it to the API at URL")
    p.add_argument("--arch", default="sm_90", help="with --submit: target arch")
    p.set_defaults(func=_cmd_import)


def _cmd_import(args: argparse.Namespace, settings: Settings) -> int:
    # worker.importers loads numpy and TVM (the worker extra), which the API image lacks
    from worker.importers import run_cli

    return run_cli(args, settings)


# --- gc (service.retention) -------------------------------------------------------------------
def _register_gc(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from service.retention import add_cli

    add_cli(sub)


# --- compile (local, no service) --------------------------------------------------------------
def _register_compile(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("compile", help="compile a model here, without the service")
    p.add_argument("model", type=Path, help=MODEL_HELP)
    p.add_argument("--out", type=Path, required=True, help="directory for model.so + report")
    p.add_argument("--arch", default="sm_90", help=ARCH_HELP)
    p.add_argument("--format", default="tvm-json", choices=["tvm-json", "tvmscript"])
    p.add_argument("--options", default="{}", help="compile options as JSON")
    p.set_defaults(func=_cmd_compile)


def _cmd_compile(args: argparse.Namespace, settings: Settings) -> int:
    from pydantic import ValidationError

    from service.spec import CompileOptions, Target

    try:
        module = args.model.read_bytes()
    except OSError as exc:
        return _fail(f"cannot read {args.model}: {exc.strerror}", EXIT_INPUT)
    try:
        target = Target(arch=args.arch)
        options = CompileOptions.model_validate(json.loads(args.options))
    except json.JSONDecodeError as exc:
        return _fail(f"--options is not JSON: {exc}", EXIT_INPUT)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(map(str, e["loc"])) or "value"
        return _fail(f"bad --arch/--options: {where}: {e['msg']}", EXIT_INPUT)

    from worker.pipeline import compile_module

    started = time.monotonic()
    last = [""]

    def progress(stage: str, fraction: float, detail: str) -> None:
        label = f"{stage} {detail}".strip()
        if label != last[0]:
            last[0] = label
            print(
                f"[{time.monotonic() - started:6.1f}s] {fraction * 100:3.0f}% {label}",
                file=sys.stderr,
            )

    try:
        result = compile_module(
            module,
            target=target,
            options=options,
            out_dir=args.out,
            settings=settings,
            progress=progress,
            fmt=args.format,
            origins=origins_beside(args.model) or None,
        )
    except StackfuseError as err:
        if (args.out / "report.json").exists():
            print(f"report: {args.out / 'report.json'}", file=sys.stderr)
        return _fail(f"{err.type}: {err.message}", _exit_code(err))
    r = result.report
    print_summary(r)
    size = r.library.size_bytes if r.library else result.library.stat().st_size
    print(f"library: {result.library} ({size} bytes)")
    print(f"report:  {result.report_path}")
    v = r.validation
    print(f"validation: {v.status}" + (f" ({v.reason})" if v.reason else ""))
    print(f"took {time.monotonic() - started:.1f} s")
    return EXIT_OK


# --- report (the fusion report as one HTML page) ----------------------------------------------
def _register_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="render a report.json as one self-contained HTML page")
    p.add_argument("report", type=Path, help="a report.json (from compile or submit --out)")
    p.add_argument("-o", "--out", type=Path, required=True, help="the HTML file to write")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    from worker.report_html import render

    try:
        doc = json.loads(args.report.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _fail(f"cannot read {args.report}: {exc}", EXIT_INPUT)
    if not isinstance(doc, dict):
        return _fail(f"{args.report} is not a report (not a JSON object)", EXIT_INPUT)
    args.out.write_text(render(doc), encoding="utf-8")
    print(f"report: {args.out}")
    return EXIT_OK


# --- prebuild (warm the kernel cache) ---------------------------------------------------------
def _register_prebuild(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "prebuild",
        help="compile the attention and GEMM configurations the selectors pick into the "
        "kernel cache",
        description="Each configuration (attention: dtype, variant, head-dim tile, mask; GEMM: "
        "dtype, tile, weight layout, epilogue) is one CUTLASS compile of ~45-95 s and ~4 GB on "
        "2 cores, shared by every model and shape that uses it. "
        "Run this once against the workers' kernel cache (STACKFUSE_KERNEL_CACHE_DIR) so that "
        "jobs compile only their glue (seconds). sm_90: the Hopper attention and GEMM "
        "configurations (float32: the TF32 GEMMs only); sm_80/86/89: the CUTLASS 2.x GEMMs "
        "(their attention kernel is compiled per shape, with the job).",
    )
    p.add_argument("--arch", default="sm_90", help=ARCH_HELP)
    p.add_argument(
        "--dtype",
        nargs="+",
        default=["float16", "bfloat16"],
        help="float16, bfloat16, float32 (sm_90: TF32 GEMMs, for jobs with allow_tf32)",
    )
    p.add_argument("--only", default=None, help="regex on the configuration's C++ type")
    p.add_argument("--jobs", type=int, default=1, help="parallel nvcc runs (~4 GB each)")
    p.add_argument(
        "--list", action="store_true", help="list the configurations (cached or missing)"
    )
    p.set_defaults(func=_cmd_prebuild)


def _cmd_prebuild(args: argparse.Namespace, settings: Settings) -> int:
    import re
    from concurrent.futures import ThreadPoolExecutor

    from worker import gemm_sm80, gemm_sm90, hopper, nvcc
    from worker.kernel_source import KernelSource

    arch = args.arch.rstrip("a")
    if arch != "sm_90" and arch not in gemm_sm80.ARCHS:
        return _fail(f"--arch {args.arch}: {ARCH_HELP}", EXIT_INPUT)
    allowed = ("float16", "bfloat16", "float32") if arch == "sm_90" else ("float16", "bfloat16")
    for d in args.dtype:
        if d not in allowed:
            return _fail(
                f"--dtype {d}: the {arch} kernels take {', '.join(allowed[:-1])} and {allowed[-1]}",
                EXIT_INPUT,
            )
    dtypes = tuple(args.dtype)
    units: list[KernelSource] = []
    if arch == "sm_90":
        half = tuple(d for d in dtypes if d != "float32")
        units += [hopper.render_config(spec, v) for v, spec in hopper.selected_configs(half)]
        units += gemm_sm90.selected_configs(dtypes)
    else:
        units += gemm_sm80.selected_configs(dtypes)
    if args.only:
        try:
            units = [u for u in units if re.search(args.only, str(u.config["type"]))]
        except re.error as exc:
            return _fail(f"--only is not a regular expression: {exc}", EXIT_INPUT)
    if args.list:
        from worker.toolchain import find_toolchain

        try:
            chain = find_toolchain(settings)
        except StackfuseError as err:
            return _fail(f"{err.type}: {err.message}", _exit_code(err))
        for u in units:
            state = "cached " if nvcc.is_cached(u, settings, chain) else "missing"
            print(f"{u.symbol}  {state}  {u.config['type']}")
        return EXIT_OK

    def one(u: KernelSource) -> tuple[KernelSource, float, bool]:
        c = nvcc.compile_object(u, settings=settings)
        return u, c.seconds, c.cache_hit

    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for u, seconds, hit in pool.map(one, units):
                state = "cached" if hit else f"compiled in {seconds:.0f} s"
                print(f"{u.symbol}  {state}  {u.config['type']}", flush=True)
    except StackfuseError as err:
        return _fail(f"{err.type}: {err.message}", _exit_code(err))
    print(f"{len(units)} configuration(s) in {settings.resolved_kernel_cache_dir()}")
    return EXIT_OK


#: Subcommand name -> registrar. Add new subcommands here (one line each).
SUBCOMMANDS: dict[str, Registrar] = {
    "api": _register_api,
    "worker": _register_worker,
    "serve": _register_serve,
    "submit": _register_submit,
    "compile": _register_compile,
    "import": _register_import,
    "prebuild": _register_prebuild,
    "report": _register_report,
    "gc": _register_gc,
    "keys": _register_keys,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stackfuse",
        description="Stacked-attention optimization of TVM Relax models, as a service.",
        epilog="Settings come from the environment (STACKFUSE_*, REDIS_URL); see the README.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS.values():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, get_settings()))
    except KeyboardInterrupt:
        return 130
    except StackfuseError as err:
        return _fail(f"{err.type}: {err.message}", _exit_code(err))


if __name__ == "__main__":
    sys.exit(main())
