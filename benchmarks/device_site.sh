#!/usr/bin/env bash
# Assemble .gpu/site: what the H200 device machine (Python 3.12, torch, no TVM, no network)
# needs to load our libraries: a runtime-only TVM (the installed package without
# libtvm_compiler.so, 3rdparty/, src/, include/: ~17 MB of 305), the cp312 apache-tvm-ffi wheel,
# the pure-Python deps of worker.toolchain (pydantic-settings and friends; pydantic-core is
# compiled, so its cp312 wheel), and what `stackfuse api` and `stackfuse worker` import beyond
# the device image (fastapi, starlette, uvicorn + httptools, redis, rq, croniter,
# opentelemetry-api, and anyio at our version; click, h11, uvloop, python-dateutil are there
# already). ~44 MB; carry it with `carry: [".gpu/site", ...]` and run with
# PYTHONPATH=$PWD/.gpu/site:$PWD. Re-run after a pin changes.
set -euo pipefail
cd "$(dirname "$0")/.."
site=.gpu/site
py=${PYTHON:-.venv/bin/python}
tvm_dir=$("$py" -c 'import os, tvm; print(os.path.dirname(tvm.__file__))' 2>/dev/null | tail -1)
wheels=$(mktemp -d /tmp/stackfuse-wheels.XXXXXX)
trap 'rm -rf "$wheels"' EXIT
rm -rf "$site" && mkdir -p "$site"
rsync -a --exclude 'lib/libtvm_compiler.so' --exclude '3rdparty' --exclude 'src' \
  --exclude 'include' --exclude '__pycache__' "$tvm_dir/" "$site/tvm/"
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$wheels" \
  "apache-tvm-ffi==$(ver apache-tvm-ffi)" "pydantic==$(ver pydantic)" \
  "pydantic-core==$(ver pydantic-core)" "pydantic-settings==$(ver pydantic-settings)" \
  "annotated-types==$(ver annotated-types)" "typing-inspection==$(ver typing-inspection)" \
  "python-dotenv==$(ver python-dotenv)" \
  "fastapi==$(ver fastapi)" "starlette==$(ver starlette)" "uvicorn==$(ver uvicorn)" \
  "httptools==$(ver httptools)" "redis==$(ver redis)" "rq==$(ver rq)" \
  "croniter==$(ver croniter)" "opentelemetry-api==$(ver opentelemetry-api)" \
  "annotated-doc==$(ver annotated-doc)" "anyio==$(ver anyio)"
for w in "$wheels"/*.whl; do
  "$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$site"
done
du -sh "$site"
