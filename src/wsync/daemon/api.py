"""The daemon's HTTP control API (FastAPI): jobs, events, reload, health, metrics.

Why FastAPI: request bodies are pydantic models, so bad JSON and bad fields
become a 422 with the field named, and the OpenAPI document
(``/openapi.json``) is generated from the same code, so it cannot drift.

Every ``/v1`` route needs ``Authorization: Bearer <token>`` (compared in
constant time, by :class:`~wsync.daemon.guard.Guard` before any body is read;
bodies over 64 KiB get 413); ``/healthz``, ``/readyz``, ``/metrics`` and ``/openapi.json``
are open so probes and scrapers need no secret.  Error bodies are always
``{"error": "<one line>", "kind": "<kind>"}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import wsync
from wsync.daemon.confine import Forbidden
from wsync.daemon.guard import Guard, token_ok
from wsync.daemon.jobs import JobFinished, NotAccepting, UnknownJob
from wsync.daemon.metrics import Metrics
from wsync.daemon.service import JobService
from wsync.daemon.store import STATES, StoreUnavailable
from wsync.errors import UsageError, WsyncError

SSE_KEEPALIVE = 15.0


class Unauthorized(Exception):
    """Missing or wrong bearer token (HTTP 401)."""


class AppState:
    """What the routes need from the running daemon; the server owns its lifetime."""

    def __init__(
        self,
        manager: JobService,
        metrics: Metrics,
        token: str,
        reload: Callable[[], dict[str, Any]],
        listen: str,
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.token = token
        self.reload = reload
        self.listen = listen
        self.started = time.time()
        self.ready = False


class PullRequest(BaseModel):
    """Body of ``POST /v1/pulls``."""

    model_config = ConfigDict(extra="forbid")
    sandbox: str = Field(min_length=1, max_length=4096, description="configured name or URI")
    dest: str | None = Field(
        default=None, max_length=4096, description="absolute path inside a dest root"
    )


class JobOut(BaseModel):
    """A job as the API reports it (``result`` has the ``wsync pull --json`` fields)."""

    id: str
    sandbox: str
    uri: str
    dest: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    trigger: str
    reconciled: bool
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    progress: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    error_kind: str | None
    exit_code: int | None


class JobList(BaseModel):
    jobs: list[JobOut]


class ErrorOut(BaseModel):
    error: str
    kind: str


def _error(status: int, message: str, kind: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message, "kind": kind}, status_code=status, headers=headers)


def _status_for(err: WsyncError) -> int:
    if isinstance(err, UnknownJob):
        return 404
    if isinstance(err, JobFinished):
        return 409
    if isinstance(err, Forbidden):  # dest or source outside the configured roots
        return 403
    if isinstance(err, NotAccepting | StoreUnavailable):
        return 503
    if isinstance(err, UsageError):
        return 422
    return 500


def _job_id(value: str) -> str:
    """A job id as asked for: no id holds a NUL (PostgreSQL's text cannot: a fleet's store
    refused the query, and the daemon took that for the store being down)."""
    if "\x00" in value:
        raise UnknownJob(f"no job {value!r}")
    return value


def create_app(state: AppState) -> FastAPI:
    """Build the ASGI app around a running :class:`JobService`."""
    app = FastAPI(
        title="wsync daemon",
        version=wsync.__version__,
        description="Control API of the wsync daemon: exact, resumable workspace pulls.",
        docs_url=None,
        redoc_url=None,
    )
    errors: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorOut},
        403: {"model": ErrorOut},
        404: {"model": ErrorOut},
        409: {"model": ErrorOut},
        422: {"model": ErrorOut},
        503: {"model": ErrorOut},
    }

    app.add_middleware(Guard, token=lambda: state.token)

    @app.exception_handler(WsyncError)
    async def _wsync_error(_request: Request, err: WsyncError) -> JSONResponse:
        return _error(_status_for(err), str(err), err.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers (no such route: 404, wrong method: 405) and FastAPI's
        # body-parse 400 would otherwise be {"detail": ...}, not the documented shape
        kind = "usage" if err.status_code < 500 else "internal"
        return _error(err.status_code, str(err.detail), kind, **(err.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        parts = []
        for item in err.errors():
            loc = ".".join(str(p) for p in item.get("loc", ()))
            if loc == "body" and item.get("type") == "model_attributes_type":
                parts.append("body: must be a JSON object (send Content-Type: application/json)")
                continue
            parts.append(f"{loc}: {item.get('msg', 'invalid')}" if loc else str(item.get("msg")))
        return _error(422, "; ".join(parts) or "invalid request", "usage")

    def auth(authorization: Annotated[str | None, Header()] = None) -> None:
        # Guard checked it already, before the body was read; kept for the OpenAPI doc
        if not token_ok(authorization, state.token):
            raise Unauthorized()

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_request: Request, _err: Unauthorized) -> JSONResponse:
        return _error(
            401, "missing or wrong bearer token", "auth", **{"WWW-Authenticate": "Bearer"}
        )

    v1 = [Depends(auth)]

    @app.post("/v1/pulls", status_code=202, dependencies=v1, responses=errors)
    async def create_pull(body: PullRequest) -> JobOut:
        """Queue a pull; an active job for the same sandbox and dest is returned reconciled."""
        job, reconciled = await state.manager.submit(body.sandbox, body.dest, trigger="api")
        return JobOut(**job.to_json(reconciled=reconciled))

    @app.get("/v1/pulls", dependencies=v1, responses=errors)
    async def list_pulls(
        state_: Annotated[list[str] | None, Query(alias="state")] = None,
        sandbox: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 100,
    ) -> JobList:
        """Jobs, newest first, filtered by state (repeatable) and sandbox."""
        for value in state_ or []:
            if value not in STATES:
                raise UsageError(f"state: unknown state {value!r} (known: {', '.join(STATES)})")
        if sandbox is not None and "\x00" in sandbox:
            raise UsageError("sandbox: contains a NUL byte")
        jobs = await state.manager.list_jobs(states=state_, sandbox=sandbox, limit=limit)
        return JobList(jobs=[JobOut(**j.to_json()) for j in jobs])

    @app.get("/v1/pulls/{job_id}", dependencies=v1, responses=errors)
    async def get_pull(job_id: str) -> JobOut:
        return JobOut(**(await state.manager.get(_job_id(job_id))).to_json())

    @app.delete("/v1/pulls/{job_id}", status_code=202, dependencies=v1, responses=errors)
    async def cancel_pull(job_id: str) -> JobOut:
        """Cancel a queued or running job; a running pull keeps its journal."""
        return JobOut(**(await state.manager.cancel(_job_id(job_id))).to_json())

    @app.get(
        "/v1/events",
        dependencies=v1,
        responses={200: {"content": {"text/event-stream": {}}}},
        response_class=StreamingResponse,
    )
    async def events(job: str | None = None) -> StreamingResponse:
        """Server-sent events: ``job`` on every state change, ``progress`` (rate-limited)."""
        manager = state.manager
        queue = manager.events.subscribe()
        try:
            active = await manager.list_jobs(states=("queued", "running"), limit=1000)
        except BaseException:
            manager.events.unsubscribe(queue)
            raise

        async def stream() -> AsyncIterator[str]:
            try:
                yield ": wsync events\n\n"
                for item in active:
                    if job is None or item.id == job:
                        yield _sse(0, "job", item.to_json())
                while True:
                    try:
                        event = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE)
                    except TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    if event is None:
                        return
                    data = event["data"]
                    if job is None or data.get("id") == job:
                        yield _sse(event["seq"], event["event"], data)
            finally:
                manager.events.unsubscribe(queue)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/reload", dependencies=v1, responses=errors)
    async def reload() -> dict[str, Any]:
        """Re-read the config file (same as SIGHUP); on error the old config stays."""
        return state.reload()

    @app.get("/v1/status", dependencies=v1, responses=errors)
    async def status() -> dict[str, Any]:
        return {
            "version": wsync.__version__,
            "listen": state.listen,
            "uptime_s": round(time.time() - state.started, 3),
            "ready": state.ready,
            **(await state.manager.status()),
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        """Liveness: the event loop answers."""
        return {"ok": True}

    @app.get("/readyz", responses={503: {"model": ErrorOut}})
    async def readyz() -> Response:
        """Readiness: jobs restored, new jobs accepted, and the job store reachable."""
        if state.ready and state.manager.accepting and state.manager.store_ok():
            return JSONResponse({"ready": True})
        if state.ready and state.manager.accepting:
            return _error(503, "not ready (the job store is unreachable)", "not-ready")
        return _error(503, "not ready (starting or shutting down)", "not-ready")

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return app


def _sse(seq: int, event: str, data: dict[str, Any]) -> str:
    body = json.dumps(data, separators=(",", ":"))
    return f"id: {seq}\nevent: {event}\ndata: {body}\n\n"
