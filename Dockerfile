# syntax=docker/dockerfile:1.7
# Stackfuse images. Two targets from one file:
#   docker build --target api    -t stackfuse-api .     # HTTP API: slim, never imports TVM
#   docker build --target worker -t stackfuse-worker .  # RQ worker: CUDA 13.0 toolchain
# docker-compose.yml builds both. Both run as the unprivileged user `stackfuse` (uid 10001),
# with the shared store at /data.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# CUDA 13.0 Update 1: nvcc/crt/cudart 13.0.88, the toolchain docs/field-notes.md verifies
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04

# --- the source, once ---------------------------------------------------------------------------
FROM scratch AS src
COPY pyproject.toml README.md /src/
COPY service /src/service
COPY worker /src/worker

# --- api -------------------------------------------------------------------------------------------
# The package without extras: the service alone, no TVM, CUTLASS or numpy (the `worker` extra).
# The API process never imports them (tests/test_import_graph.py, and tests/service/test_api.py
# checks the running process's memory maps); .ci/containers starts this image.
FROM ${PYTHON_IMAGE} AS api
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin stackfuse \
 && mkdir -p /data && chown stackfuse:stackfuse /data
COPY --from=src /src /src
RUN python -m venv /opt/venv && /opt/venv/bin/pip install /src && rm -rf /src
ENV PATH=/opt/venv/bin:$PATH \
    STACKFUSE_DATA_DIR=/data \
    STACKFUSE_API_HOST=0.0.0.0 \
    STACKFUSE_API_PORT=8000
USER stackfuse
WORKDIR /home/stackfuse
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('STACKFUSE_API_PORT', '8000'), timeout=2)"]
CMD ["stackfuse", "api"]

# --- worker ----------------------------------------------------------------------------------------
# The CUDA devel image carries nvcc, the CUDA headers and libcudart; gcc/g++ are nvcc's host
# compiler (and build the driver stub on hosts without a GPU). The GPU driver itself comes from
# the host through the NVIDIA container toolkit (compose: deploy.resources.reservations.devices).
FROM ${CUDA_IMAGE} AS worker
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin stackfuse \
 && mkdir -p /data && chown stackfuse:stackfuse /data
COPY --from=src /src /src
# worker: the compiler toolchain; cuda: the pinned nvcc 13.0.88 from PyPI, so that the image
# has nvcc whatever its base (a CUDA image's own /usr/local/cuda is found first)
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install '/src[worker,cuda]' && rm -rf /src
ENV PATH=/opt/venv/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    STACKFUSE_DATA_DIR=/data
USER stackfuse
WORKDIR /home/stackfuse
# SIGTERM = finish the running job, then exit (give it STACKFUSE_JOB_TIMEOUT_S: compose's
# stop_grace_period); a second SIGTERM stops the job.
STOPSIGNAL SIGTERM
CMD ["stackfuse", "worker"]
