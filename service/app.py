"""The ASGI application: factory, lifespan, shared state. Never imports TVM.

``create_app(settings)`` builds a fresh app (tests pass their own ``Settings``); uvicorn runs it
with ``--factory``. Connections are opened in the lifespan, not at import time.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from service import api, logs, metrics, problems
from service.middleware import BodyLimit
from service.settings import Settings, get_settings
from service.state import build_state, warm_up


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logs.configure(settings.log_format)  # here: each uvicorn worker process builds its own app

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(settings)
        app.state.stackfuse = state
        await warm_up(state)
        # Everything alive now (modules, schemas, the app) lives as long as the process: keep it
        # out of the cyclic GC, whose full passes over it otherwise stall requests for ~100 ms.
        gc.freeze()
        try:
            yield
        finally:
            await state.redis.aclose()
            state.sync_redis.close()

    # /docs and /redoc from the Swagger UI and ReDoc assets packaged with fastapi-offline
    # (served under /static-offline-docs): they work without reaching a CDN
    app = FastAPIOffline(
        title="Stackfuse",
        summary="Stacked-attention optimization of TVM Relax models, as a service.",
        description=(
            "Submit a Relax module (TVM JSON); a worker fuses its stacked-QKV attention into "
            "CUTLASS kernels and builds a shared library. Errors are RFC 9457 problem details "
            "(`application/problem+json`)."
        ),
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    problems.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(api.router)
    app.include_router(metrics.make_router())
    return app
